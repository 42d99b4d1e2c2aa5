"""Checks the propagation hook (``_hook``) runs inside spmdgt's calls, each raising (so the
op takes the exact fallback, ``NoRule``) where DTensor's rule would give other values than
one process, read from the specs alone (alike on every rank). Before propagation, per op
(registered on the op's record, ``_registry``): a reshape of a dim sharded unevenly over
several mesh dims, a low-precision product or reduction over a sharded dim, a partial
value's bits read as another dtype. After it, for
any op: a strategy DTensor derived that nests uneven shards (``check_nesting``), a masked
partial on a mesh of 2+ dims (``check_mask_partial``)."""

from __future__ import annotations

import torch

from spmdgt.tensor._registry import register_aten, registered
from spmdgt.tensor._shards import nested_uneven

__all__ = ["check_mask_partial", "check_nesting"]

aten = torch.ops.aten


# DTensor's reshaping view rules (``_view_ops``): they check a flattened or split dim's
# evenness against the first mesh dim that shards it only (see ``_shards.nested_uneven``).
def _check_reshape(op_call, args, specs, _) -> None:
    """Raise (so the op takes the exact fallback) where a reshape's input has one tensor dim
    sharded unevenly over several mesh dims, which DTensor's view rule would view at sizes
    the ranks' pieces do not have: an error on some ranks, or wrong values."""
    for spec in specs:
        if nested_uneven(spec):
            raise RuntimeError(
                f"{op_call} on a dim sharded unevenly over several mesh dims "
                f"({tuple(spec.placements)}, shape {tuple(spec.shape)})"
            )


register_aten(
    (aten.view.default, aten.view_copy.default, aten.reshape.default, aten._unsafe_view.default),
    "check",
    _check_reshape,
)


def check_nesting(op_call, specs, result) -> None:
    """Raise (so the op takes the exact fallback) where the strategy DTensor derived from an
    op's decomposition (no rule registered for the op) lays an input or an output out with one
    tensor dim sharded unevenly over several mesh dims while no input came in so: a layout
    DTensor invented, on a mesh of 2+ dims only, through the view rules that misjudge it
    (``_check_reshape``): ``pixel_unshuffle`` on ``(Replicate(), Shard(1))`` had its 6 rows
    redistributed as ``(Shard(2), Shard(2))``, pieces 2/1/2/1, and each rank's kernel refused
    its own height. Registered rules (pointwise ``where``, say) redistribute such layouts
    exactly, and inputs that already come in nested keep DTensor's path."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves

    mine = [s for s in specs if isinstance(s, DTensorSpec)]
    if not mine or all(s.mesh.ndim == 1 for s in mine) or registered(op_call):
        return
    if any(nested_uneven(s) for s in mine):
        return
    chosen = list(tree_leaves(getattr(result, "output_spec", None)))
    schema = getattr(result, "redistribute_schema", None)
    if schema is not None:
        chosen += list(schema.args_spec)
    for spec in chosen:
        if isinstance(spec, DTensorSpec) and nested_uneven(spec):
            raise RuntimeError(
                f"{op_call}: DTensor's strategy shards a dim unevenly over several mesh dims "
                f"({tuple(spec.placements)}, shape {tuple(spec.shape)})"
            )


def check_mask_partial(op_call, result) -> None:
    """Raise (so the op takes the exact fallback) where DTensor's strategy, on a mesh of 2+
    dims, uses a ``_MaskPartial`` (a gather or an embedding on a dim sharded over one mesh
    dim). Its ``MaskBuffer`` is one object shared by every use of the cached strategy, with a
    reference count: on 2x2, ``multi_margin_loss``'s gather on ``(Replicate(), Shard(1))``
    materialised it twice with different masks ("MaskBuffer has been materialized with
    conflicting data"), and a count left behind by one op made later, unrelated ops raise or
    not depending on what ran before. 1-D meshes keep DTensor's path (the sweep's rows there
    are equal)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import _MaskPartial
    from torch.utils._pytree import tree_leaves

    chosen = list(tree_leaves(getattr(result, "output_spec", None)))
    schema = getattr(result, "redistribute_schema", None)
    if schema is not None:
        chosen += list(schema.args_spec)
    for spec in chosen:
        if (
            isinstance(spec, DTensorSpec)
            and spec.mesh.ndim > 1
            and any(isinstance(p, _MaskPartial) for p in spec.placements)
        ):
            raise RuntimeError(
                f"{op_call}: DTensor's strategy uses a masked partial on a {spec.mesh.ndim}-D "
                "mesh (its shared mask buffer is not safe there)"
            )


# Matrix products -> (first operand's index in the specs, its contracted dim, the second
# operand's contracted dim), dims counted from the end.
_MATMULS = {
    aten.mm.default: (0, -1, -2),
    aten.bmm.default: (0, -1, -2),
    aten.addmm.default: (1, -1, -2),
    aten.baddbmm.default: (1, -1, -2),
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Sums -> the index of their ``dim`` argument (None: over every dim).
_SUMS = {
    aten.sum.default: None,
    aten.sum.dim_IntList: 1,
    aten.mean.default: None,
    aten.mean.dim: 1,
    aten.linalg_vector_norm.default: 2,
}


def _check_low_precision_reduction(op_call, args, specs, at) -> None:
    """As ``_check_low_precision_sum``, for a bfloat16/float16 sum, mean or norm over a
    sharded dim: each rank rounds its partial result, torch rounds the whole once (Muon's
    ``norm()`` of its bfloat16 gradient)."""
    spec = specs[0] if specs else None
    if not hasattr(spec, "placements") or spec.tensor_meta is None:
        return
    if spec.tensor_meta.dtype not in _LOW_PRECISION:
        return
    dims = args[at] if at is not None and len(args) > at else None
    ndim = len(spec.shape)
    if dims is None or dims == []:
        dims = range(ndim)
    elif isinstance(dims, int):
        dims = [dims]
    reduced = {d % max(ndim, 1) for d in dims}
    if any(p.is_partial() or any(p.is_shard(d) for d in reduced) for p in spec.placements):
        raise RuntimeError(
            f"{op_call}: {spec.tensor_meta.dtype} reduction over a sharded dim (the ranks "
            "would combine partial results rounded to low precision)"
        )


def _check_low_precision_sum(op_call, args, specs, where) -> None:
    """Raise (so the op takes the exact fallback) for a bfloat16/float16 matrix product
    whose contracted dim is sharded: each rank's kernel rounds its partial sum to the low
    precision and the ranks then add rounded values, where torch's kernel accumulates in
    float32 and rounds once (Muon's Newton-Schulz iteration came out 4e-3 off)."""
    first = where[0]
    pair = [s for s in specs[first : first + 2] if hasattr(s, "placements")]
    if len(pair) != 2 or pair[0].tensor_meta is None:
        return
    if pair[0].tensor_meta.dtype not in _LOW_PRECISION:
        return
    for spec, dim in zip(pair, where[1:]):
        dim += len(spec.shape)
        if any(p.is_shard(dim) or p.is_partial() for p in spec.placements):
            raise RuntimeError(
                f"{op_call}: {pair[0].tensor_meta.dtype} product over a sharded dim "
                "(the ranks would add partial sums rounded to low precision)"
            )


register_aten(_MATMULS, "check", _check_low_precision_sum)
register_aten(_SUMS, "check", _check_low_precision_reduction)


def _check_partial_bits(op_call, args, specs, _) -> None:
    """Raise (so the op takes the exact fallback) for ``view(dtype)`` of a partial value into
    another dtype: DTensor's rule keeps the placement, so the ranks' reinterpreted bits would
    be reduced, which is not the reinterpreted bits of the reduced value (a float32 sum read
    as int32 came out as other numbers)."""
    spec = specs[0] if specs else None
    placements = getattr(spec, "placements", ())
    meta = getattr(spec, "tensor_meta", None)
    if meta is not None and args[1] != meta.dtype and any(p.is_partial() for p in placements):
        raise RuntimeError(f"{op_call} of a partial value (its bits would be reduced)")


register_aten((aten.view.dtype,), "check", _check_partial_bits)
