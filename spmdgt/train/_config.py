"""The trainer's typed YAML configuration.

YAML (every section optional; unknown keys are errors naming file and key)::

    strategy: fsdp                 # ddp | fsdp | placements
    fsdp: {use_mixed_precision: true, reshard_after_forward: true, accumulate_sharded: false}
    ddp: {bucket_cap_mb: 25, find_unused_parameters: false}
    training:
      epochs: 3
      batch_size: 16               # per rank
      gradient_accumulation_steps: 4
      max_grad_norm: 1.0
      use_amp: false
      max_steps: null              # stop after this many optimizer steps (null: all epochs)
      scheduler: {type: linear_warmup, warmup_steps: 100, total_steps: 1000}
    placements:        # module-name glob -> colwise | rowwise | replicate | sharded_input |
      "layers.*.mlp.up": colwise   # colwise_gather | rowwise_split | packed_colwise | experts |
                                   # loss_parallel (an LM head split over the vocabulary) |
                                   # sequence styles (_tp_sequence);
      "layers.*.mlp.down": rowwise # or `placements: auto` (derived from the model)
    checkpoint: {dir: ckpt, every_steps: 50}
    profile: false
    logdir: runs/exp1
    log_every: 10                  # steps between loss reductions, progress lines, scalars
    compile: false                 # torch.compile each block (TP -> AC -> compile -> FSDP)
    compile_backend: inductor      # any torch.compile backend name (aot_eager: no codegen)
    activation_checkpointing: false  # recompute each block's activations in backward
    sync_batchnorm: true           # BatchNorm over the global batch under DDP/FSDP (one
                                   # process's numbers); false: each rank's own rows
    parallelism: {dp_replicate: 1, dp_shard: -1, tp: 1}  # 2-D/3-D mesh (torchtitan's names)
                                   # sequence_parallel: true (with placements: auto)

Load with ``load_train_config(path)``; pass the result as ``DistributedTrainer(config=...)``.
The config is the one place for these settings: the trainer's keyword arguments of the same
names are pass-throughs that ``override`` sets here (validated by the same ``__post_init__``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal

from spmdgt.config import ConfigError, from_dict, load_mapping

__all__ = [
    "CheckpointConfig",
    "DDPConfig",
    "FSDPConfig",
    "ParallelismConfig",
    "SchedulerConfig",
    "TrainConfig",
    "TrainingConfig",
    "load_train_config",
    "override",
]

STRATEGIES = ("ddp", "fsdp", "placements")
PLACEMENT_STYLES = (
    "colwise",
    "rowwise",
    "replicate",
    "sharded_input",
    "colwise_gather",
    "rowwise_split",
    "packed_colwise",
    "experts",
    "loss_parallel",
    "sequence_split",
    "sequence_parallel",
    "sequence_gather",
    "rowwise_scatter",
    "sequence_parallel_gather",
)


def _bool(value: object, key: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {value!r}", key=key, value=value)


def _positive_int(value: object, key: str, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"must be an integer >= {low}, got {value!r}", key=key, value=value)


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """FSDP2 (``fully_shard``) settings."""

    use_mixed_precision: bool = False
    """bf16 parameters and compute, fp32 gradient reduction (``MixedPrecisionPolicy``)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); ``False`` keeps them (ZeRO-2-like)."""
    accumulate_sharded: bool = False
    """Under gradient accumulation, reduce-scatter every micro-step's gradients and add them
    up sharded (torchtitan's way): a rank holds ``1/dp_shard`` of the gradients between
    micro-steps, for one reduce-scatter per unit per micro-step (HSDP's all-reduce over
    ``dp_replicate`` still runs once per step). ``False``: gradients are communicated once
    per step, held unsharded between micro-steps (FSDP2's ``set_requires_gradient_sync``)."""

    def __post_init__(self) -> None:
        _bool(self.use_mixed_precision, "use_mixed_precision")
        _bool(self.reshard_after_forward, "reshard_after_forward")
        _bool(self.accumulate_sharded, "accumulate_sharded")


@dataclass(kw_only=True, slots=True)
class DDPConfig:
    """``DistributedDataParallel`` settings."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB: larger buckets mean fewer, bigger all-reduces."""
    find_unused_parameters: bool = False
    """Let DDP find parameters the forward did not use (a model with branches); costs a graph
    walk per step. FSDP2 handles unused parameters itself and warns that this does nothing."""

    def __post_init__(self) -> None:
        _bool(self.find_unused_parameters, "find_unused_parameters")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(
                f"must be > 0, got {self.bucket_cap_mb}",
                key="bucket_cap_mb",
                value=self.bucket_cap_mb,
            )


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    type: Literal["linear_warmup", "cosine", "constant"] = "constant"
    """``linear_warmup``: linear ramp to the base lr over ``warmup_steps``, then linear decay to
    0 at ``total_steps``; ``cosine``: same ramp, then cosine decay to 0; ``constant``: none."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr 0."""
    total_steps: int | None = None
    """Optimizer step at which the decay reaches 0 (required for the decaying schedules)."""

    def __post_init__(self) -> None:
        _positive_int(self.warmup_steps, "warmup_steps", allow_zero=True)
        if self.type != "constant":
            if self.total_steps is None:
                raise ConfigError(
                    f"scheduler type {self.type!r} needs total_steps", key="total_steps"
                )
            _positive_int(self.total_steps, "total_steps")
            if self.total_steps < self.warmup_steps:
                raise ConfigError(
                    f"total_steps ({self.total_steps}) < warmup_steps ({self.warmup_steps})",
                    key="total_steps",
                    value=self.total_steps,
                )


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The loop itself."""

    epochs: int = 1
    """Passes over the training set."""
    batch_size: int = 32
    """Samples per rank per micro-step (the global batch is this x data-parallel ranks x
    ``gradient_accumulation_steps``)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; gradients are synchronised only on the last one (FSDP's
    ``accumulate_sharded`` reduce-scatters every micro-step's)."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm (over all shards) to this; ``None`` disables clipping."""
    use_amp: bool = False
    """Autocast to bf16 (fp16 + GradScaler on CUDA without bf16)."""
    warmup_steps: int = 2
    """Optimizer steps excluded from the timing statistics of the summary."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (counted from step 0, so a resumed run stops at the
    same step); ``None`` trains all ``epochs``."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""

    def __post_init__(self) -> None:
        _positive_int(self.epochs, "epochs")
        _positive_int(self.batch_size, "batch_size")
        _positive_int(self.gradient_accumulation_steps, "gradient_accumulation_steps")
        _positive_int(self.warmup_steps, "warmup_steps", allow_zero=True)
        if self.max_steps is not None:
            _positive_int(self.max_steps, "max_steps")
        _bool(self.use_amp, "use_amp")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(
                f"must be > 0 or null, got {self.max_grad_norm}",
                key="max_grad_norm",
                value=self.max_grad_norm,
            )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Distributed checkpoints (``torch.distributed.checkpoint``), written atomically."""

    dir: str | None = None
    """Directory holding ``step_<n>`` checkpoints; ``None`` disables checkpointing."""
    every_steps: int = 0
    """Save every this many optimizer steps (0: only at the end of training)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ``dir`` when one exists."""
    keep_last: int = 2
    """Complete checkpoints kept on disk; older ones are deleted after a successful save."""

    def __post_init__(self) -> None:
        _positive_int(self.every_steps, "every_steps", allow_zero=True)
        _positive_int(self.keep_last, "keep_last")


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """The device mesh, in torchtitan's names and order: ``(dp_replicate, dp_shard, tp)``.

    The defaults (``dp_replicate: 1, dp_shard: -1, tp: 1``) are today's 1-D world mesh: every
    rank in one data-parallel group (``placements``: one tensor-parallel group). ``-1`` (at
    most one size) means "the ranks left": the world size over the other sizes. The product
    must equal the world size, checked where the mesh is built (``resolve``)."""

    dp_replicate: int = 1
    """Data-parallel replicas: HSDP's replicate dim (FSDP shards within each replica)."""
    dp_shard: int = -1
    """FSDP's shard dim (-1: the rest of the world)."""
    tp: int = 1
    """Tensor-parallel ranks: the ``placements`` table is applied within this dim."""
    sequence_parallel: bool = False
    """``placements: auto`` also splits the residual stream between the tensor-parallel
    layers over the sequence (``_tp_sequence``: norms on each rank's tokens, the sub-blocks'
    inputs all-gathered and outputs reduce-scattered): the same numbers, the stream's and
    checkpointed blocks' bytes over ``tp``. A hand table names those rows itself."""

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "dp_shard", "tp"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ConfigError(
                    f"must be a positive integer or -1 (the rest), got {value!r}",
                    key=f"parallelism.{key}",
                    value=value,
                )
        _bool(self.sequence_parallel, "parallelism.sequence_parallel")
        rest = [k for k in ("dp_replicate", "dp_shard", "tp") if getattr(self, k) == -1]
        if len(rest) > 1:
            raise ConfigError(
                f"at most one size may be -1 (the rest), got -1 for {', '.join(rest)}",
                key=f"parallelism.{rest[1]}",
                value=-1,
            )

    @property
    def is_default(self) -> bool:
        """Whether this is today's 1-D world mesh (no tensor or replicate dim)."""
        return self.dp_replicate == 1 and self.tp == 1

    def resolve(self, world_size: int) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, tp)`` with -1 filled in; a ``ConfigError`` naming
        ``parallelism``, the sizes and the world size when they do not multiply to it."""
        sizes = [self.dp_replicate, self.dp_shard, self.tp]
        known = 1
        for v in sizes:
            if v != -1:
                known *= v
        if -1 in sizes and known and world_size % known == 0:
            sizes[sizes.index(-1)] = world_size // known
        if -1 in sizes or sizes[0] * sizes[1] * sizes[2] != world_size:
            raise ConfigError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} "
                f"must multiply to the world size {world_size}",
                key="parallelism",
                value={
                    "dp_replicate": self.dp_replicate,
                    "dp_shard": self.dp_shard,
                    "tp": self.tp,
                },
            )
        return sizes[0], sizes[1], sizes[2]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the trainer reads from YAML."""

    strategy: str = "ddp"
    """``ddp`` (replicate, all-reduce grads), ``fsdp`` (FSDP2 ``fully_shard``) or
    ``placements`` (tensor parallelism from the ``placements`` table)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 settings (strategy ``fsdp``)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DDP settings (strategy ``ddp``)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Loop settings."""
    placements: dict[str, str] | str = field(default_factory=dict)
    """Module-name glob -> one of ``PLACEMENT_STYLES``; first match wins. ``"auto"``: derived
    from the model when it is wrapped (HF's ``base_model_tp_plan``, else its module tree;
    ``_tp_plan.derive_placements``), printed on rank 0."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint directory and frequency."""
    profile: bool = False
    """Write per-rank ``torch.profiler`` traces under ``<logdir>/profile``."""
    logdir: str | None = None
    """TensorBoard directory (rank 0 writes scalars); ``None`` disables logging."""
    log_every: int = 10
    """Optimizer steps between loss reductions: per-step losses stay on the device and are
    all-reduced in one small collective every this many steps (on every rank: the schedule of a
    collective must not depend on who logs), then written to TensorBoard and, without a
    terminal, printed as a progress line. Memory is sampled at the same steps."""
    compile: bool = False
    """``torch.compile`` each transformer block (the model's ``ModuleList`` of layers; the
    whole model when it has none), in torchtitan's order: tensor parallel, activation
    checkpointing, compile, FSDP. ``GT_COMPILE=0`` in the environment overrides it."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend: ``inductor`` (generated kernels), ``aot_eager`` (the
    same graphs and autograd, no code generation: quick to compile, for tests), any name
    ``torch._dynamo.list_backends()`` knows."""
    activation_checkpointing: bool = False
    """Wrap each block in ``checkpoint_wrapper``: its activations are recomputed in backward
    (less memory, about one more forward of compute)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The mesh ``(dp_replicate, dp_shard, tp)``; the default is the 1-D world mesh."""
    sync_batchnorm: bool = True
    """Under DDP and FSDP, BatchNorm layers normalise with the statistics of the global batch,
    as one process does (``_sync_bn``: torch's ``SyncBatchNorm`` on CUDA, an all-reduce of the
    statistics elsewhere): two small all-reduces per BatchNorm per forward. ``false``: each
    rank's own rows (DDP's behaviour), cheaper, and other numbers than one process."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}",
                key="strategy",
                value=self.strategy,
            )
        if isinstance(self.placements, str) and self.placements != "auto":
            raise ConfigError(
                f"placements must be a table (module-name glob -> style) or 'auto', got "
                f"{self.placements!r}",
                key="placements",
                value=self.placements,
            )
        table = self.placements if isinstance(self.placements, dict) else {}
        for pattern, style in table.items():
            if style not in PLACEMENT_STYLES:
                raise ConfigError(
                    f"unknown placement {style!r} for {pattern!r}; expected one of "
                    f"{', '.join(PLACEMENT_STYLES)}",
                    key=f"placements.{pattern}",
                    value=style,
                )
        for key in ("compile", "activation_checkpointing", "profile", "sync_batchnorm"):
            _bool(getattr(self, key), key)
        _positive_int(self.log_every, "log_every")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ConfigError(
                f"must be a torch.compile backend name, got {self.compile_backend!r}",
                key="compile_backend",
                value=self.compile_backend,
            )
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            from torch._dynamo import list_backends

            known = list_backends(exclude_tags=())
            if self.compile_backend not in known:
                raise ConfigError(
                    f"unknown torch.compile backend {self.compile_backend!r}; torch knows: "
                    f"{', '.join(sorted(known))}",
                    key="compile_backend",
                    value=self.compile_backend,
                )
        if self.parallelism.tp != 1 and not self.placements:
            raise ConfigError(
                f"parallelism.tp={self.parallelism.tp} needs a non-empty 'placements' table "
                "(applied within the tp dim)",
                key="parallelism.tp",
                value=self.parallelism.tp,
            )
        if self.parallelism.tp != 1 and self.strategy == "ddp":
            raise ConfigError(
                "strategy 'ddp' cannot run over tensor-parallel (DTensor) parameters (torch's "
                "DDP does not support them); use strategy 'fsdp' with parallelism.tp, or "
                "'placements' for tensor parallelism alone",
                key="parallelism.tp",
                value=self.parallelism.tp,
            )
        if self.parallelism.sequence_parallel and self.placements != "auto":
            raise ConfigError(
                "sequence_parallel derives its rows for 'placements: auto'; a hand table names "
                "them itself (sequence_split, sequence_parallel, sequence_gather, "
                "rowwise_scatter, sequence_parallel_gather)",
                key="parallelism.sequence_parallel",
                value=True,
            )
        if self.strategy == "placements" and not self.placements:
            raise ConfigError(
                "strategy 'placements' needs a non-empty 'placements' table "
                "(module-name pattern -> colwise | rowwise | replicate | sharded_input | ...) "
                "or 'auto' (derived from the model)",
                key="placements",
            )


def load_train_config(path: str | os.PathLike) -> TrainConfig:
    """Read a training YAML file into a ``TrainConfig``; errors name the file and key."""
    data, name = load_mapping(path, what="training config")
    return from_dict(TrainConfig, data, file=name)


# Where each keyword that ``override`` accepts lives: the top level, or a section's name.
_SECTION_OF = {
    "strategy": None,
    "logdir": None,
    "log_every": None,
    "profile": None,
    "compile": None,
    "compile_backend": None,
    "activation_checkpointing": None,
    "sync_batchnorm": None,
    "placements": None,
    "epochs": "training",
    "max_steps": "training",
    "use_amp": "training",
    "gradient_accumulation_steps": "training",
    "max_grad_norm": "training",
    "find_unused_parameters": "ddp",
    "dp_replicate": "parallelism",
    "dp_shard": "parallelism",
    "tp": "parallelism",
    "sequence_parallel": "parallelism",
}


def override(cfg: TrainConfig, **values: object) -> TrainConfig:
    """``cfg`` with the given fields replaced, wherever they live (``epochs`` is
    ``training.epochs``); ``None`` values are left out, so an unset keyword keeps the config's
    value.

    The trainer's keyword arguments that name config fields go through here: new dataclasses
    are built, so every ``__post_init__`` validates the new value (a ``ConfigError`` naming the
    field and value) and the caller's ``cfg`` is not changed; sections not named stay shared."""
    top: dict[str, object] = {}
    sections: dict[str, dict[str, object]] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in _SECTION_OF:
            raise TypeError(f"override() got an unknown field {name!r}")
        section = _SECTION_OF[name]
        if section is None:
            top[name] = value
        else:
            sections.setdefault(section, {})[name] = value
    for section, fields in sections.items():
        top[section] = replace(getattr(cfg, section), **fields)
    return replace(cfg, **top) if top else cfg
