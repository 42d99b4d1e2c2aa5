"""Views of sharded tensors: writes through them reach their base, as on a torch view.

DTensor makes some views of a sharded tensor by redistributing it: the view is a copy
(``y[:, :2]`` of column shards, ``y.view(-1)`` of uneven rows). ``tag_views`` tags each such
copy with how to rebuild it from its base; ``write_through`` applies an in-place op on one to
the base's global value through the same view, as one process would, and rebuilds the copy
(``_moves.refresh`` brings a copy up to date after a write to its base). A real view (shared
shard memory) records where it lies in its root (``alias_of``), for the overlap model
(``_overlap``), since its wrapper's storage offset is its shard's. ``keep_grad_layout``
keeps autograd's ``CopySlices`` backward of such writes on the base's own layout.

``_optable``'s view and in-place routes call these; ``_inplace_views`` and the compile pass
(``compile/_refusals.py``, ``_hot_functions._settle_views``) read the tags.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from spmdgt.tensor._fallback import (
    _DisableSubclass,
    _map,
    _note,
    _refuse_traced,
    _write_back,
    op_name,
    written,
)
from spmdgt.tensor._meshes import spans_world
from spmdgt.tensor._moves import gather, move, refresh, target_of

__all__ = ["alias_of", "keep_grad_layout", "tag_views", "write_through"]


def keep_grad_layout(func, args, kwargs) -> None:
    """After mutation ``func`` wrote a tensor that is autograd's view of a sharded base,
    with autograd recording: the base's gradient reaches the write's backward in the base's
    own layout.

    autograd records such a write as ``CopySlices`` on the base; its backward takes the same
    view of the base's gradient and writes the write's own gradient into it in place. A
    gradient arriving in another layout (``Shard(1)`` for a row-sharded base: a loss mixing
    it with column shards) makes that view a copy DTensor had to redistribute, so the write
    went nowhere and the base's gradient skipped the write (a silently wrong gradient,
    2026-11-30). Laid out as the base was when the write was made, the view is the one the
    forward took, which shared the base's memory. Decided from placements, alike on every
    rank."""
    self = args[0] if args else None
    if isinstance(self, DTensor) and not (kwargs and "out" in kwargs):
        targets = (self,)  # the common case, without the schema's walk (~3 us)
    else:
        targets = written(func, args, kwargs)
    with _DisableSubclass():  # a getter through gt.Tensor's __torch_function__ costs ~13 us
        for t in targets:
            base = t._base
            if not isinstance(base, DTensor) or not base.requires_grad:
                continue
            placements = base._spec.placements
            if any(isinstance(p, Partial) for p in placements):
                continue  # no view of a partial sum is a window of the base's memory anyway
            target = target_of(base._spec.mesh, placements)
            base.register_hook(lambda g, _t=target: move(g, _t) if isinstance(g, DTensor) else g)


_is_alias_of = torch._C._is_alias_of
# a view where strides allow
_VIEW_OR_COPY = frozenset({"reshape", "reshape_as", "flatten", "ravel"})
# ``x.view_as(y)`` is ``x.view(y.shape)``: ``y`` gives a shape, not an index
_SHAPED_BY = {
    "view_as": torch.Tensor.view,
    "reshape_as": torch.Tensor.reshape,
    "expand_as": torch.Tensor.expand,
}
_torch_copies: dict = {}  # (op, global size, stride, arguments) -> whether torch copies


def _copies_in_torch(func, src: DTensor, rest: tuple, kw: dict) -> bool:
    """Whether torch's own view-or-copy op (``reshape``, ``flatten``, ``ravel``) makes a copy of
    ``src``, decided as torch decides, on the global size and strides (a meta tensor; cached).
    Where torch copies, writes through the result must not reach ``src``: tagged as a view,
    ``z[:, 1:3].reshape(-1).mul_(2)`` on row shards wrote ``z`` (2026-11-30)."""
    try:
        key = (func, tuple(src.shape), src.stride(), rest, tuple(sorted(kw.items())))
        hash(key)
    except TypeError:  # a list among the arguments
        key = None
    r = _torch_copies.get(key) if key is not None else None
    if r is None:
        meta = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta")
        r = not _is_alias_of(func(meta, *rest, **kw), meta)
        if key is not None:
            if len(_torch_copies) > 4096:
                _torch_copies.clear()
            _torch_copies[key] = r
    return r


def tag_views(func, args, kwargs, out, src) -> None:
    """After view op ``func`` on sharded ``src``: tag each output that does not share ``src``'s
    local memory (DTensor redistributed to make it, so it is a copy) with how to rebuild it
    from the base, so an in-place op on it can write through, as on a torch view. Shared
    memory is the storage's: DTensor's local view ops run below autograd, so no ``_base``
    tells (before 2026-11-29 every view was tagged for want of one).

    The tag holds the base itself, not a weak reference: a torch view keeps its base's
    storage alive, so writes to the base made before it died stay visible through the view,
    and writes through the view keep reaching a base nobody else holds. With a weak reference
    a copy went stale the moment Python collected its base, a result that depended on when
    the collector ran. The view holds only the base (never the reverse), so both die with the
    view's last reference, as a torch view and its storage do."""
    name = op_name(func)
    rest, kw = args[1:], dict(kwargs or {})
    shaped_by = _SHAPED_BY.get(name)
    if shaped_by is not None and rest and isinstance(rest[0], torch.Tensor):
        func, rest = shaped_by, (tuple(rest[0].shape), *rest[1:])
    if any(isinstance(a, DTensor) for a in rest) or any(
        isinstance(v, DTensor) for v in kw.values()
    ):
        return  # tensor indices: advanced indexing, a copy in torch too
    if name in _VIEW_OR_COPY and _copies_in_torch(func, src, rest, kw):
        return  # torch copies too: the result is no view of ``src``
    parent = getattr(src, "_gt_view", None)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    src_local = src._local_tensor
    # a real view where it shares the shard's memory. Decided alike on every rank: DTensor's
    # local view ops run below autograd (no ``_base`` to go by), a pure view op's local result
    # shares the shard's memory on every rank, and a redistribution's result on none; but a
    # view-or-copy op (``reshape``) may copy on one rank's shard and not another's (their
    # strides differ where shards are uneven), and a rank off a sub-mesh holds a placeholder
    real = parent is None and name not in _VIEW_OR_COPY and spans_world(src.device_mesh)
    detached = name == "detach"
    for i, o in enumerate(outs):
        if not isinstance(o, DTensor):
            continue

        def replay(full, _i=i, _many=o is not out):
            v = func(full, *rest, **kw)
            return v[_i] if _many else v

        if real and _is_alias_of(o._local_tensor, src_local):
            # a real view of the shard: writes reach the base already. Where it lies in the
            # base's global memory is kept for the overlap model (_overlap): the wrapper's
            # storage offset is its shard's, which differs by rank on uneven shards
            o._gt_alias = alias_of(src, replay)
            continue

        base = src
        if parent is not None:  # a view of a tagged view: replay both from the first base
            base, inner, _ = parent

            def replay(full, _outer=replay, _inner=inner):
                return _outer(_inner(full))

        # for good, whatever becomes of the copy (set in program order, alike on every rank):
        # the replay reads the base in its shape now, which an in-place view may not change
        base._gt_copied = True
        if detached or getattr(src, "_gt_detached", False):
            # written behind autograd's back (write_through). The tag holds the base's memory
            # and version counter, not its history: a torch ``detach`` keeps no graph alive
            o._gt_detached = True
            if base.requires_grad:
                with _DisableSubclass():
                    base = base.detach()
        # the base's version now: a later write to the base makes this copy stale (refresh)
        o._gt_view = (base, replay, base._version)


def alias_of(src: DTensor, replay) -> tuple:
    """``_gt_alias`` of a real view ``replay(src)``: (the root's storage offset, its spec when
    the view was taken, how to take the view from a tensor laid out so); not the root itself,
    which a ``detach`` must not keep alive with its graph. Views of real views chain to
    the first root. The spec says the root's global size and strides then: an in-place view
    of the root later gives it a new spec and shape, not new memory. Two reads a view op."""
    alias = getattr(src, "_gt_alias", None)
    if alias is not None:
        offset, spec, inner = alias
        return offset, spec, lambda full, _outer=replay, _inner=inner: _outer(_inner(full))
    return src.storage_offset(), src._spec, replay


def write_through(func, args, kwargs, view: DTensor):
    """An in-place op on a tagged view: apply it to the base's global value through the same
    view, as torch would, write the base back, and refresh the view. Returns NotImplemented
    when torch's own op would not be a view either (advanced indexing): then the op acts on
    the copy alone, as in torch.

    Where autograd records, the same write is recorded: on the clone of the base's global
    value it records the view's ``CopySlices``, as one process does on its tensor, and
    torch's own checks run there (one of several views of a function raises its error); the
    base takes the new value with ``copy_``, so its history runs through the write, and
    ``refresh`` brings the view up to date (autograd rebuilds its history from the base's).
    Before 2026-11-30 such a write raised."""
    _refuse_traced(func, args, kwargs, "a write through a view DTensor had to copy", mutates=True)
    name = op_name(func)
    base, replay, _ = view._gt_view
    grads = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:])
    if getattr(view, "_gt_detached", False):
        # a detached view (``p.detach()[1:3].zero_()``): torch writes its base's memory
        # behind autograd's back, a leaf's too; so does this, unrecorded
        if grads and torch.is_grad_enabled():
            raise RuntimeError(
                f"spmdgt: {name} on a detached view of a sharded tensor, a copy DTensor had to "
                "make, with an operand that requires grad: not supported (torch would give "
                "the view a history of its own). Detach the operand, or write the base itself."
            )
        recorded = False
    else:
        recorded = torch.is_grad_enabled() and (base.requires_grad or view.requires_grad or grads)
    if recorded:
        if base.is_leaf and base.requires_grad:
            raise RuntimeError(
                "a view of a leaf Variable that requires grad is being used in an in-place "
                "operation."
            )
        _check_view_creation(view)
    with torch.set_grad_enabled(recorded):
        full_base = gather(base).clone()
        with _DisableSubclass():
            full_view = replay(full_base)
        if not _is_alias_of(full_view, full_base):  # advanced indexing: a copy in torch too
            return NotImplemented
        _note(func, "write through a view that DTensor had to copy", (base,), None)
        rest, kw = _map(
            lambda a: gather(a) if isinstance(a, DTensor) else a, (args[1:], kwargs or {})
        )
        with _DisableSubclass():
            func(full_view, *rest, **kw)
        _write_back(base, full_base, name)
        if recorded:
            refresh(view)
        else:
            with _DisableSubclass():
                new_view = replay(full_base)
            _write_back(view, new_view.contiguous(), name)
            view._gt_view = (base, replay, base._version)
    return None if name == "__setitem__" else view


def _check_view_creation(view: DTensor) -> None:
    """torch's own error for a view made under ``no_grad`` and written with autograd
    recording: raised by torch itself, on a plain view made the same way (the write on the
    copy would pass)."""
    with _DisableSubclass():
        if not view._is_view():
            return
        meta = torch._C._autograd._get_creation_meta(view)
    if meta == torch._C._autograd.CreationMeta.NO_GRAD_MODE:
        base = torch.zeros(1, requires_grad=True).clone()
        with torch.no_grad():
            probe = base[:]
        probe.mul_(1)
