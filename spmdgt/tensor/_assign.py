"""Assignments that replace a tensor's value wholesale: ``t.data = value`` and ``t.set_(src)``.

``.data =`` is an attribute, not an op: DTensor's C++ setter would change the wrapper's shape
and keep the old shards. spmdgt gives ``torch.Tensor`` a ``data`` property (reads stay
torch's; ``install_data_setter``): a ``gt.Tensor`` takes the value (``set_data``), a plain
tensor refuses a sharded value at the assignment. ``Tensor.set_`` reaches
``gt.Tensor.__torch_dispatch__`` as ``aten.set_.source_Tensor``, the ``ASSIGN`` route
(``assign``), and ends in the same ``set_data``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmdgt._core import scope as _scope
from spmdgt.tensor import _fallback
from spmdgt.tensor._meshes import spans_world
from spmdgt.tensor._moves import _cls, place, refresh

__all__ = ["assign", "install_data_setter", "set_data"]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass


_data = torch._C.TensorBase.data  # torch's own ``.data`` (a C getset)


def set_data(t: DTensor, value) -> None:
    """``t.data = value`` for a ``gt.Tensor`` ``t``: ``t`` takes ``value``'s values, shape and
    dtype, as in torch (where DTensor's C++ setter changes the wrapper's shape alone and
    keeps the old shards: old values, or a shape that does not match them).

    A DTensor ``value``: ``t`` takes its layout and its shards themselves, so the two share
    memory as torch's would (a copy DTensor made for a view keeps its tie to the view's base,
    see ``_views.tag_views``). A plain ``value`` (the same on every rank, as every plain
    tensor is): laid out as ``t`` is, a shard dim the new shape lacks replicated; a copy, so
    later writes to ``value`` do not reach ``t`` (no rank holds a sharded tensor's memory
    whole). Ties between parameters: assign the parameter itself (``b.weight = a.weight``)"""
    from spmdgt.tensor._placement import Target

    for x in (t, value):
        if _scope.lazy_sync is not None and "_gt_lazy" in getattr(x, "__dict__", ()):
            _scope.lazy_sync(".data =")
    if isinstance(value, DTensor):
        if getattr(value, "_gt_view", None) is not None:
            refresh(value)
        new = value
    elif isinstance(value, torch.Tensor):
        ndim = value.dim()
        placements = tuple(
            Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in t.placements
        )
        with torch.no_grad():
            new = place(value.detach(), Target(t.device_mesh, placements))
    else:
        new = value  # torch's own error: "Variable data has to be a tensor, but got int"
    with _DisableSubclass():
        _data.__set__(t, new)  # torch's checks (dtype and requires_grad); the new metadata
    t._local_tensor = new._local_tensor.detach()  # the same memory, no autograd history
    t._spec = new._spec
    # a copy DTensor made for a view stays tied to the view's base, as a torch view would
    t._gt_view = getattr(new, "_gt_view", None)


def _data_get(self):
    return _data.__get__(self)


def _data_set(self, value):
    if isinstance(self, _cls[0]) and _cls[0] is not DTensor:
        return set_data(self, value)
    if isinstance(value, DTensor) and not isinstance(self, DTensor):
        whole = _whole_local(value)
        if whole is not None:  # every rank holds all of it: torch's sharing, rank by rank
            return _data.__set__(self, whole)
        raise RuntimeError(
            f"cannot set .data of a plain {type(self).__name__} to a sharded tensor (placements "
            f"{tuple(value.placements)}): torch would give it the sharded tensor's wrapper, "
            "which holds no values. To make a module's parameter sharded, assign a parameter: "
            "`module.weight = torch.nn.Parameter(value)` (or tie: `module.weight = "
            "other.weight`); to keep it plain with the global value: `with torch.no_grad(): "
            "module.weight.copy_(value)`"
        )
    _data.__set__(self, value)


def _whole_local(value: DTensor) -> torch.Tensor | None:
    """The local tensor of a value replicated over a mesh of every rank (each rank holds the
    whole value: ``vector_to_parameters`` gives each plain parameter a slice of a flat vector
    that mixed plain and sharded parameters), else None. Decided from the spec alone."""
    spec = value._spec
    if not all(p.is_replicate() for p in spec.placements) or not spans_world(spec.mesh):
        return None
    if getattr(value, "_gt_view", None) is not None:
        refresh(value)
    return value._local_tensor.detach()


def install_data_setter() -> None:
    """``.data =`` on every torch tensor through ``_data_set``: a ``gt.Tensor`` takes the value
    (``_set_data``), a plain tensor refuses a sharded one at the assignment. torch's setter
    offers ``__torch_function__`` only to the tensor assigned to, so a sharded value given
    to a plain parameter (``lin.weight.data = t``) never reaches spmdgt, and the parameter
    fails later (a crash, or "data is not allocated yet"). Reads stay torch's own."""
    if isinstance(torch.Tensor.__dict__.get("data"), property):
        return
    torch.Tensor.data = property(_data_get, _data_set, doc=_data.__doc__)


def assign(func, args, kwargs):
    """``aten.set_.source_Tensor`` (route ``ASSIGN``), below autograd (which has made its
    checks): a ``gt.Tensor`` self takes the source as ``.data =`` does (``_set_data``), after
    torch's dtype check. A plain self cannot hold a sharded source's shards: the in-place
    fallback gives it the global value."""
    self, src = args
    if not isinstance(self, DTensor):
        return _fallback.run_inplace(func, args, kwargs, "set_ of a plain tensor")
    if src.dtype != self.dtype:  # torch's error, from metadata alike on every rank
        torch.empty(0, dtype=self.dtype, device="meta").set_(
            torch.empty(0, dtype=src.dtype, device="meta")
        )
    set_data(self, src)
    return self
