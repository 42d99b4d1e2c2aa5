"""Wrap a model for a parallel strategy, on torch's own engines.

* ``ddp``: ``DistributedDataParallel``; gradient accumulation under ``no_sync``.
* ``fsdp``: FSDP2 ``fully_shard`` on every transformer block (``_units``: HF's
  ``model.model.layers`` too; tied weights stay in one unit), then the root;
  ``MixedPrecisionPolicy(bf16 params, fp32 reduce)`` for mixed precision; accumulation via
  ``set_requires_gradient_sync(False)``, or with ``accumulate_sharded`` a reduce-scatter every
  micro-step (``set_requires_all_reduce(False)``: HSDP's all-reduce once per step). On gloo,
  reductions are forced to SUM-then-divide (``set_force_sum_reduction_for_comms``) rather
  than trusting an AVG reduce-scatter.
* ``placements``: tensor parallelism from a YAML table of module-name globs through
  ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (gathered and split
  variants too) and ``_tp_styles``' packed and experts styles on the world mesh; ``auto``
  derives the table from the model (``_tp_plan``), which also refuses tables that cannot be
  exact. Every rank must see the same batch (no data parallelism); ``replicate`` keeps a full
  copy on each rank (plain tensors that stay identical because their inputs are identical).

``wrap_model`` is the one place that applies these, in torchtitan's order (its
``parallelize_llama``), each step a small function of its own: ``apply_tp`` (tensor
parallel), ``apply_ac`` (activation checkpointing, ``activation_checkpointing=True``),
``apply_compile`` (``torch.compile`` of each block, ``compile=True``; see ``_compile``), then
``apply_fsdp`` (``fully_shard`` per block and the root) or ``apply_ddp`` (DDP around the model).
Which submodules are FSDP's units is ``_units``' rule, shared with the cost model in ``_comm``.

In a world of one nothing is wrapped: the plain model trains as is (blocks still compiled).
``Wrapped.no_sync()`` is the one context the trainer uses to skip gradient communication on
non-final micro-steps.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from spmdgt.train._comm import (
    CollectiveLog,
    LoggedAllGather,
    LoggedReduceScatter,
    ddp_counting_hook,
)
from spmdgt.train._compile import (
    CompileState,
    apply_activation_checkpointing,
    compile_blocks,
    find_blocks,
)
from spmdgt.train._config import STRATEGIES, DDPConfig, FSDPConfig, TrainConfig
from spmdgt.train._layout import Layout
from spmdgt.train._sync_bn import batchnorms, sync_batchnorm
from spmdgt.train._tp_plan import resolve_placements
from spmdgt.train._tp_sequence import split_outside_checkpoint
from spmdgt.train._tp_table import has_loss_parallel, placement_plan, sharded_input_modules
from spmdgt.train._units import fsdp_blocks

__all__ = [
    "Wrapped",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "clip_grad_norm",
    "wrap_model",
]


@dataclass
class Wrapped:
    """A model ready to train: the module to call plus how to silence gradient sync."""

    module: nn.Module
    strategy: str
    log: CollectiveLog = field(default_factory=CollectiveLog)
    fsdp_modules: list[nn.Module] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    """dtype for ``torch.autocast`` around forward; None when FSDP mixed precision does it."""
    comm_source: str | None = "no_collectives"
    """What fills ``log``: a torch hook, ``None`` when only the interceptor's op stream can see
    the collectives (placements: measured only on request), "no_collectives" in a world of one."""
    compiled: CompileState | None = None
    """What ``compile=True`` compiled (None: nothing compiled)."""
    partial_grads: list[nn.Parameter] = field(default_factory=list)
    """FSDP's sharded parameters of ``sharded_input`` modules under tensor parallelism: each
    tensor-parallel rank's gradient covers its own heads only, summed over ``partial_group``
    by ``sum_partial_grads`` once per optimizer step (FSDP2 replaces the parameters, so a
    hook on the originals would never fire)."""
    partial_group: object = None
    placements: dict[str, str] | None = None
    """The table applied (``placements: auto``: the derived one), ``None`` without TP."""
    accumulate_sharded: bool = False
    """FSDP's ``accumulate_sharded``: ``no_sync`` keeps the reduce-scatters (and holds back
    HSDP's all-reduce only)."""
    synced_norms: list[str] = field(default_factory=list)
    """The BatchNorm layers ``sync_batchnorm`` made global-batch ones (``_sync_bn``)."""
    loss_parallel: bool = False
    """The table splits the output layer over the vocabulary (``loss_parallel``): its logits
    are split DTensors, so the loss and its backward run under torch's ``loss_parallel``
    (``loss_context``)."""

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Where a micro-step's forward, loss and backward run: torch's ``loss_parallel``
        when the logits are split (cross-entropy on the vocabulary shards: two small
        all-reduces per row set, no rank holds a row's whole logits), else nothing."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def sum_partial_grads(self) -> None:
        """Sum the ``partial_grads`` over the tensor-parallel group (collective on that group;
        nothing to do without them). Called after the step's last backward, before clipping:
        FSDP's reduction over the data dims is done (and, under gradient accumulation, every
        micro-step's gradient is in), so one all-reduce per step completes the sum. The ranks
        of a tp group sit at the same data-parallel coordinates, so they hold the same FSDP
        shard of each parameter and their local shards add up element by element."""
        locals_ = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for p in self.partial_grads
            if p.grad is not None
        ]
        if not locals_:
            return
        # One all-reduce for all of them (two small norms per layer would be 2L collectives);
        # grouped by dtype, the same on every rank of the group.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in locals_:
            by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, group=self.partial_group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no collective until the context exits. Under FSDP's
        ``accumulate_sharded`` each unit still reduce-scatters its gradients (added up in
        the sharded ones) and only HSDP's all-reduce over ``dp_replicate`` waits for the
        step's last micro-step (FSDP2's ``set_requires_all_reduce``)."""
        if self.strategy == "ddp" and isinstance(self.module, nn.parallel.DistributedDataParallel):
            with self.module.no_sync():
                yield
        elif self.fsdp_modules:
            root = self.fsdp_modules[-1]
            hold = (
                root.set_requires_all_reduce
                if self.accumulate_sharded
                else root.set_requires_gradient_sync
            )
            hold(False)
            try:
                yield
            finally:
                hold(True)
        else:
            yield


def _sum_gradients_over_ranks(
    model: nn.Module, table: dict[str, str], group: object = None
) -> None:
    """``sharded_input`` modules read this rank's part of a colwise output (a per-head norm
    over this rank's heads), so each rank's gradient of their whole, plain parameters is a
    partial sum: a hook on each gradient sums it over the tensor-parallel ``group`` (``None``:
    the world) before it accumulates (once
    per backward, so gradient accumulation stays exact). Every rank runs the same backward,
    so the hooks' all-reduces come in the same order everywhere."""
    import torch.distributed as dist

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for module in sharded_input_modules(model, table):
        for param in module.parameters():
            param.register_hook(summed)


def wrap_model(
    model: nn.Module,
    config: TrainConfig,
    layout: Layout,
    *,
    amp_dtype: torch.dtype = torch.bfloat16,
    compile: bool = False,
    loss_parallel: bool = False,
) -> Wrapped:
    """Move ``model`` to the layout's device and wrap it as ``config`` says, over ``layout``'s
    meshes (no wrapping in a world of one).

    The one place that decides the order, torchtitan's (``parallelize_llama``): tensor
    parallel, activation checkpointing, ``torch.compile`` per block, then FSDP2 or DDP. Each
    step is an ``apply_*`` function of its own. ``config`` comes validated (``TrainConfig``);
    ``layout`` (``_layout.build_layout``) says which mesh each engine spans: TP on
    ``tp_mesh`` (the 1-D world for ``placements``), FSDP2 over ``dp_mesh`` (HSDP when it is
    2-D) or DDP over its group. ``compile`` must already be agreed by every rank.
    ``loss_parallel``: the loss is the model's own token cross-entropy of its logits, so
    ``placements: auto`` may split the output layer over the vocabulary."""
    strategy = config.strategy
    assert strategy in STRATEGIES, strategy  # TrainConfig validated it
    use_amp, fsdp = config.training.use_amp, config.fsdp
    model = model.to(layout.device)
    wrapped = Wrapped(model, strategy, autocast_dtype=amp_dtype if use_amp else None)
    fsdp_follows = layout.data_parallel and strategy == "fsdp"
    sharded_input: list[nn.Module] = []
    if layout.tensor_parallel:
        assert config.placements, "TrainConfig requires a placements table for tensor parallelism"
        placements = resolve_placements(
            model,
            config.placements,
            tp=layout.tp,
            loss_parallel=loss_parallel,
            sequence_parallel=config.parallelism.sequence_parallel,
        )
        wrapped.placements = placements
        wrapped.loss_parallel = layout.tp_mesh is not None and has_loss_parallel(placements)
        plan = placement_plan(model, placements, layout.tp)  # checked in a world of 1 too
        if layout.tp_mesh is not None:
            # the N-D mesh's tp group; None on the 1-D world: the default group, as before
            group = layout.tp_mesh.get_group() if layout.two_d else None
            sharded_input = apply_tp(
                model, layout.tp_mesh, plan, placements, group=group, hooks=not fsdp_follows
            )
            wrapped.partial_group = group
            # DTensor's collectives have no hook: the trainer reads them from the interceptor's
            # op stream when measurement is asked for (see DistributedTrainer.train).
            wrapped.comm_source = None
    elif strategy == "fsdp" and not layout.distributed and fsdp.use_mixed_precision:
        wrapped.autocast_dtype = amp_dtype  # same numerics as bf16 params: autocast the forward
    # FSDP's units by name, taken before apply_ac wraps them: a compile fallback (a model
    # without a block list) compiles the units themselves, not their checkpoint wrappers.
    fallback = _fsdp_named_blocks(model) if fsdp_follows else None
    if config.activation_checkpointing:
        apply_ac(model)
    if compile:
        # DTensor collectives run inside tensor-parallel blocks: a compile failure is then an
        # error, never an eager fallback on one rank (it could order those collectives
        # differently). DDP's and FSDP2's collectives run in hooks around the blocks.
        in_blocks = layout.tp_mesh is not None
        wrapped.compiled = apply_compile(model, config.compile_backend, in_blocks, fallback)
    if layout.data_parallel and config.sync_batchnorm and batchnorms(model):
        # the group over the data dims (a flattened one for HSDP): made only for such models
        wrapped.synced_norms = sync_batchnorm(model, _dp_group(layout.dp_mesh), layout.device)
    find_unused = config.ddp.find_unused_parameters
    if layout.data_parallel and strategy == "ddp":
        group = _dp_group(layout.dp_mesh) if layout.two_d else None
        wrapped.module = apply_ddp(
            model, layout.device, config.ddp, find_unused, wrapped.log, group
        )
        wrapped.comm_source = "ddp_comm_hook"
    elif fsdp_follows:
        if find_unused:
            warnings.warn(
                "find_unused_parameters does nothing under FSDP2 (it handles unused parameters)",
                stacklevel=_USER_FRAME,
            )
        mixed = fsdp.use_mixed_precision or use_amp
        wrapped.fsdp_modules = apply_fsdp(model, layout.dp_mesh, fsdp, amp_dtype if mixed else None)
        wrapped.accumulate_sharded = fsdp.accumulate_sharded
        # their parameters are FSDP's sharded ones now: summed after the step's backward
        wrapped.partial_grads = [p for m in sharded_input for p in m.parameters()]
        sum_only = layout.backend != "nccl"
        _log_fsdp_collectives(wrapped.fsdp_modules, wrapped.log, sum_only=sum_only)
        # FSDP's own MixedPrecisionPolicy casts; autocast stays off so compute is what it says.
        wrapped.autocast_dtype = None
        wrapped.comm_source = "fsdp2_collective_hooks"
    return wrapped


# The frame a wrap_model warning points at: the user's DistributedTrainer(...) call (warn ->
# wrap_model -> DistributedTrainer._wrap -> DistributedTrainer.__init__ -> the user).
_USER_FRAME = 4


def apply_tp(
    model: nn.Module,
    mesh: object,
    plan: dict[str, object],
    table: dict[str, str],
    group: object = None,
    hooks: bool = True,
) -> list[nn.Module]:
    """Tensor parallelism: ``parallelize_module`` with ``plan`` on ``mesh`` (1-D: the world's
    or a bigger mesh's ``tp`` dim), then the gradient hooks of the ``sharded_input`` modules
    (their whole parameters see a part of the input), summing over ``group`` (the ``tp``
    dim's process group on a bigger mesh; ``None``: the world). Returns those modules;
    ``hooks=False`` (FSDP follows, and replaces their parameters) leaves the sum to
    ``Wrapped.sum_partial_grads``."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)
    if hooks:
        _sum_gradients_over_ranks(model, table, group)
    return sharded_input_modules(model, table)


def apply_ac(model: nn.Module) -> None:
    """Activation checkpointing per block (``checkpoint_wrapper``, non-reentrant): after tensor
    parallelism, so recomputation replays the sharded forward, and before compile, so each
    compiled graph holds the recomputation. A sequence split on the first block moves onto
    its wrapper (``_tp_sequence.split_outside_checkpoint``: the checkpoint saves the split)."""
    apply_activation_checkpointing(model)
    split_outside_checkpoint(model)


def apply_compile(
    model: nn.Module,
    backend: str,
    collectives_in_blocks: bool,
    fallback_units: list[tuple[str, nn.Module]] | None,
) -> CompileState:
    """``torch.compile`` per block, in place: after TP and activation checkpointing, before
    FSDP/DDP, so their hooks run eagerly around each compiled block."""
    return compile_blocks(
        model, backend, collectives_in_blocks=collectives_in_blocks, fallback_units=fallback_units
    )


def apply_fsdp(
    model: nn.Module, mesh: object, fsdp: FSDPConfig, param_dtype: torch.dtype | None
) -> list[nn.Module]:
    """FSDP2: ``fully_shard`` each block, then the root, so parameters are gathered one block
    at a time. ``param_dtype`` (mixed precision): compute in it, reduce gradients in fp32.
    Returns the units, the root last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype is not None
        else MixedPrecisionPolicy()
    )
    units = fsdp_blocks(model)
    for block in units:
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
    units.append(model)
    return units


def _log_fsdp_collectives(units: list[nn.Module], log: CollectiveLog, *, sum_only: bool) -> None:
    """Route every unit's all-gathers and reduce-scatters through ``log``'s recording wrappers
    of torch's defaults; ``sum_only`` (gloo): SUM then divide, never an AVG reduction."""
    for unit in units:
        if sum_only:
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_custom_all_gather(LoggedAllGather(log))
        unit.set_custom_reduce_scatter(LoggedReduceScatter(log))


def apply_ddp(
    model: nn.Module,
    device: torch.device,
    ddp: DDPConfig,
    find_unused_parameters: bool,
    log: CollectiveLog,
    group: object = None,
) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel`` around the whole (possibly compiled) model, last: dynamo
    never traces DDP itself. A comm hook doing DDP's divide + SUM all-reduce records each
    bucket's all-reduce in ``log``. ``group``: the data-parallel process group (``None``:
    the world)."""
    ids = [device.index] if device.type == "cuda" else None
    module = nn.parallel.DistributedDataParallel(
        model,
        device_ids=ids,
        process_group=group,
        bucket_cap_mb=ddp.bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
    )
    module.register_comm_hook(group, ddp_counting_hook(log))
    return module


def _dp_group(mesh: object) -> object:
    """One process group over every rank of the data-parallel mesh (DDP takes one group)."""
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()


def _fsdp_named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """FSDP's units by name, compiled when the model has no block list: compiling the whole
    model would trace FSDP2's hooks on its children; compiling each unit keeps them eager."""
    if find_blocks(model) is not None:
        return None
    ids = {id(b) for b in fsdp_blocks(model)}
    return [(n, m) for n, m in model.named_modules() if id(m) in ids]


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global 2-norm of all gradients to ``max_norm``; return the norm before clipping.

    Sharded (DTensor) gradients contribute their *global* norm, replicated plain gradients
    their own: the result equals clipping the unsharded model in one process. Tensor-parallel
    models mix both kinds, which ``torch.nn.utils.clip_grad_norm_`` cannot combine in one call,
    and on a 2-D mesh DTensors on different meshes (``(dp_shard, tp)`` and ``dp_shard``): their
    norms are taken per mesh.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:  # DDP, world of one, or FSDP2 (all DTensors: handled below): torch's own
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    # One norm per mesh: tensor parallel under FSDP2 leaves DTensors on the 2-D
    # (dp_shard, tp) mesh beside the replicated modules' on dp_shard alone, and DTensor ops
    # do not mix meshes. Each mesh's norm is reduced over it (full_tensor), then combined.
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in parameters:
        if isinstance(p.grad, DTensor):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.float() ** 2
    if plain:
        sq = sq + torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2
    total = sq.sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    if plain:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor)],
            max_norm,
            total,
        )
    return total


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over all ranks (identity in a world of one); sum then divide."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t
