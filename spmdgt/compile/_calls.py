"""What a lazy region reads off a call before it records it, and the formats it records in.

``_region`` decides per call whether and how it is recorded; this module holds what that
decision reads, as plain functions of the call and the region's settings (their only state is
two caches: the interned metadata ids and the fast path's metadata table): a first-seen input
(``_first``) or all the call's tensors (``_scan``), its arguments' *descriptors*
(``_describe``), its metadata key (``_mkey``, ``_part``) and the metadata of its result
(``_out_meta``, ``_meta_miss``). ``_plan`` reads the same formats when a region ends. They
live here, below both, so that the two read one definition and import no circle.

A recorded call is a tuple in ``Region.nodes``: ``(func, args, kwargs, meta, ref)`` (``args``
its arguments' descriptors, ``kwargs`` ``(name, descriptor)`` pairs; ``meta`` is ``(shape,
stride, dtype)``, None for a tuple call; ``ref`` a weak reference to its placeholder). Its
placeholder carries the tag ``(region, index, part, rg)`` in ``_gt_lazy`` (``part``: its
interned metadata, its share of a later call's key in ``Region._fast``; ``rg``: it will need
grad). Tuples, not objects: one is built per recorded op (``bench_record.py``).

A descriptor is a pair: ``("n", index)`` a pending result of the region, ``("c", value)`` a
constant, ``("L", descriptors)`` a list of tensors; tentative (nothing added to the region
yet) ``("I", tensor)`` a real input and ``("F", value)`` a float that becomes a graph input;
committed (``Region._commit``) ``("i", index)`` and ``("f", index)``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spmdgt.compile import _lazy_ops, _sharded

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_NoSubclass = torch._C.DisableTorchFunctionSubclass
_CONST = (int, bool, str, type(None), torch.dtype)
_DYNAMIC = _lazy_ops.DYNAMIC_FLOAT

# the record formats (see the module docstring): a node's fields, a placeholder's tag's
_FUNC, _ARGS, _KWARGS, _META, _REF = range(5)
_REGION, _INDEX, _PART, _RG = range(4)


def _no_placeholder() -> None:
    """A tuple call's ``ref``: it has no placeholder of its own (its elements do)."""
    return None


# ``_fast``'s keys hold each tensor's metadata as a small int (its interned ``("t", shape,
# stride, dtype)`` or ``("d", spec)``): hashing an int costs less than hashing the tuple each
# op. Ids are never reused (a counter), so when the table is cleared at its cap a key built
# before simply misses; it never finds another tensor's metadata.
_parts: dict[Any, int] = {}
_next_part = itertools.count()
_PARTS_CAP = 16384


def _part(what: tuple) -> int:
    """The interned id of a tensor's metadata ``what``."""
    got = _parts.get(what)
    if got is None:
        if len(_parts) >= _PARTS_CAP:
            _parts.clear()
        got = _parts[what] = next(_next_part)
    return got


def _ckey(v: Any) -> Any:
    """A constant's part of the key (floats by their bits, so nan and -0.0 key exactly)."""
    if type(v) is float:
        return ("F", v.hex())
    if type(v) in (tuple, list):
        return (type(v).__name__, tuple(_ckey(x) for x in v))
    return (type(v).__name__, v)


def _mkey(a: Any, d: tuple) -> Any:
    """An argument's part of the call's metadata key (``a`` described by ``d``)."""
    if d[0] == "L":
        return ("L", tuple(_mkey(x, dx) for x, dx in zip(a, d[1], strict=True)))
    if d[0] in ("I", "n"):
        spec = _sharded.layout(a)
        return ("t", tuple(a.shape), a.stride(), a.dtype) if spec is None else ("d", spec)
    if d[0] == "F":
        return ("f",)
    return _ckey(a)


def _tensors(args: tuple, kwargs: dict) -> Any:
    """The call's tensor arguments, those in a list or tuple included (``cat``, ``stack``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _first(
    a: torch.Tensor, t: type, mesh: Any, device: torch.device | None, min_numel: int
) -> tuple | None:
    """What ``Region._fast`` keeps of a real input ``a`` (of type ``t``) it meets first in a
    region (of ``mesh``, on ``device``): ``(key part, requires_grad, big, descriptor)``; None
    when ``_fast`` cannot take it (another device, a plain tensor in a sharded region or the
    converse, a view ``gt.Tensor``, another mesh, an inference tensor: it keeps no version
    counter, which the region reads)."""
    if t is _Tensor or t is _Parameter:
        if mesh is not None or (device is not None and a.device != device) or a.is_inference():
            return None
        part = _part(("t", tuple(a.shape), a.stride(), a.dtype))
        return part, a.requires_grad, a.numel() >= min_numel, ("I", a)
    if mesh is None or not isinstance(a, DTensor):
        return None
    spec = a._spec
    if spec.mesh is not mesh or getattr(a, "_gt_view", None) is not None:
        return None
    with _NoSubclass():  # its metadata as the DTensor's own (no gt.Tensor hop)
        if a.device != device or a.is_inference():
            return None
        big = a.numel() // mesh.size() >= min_numel  # per rank, from global sizes
        return _part(("d", spec)), a.requires_grad, big, ("I", a)


def _scan(args: tuple, kwargs: dict, min_numel: int) -> tuple | None:
    """The call's tensors, read once: ``(lazy, big, device, rg, mesh, plain)`` (a pending
    input, a real one of ``min_numel`` elements per rank, their one device, any input
    needing grad, the sharded ones' one mesh, a real plain input that needs grad); None
    when the region cannot hold the call (another kind of tensor, two meshes or
    devices)."""
    big = lazy = rg = plain = False
    device = mesh = None
    for a in _tensors(args, kwargs):
        node = a.__dict__.get("_gt_lazy")
        if type(a) not in _PLAIN:
            if not isinstance(a, DTensor) or getattr(a, "_gt_view", None) is not None:
                return None
            m = a._spec.mesh
            if mesh is None:
                mesh = m
            elif m is not mesh:
                return None
        elif node is None and a.requires_grad:
            plain = True
        if node is not None:
            lazy = True
            rg = rg or node[_RG]
        else:
            rg = rg or a.requires_grad
            # per rank of the mesh, from global sizes: the same on every rank
            n = a.numel() if mesh is None or type(a) in _PLAIN else a.numel() // m.size()
            big = big or n >= min_numel
        if device is None:
            device = a.device
        elif a.device != device:
            return None
    return lazy, big, device, rg, mesh, plain


def _describe(region: Any, func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """Tentative descriptors of the arguments and the call's metadata key:
    ``(args' descriptors, kwargs' (name, descriptor), key)``; None if one cannot be
    described (``region``: the region the call would join)."""
    dyn = func in _DYNAMIC
    adesc, mkey = [], [func]
    for i, a in enumerate(args):
        d = _desc(region, a, dyn and i < 2)
        if d is None:
            return None
        adesc.append(d)
        mkey.append(_mkey(a, d))
    kdesc = []
    for k, a in kwargs.items():
        d = _desc(region, a, False)
        if d is None:
            return None
        kdesc.append((k, d))
        mkey.append((k, _mkey(a, d)))
    return adesc, kdesc, tuple(mkey)


def _desc(region: Any, a: Any, dyn_float: bool) -> tuple | None:
    """A tentative descriptor (nothing is added to the region until ``_commit``); None for
    an argument the region cannot describe (a pending result of another region ...)."""
    if type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
        ds = tuple(_desc(region, x, False) for x in a)
        if not all(d is not None and d[0] in ("I", "n") for d in ds):
            return None
        return ("L", ds)
    if isinstance(a, torch.Tensor):
        node = a.__dict__.get("_gt_lazy")
        if node is not None:
            return ("n", node[_INDEX]) if node[_REGION] is region else None
        return None if a.is_inference() else ("I", a)  # no version counter to read
    t = type(a)
    if t is float:
        return ("F", a) if dyn_float else ("c", a)
    if t in _CONST:
        return ("c", a)
    if (t is tuple or t is list) and all(type(x) in (int, float, bool) for x in a):
        return ("c", a)
    return None


def _out_meta(mkey: tuple, func: Any, args: tuple, kwargs: dict, mesh: Any) -> tuple | None:
    """``(meta, spec)``: the result's (global) metadata, and for a sharded call
    ``_sharded.out_spec``'s answer; None when the result is none the region can hold."""
    if mesh is None:
        try:
            meta = _lazy_ops.out_meta(mkey, func, args, kwargs)
        except Exception:
            meta = None  # let eager raise the program's own error
        return None if meta is None else (meta, None)
    spec = _sharded.out_spec(mkey, func, args, kwargs)
    if spec is None:
        return None
    tm = spec[0].tensor_meta
    return (tuple(tm.shape), tuple(tm.stride), tm.dtype), spec


# ``Region._fast``'s keys -> (meta, spec, part, floating); ``_region`` reads it by name (it is
# cleared at its cap, never rebound, so both modules see one table)
_fast_meta: dict[tuple, tuple] = {}


def _meta_miss(key: tuple, func: Any, args: tuple, mesh: Any) -> tuple | None:
    """``(meta, spec, part, floating)`` of ``_fast``'s call on a cache miss
    (``_out_meta``; ``part``: the result's interned metadata, None for a tuple;
    ``floating``: a float or complex result, which may need grad), kept by its key; None
    when the call cannot be recorded (``mesh``: the region's, None for a plain one)."""
    with _NoSubclass():
        try:
            got = _out_meta(key, func, args, {}, mesh)
        except Exception:
            got = None
    if got is None:
        return None
    meta, spec = got
    what = ("t", *meta) if spec is None else ("d", spec[0])
    part = None if meta[0] is None else _part(what)
    floating = meta[0] is not None and (meta[2].is_floating_point or meta[2].is_complex)
    got = _fast_meta[key] = (meta, spec, part, floating)
    if len(_fast_meta) > 4096:
        _fast_meta.clear()
    return got


def _generator(device: torch.device) -> torch.Generator:
    """The default generator a random call on ``device`` draws from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]
