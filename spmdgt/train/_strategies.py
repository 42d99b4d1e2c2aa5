"""Wrap a model for a parallel strategy, on torch's own engines.

* ``ddp``: ``DistributedDataParallel``; gradient accumulation under ``no_sync``.
* ``fsdp``: FSDP2 ``fully_shard`` on every direct child holding parameters, then the root;
  ``MixedPrecisionPolicy(bf16 params, fp32 reduce)`` for mixed precision; accumulation via
  ``set_requires_gradient_sync(False)``. On gloo, reductions are forced to SUM-then-divide
  (``set_force_sum_reduction_for_comms``) rather than trusting an AVG reduce-scatter.
* ``placements``: tensor parallelism from a YAML table of module-name globs through
  ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on the world mesh. Every
  rank must see the same batch (no data parallelism); ``replicate`` keeps a full copy on each
  rank (plain tensors that stay identical because their inputs are identical).

``compile=True`` (see ``_compile``) goes block by block in torchtitan's order: tensor parallel,
then activation checkpointing (``activation_checkpointing=True``), then ``torch.compile`` of
each block, then ``fully_shard`` per block and the root (or DDP around the model).

In a world of one nothing is wrapped: the plain model trains as is (blocks still compiled).
``Wrapped.no_sync()`` is the one context the trainer uses to skip gradient communication on
non-final micro-steps.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from spmdgt.config import ConfigError
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
from spmdgt.train._config import PLACEMENT_STYLES, STRATEGIES, DDPConfig, FSDPConfig

__all__ = ["Wrapped", "clip_grad_norm", "fsdp_units", "wrap_model"]


@dataclass
class Wrapped:
    """A model ready to train: the module to call plus how to silence gradient sync."""

    module: nn.Module
    strategy: str
    data_parallel_size: int
    """Ranks that see different data (1 for placements: every rank sees the same batch)."""
    log: CollectiveLog = field(default_factory=CollectiveLog)
    fsdp_modules: list[nn.Module] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    """dtype for ``torch.autocast`` around forward; None when FSDP mixed precision does it."""
    comm_source: str | None = "no_collectives"
    """What fills ``log``: a torch hook, ``None`` when only the interceptor's op stream can see
    the collectives (placements: measured only on request), "no_collectives" in a world of one."""
    compiled: CompileState | None = None
    """What ``compile=True`` compiled (None: nothing compiled)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no collective until the context exits."""
        if self.strategy == "ddp" and isinstance(self.module, nn.parallel.DistributedDataParallel):
            with self.module.no_sync():
                yield
        elif self.fsdp_modules:
            root = self.fsdp_modules[-1]
            root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                root.set_requires_gradient_sync(True)
        else:
            yield


def _placement_plan(
    model: nn.Module, table: dict[str, str], world_size: int = 1
) -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    used = dict.fromkeys(table, False)
    for name, module in model.named_modules():
        if not name:
            continue
        for pattern, style in table.items():
            if fnmatch.fnmatchcase(name, pattern):
                used[pattern] = True
                if style not in ("replicate", "sharded_input"):
                    if not isinstance(module, (nn.Linear, nn.Embedding)):
                        raise ConfigError(
                            f"{style} placement needs an nn.Linear or nn.Embedding, but "
                            f"{name!r} is a {type(module).__name__}",
                            key=f"placements.{pattern}",
                            value=style,
                        )
                    _check_divisible(module, name, pattern, style, world_size)
                    plan[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
                break  # first matching pattern wins
    _refuse_unplaced_beside_colwise(model, plan, table)
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ConfigError(
            f"placement pattern(s) {', '.join(map(repr, unused))} match no module; module names "
            f"look like: {', '.join(names)}",
            key=f"placements.{unused[0]}",
        )
    return plan


def _refuse_unplaced_beside_colwise(
    model: nn.Module, plan: dict[str, object], table: dict[str, str]
) -> None:
    """Refuse a table that leaves a module with parameters beside a colwise one unnamed.

    Such a module (Qwen3's per-head ``q_norm``/``k_norm`` beside ``q_proj``/``k_proj``) most
    likely sees the colwise layer's output: this rank's heads only. Its plain parameters'
    gradients would then cover those heads alone and the ranks' "replicated" weights drift
    apart, silently. A pre-norm beside them sees the full input instead and is right as a
    plain module, so naming it ``replicate`` in the table says so and is accepted."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = {name for name, style in plan.items() if isinstance(style, ColwiseParallel)}
    named = {
        name
        for name, _ in model.named_modules()
        if name and any(fnmatch.fnmatchcase(name, p) for p in table)
    }
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        children = [(prefix + n, c) for n, c in parent.named_children()]
        beside = [n for n, _ in children if n in colwise]
        if not beside:
            continue
        for name, child in children:
            if name in named or not any(True for _ in child.parameters()):
                continue
            raise ConfigError(
                f"{name!r} ({type(child).__name__}) has parameters and sits beside the colwise "
                f"{beside[0]!r}, but the placements table does not name it. If it reads "
                f"{beside[0]!r}'s output (a per-head norm), it sees only this rank's part and "
                "its plain gradient would cover that part alone (the ranks' copies would drift "
                "apart): "
                f"name it '{name}: sharded_input' (its parameters stay whole, their "
                "gradients are summed over the ranks). If it reads the full input (a "
                f"pre-norm), name it '{name}: replicate'",
                key=f"placements.{name}",
            )


def _sum_gradients_over_ranks(model: nn.Module, table: dict[str, str]) -> None:
    """``sharded_input`` modules read this rank's part of a colwise output (a per-head norm
    over this rank's heads), so each rank's gradient of their whole, plain parameters is a
    partial sum: a hook on each gradient sums it over the ranks before it accumulates (once
    per backward, so gradient accumulation stays exact). Every rank runs the same backward,
    so the hooks' all-reduces come in the same order everywhere."""
    import torch.distributed as dist

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad

    for name, module in model.named_modules():
        style = next((s for p, s in table.items() if fnmatch.fnmatchcase(name, p)), None)
        if name and style == "sharded_input":
            for param in module.parameters():
                param.register_hook(summed)


# (is an Embedding, style) -> the attribute holding the dim that style splits
_SHARDED_DIM = {
    (True, "colwise"): "embedding_dim",
    (True, "rowwise"): "num_embeddings",
    (False, "colwise"): "out_features",
    (False, "rowwise"): "in_features",
}


def _check_divisible(
    module: nn.Module, name: str, pattern: str, style: str, world_size: int
) -> None:
    """torch hands colwise output to rowwise input as even local shards: demand divisibility."""
    what = _SHARDED_DIM[(isinstance(module, nn.Embedding), style)]
    size = getattr(module, what)
    if size % world_size:
        raise ConfigError(
            f"{style} placement of {name!r} splits its {what}={size} over {world_size} ranks; "
            f"tensor parallelism needs it divisible by the world size (pad the layer or "
            f"replicate it)",
            key=f"placements.{pattern}",
            value=style,
        )


def wrap_model(
    model: nn.Module,
    strategy: str,
    *,
    device: torch.device,
    world_size: int,
    backend: str | None,
    use_amp: bool = False,
    amp_dtype: torch.dtype = torch.bfloat16,
    find_unused_parameters: bool = False,
    ddp: DDPConfig | None = None,
    fsdp: FSDPConfig | None = None,
    placements: dict[str, str] | None = None,
    mesh: object = None,
    compile: bool = False,
    compile_backend: str = "inductor",
    activation_checkpointing: bool = False,
) -> Wrapped:
    """Move ``model`` to ``device`` and wrap it for ``strategy`` (no wrapping in a world of 1).

    ``compile``/``activation_checkpointing``: per block, after tensor parallelism and before
    FSDP/DDP (torchtitan's order); ``compile`` must already be agreed by every rank."""
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}",
            key="strategy",
            value=strategy,
        )
    ddp = ddp or DDPConfig()
    fsdp = fsdp or FSDPConfig()
    model = model.to(device)
    log = CollectiveLog()
    autocast = amp_dtype if use_amp else None

    if strategy == "placements":
        table = placements or {}
        if not table:
            raise ConfigError("strategy 'placements' needs a placements table", key="placements")
        bad = {p: s for p, s in table.items() if s not in PLACEMENT_STYLES}
        if bad:
            p, s = next(iter(bad.items()))
            raise ConfigError(f"unknown placement {s!r}", key=f"placements.{p}", value=s)
        plan = _placement_plan(model, table, world_size)  # validated even in a world of one
        if world_size == 1:
            compiled = _ac_and_compile(
                model, compile, compile_backend, activation_checkpointing, collectives=False
            )
            return Wrapped(model, strategy, 1, log, autocast_dtype=autocast, compiled=compiled)
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, plan)
        _sum_gradients_over_ranks(model, table)
        # DTensor collectives run inside the blocks: a compile failure is an error, never an
        # eager fallback on one rank (it could order those collectives differently).
        compiled = _ac_and_compile(
            model, compile, compile_backend, activation_checkpointing, collectives=True
        )
        # DTensor's collectives have no hook: the trainer reads them from the interceptor's op
        # stream when measurement is asked for (see DistributedTrainer.train), never by tracing
        # here.
        return Wrapped(
            model,
            strategy,
            1,
            log,
            autocast_dtype=autocast,
            comm_source=None,
            compiled=compiled,
        )

    if world_size == 1:
        if strategy == "fsdp" and fsdp.use_mixed_precision:
            autocast = amp_dtype  # same numerics as bf16 params: autocast the forward
        compiled = _ac_and_compile(
            model, compile, compile_backend, activation_checkpointing, collectives=False
        )
        return Wrapped(model, strategy, 1, log, autocast_dtype=autocast, compiled=compiled)

    # DDP's and FSDP2's collectives run in hooks around the blocks, never inside them.
    compiled = _ac_and_compile(
        model,
        compile,
        compile_backend,
        activation_checkpointing,
        collectives=False,
        fallback_units=_fsdp_named_blocks(model) if strategy == "fsdp" else None,
    )
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        module = nn.parallel.DistributedDataParallel(
            model,
            device_ids=ids,
            bucket_cap_mb=ddp.bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
        )
        module.register_comm_hook(None, ddp_counting_hook(log))
        return Wrapped(
            module,
            strategy,
            world_size,
            log,
            autocast_dtype=autocast,
            comm_source="ddp_comm_hook",
            compiled=compiled,
        )

    # fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if find_unused_parameters:
        warnings.warn(
            "find_unused_parameters does nothing under FSDP2 (it handles unused parameters)",
            stacklevel=3,
        )
    mixed = fsdp.use_mixed_precision or use_amp
    mp = (
        MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    units = _fsdp_blocks(model)
    for block in units:
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
    units.append(model)
    sum_only = backend != "nccl"
    for unit in units:
        if sum_only:
            # gloo: SUM then divide by the data-parallel size, never an AVG reduction.
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_custom_all_gather(LoggedAllGather(log))
        unit.set_custom_reduce_scatter(LoggedReduceScatter(log))
    # FSDP's own MixedPrecisionPolicy casts; autocast stays off so compute is what it says.
    return Wrapped(
        model,
        strategy,
        world_size,
        log,
        fsdp_modules=units,
        autocast_dtype=None,
        comm_source="fsdp2_collective_hooks",
        compiled=compiled,
    )


def _ac_and_compile(
    model: nn.Module,
    compile: bool,
    backend: str,
    activation_checkpointing: bool,
    *,
    collectives: bool,
    fallback_units: list[tuple[str, nn.Module]] | None = None,
) -> CompileState | None:
    """Activation checkpointing, then ``torch.compile``, per block (after TP, before FSDP)."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if not compile:
        return None
    return compile_blocks(
        model, backend, collectives_in_blocks=collectives, fallback_units=fallback_units
    )


def _fsdp_named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """FSDP's units by name, compiled when the model has no block list: compiling the whole
    model would trace FSDP2's hooks on its children; compiling each unit keeps them eager."""
    if find_blocks(model) is not None:
        return None
    ids = {id(b) for b in _fsdp_blocks(model)}
    return [(n, m) for n, m in model.named_modules() if id(m) in ids]


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``fully_shard`` wraps before the root: each direct child that owns
    parameters, or each element of a child ``ModuleList`` (transformer layers), so all-gathers
    are per block."""
    blocks = []
    for child in model.children():
        inner = child.children() if isinstance(child, nn.ModuleList) else [child]
        blocks.extend(b for b in inner if any(True for _ in b.parameters()))
    return blocks


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units that communicate when ``wrap_model`` shards ``model``: its blocks, then
    the root when parameters are left outside them (a root without parameters issues no
    collectives). One all-gather per unit per forward (and backward), one reduce-scatter."""
    blocks = _fsdp_blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = any(id(p) not in inside for p in model.parameters())
    return [*blocks, model] if rest else blocks


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global 2-norm of all gradients to ``max_norm``; return the norm before clipping.

    Sharded (DTensor) gradients contribute their *global* norm, replicated plain gradients
    their own: the result equals clipping the unsharded model in one process. Tensor-parallel
    models mix both kinds, which ``torch.nn.utils.clip_grad_norm_`` cannot combine in one call.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:  # DDP, world of one, or FSDP2 (all DTensors: handled below): torch's own
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    if sharded:
        n = torch.nn.utils.get_total_norm(sharded, 2.0)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.float() ** 2
    if plain:
        sq = sq + torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2
    total = sq.sqrt()
    if sharded:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in parameters if isinstance(p.grad, DTensor)], max_norm, total
        )
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
