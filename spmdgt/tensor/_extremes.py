"""``argmax`` and ``argmin`` over a sharded dim, exactly: the first index of the extreme in
torch's order, NaN included, with shards of any size.

DTensor runs them through a handler of its own (``_nonlinear_redux.argminmax_handler``): each
rank takes its shard's extreme and index, the ranks gather both, and the *first rank* holding
the extreme wins. torch returns the first *flat index* of the extreme, and the two agree only
where the shards follow one another in flat order: ``x.argmax()`` of column shards picks a
tie on a later row when its column is on an earlier rank (``[[1, 5], [5, 0]]`` over 2 ranks:
2 for torch's 1, silently), and a NaN likewise. A rank whose shard is empty (4 rows over 8
ranks) raises in the local reduction while the others wait in the gather: a hang.

The wrap (``_handlers``) takes every rank's candidate (its extreme, the global index of its
first occurrence, or index -1 for an empty shard), gathers the candidates over the mesh dims
sharding the reduced dim (two all-gathers, as DTensor's), and picks the smallest index among
the candidates equal to the extreme (NaN equal to NaN). Every rank computes the same answer
from the same gathered values. Where no mesh dim shards the reduced dim, or the layout is one
DTensor's handler refuses (``_StridedShard``), DTensor's handler runs as it is; a bool input
or an empty reduction raises torch's own error on every rank, before any data moves.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from spmdgt.tensor import _handlers

__all__: list[str] = []  # a handler wrap (``_handlers``)

_ARGMAX = torch.ops.aten.argmax.default
_ARGMIN = torch.ops.aten.argmin.default
_NO_INDEX = torch.iinfo(torch.int64).max


@_handlers.wrap(_ARGMAX, _ARGMIN)
def _first_extreme(original, op_call, args, kwargs):
    """DTensor's ``argmax``/``argmin`` handler with torch's tie order (module docstring)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if not isinstance(x, DTensor) or x.ndim == 0 or x.device_mesh.get_coordinate() is None:
        return original(op_call, args, kwargs)
    spec = x._spec
    if dim is not None:
        dim = dim % x.ndim
    if x.dtype is torch.bool or (x.numel() == 0 and (dim is None or x.shape[dim] == 0)):
        # torch's own error (a bool input; an empty reduction), the same on every rank
        return op_call(torch.empty(x.shape, dtype=x.dtype), *args[1:], **kwargs)
    if any(type(p) is not Shard and p.is_shard() for p in spec.placements):
        return original(op_call, args, kwargs)  # _StridedShard: DTensor's own error
    mesh_dims = [
        m for m, p in enumerate(spec.placements) if p.is_shard() and (dim is None or p.dim == dim)
    ]
    if not mesh_dims:
        return original(op_call, args, kwargs)  # every rank's reduction is whole
    from torch.distributed.tensor._nonlinear_redux import _get_output_sharding

    out_spec = _get_output_sharding(op_call, args, kwargs).output_spec
    if any(p.is_partial() for p in spec.placements):
        x = x.redistribute(
            x.device_mesh, [Replicate() if p.is_partial() else p for p in spec.placements]
        )
    value, index = _candidate(op_call, x, dim)
    for m in mesh_dims:
        value = funcol.all_gather_single(value, 0, (x.device_mesh, m))
        index = funcol.all_gather_single(index, 0, (x.device_mesh, m))
    best = _extreme(op_call, value, index >= 0)
    hit = (index >= 0) & (value == best)
    if value.is_floating_point():
        hit |= value.isnan() & best.isnan()
    first = torch.where(hit, index, _NO_INDEX).amin(0)
    if dim is None:
        first = first.reshape([1] * x.ndim if keepdim else [])
    elif not keepdim:
        first = first.squeeze(dim)
    return DTensor._op_dispatcher.wrap(first, out_spec)


def _candidate(op_call, x: DTensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's extreme and the global index of its first occurrence, with a leading dim
    of 1 to gather along (index -1: an empty shard, no candidate)."""
    local = x.to_local()
    shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    if dim is None:
        flat = local.reshape(-1)
        if flat.numel() == 0:
            return flat.new_zeros(1, 1), torch.full((1, 1), -1, dtype=torch.long)
        at = op_call(flat, 0, True)
        index = torch.zeros_like(at)
        rest = at
        for d in range(x.ndim):  # the local flat index to the global one
            inner = math.prod(shape[d + 1 :])
            index = index + (rest // inner + offset[d]) * math.prod(x.shape[d + 1 :])
            rest = rest % inner
        return flat[at].unsqueeze(0), index.unsqueeze(0)
    if local.shape[dim] == 0:
        size = list(local.shape)
        size[dim] = 1
        return local.new_zeros([1, *size]), torch.full([1, *size], -1, dtype=torch.long)
    at = op_call(local, dim, True)
    return local.gather(dim, at).unsqueeze(0), (at + offset[dim]).unsqueeze(0)


def _extreme(op_call, value: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The extreme over the gathered candidates (dim 0), the empty shards' left out; a NaN
    candidate is the extreme, as in torch's ``argmax`` and ``argmin``."""
    if value.is_floating_point():
        bound = float("-inf") if op_call is _ARGMAX else float("inf")
    else:
        info = torch.iinfo(value.dtype)
        bound = info.min if op_call is _ARGMAX else info.max
    value = torch.where(valid, value, torch.full_like(value, bound))
    return value.amax(0) if op_call is _ARGMAX else value.amin(0)
