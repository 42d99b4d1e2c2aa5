"""Sharded lazy regions: ops on ``gt.Tensor``s (DTensors) recorded, then run as one graph.

A capturable call whose tensor arguments are all DTensors on one mesh spanning the world (or
pending results of the same region) is recorded like a plain one (``_region``); what differs
lives here:

- **Result layout before the data.** The placeholder needs its placements, global and local
  shapes now. ``out_spec`` runs the call once on DTensors whose local tensors are on the meta
  device (DTensor's own sharding propagation, redistributions included, moving no data) and
  caches the result by the call, the inputs' global metadata and placements, and the
  constants. The same run notes whether the call moves data between ranks (DTensor's
  ``CommDebugMode`` counts the collectives it would issue): a graph that holds collectives
  cannot fall back on one rank alone.
- **Every rank takes the same decisions.** What is recorded depends on global metadata only
  (global shapes, placements, element counts per rank of the mesh), never on a rank's local
  shard, so uneven shards record the same region on every rank; sub-meshes are not recorded.
- **The graph** is the recorded calls over the DTensor inputs, compiled by the backend
  (AOTAutograd traces DTensor's propagation and collectives into it), run with DTensor's
  implicit replication on, as ``gt.Tensor`` runs every op (``implicit``).
- **Autograd.** AOTAutograd wants a gradient of the type and placements it traced for every
  output that needs one, but the engine materialises a missing gradient as a plain tensor of
  the global shape. ``Join`` sits between the graph and the placeholders and hands the graph
  DTensor zeros for outputs that got no gradient.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spmdgt._core import scope as _scope

__all__ = [
    "Join",
    "fill",
    "implicit",
    "layout",
    "out_spec",
    "placeholder",
    "recordable",
    "release",
    "zeros",
]

_CAP = 4096
_MISSING = object()
_specs: OrderedDict[Any, Any] = OrderedDict()
_whole: dict[int, tuple[Any, bool]] = {}


def recordable(func: Any, mesh: Any) -> bool:
    """Whether a call on DTensors of ``mesh`` may be recorded: a mesh spanning the world
    (every rank then records it), and an op ``gt.Tensor`` runs as DTensor does (no fallback,
    no mesh move inside the active signal's scope)."""
    got = _whole.get(id(mesh))
    if got is None or got[0] is not mesh:  # keyed by id, the mesh held: hashing one costs
        from spmdgt.runtime._state import get_runtime

        got = _whole[id(mesh)] = (mesh, mesh.size() == get_runtime().world_size)
    if not got[1]:
        return False
    if _route(func) != 0:
        return False
    if _scope.stack:
        dst = _signal_mesh()[0]
        if dst is not None and dst is not mesh:
            return False
    return True


def _route(func: Any) -> int:
    global _route
    from spmdgt.tensor._optable import route

    _route = route
    return route(func)


def _signal_mesh() -> Any:
    global _signal_mesh
    from spmdgt.tensor._moves import signal_mesh

    _signal_mesh = signal_mesh
    return signal_mesh()


def layout(t: torch.Tensor) -> Any:
    """A DTensor's part of a key: its spec (global shape, stride, dtype, placements, mesh;
    its hash is cached), None for a plain tensor."""
    return t._spec if isinstance(t, DTensor) else None


@contextlib.contextmanager
def implicit() -> Iterator[None]:
    """DTensor's implicit replication on, as ``gt.Tensor`` runs every op."""
    saved = torch._C._get_dtensor_allow_implicit_replication()
    torch._C._set_dtensor_allow_implicit_replication(True)
    try:
        yield
    finally:
        torch._C._set_dtensor_allow_implicit_replication(saved)


def out_spec(key: Any, func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """``(spec, local shape, local stride, collectives)`` of ``func``'s result on these
    arguments, or None when it is not one DTensor or DTensor has no rule for it (the call then
    runs eagerly, taking ``gt.Tensor``'s exact fallback). Cached by ``key``."""
    got = _specs.get(key, _MISSING)
    if got is not _MISSING:
        _specs.move_to_end(key)
        return got

    def meta(a: Any) -> Any:
        if isinstance(a, DTensor):
            loc = a._local_tensor
            m = torch.empty_strided(loc.shape, loc.stride(), dtype=loc.dtype, device="meta")
            return DTensor(m, a._spec, requires_grad=False)
        if type(a) in (list, tuple):
            return [meta(x) for x in a]
        return a

    from torch.distributed.tensor.debug import CommDebugMode

    sees = CommDebugMode()
    try:
        with torch._C.DisableTorchFunction(), implicit(), sees:
            out = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    except Exception:
        out = None  # no rule, or the program's own error: eager says which
    got = None
    if isinstance(out, DTensor):
        loc = out._local_tensor
        got = (out._spec, tuple(loc.shape), tuple(loc.stride()), sees.get_total_counts() > 0)
    _specs[key] = got
    if len(_specs) > _CAP:
        _specs.popitem(last=False)
    return got


def placeholder(
    spec: Any, shape: tuple, stride: tuple, device: torch.device, requires_grad: bool = False
) -> torch.Tensor:
    """A ``gt.Tensor`` of ``spec`` over an unfilled local tensor (``requires_grad``: a leaf
    until ``fill``, as ``_region`` explains)."""
    global _GtTensor
    if _GtTensor is None:
        from spmdgt.tensor._tensor import Tensor as _GtTensor
    dtype = spec.tensor_meta.dtype
    if _mode_depth():  # another function mode below the hook's: it must not see this
        with torch._C.DisableTorchFunction():
            loc = _empty_strided(shape, stride, dtype=dtype, device=device)
    else:
        loc = _empty_strided(shape, stride, dtype=dtype, device=device)
    # DTensor's own constructor (C++), without the call of DTensor.__init__, which does nothing
    # but costs a torch._disable_dynamo wrapper (~3 us) per placeholder
    return _dtensor_new(_GtTensor, loc, spec, requires_grad=requires_grad)


_GtTensor: Any = None  # gt.Tensor, imported at the first placeholder
_mode_depth = torch._C._len_torch_function_stack
_empty_strided = torch.empty_strided
_dtensor_new = DTensor.__new__


def _like(t: torch.Tensor) -> tuple:
    loc = t._local_tensor if isinstance(t, DTensor) else t
    return (type(t), getattr(t, "_spec", None), loc.shape, loc.dtype, loc.device)


def zeros(like: tuple) -> torch.Tensor:
    """Zeros laid out as ``_like``'s tensor (a Partial placement's zeros sum to zero too)."""
    cls, spec, shape, dtype, device = like
    loc = torch.zeros(shape, dtype=dtype, device=device)
    if spec is None:
        return loc
    z = DTensor(loc, spec, requires_grad=False)
    z.__class__ = cls
    return z


class Join(torch.autograd.Function):
    """Identity on a graph's outputs that need grad; in backward, DTensor zeros stand in for
    the gradients the engine left undefined (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.like = [_like(o) for o in outs]
        # ``detach``, not a view: autograd forbids writing in place into an output of a
        # Function that returns several views, and the program may (a differentiable
        # optimizer's ``param.add_`` on a weight a hot function returned). The storage and
        # the version counter are still the output's, so a write into a value saved for
        # backward raises as eagerly
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return tuple(g if g is not None else zeros(z) for g, z in zip(grads, ctx.like, strict=True))


def release(p: torch.Tensor, out: torch.Tensor) -> bool:
    """Ready placeholder ``p`` for its result ``out``: a leaf until now (see ``record``),
    the result decides whether it needs grad (True). False when autograd gave ``p`` a
    history of its own meanwhile: a custom ``autograd.Function`` whose ``forward`` returned
    it (its calls ran under no_grad there, so ``out`` needs none); ``p`` then keeps that
    history and takes ``out``'s values alone, its version unmoved (the fill is no write of
    the program's: a Function that saved its output must not see it modified)."""
    if p.is_leaf:
        if p.requires_grad:
            p.requires_grad_(False)
        return True
    if out.requires_grad:  # two histories for one tensor: never silently one of them
        raise RuntimeError(
            "spmdgt lazy regions: a pending result was given a history by autograd before "
            "its region ran and its region's result needs grad too; run with "
            "GT_WORKER_BATCH_SIZE unset, or read the value before the autograd.Function"
        )
    return False


def fill(plan: Any, results: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fill a sharded plan's placeholders whose results (DTensors) need grad; the others are
    returned as (placeholder's shard, result's shard) for ``_plan.fill`` to fill."""
    results = list(results)
    need = [i for i, o in enumerate(results) if o.requires_grad]
    rest = []
    with torch._C.DisableTorchFunction(), implicit():
        if len(need) > 1:
            with torch.enable_grad():
                joined = Join.apply(*(results[i] for i in need))
            for i, o in zip(need, joined, strict=True):
                results[i] = o
        for p, out in zip(plan.outputs, results, strict=True):
            p.__dict__.pop("_gt_lazy", None)
            history = not release(p, out)  # a custom Function's output: values alone
            if tuple(out._spec.placements) != tuple(p._spec.placements):
                out = out.redistribute(p._spec.mesh, p._spec.placements)  # same on every rank
            if out.requires_grad and not history:
                with torch.enable_grad():
                    p.copy_(out)  # grad_fn: CopyBackwards into the graph's backward
            else:
                rest.append((p._local_tensor, out._local_tensor))
    return rest
