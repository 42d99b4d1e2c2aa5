"""One lazy region: the ops recorded since the last sync point, and their placeholders.

``Region.record`` turns a capturable call (``_lazy_ops``) into a node and hands back a
*placeholder*: a real tensor of the result's shape, strides, dtype and device, not yet filled.
The placeholder carries its node in the attribute ``_gt_lazy`` (so a later op finds it without
any table keyed by ``id()``: ids are reused once an object dies), and the node holds only a
weak reference to the placeholder, so a result the program drops is not computed at all.

``Region.take`` ends the region at a sync point: it keeps the nodes a live placeholder needs,
and describes them as a ``Plan`` (the graph's structure, where each input comes from, the
inputs' metadata, grad mode, constants) for ``_graphs`` to key, compile and run; ``fill``
then puts the results into the placeholders (``copy_`` where a result needs grad, so the
placeholder's ``grad_fn`` leads into the compiled backward; ``set_`` otherwise).

A region is plain or sharded: calls on ``gt.Tensor``s of one mesh make a sharded region, whose
placeholders are ``gt.Tensor``s laid out as DTensor's propagation says (``_sharded``); a call
that would mix the two, or two meshes, ends the region and starts the next.

Region inputs are held strongly until the region runs (their ids are stable while held, so the
de-duplication by id below is sound), and their version counters are checked at the sync: an
input changed in place behind the function layer (C++ code) raises instead of giving a result
computed from the changed value.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spmdgt.compile import _lazy_ops, _sharded

__all__ = ["Plan", "Region", "fill"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NoSubclass = torch._C.DisableTorchFunctionSubclass
_CONST = (int, bool, str, type(None), torch.dtype)
NOFLUSH = object()  # ``record``: not captured, and pure: no need to end the region
_SLOW = object()  # ``_fast``: not its case, ``_record`` decides
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_NoTorchFunction = torch._C.DisableTorchFunction
_DYNAMIC = _lazy_ops.DYNAMIC_FLOAT
_RANDOM = _lazy_ops.RANDOM
_FKEY = (float,)
_grad_on = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_autocast = torch.is_autocast_enabled
_empty_strided = torch.empty_strided
_mode_depth = torch._C._len_torch_function_stack
_weakref = weakref.ref
_fast_meta: dict[tuple, tuple] = {}  # ``_fast``'s keys -> (meta, spec, part, floating)
_getitem = operator.getitem  # a tuple call's element, one node each
# views without autograd's view tracking: never recorded (the region ends first)
_UNSAFE_VIEWS = frozenset({torch.unsafe_split, torch.Tensor.unsafe_split})


def _no_placeholder() -> None:
    """A tuple call's ``ref``: it has no placeholder of its own (its elements do)."""
    return None


# A recorded call is a tuple in ``Region.nodes``: ``(func, args, kwargs, meta, ref)`` (``meta``
# is ``(shape, stride, dtype)``, None for a tuple call; ``ref`` a weak reference to its
# placeholder). Its placeholder carries the tag ``(region, index, part, rg)`` in ``_gt_lazy``
# (``part``: its interned metadata, its share of a later call's key in ``_fast``; ``rg``: it
# will need grad). Tuples, not objects: one is built per recorded op (``bench_record.py``).
_FUNC, _ARGS, _KWARGS, _META, _REF = range(5)
_REGION, _INDEX, _PART, _RG = range(4)

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


class Plan:
    """What a region computes, ready to be keyed (``base`` and ``floats``) and built."""

    __slots__ = ("base", "comm", "float_dtypes", "floats", "grad", "inplace", "inputs", "mesh",
                 "nodes", "ops", "outputs", "rng", "rng_state", "views")  # fmt: skip

    def __init__(self) -> None:
        self.nodes: list[tuple] = []  # (func, args, kwargs) with descriptors remapped
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[Any] = []  # live placeholders, in output order
        self.grad = False
        self.floats: list[float] = []  # values of the float slots (graph inputs if dynamic)
        self.float_dtypes: list[torch.dtype] = []
        self.base: Any = None
        self.ops = 0
        self.mesh: Any = None  # sharded plans: the inputs' mesh (see _sharded)
        self.comm = False  # a sharded plan holds collectives
        self.rng: Any = None  # random calls: the generator and its state at the first
        self.rng_state: Any = None
        # views (``record_views``): the live view placeholders, whose data comes with their
        # base's (only their tags go at ``fill``), and the ids of the bases among the outputs,
        # filled in place (``copy_``) so that the views see their values
        self.views: list[torch.Tensor] = []
        self.inplace: set[int] = set()


def _ckey(v: Any) -> Any:
    """A constant's part of the key (floats by their bits, so nan and -0.0 key exactly)."""
    if type(v) is float:
        return ("F", v.hex())
    if type(v) in (tuple, list):
        return (type(v).__name__, tuple(_ckey(x) for x in v))
    return (type(v).__name__, v)


class Region:
    """The ops recorded since the last sync point (see the module docstring)."""

    def __init__(self, min_numel: int) -> None:
        self.min_numel = min_numel
        self.nodes: list[tuple] = []  # (func, args, kwargs, meta, ref)
        self.calls = 0  # calls recorded (a tuple call is one)
        self.inputs: list[torch.Tensor] = []
        self.versions: list[int] = []
        self._pos: dict[int, int] = {}  # id(input) -> index; the input is held in self.inputs
        # ``_fast``: id(input) -> (its key part, requires_grad, big, its committed descriptor),
        # read once per region (a held input's metadata changes only through calls that end
        # the region: ``resize_``, ``requires_grad_``, in-place views; C++ ones bump its version)
        self._seen: dict[int, tuple] = {}
        self.floats: list[float] = []
        self.grad = False
        self.device: torch.device | None = None
        # its type, read once (``torch.device.type`` builds a new string at each read), and
        # whether it is the CPU (a placeholder there needs no ``device=``: see ``_fast``)
        self.device_type = ""
        self.cpu = False
        self.mesh: Any = None  # the mesh of a sharded region (None: plain)
        self.comm = False  # a sharded region's calls move data between ranks
        # random calls: the generator they draw from, its state at the first one, and their
        # placeholders held (a draw whose result is dropped still moves the generator)
        self.rng: Any = None
        self.rng_state: Any = None
        self.keep: list[torch.Tensor] = []
        # views of pending results (``record_views``): node index of a view -> its root
        # base's; root base's index -> the base, held (the views' data will be its storage)
        self.view_root: dict[int, int] = {}
        self.bases: dict[int, torch.Tensor] = {}

    def record(self, func: Any, args: tuple, kwargs: dict | None, fast: bool = True) -> Any:
        """The placeholder for ``func(*args, **kwargs)`` (for a call returning a tuple, the
        same tuple type of placeholders); ``NOFLUSH`` for a small pure call on real tensors (it
        runs eagerly, the region goes on); None when the call cannot be captured (the caller
        ends the region and runs it eagerly). ``fast=False``: ``_fast`` has declined it."""
        if fast and not kwargs:
            got = self._fast(func, args)
            if got is not _SLOW:
                return got
        # metadata reads of a gt.Tensor (shape, stride, numel) would each run its
        # __torch_function__: read them as the DTensor's own
        with _NoSubclass():
            got = self._record(func, args, kwargs or {})
        if got is not None and got is not NOFLUSH:
            self.calls += 1
        return got

    def _fast(self, func: Any, args: tuple) -> Any:
        """``_record`` for the common calls: positional arguments only, each a constant or a
        tensor that is pending in this region or real (plain in a plain region; in a sharded
        one a ``gt.Tensor`` of its mesh); recorded when one is pending, ``NOFLUSH`` when all
        are real, plain and small; ``_SLOW`` for anything else (``_record`` then decides).
        One pass builds the descriptors and the metadata key (ints: ``_part``); a float is
        keyed by its type in a plain region (its value never changes a plain result's shape,
        strides or dtype), by its value in a sharded one. Written for speed: it runs once per
        recorded op (``benchmarks/bench_record.py``); a real input already in the region is
        read from ``_seen``, a pending one from its tag."""
        key: list[Any] = [func]
        descs: list[tuple] = []
        fresh: list[tuple] = []  # (position, key part, requires_grad, big) of new real inputs
        lazy = rg = big = commit = False
        mesh = self.mesh
        dyn = 2 if func in _DYNAMIC else 0  # the first two float slots become graph inputs
        seen = self._seen
        for a in args:
            t = type(a)
            if t is float:
                key.append(_FKEY if mesh is None else (t, a))
                if dyn > len(descs):
                    descs.append(("F", a))
                    commit = True
                else:
                    descs.append(("c", a))
                continue
            if t is int or t is bool:
                key.append((t, a))
                descs.append(("c", a))
                continue
            if t is not _Tensor and not isinstance(a, _Tensor):
                return _SLOW
            tag = a.__dict__.get("_gt_lazy")
            if tag is not None:
                if tag[_REGION] is not self:
                    return _SLOW
                lazy = True
                rg = rg or tag[_RG]
                key.append(tag[_PART])
                descs.append(("n", tag[_INDEX]))
                continue
            got = seen.get(id(a))  # held by the region: the id is this tensor's
            if got is None:
                got = self._first(a, t)
                if got is None:
                    return _SLOW
                fresh.append((len(descs), *got[:3]))
                commit = True
            part, r, b, d = got
            big = big or b
            rg = rg or r
            key.append(part)
            descs.append(d)
        if not lazy:  # real tensors only: small plain ones run eagerly, the region goes on
            return NOFLUSH if not big and mesh is None and func not in _RANDOM else _SLOW
        if func in _RANDOM:
            return _SLOW
        grad = _grad_on()
        if grad != self.grad or _inference() or _autocast(self.device_type):
            return _SLOW
        if mesh is not None and not _sharded.recordable(func, mesh):
            return _SLOW
        key = tuple(key)
        got = _fast_meta.get(key)
        if got is None:
            got = self._meta_miss(key, func, args)
            if got is None:
                return None  # eager runs it (and raises the program's own error)
        meta, spec, part, floating = got
        if commit:  # nothing is added to the region before the call is known to be recorded
            if mesh is None:
                descs = [self._commit(d) for d in descs]
            else:
                with _NoSubclass():  # a gt.Tensor's version, as the DTensor's own
                    descs = [self._commit(d) for d in descs]
            for i, part, r, b in fresh:  # an argument's position is its descriptor's
                seen[id(args[i])] = (part, r, b, descs[i])
        self.calls += 1
        if spec is not None or meta[0] is None:  # a sharded or tuple result: ``_emit``
            if spec is not None:
                self.comm = self.comm or spec[3]
            return self._emit(func, tuple(descs), (), meta, grad and rg, self.device, spec, part)
        # ``_emit`` of a plain tensor result, inline (one call less per recorded op)
        rg = grad and rg and floating
        if _mode_depth():  # another function mode below the hook's: it must not see this
            with _NoTorchFunction():
                p = _empty_strided(meta[0], meta[1], dtype=meta[2], device=self.device)
        elif self.cpu:  # with no mode, torch's factories make CPU tensors (``device=`` costs)
            p = _empty_strided(meta[0], meta[1], dtype=meta[2])
        else:
            p = _empty_strided(meta[0], meta[1], dtype=meta[2], device=self.device)
        if rg:  # it says so already (see ``_emit``)
            p.requires_grad_()
        nodes = self.nodes
        p._gt_lazy = (self, len(nodes), part, rg)
        nodes.append((func, tuple(descs), (), meta, _weakref(p)))
        return p

    def _first(self, a: torch.Tensor, t: type) -> tuple | None:
        """What ``_fast`` keeps of a real input it meets first in this region: ``(key part,
        requires_grad, big, descriptor)``; None when ``_fast`` cannot take it (another
        device, a plain tensor in a sharded region or the converse, a view ``gt.Tensor``,
        another mesh)."""
        mesh = self.mesh
        if t is _Tensor or t is _Parameter:
            if mesh is not None or (self.device is not None and a.device != self.device):
                return None
            part = _part(("t", tuple(a.shape), a.stride(), a.dtype))
            return part, a.requires_grad, a.numel() >= self.min_numel, ("I", a)
        if mesh is None or not isinstance(a, DTensor):
            return None
        spec = a._spec
        if spec.mesh is not mesh or getattr(a, "_gt_view", None) is not None:
            return None
        with _NoSubclass():  # its metadata as the DTensor's own (no gt.Tensor hop)
            if a.device != self.device:
                return None
            big = a.numel() // mesh.size() >= self.min_numel  # per rank, from global sizes
            return _part(("d", spec)), a.requires_grad, big, ("I", a)

    def _meta_miss(self, key: tuple, func: Any, args: tuple) -> tuple | None:
        """``(meta, spec, part, floating)`` of ``_fast``'s call on a cache miss
        (``_out_meta``; ``part``: the result's interned metadata, None for a tuple;
        ``floating``: a float or complex result, which may need grad), kept by its key; None
        when the call cannot be recorded."""
        with _NoSubclass():
            try:
                got = self._out_meta(key, func, args, {}, self.mesh)
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

    def record_views(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """``split``/``chunk``/``unbind`` (``_lazy_ops.VIEWS``) of a pending plain result of
        this region: the call's node and one ``getitem`` node per element, whose placeholders
        are eager's own views of the base's placeholder (run now on its unfilled memory: no
        data is read), so a view aliases its base as eager's does (``_base``, an in-place
        change of either seen by the other, autograd's view rules). The base is then filled in
        place at ``fill`` and the views need no filling; a later recorded op on a view reads
        the graph's ``getitem``. None when the call is not that (the caller ends the region):
        a sharded region, a base that will need grad, another tensor argument, a mode
        change."""
        if self.mesh is not None or not args or func in _UNSAFE_VIEWS:
            return None
        kwargs = kwargs or {}
        base = args[0]
        tag = base.__dict__.get("_gt_lazy") if type(base) is _Tensor else None
        if tag is None or tag[_REGION] is not self or tag[_RG]:
            # a base that will need grad: it is filled in place under autograd, which the
            # views of a call returning several views may not see (autograd raises at their
            # next use); the region runs first, and eager makes the views of its result
            return None
        descs: list[tuple] = [("n", tag[_INDEX])]
        for a in args[1:]:
            d = self._desc(a, False)
            if d is None or d[0] != "c":
                return None
            descs.append(d)
        kdescs = []
        for k, a in kwargs.items():
            d = self._desc(a, False)
            if d is None or d[0] != "c":
                return None
            kdescs.append((k, d))
        if _grad_on() != self.grad or _inference() or _autocast(self.device_type):
            return None
        try:
            with _NoTorchFunction():
                views = func(*args, **kwargs)
        except Exception:
            return None  # eager runs it (and raises the program's own error)
        if not isinstance(views, tuple) or not all(type(v) is _Tensor for v in views):
            return None
        root = self.view_root.get(tag[_INDEX], tag[_INDEX])
        if root == tag[_INDEX]:
            self.bases[root] = base  # held: the views' values come with it, in place
        nodes = self.nodes
        ref = ("n", len(nodes))
        nodes.append((func, tuple(descs), tuple(kdescs), None, _no_placeholder))
        for i, v in enumerate(views):
            index = len(nodes)
            meta = (tuple(v.shape), v.stride(), v.dtype)
            v._gt_lazy = (self, index, _part(("t", *meta)), tag[_RG])
            nodes.append((_getitem, (ref, ("c", i)), (), meta, _weakref(v)))
            self.view_root[index] = root
        self.calls += 1
        return views

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``record``'s general path: any arguments, plain or sharded (see ``record``)."""
        seen = self._scan(args, kwargs)
        if seen is None:
            return None
        lazy, big, device, rg, mesh, plain = seen
        random = func in _RANDOM
        if random and (not _lazy_ops.drops(args, kwargs) or mesh is not None):
            return None  # eager: it aliases its input, or draws per shard on gt.Tensors
        if not lazy and not big:
            # a small pure call runs eagerly, the region goes on; a small draw may not (it
            # would draw before the region's own draws): the region runs first
            return None if random and self.rng is not None else NOFLUSH
        grad = torch.is_grad_enabled()
        if not self._admits(func, device, mesh, plain, grad):
            return None
        described = self._describe(func, args, kwargs)
        if described is None:
            return None
        adesc, kdesc, mkey = described
        out = self._out_meta(mkey, func, args, kwargs, mesh)
        if out is None:
            return None
        meta, spec = out
        if random and self.rng is None:
            self.rng = _generator(device)
            self.rng_state = self.rng.get_state()  # the region's draws start from here
        if spec is not None:
            self.comm = self.comm or spec[3]
        self.grad = grad
        self.device = device
        self.device_type = device.type
        self.cpu = self.device_type == "cpu"
        self.mesh = mesh
        adesc = tuple(self._commit(d) for d in adesc)
        kdesc = tuple((k, self._commit(d)) for k, d in kdesc)
        p = self._emit(func, adesc, kdesc, meta, grad and rg, device, spec)
        if random:  # every draw runs, in order, even if its result is dropped
            self.keep.append(p)
        return p

    def _scan(self, args: tuple, kwargs: dict) -> tuple | None:
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
                big = big or n >= self.min_numel
            if device is None:
                device = a.device
            elif a.device != device:
                return None
        return lazy, big, device, rg, mesh, plain

    def _admits(self, func: Any, device: Any, mesh: Any, plain: bool, grad: bool) -> bool:
        """Whether a call on ``device`` (sharded over ``mesh``) may join this region: its
        device, its kind (plain or sharded on one mesh), grad mode as the region's, no
        inference mode or autocast. A sharded call with a real plain input that needs grad
        may not: ``gt.Tensor`` lifts it (its gradient stays plain), which a graph does not."""
        if device is None or (self.device is not None and device != self.device):
            return False
        if mesh is not None and (plain or not _sharded.recordable(func, mesh)):
            return False
        if self.nodes and (mesh is not self.mesh or grad != self.grad):
            return False  # plain and sharded, two meshes, or grad mode changed: the next region
        return not (torch.is_inference_mode_enabled() or torch.is_autocast_enabled(device.type))

    def _describe(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """Tentative descriptors of the arguments and the call's metadata key:
        ``(args' descriptors, kwargs' (name, descriptor), key)``; None if one cannot be
        described."""
        dyn = func in _DYNAMIC
        adesc, mkey = [], [func]
        for i, a in enumerate(args):
            d = self._desc(a, dyn and i < 2)
            if d is None:
                return None
            adesc.append(d)
            mkey.append(_mkey(a, d))
        kdesc = []
        for k, a in kwargs.items():
            d = self._desc(a, False)
            if d is None:
                return None
            kdesc.append((k, d))
            mkey.append((k, _mkey(a, d)))
        return adesc, kdesc, tuple(mkey)

    @staticmethod
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

    def _emit(
        self,
        func: Any,
        args: tuple,
        kwargs: tuple,
        meta: tuple,
        rg: bool,
        device: Any,
        spec: tuple | None = None,
        part: int | None = None,
    ) -> Any:
        """Add the call's node (committed descriptors) and hand back its placeholder; for a
        call returning a tuple (``meta[0] is None``), one ``getitem`` node and placeholder per
        element, in the call's own tuple type. ``part``: the result's interned metadata
        (``_fast`` keeps it with the call's metadata; computed here when None)."""
        nodes = self.nodes
        if meta[0] is None:
            _, kind, metas = meta
            ref = ("n", len(nodes))
            nodes.append((func, args, kwargs, None, _no_placeholder))
            items = [
                self._emit(_getitem, (ref, ("c", i)), (), m, rg, device)
                for i, m in enumerate(metas)
            ]
            return kind(items)
        shape, stride, dtype = meta
        rg = rg and (dtype.is_floating_point or dtype.is_complex)
        # a placeholder that will need grad says so already: dynamo picks a hot function's
        # graph by guards on ``requires_grad`` (checked in C++, before the graph's runner fills
        # the region), so a pending input must show what the filled one will
        if spec is not None:
            p = _sharded.placeholder(spec[0], spec[1], spec[2], device, rg)
            if part is None:
                part = _part(("d", spec[0]))
        else:
            if _mode_depth():  # another function mode below the hook's: it must not see this
                with _NoTorchFunction():
                    p = _empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                p = _empty_strided(shape, stride, dtype=dtype, device=device)
            if rg:
                p.requires_grad_()
            if part is None:
                part = _part(("t", *meta))
        p._gt_lazy = (self, len(nodes), part, rg)
        nodes.append((func, args, kwargs, meta, _weakref(p)))
        return p

    def _desc(self, a: Any, dyn_float: bool) -> tuple | None:
        """A tentative descriptor (nothing is added to the region until ``_commit``)."""
        if type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
            ds = tuple(self._desc(x, False) for x in a)
            if not all(d is not None and d[0] in ("I", "n") for d in ds):
                return None
            return ("L", ds)
        if isinstance(a, torch.Tensor):
            node = a.__dict__.get("_gt_lazy")
            if node is not None:
                return ("n", node[_INDEX]) if node[_REGION] is self else None
            return ("I", a)
        t = type(a)
        if t is float:
            return ("F", a) if dyn_float else ("c", a)
        if t in _CONST:
            return ("c", a)
        if (t is tuple or t is list) and all(type(x) in (int, float, bool) for x in a):
            return ("c", a)
        return None

    def _commit(self, d: tuple) -> tuple:
        kind, v = d
        if kind == "L":
            return ("L", tuple(self._commit(x) for x in v))
        if kind == "I":
            k = self._pos.get(id(v))
            if k is None:
                k = self._pos[id(v)] = len(self.inputs)
                self.inputs.append(v)
                self.versions.append(v._version)
            return ("i", k)
        if kind == "F":
            self.floats.append(v)
            return ("f", len(self.floats) - 1)
        return d

    def take(self) -> Plan | None:
        """End the region: the plan of what live placeholders need (None if nothing)."""
        nodes, inputs, versions, floats = self.nodes, self.inputs, self.versions, self.floats
        self.nodes, self.inputs, self.versions, self.floats = [], [], [], []
        self._pos = {}
        self._seen = {}
        self.device, self.device_type, self.cpu = None, "", False
        mesh, comm, self.mesh, self.comm = self.mesh, self.comm, None, False
        keep, self.keep = self.keep, []  # held until the plan holds them as outputs
        view_root, self.view_root = self.view_root, {}
        bases, self.bases = self.bases, {}
        live = {}
        views = []
        for i, n in enumerate(nodes):
            p = n[_REF]()
            if p is not None:
                if i in view_root:  # a view: its base is live and fills it
                    views.append(p)
                else:
                    live[i] = p
        for i, t in enumerate(inputs):
            if t._version != versions[i]:
                for p in live.values():
                    p.__dict__.pop("_gt_lazy", None)
                raise RuntimeError(
                    "spmdgt lazy region: an input was changed in place by code the region "
                    "cannot see (C++ or a non-torch call) before the region ran; its results "
                    "would be wrong, so none are given"
                )
        if not live:
            return None
        needed = set(live)
        for i in range(len(nodes) - 1, -1, -1):
            if i in needed:
                n = nodes[i]
                for d in _flat((*n[_ARGS], *(d for _, d in n[_KWARGS]))):
                    if d[0] == "n":
                        needed.add(d[1])
        plan = Plan()
        plan.views = views
        plan.inplace = {id(b) for b in bases.values()}
        plan.rng, plan.rng_state, self.rng, self.rng_state = self.rng, self.rng_state, None, None
        plan.grad = self.grad
        plan.mesh = mesh
        plan.comm = comm
        remap: dict[int, int] = {}
        in_map: dict[int, int] = {}
        fl_map: dict[int, int] = {}
        keyed = []

        def desc(d: tuple, n: tuple) -> tuple:
            kind, v = d
            if kind == "L":
                return ("L", tuple(desc(x, n) for x in v))
            if kind == "n":
                return ("n", remap[v])
            if kind == "i":
                if v not in in_map:
                    in_map[v] = len(plan.inputs)
                    plan.inputs.append(inputs[v])
                return ("i", in_map[v])
            if kind == "f":
                if v not in fl_map:
                    fl_map[v] = len(plan.floats)
                    plan.floats.append(floats[v])
                    plan.float_dtypes.append(n[_META][2])
                return ("f", fl_map[v])
            return d

        outs = []
        for i, n in enumerate(nodes):
            if i not in needed:
                continue
            func = n[_FUNC]
            a = tuple(desc(d, n) for d in n[_ARGS])
            k = tuple((name, desc(d, n)) for name, d in n[_KWARGS])
            remap[i] = len(plan.nodes)
            plan.nodes.append((func, a, k))
            keyed.append(
                (func, tuple(_dkey(d) for d in a), tuple((name, _dkey(d)) for name, d in k))
            )
            if i in live:
                outs.append(remap[i])
                plan.outputs.append(live[i])
        del keep, bases
        ins = tuple(_inkey(t) for t in plan.inputs)
        plan.base = (tuple(keyed), ins, tuple(outs), plan.grad, tuple(plan.float_dtypes))
        plan.ops = len(plan.nodes)
        return plan


def _inkey(t: torch.Tensor) -> tuple:
    spec = _sharded.layout(t)
    if spec is not None:  # global shape, stride, dtype, placements and mesh
        return (spec, t.requires_grad)
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _dkey(d: tuple) -> Any:
    if d[0] == "L":
        return ("L", tuple(_dkey(x) for x in d[1]))
    return ("c", _ckey(d[1])) if d[0] == "c" else d


def _flat(descs: Any) -> Any:
    """The descriptors, those inside a list's descriptor included."""
    for d in descs:
        if d[0] == "L":
            yield from d[1]
        else:
            yield d


def _tensors(args: tuple, kwargs: dict) -> Any:
    """The call's tensor arguments, those in a list or tuple included (``cat``, ``stack``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _generator(device: torch.device) -> torch.Generator:
    """The default generator a random call on ``device`` draws from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def _mkey(a: Any, d: tuple) -> Any:
    if d[0] == "L":
        return ("L", tuple(_mkey(x, dx) for x, dx in zip(a, d[1], strict=True)))
    if d[0] in ("I", "n"):
        spec = _sharded.layout(a)
        return ("t", tuple(a.shape), a.stride(), a.dtype) if spec is None else ("d", spec)
    if d[0] == "F":
        return ("f",)
    return _ckey(a)


def fill(plan: Plan, results: Any) -> None:
    """Put ``results`` into the plan's placeholders (which stop being placeholders)."""
    inputs = plan.inputs
    if plan.mesh is not None:  # results that need grad are copied in; the rest by shard
        pairs = _sharded.fill(plan, results)
        inputs = [getattr(t, "_local_tensor", t) for t in inputs]
    else:
        pairs = zip(plan.outputs, results, strict=True)
    # with a backward, a result that needs no grad may still be saved for it: copied, so that
    # an in-place change of the placeholder later cannot reach the saved value unseen
    grad = plan.grad and any(t.requires_grad for t in plan.inputs)
    seen: set[int] = set()
    inplace = plan.inplace
    with torch._C.DisableTorchFunction():
        for v in plan.views:  # views of a base filled below: their data comes with it
            v.__dict__.pop("_gt_lazy", None)
        for p, out in pairs:
            p.__dict__.pop("_gt_lazy", None)
            if p.requires_grad:  # a leaf until now (see ``record``): the result decides
                p.requires_grad_(False)
            if out.requires_grad:
                with torch.enable_grad():
                    p.copy_(out)  # grad_fn: CopyBackwards into the graph's backward
                continue
            ptr = out.untyped_storage().data_ptr()
            if (
                id(p) in inplace  # a base of views: their memory is its own, kept
                or grad
                or ptr in seen
                or out.stride() != p.stride()
                or out.storage_offset() != 0
                or any(t.untyped_storage().data_ptr() == ptr for t in inputs)
            ):
                with torch.no_grad():
                    p.copy_(out)
            else:  # the result's memory becomes the placeholder's: no copy
                seen.add(ptr)
                with torch.no_grad():
                    p.set_(out)
