"""Mutations whose operands share memory with the tensor they write: torch's verdict, exactly.

torch checks, before an in-place op or an ``out=`` writes, whether an input and the written
tensor overlap in memory: ``q.add_(q.T)``, ``x[1:].add_(x[:-1])`` and ``x[1:] = x[:-1]`` raise
"unsupported operation: some elements of the input tensor and the written-to tensor refer to
a single memory location", while ``x.add_(x)`` (the same elements) or ``x[:3].add_(x[4:])``
(disjoint ones) compute in place. A sharded operand is laid out for the op on its own (DTensor
redistributes ``q.T`` into a copy, a view DTensor had to copy is one already), so the overlap
vanished and the op computed ``Q + Q.T``.

``through_model`` tells, from wrapper metadata alone (alike on every rank), whether an operand
shares memory with the written tensor: DTensor gives a view's wrapper its base's storage and
the view's global strides and offset, and a view spmdgt's fallback made (``_gt_view``) aliases
its base. ``run_aliased`` then runs the op as one process would, on a model of that memory:
one plain tensor holding the global values, every aliased operand a view of it with its own
strides and offset (a fallback view replayed from its base's). torch's own checks run on it
and raise its own error on every rank, or the op computes torch's own values, overlap
included, which are written back into the sharded tensors holding the memory. With autograd
recording (the model is plain), the model only checks, and the op then takes its usual path on
copies of the operands sharing the written memory (``Copies``): where torch's value depends on
the order its kernel writes (``x.sub_(x[:, :1])``: column 0 is zeroed before the others read
it), which copies cannot give, it raises instead, on every rank. An expanded operand
(``x[:, :1].expand_as(x)``) is modelled on its memory once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Copies", "run_aliased", "through_model", "written_of"]


class Copies(NamedTuple):
    """``through_model``'s answer with autograd recording: run the op the usual way on these
    arguments, where every operand sharing the written tensor's memory is a copy."""

    args: tuple
    kwargs: dict


_DisableSubclass = torch._C.DisableTorchFunctionSubclass


def _tensors(args, kwargs) -> list:
    """The DTensor operands, one list level deep (``torch.cat``'s list, ``out=`` tuples)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, DTensor):
            found.append(a)
        elif type(a) is list or type(a) is tuple:
            found += [b for b in a if isinstance(b, DTensor)]
    return found


def _storage(t: DTensor) -> int:
    """The identity of ``t``'s wrapper storage. Callers hold ``DisableTorchFunctionSubclass``:
    through a ``gt.Tensor``'s own ``__torch_function__`` the call costs ~50 us."""
    return t.untyped_storage()._cdata


def _fallback_base(t: DTensor):
    """The base of a view DTensor had to copy (``_gt_view``), else None. Such a view is
    modelled by its replay from the base, whatever its wrapper says: DTensor gives a view's
    wrapper its base's storage even where the shard is a copy, with the shard's offset,
    which is not the view's place in the global memory (before 2026-11-30 such a view was
    modelled at that offset: ``t[1:3] = t[2:4]`` of ``p.t()`` on column shards wrote other
    columns' values into columns 0 and 4)."""
    tag = getattr(t, "_gt_view", None)
    return tag[0] if tag is not None else None


def _key(t: DTensor) -> int:
    """Which memory ``t`` is a window of: its wrapper's storage, or its base's."""
    base = _fallback_base(t)
    return _key(base) if base is not None else _storage(t)


def written_of(args, kwargs) -> list:
    """The DTensors an op writes: ``out=`` if given, else ``self`` of an in-place op."""
    out = (kwargs or {}).get("out")
    if out is not None:
        outs = out if isinstance(out, (list, tuple)) else (out,)
        return [o for o in outs if isinstance(o, DTensor)]
    return [args[0]] if args and isinstance(args[0], DTensor) else []


def _geometry(t: DTensor) -> tuple:
    """(size, stride, offset) of the window of the shared memory ``t``'s model is taken
    from: a real view's root as it was when the view was taken (``_views.alias_of``; the
    view's wrapper offset is its shard's, which differs by rank on uneven shards; an in-place
    view keeps a tensor's offset), else ``t``'s own."""
    alias = getattr(t, "_gt_alias", None)
    if alias is not None:
        offset, spec, _ = alias
        meta = spec.tensor_meta
        return meta.shape, meta.stride, offset
    return t.shape, t.stride(), t.storage_offset()


def _extent(geometry: tuple) -> int:
    shape, stride, offset = geometry
    if any(n == 0 for n in shape):
        return offset
    return offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1


def _members(args, kwargs, keys) -> dict[int, DTensor]:
    """id -> each operand on the memory ``keys`` name, and the bases of its tagged views."""
    members: dict[int, DTensor] = {}

    def add(t: DTensor) -> None:
        if id(t) not in members:
            members[id(t)] = t
            tag = getattr(t, "_gt_view", None)
            if tag is not None:
                add(tag[0])

    for a in _tensors(args, kwargs):
        if _key(a) in keys:
            add(a)
    return members


def run_aliased(func, args, kwargs, name: str):
    """Run mutation ``func`` on a plain model of the memory its aliased operands share (see
    the module docstring). Returns the op's result with the model's tensors mapped back to
    the sharded ones, or NotImplemented when the op must take its usual path (autograd is
    recording, or the operands view the memory as different dtypes)."""
    from spmdgt.tensor._fallback import _check_leaf, _map, _note, _write_back, gather

    written = written_of(args, kwargs)
    for w in written:
        _check_leaf(w, name)  # torch's autograd check comes before its overlap check
    with _DisableSubclass():
        keys = {_key(w) for w in written}
        members = _members(args, kwargs, keys)
        bases = {i: _fallback_base(t) for i, t in members.items()}
        keys_of = {i: _key(t) for i, t in members.items()}
    held = [t for i, t in members.items() if bases[i] is None]
    if len({t.dtype for t in members.values()}) > 1:
        return NotImplemented  # views of one memory as other dtypes: no one model tensor
    needs = []
    _map(lambda a: needs.append(a.requires_grad) if isinstance(a, torch.Tensor) else a, args)
    _map(lambda a: needs.append(a.requires_grad) if isinstance(a, torch.Tensor) else a, kwargs)
    grad = torch.is_grad_enabled() and any(needs + [t.requires_grad for t in held])
    like = held[0]
    with _DisableSubclass():
        geometries = {id(t): _geometry(t) for t in held}
    size = max(_extent(g) for g in geometries.values())
    memory = {
        k: torch.empty(size, dtype=like.dtype, device=like._local_tensor.device) for k in keys
    }
    models: dict[int, torch.Tensor] = {}

    def model(t: DTensor) -> torch.Tensor:
        m = models.get(id(t))
        if m is None:
            base = bases[id(t)]
            if base is not None:
                with _DisableSubclass():
                    m = t._gt_view[1](model(base))  # replayed from the base's model
            else:
                m = memory[keys_of[id(t)]].as_strided(*geometries[id(t)])
                alias = getattr(t, "_gt_alias", None)
                if alias is not None:  # the view taken from its root's window, as it was
                    with _DisableSubclass():
                        m = alias[2](m)
            models[id(t)] = m
        return m

    with torch.no_grad():
        for t in held:  # the global values, each at its place in the shared memory
            m, g = model(t), gather(t)
            if _expanded(m):  # an expanded view (``x[:, :1].expand_as(x)``): each element
                # of its memory once, as writing a tensor with repeated elements raises
                once = tuple(0 if st == 0 else slice(None) for st in m.stride())
                m, g = m[once], g[once]
            m.copy_(g)
        for t in members.values():  # views the fallback made: replayed once the base is in
            model(t)
        full_args, full_kwargs = _map(
            lambda a: (
                models[id(a)] if id(a) in models else gather(a) if isinstance(a, DTensor) else a
            ),
            (args, kwargs),
        )
        copied = None
        if grad:
            copied = _as_copies(func, full_args, full_kwargs, [models[id(w)] for w in written])
        with _DisableSubclass():
            res = func(*full_args, **full_kwargs)  # torch's overlap checks, on every rank alike
    if grad:
        return _as_recorded(args, kwargs, members, written, models, copied, name)
    _note(func, "an operand shares memory with the tensor written", args, kwargs)
    with torch.no_grad():
        # the tensors holding the memory take its new values; views DTensor had to copy are
        # rebuilt from them at their next use (their base's version moved)
        for t in held:
            # an expanded view repeats memory another tensor here holds whole (torch raises
            # when an op writes one), and its shards view that tensor's: written with it
            if not _expanded(t):  # held: no tagged copy (those are replayed, never held)
                _write_back(t, model(t).contiguous(), name)
        for t in written:  # a written copy torch would not have made a view of the memory
            m = model(t)
            if bases[id(t)] is not None and m.untyped_storage().data_ptr() != (
                memory[keys_of[id(t)]].untyped_storage().data_ptr()
            ):
                _write_back(t, m.contiguous(), name)
    back = {id(m): members[i] for i, m in models.items()}
    return _map(lambda r: back.get(id(r), r), res)


def _as_recorded(args, kwargs, members: dict, written: list, models: dict, copied, name: str):
    """``run_aliased``'s answer where autograd records: the usual path computes the op and
    records its gradient, on copies of the operands sharing the written memory (``Copies``):
    read in place, each rank's kernel would check the overlap of its own shards, whose
    shapes differ (a rank holding one row raised alone). That is torch's value only where
    the kernel's order does not matter (the same elements, disjoint ones): ``x.sub_(x[:, :1])``
    zeroes column 0 before the other columns read it, and raises here. Decided on the
    model's global values (``copied``: the copies' result), alike on every rank."""
    if copied is None or not all(
        _same(models[id(w)], c) for w, c in zip(written, copied, strict=True)
    ):
        raise RuntimeError(
            f"{name}: an operand shares memory with the tensor written, and torch's result "
            "depends on the order its kernel writes the elements in; spmdgt records the "
            "gradient of an in-place op with the operand read before the write, which "
            "gives other values here. Clone the operand first (x.sub_(x[:, :1].clone())), "
            "or write out of place"
        )
    shared = {id(t) for t in members.values() if not any(t is w for w in written)}
    return Copies(*_map_tensors(lambda a: a.clone() if id(a) in shared else a, (args, kwargs)))


def _expanded(t: torch.Tensor) -> bool:
    """Whether ``t`` repeats elements of its memory along a dim (stride 0, size > 1)."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))


def _as_copies(func, args, kwargs, written: list) -> list | None:
    """The values ``func`` writes into ``written`` (model tensors) when every operand is read
    as a copy made before the write; None where that cannot be run (torch's own error, left to
    the model's run to raise)."""
    copies = {id(w): w.clone() for w in written}
    c_args, c_kwargs = _map_tensors(lambda a: copies.get(id(a), a.clone()), (args, kwargs))
    try:
        with _DisableSubclass():
            func(*c_args, **c_kwargs)
    except Exception:
        return None
    return [copies[id(w)] for w in written]


def _map_tensors(fn, tree):
    from spmdgt.tensor._fallback import _map

    return _map(lambda a: fn(a) if isinstance(a, torch.Tensor) else a, tree)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN."""
    return (
        bool(((a == b) | (a.isnan() & b.isnan())).all())
        if a.is_floating_point() or (a.is_complex())
        else bool((a == b).all())
    )


def through_model(func, args, kwargs):
    """``func`` run by ``run_aliased`` when an operand aliases the tensor it writes; else (or
    where the model only checks) NotImplemented: the op takes its usual path. On every
    in-place op, so the common case (``self`` written, no ``out=``) is one pass over the
    arguments and one storage lookup per DTensor operand other than ``self``."""
    if kwargs and kwargs.get("out") is not None:
        return _through_model_out(func, args, kwargs)
    w = args[0] if args else None
    if not isinstance(w, DTensor):
        return NotImplemented
    others = None
    for a in (*args[1:], *kwargs.values()) if kwargs else args[1:]:
        if isinstance(a, DTensor):
            if a is not w:
                others = [a] if others is None else [*others, a]
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, DTensor) and b is not w:
                    others = [b] if others is None else [*others, b]
    if others is None:
        return NotImplemented
    with _DisableSubclass():
        key = _key(w)
        for a in others:
            if _key(a) == key:
                break
        else:
            return NotImplemented
    from spmdgt.tensor._fallback import op_name

    return run_aliased(func, args, kwargs, op_name(func))


def _through_model_out(func, args, kwargs):
    """``through_model`` for an ``out=`` call (every tensor written is checked)."""
    written = written_of(args, kwargs)
    if not written:
        return NotImplemented
    others = [a for a in _tensors(args, kwargs) if not any(a is w for w in written)]
    if not others:
        return NotImplemented
    with _DisableSubclass():
        keys = {_key(w) for w in written}
        if not any(_key(a) in keys for a in others):
            return NotImplemented
    from spmdgt.tensor._fallback import op_name

    return run_aliased(func, args, kwargs, op_name(func))
