"""A tensor-parallel placements table, checked and turned into ``parallelize_module``'s plan.

``placement_plan(model, table, tp_size)`` refuses, before any shard is made, a table that
cannot be exact (``_tp_plan.check_table``; a module with parameters left unnamed beside a
colwise one), names modules it cannot split, or splits a dim that does not divide; else it
returns module name -> DTensor ``ParallelStyle``. ``_tp_plan`` derives a table
(``placements: auto``); ``_strategies.apply_tp`` applies the plan.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from spmdgt.config import ConfigError
from spmdgt.train._tp_plan import LOSS_PARALLEL, SPLIT_COLWISE, _style_of, check_table

__all__ = ["has_loss_parallel", "placement_plan", "sharded_input_modules"]


def placement_plan(
    model: nn.Module, table: dict[str, str], world_size: int = 1
) -> dict[str, object]:
    """The ``parallelize_module`` plan of ``table`` (module-name glob -> style, first match
    wins), refused before any shard is made when it cannot be exact (``check_table``, then
    the unnamed-beside-colwise rule) or names modules it cannot split."""
    check_table(model, table)
    plan: dict[str, object] = {}
    used = dict.fromkeys(table, False)
    for name, module in model.named_modules():
        if not name:
            continue
        for pattern, style in table.items():
            if fnmatch.fnmatchcase(name, pattern):
                used[pattern] = True
                if style not in ("replicate", "sharded_input"):
                    plan[name] = _style(module, name, pattern, style, world_size)
                break  # first matching pattern wins
    _refuse_unplaced_beside_colwise(model, table)
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ConfigError(
            f"placement pattern(s) {', '.join(map(repr, unused))} match no module; module names "
            f"look like: {', '.join(names)}",
            key=f"placements.{unused[0]}",
        )
    return plan


def _style(module: nn.Module, name: str, pattern: str, style: str, world_size: int) -> object:
    """One module's DTensor ``ParallelStyle`` for the table's ``style`` (checked first)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from spmdgt.train._tp_sequence import SEQUENCE_STYLES, sequence_style
    from spmdgt.train._tp_styles import ExpertsParallel, PackedColwise

    if style in SEQUENCE_STYLES and style != "rowwise_scatter":
        return sequence_style(style)  # any module: its hidden states' layout
    if style == "experts":
        _check_experts(module, name, pattern, world_size)
        return ExpertsParallel()
    linear_only = style in ("packed_colwise", "rowwise_split", "rowwise_scatter", LOSS_PARALLEL)
    kinds = (nn.Linear,) if linear_only else (nn.Linear, nn.Embedding)
    if not isinstance(module, kinds):
        raise ConfigError(
            f"{style} placement needs an {' or '.join('nn.' + k.__name__ for k in kinds)}, "
            f"but {name!r} is a {type(module).__name__}",
            key=f"placements.{pattern}",
            value=style,
        )
    _check_divisible(module, name, pattern, style, world_size)
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == LOSS_PARALLEL:  # the logits stay split: the loss reads them under loss_parallel
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if style == "packed_colwise":
        return PackedColwise(parts=2)
    if style == "rowwise_scatter":
        return sequence_style(style)
    # rowwise: an embedding's token ids are whole on every rank (vocab-parallel lookup);
    # rowwise_split: a whole input, each rank takes its slice
    whole = style == "rowwise_split" or isinstance(module, nn.Embedding)
    return RowwiseParallel(input_layouts=Replicate()) if whole else RowwiseParallel()


def _check_experts(module: nn.Module, name: str, pattern: str, world_size: int) -> None:
    """``experts`` takes HF's fused experts: ``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``, no other parameters, ``I`` divisible by the ranks."""
    params = dict(module.named_parameters(recurse=False))
    gu, down = params.get("gate_up_proj"), params.get("down_proj")
    ok = (
        set(params) == {"gate_up_proj", "down_proj"}
        and gu.ndim == 3
        and down.ndim == 3
        and gu.shape[1] == 2 * down.shape[2]
        and gu.shape[2] == down.shape[1]
    )
    if not ok:
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        raise ConfigError(
            f"experts placement needs HF's fused experts (gate_up_proj [E, 2I, H] and "
            f"down_proj [E, H, I], nothing else), but {name!r} has {shapes}",
            key=f"placements.{pattern}",
            value="experts",
        )
    if down.shape[2] % world_size:
        raise ConfigError(
            f"experts placement of {name!r} splits its intermediate size {down.shape[2]} over "
            f"{world_size} ranks; it must divide by the ranks",
            key=f"placements.{pattern}",
            value="experts",
        )


def _refuse_unplaced_beside_colwise(model: nn.Module, table: dict[str, str]) -> None:
    """Refuse a table that leaves a module with parameters beside a colwise one unnamed.

    Such a module (Qwen3's per-head ``q_norm``/``k_norm`` beside ``q_proj``/``k_proj``) most
    likely sees the colwise layer's output: this rank's heads only. Its plain parameters'
    gradients would then cover those heads alone and the ranks' "replicated" weights drift
    apart, silently. A pre-norm beside them sees the full input instead and is right as a
    plain module, so naming it ``replicate`` in the table says so and is accepted."""
    colwise = {name for name, _ in model.named_modules() if _style_of(name, table) in SPLIT_COLWISE}
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


# (is an Embedding, style) -> the attribute holding the dim that style splits, and the
# parts it must split into (packed: each of its 2 parts over the ranks)
_SHARDED_DIM = {
    (True, "colwise"): ("embedding_dim", 1),
    (True, "colwise_gather"): ("embedding_dim", 1),
    (True, "rowwise"): ("num_embeddings", 1),
    (False, "colwise"): ("out_features", 1),
    (False, "colwise_gather"): ("out_features", 1),
    (False, LOSS_PARALLEL): ("out_features", 1),
    (False, "packed_colwise"): ("out_features", 2),
    (False, "rowwise"): ("in_features", 1),
    (False, "rowwise_split"): ("in_features", 1),
    (False, "rowwise_scatter"): ("in_features", 1),
}


def _check_divisible(
    module: nn.Module, name: str, pattern: str, style: str, world_size: int
) -> None:
    """torch hands colwise output to rowwise input as even local shards: demand divisibility."""
    what, parts = _SHARDED_DIM[(isinstance(module, nn.Embedding), style)]
    size = getattr(module, what)
    if size % (world_size * parts):
        raise ConfigError(
            f"{style} placement of {name!r} splits its {what}={size} over {world_size} ranks"
            f"{f' in each of its {parts} parts' if parts > 1 else ''}; tensor parallelism needs "
            f"it divisible by the world size (pad the layer or replicate it)",
            key=f"placements.{pattern}",
            value=style,
        )


def sharded_input_modules(model: nn.Module, table: dict[str, str]) -> list[nn.Module]:
    """The modules the table names ``sharded_input`` (first matching pattern wins)."""
    found = []
    for name, module in model.named_modules():
        style = next((s for p, s in table.items() if fnmatch.fnmatchcase(name, p)), None)
        if name and style == "sharded_input":
            found.append(module)
    return found


def has_loss_parallel(table: dict[str, str]) -> bool:
    """Whether the table splits an output layer for the loss (``loss_parallel``): its
    logits are then split, and the trainer runs forward and backward under torch's
    ``loss_parallel``."""
    return LOSS_PARALLEL in table.values()
