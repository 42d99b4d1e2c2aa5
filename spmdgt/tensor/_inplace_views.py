"""In-place ops that change only a tensor's shape and strides: ``t_``, ``transpose_``
(``swapdims_``, ``swapaxes_``), ``squeeze_`` and ``unsqueeze_``.

DTensor has no rule for them, and the in-place fallback cannot help: it writes a global
result back into each rank's shard, and a sharded tensor's wrapper cannot change its shape
there (the row raised; ``optim.Adamax(differentiable=True)``'s ``unsqueeze_`` too). Yet none
moves data: each is the same op on every rank's local tensor, with the shard dims renumbered
(``Shard(0)`` becomes ``Shard(1)`` after ``unsqueeze_(0)``, ``Shard(1)`` becomes ``Shard(0)``
after ``t_()``). So spmdgt does exactly that, at the aten level, below autograd (which records
the op's backward and bumps the version as for a plain tensor): the local tensor changes in
place (its memory and every alias of it stay), the spec takes the new placements, and the
wrapper takes the new global sizes and strides. Decided from metadata alone, the same on
every rank; no collective.

What stays refused: ``squeeze_`` of a size-1 dim that a mesh dim shards (one rank holds the
element, the others none: removing the dim moves data), a placement other than
``Shard``/``Replicate``/``Partial``, a call while torch.compile traces (the in-place fallback's
clear error), and a tensor a view was ever copied from (``_gt_copied``, set by
``_views.tag_views``): such a copy rebuilds itself from its base's global value by
replaying the view on the base's shape of then, which a new shape would silently change. The
flag is never cleared (whether the copy is still alive depends on the garbage collector's
timing, which may differ between ranks); the error says to use the out-of-place op. A view
the fallback copied (``_gt_view``) or a real view (``_gt_alias``) changes shape like any
tensor, and how it is taken from its base follows (before 2026-11-30 a copied view's ``t_()``
went to the write-through, which left its shape as it was, silently).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from spmdgt.tensor._fallback import tracing
from spmdgt.tensor._registry import register_aten

__all__ = ["NAMES", "run"]

_aten = torch.ops.aten
# the torch functions that reach the ops below (``swapdims_``/``swapaxes_`` are
# ``transpose_`` at the aten level)
NAMES = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_"})
_OPS = (
    _aten.t_.default,
    _aten.transpose_.default,
    _aten.squeeze_.default,
    _aten.squeeze_.dim,
    _aten.squeeze_.dims,
    _aten.unsqueeze_.default,
)
_PLAIN = (Shard, Replicate, Partial)
# the wrapper's own sizes and strides are set by its backend's ``as_strided_``: below
# autograd (the op's own record is autograd's), past spmdgt's and DTensor's dispatch
_BELOW = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def _dims(op, shape: torch.Size, args: tuple) -> list[int]:
    """The global dims ``op`` removes (``squeeze_``) or adds (``unsqueeze_``); for
    ``t_``/``transpose_`` the two it swaps. ``args`` as torch normalised them, on metadata."""
    ndim = len(shape)
    if op is _aten.unsqueeze_.default:
        return [args[0] % (ndim + 1)]
    if op is _aten.t_.default:
        return [0, 1] if ndim == 2 else []
    if op is _aten.transpose_.default:
        return [args[0] % max(ndim, 1), args[1] % max(ndim, 1)] if ndim else []
    if op is _aten.squeeze_.default:
        picked = range(ndim)
    elif op is _aten.squeeze_.dim:
        picked = [args[0]]
    else:
        picked = args[0]
    return sorted({d % max(ndim, 1) for d in picked if ndim and shape[d % ndim] == 1})


def _placements(op, placements: tuple, dims: list[int]) -> tuple | None:
    """The placements after ``op``; None where the op would have to move data."""
    out = []
    for p in placements:
        if not isinstance(p, Shard):
            out.append(p)
            continue
        d = p.dim
        if op is _aten.unsqueeze_.default:
            out.append(Shard(d + 1) if d >= dims[0] else p)
        elif op in (_aten.t_.default, _aten.transpose_.default):
            swap = {dims[0]: dims[1], dims[1]: dims[0]} if dims else {}
            out.append(Shard(swap.get(d, d)))
        elif d in dims:
            return None  # a sharded size-1 dim: one rank holds it, the others nothing
        else:
            out.append(Shard(d - sum(1 for r in dims if r < d)))
    return tuple(out)


def run(op, args, kwargs):
    """``op`` (one of ``_OPS``) on a DTensor, in place; None where it cannot be done without
    moving data, so the op goes on to the fallback's error."""
    self = args[0]
    if (
        kwargs
        or not isinstance(self, DTensor)
        or tracing(args)
        or not all(type(p) in _PLAIN for p in self.placements)
    ):
        return None
    if getattr(self, "_gt_copied", False):
        name = op.__name__.split(".")[0]
        raise RuntimeError(
            f"{name}: a view of this sharded tensor was taken as a copy "
            f"(placements {tuple(self.placements)}: DTensor had to move data to make it), and "
            "that copy follows the tensor's shape of then; changing the shape in place would "
            f"leave it reading another layout. Use the out-of-place {name.rstrip('_')}()"
        )
    meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
    op(meta, *args[1:])  # torch's own checks and errors (a dim out of range), and the result
    dims = _dims(op, self.shape, args[1:])
    placements = _placements(op, tuple(self.placements), dims)
    if placements is None:
        return None
    local = self._local_tensor
    if self.device_mesh.get_coordinate() is None:
        pass  # a rank off the tensor's sub-mesh holds an empty placeholder, as DTensor keeps it
    elif op in (_aten.squeeze_.default, _aten.squeeze_.dim, _aten.squeeze_.dims):
        if dims:  # the global size-1 dims only: a shard's own size 1 is not the tensor's
            local.squeeze_(dims)
    else:
        op(local, *args[1:])
    spec = self._spec
    self._spec = DTensorSpec(
        spec.mesh, placements, tensor_meta=TensorMeta(meta.shape, meta.stride(), meta.dtype)
    )
    with torch._C._AutoDispatchBelowADInplaceOrView(), torch._C._ExcludeDispatchKeyGuard(_BELOW):
        _aten.as_strided_.default(self, meta.shape, meta.stride(), self.storage_offset())
    # how the tensor is taken from its base follows the op: a real view's place in its root's
    # memory (``_gt_alias``), a copy's replay from its base (``_gt_view``, whose values stay
    # as of the same base version: the op moves none)
    name, rest = op.__name__.split(".")[0][:-1], args[1:]
    alias = getattr(self, "_gt_alias", None)
    if alias is not None:
        self._gt_alias = (alias[0], alias[1], _then(alias[2], name, rest))
    view = getattr(self, "_gt_view", None)
    if view is not None:
        self._gt_view = (view[0], _then(view[1], name, rest), view[2])
    return self


def _then(replay, name: str, rest: tuple):
    """``replay`` followed by the out-of-place form of in-place view ``name`` + ``_``."""
    return lambda full: getattr(replay(full), name)(*rest)


register_aten(_OPS, "intercept", run)
