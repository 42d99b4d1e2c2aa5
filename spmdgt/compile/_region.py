"""One lazy region: the ops recorded since the last sync point, and their placeholders.

``Region.record`` turns a capturable call (``_lazy_ops``) into a node and hands back a
*placeholder*: a real tensor of the result's shape, strides, dtype and device, not yet filled.
The placeholder carries its node in the attribute ``_gt_lazy`` (so a later op finds it without
any table keyed by ``id()``: ids are reused once an object dies), and the node holds only a
weak reference to the placeholder, so a result the program drops is not computed at all. This
module decides, per call, whether and how it joins the region (the hot path: ``_fast`` runs
once per recorded op); what it reads off a call, and the formats of nodes, tags and
descriptors, are ``_calls``'.

``Region.take`` ends the region at a sync point: ``_plan`` keeps the nodes a live placeholder
needs and describes them as a ``Plan`` for ``_graphs`` to key, compile and run, and ``fill``s
the placeholders with the results.

A region is plain or sharded: calls on ``gt.Tensor``s of one mesh make a sharded region, whose
placeholders are ``gt.Tensor``s laid out as DTensor's propagation says (``_sharded``); a call
that would mix the two, or two meshes, ends the region and starts the next.

Region inputs are held strongly until the region runs (their ids are stable while held, so the
de-duplication by id below is sound), and their version counters are checked at the sync
(``_plan``): an input changed in place behind the function layer (C++ code) raises instead of
giving a result computed from the changed value.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch

from spmdgt.compile import _lazy_ops, _sharded
from spmdgt.compile._calls import (
    _INDEX,
    _PART,
    _REGION,
    _RG,
    _desc,
    _describe,
    _fast_meta,
    _first,
    _generator,
    _meta_miss,
    _no_placeholder,
    _out_meta,
    _part,
    _scan,
)
from spmdgt.compile._plan import Plan, build

__all__ = ["NOFLUSH", "Region"]

_NoSubclass = torch._C.DisableTorchFunctionSubclass
NOFLUSH = object()  # ``record``: not captured, and pure: no need to end the region
_SLOW = object()  # ``_fast``: not its case, ``_record`` decides
_Tensor = torch.Tensor
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
_getitem = operator.getitem  # a tuple call's element, one node each
# views without autograd's view tracking: never recorded (the region ends first)
_UNSAFE_VIEWS = frozenset({torch.unsafe_split, torch.Tensor.unsafe_split})


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
                got = _first(a, t, mesh, self.device, self.min_numel)
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
            got = _meta_miss(key, func, args, mesh)
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
            d = _desc(self, a, False)
            if d is None or d[0] != "c":
                return None
            descs.append(d)
        kdescs = []
        for k, a in kwargs.items():
            d = _desc(self, a, False)
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
        seen = _scan(args, kwargs, self.min_numel)
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
        described = _describe(self, func, args, kwargs)
        if described is None:
            return None
        adesc, kdesc, mkey = described
        out = _out_meta(mkey, func, args, kwargs, mesh)
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
        """End the region: the plan of what live placeholders need (None if nothing; built by
        ``_plan.build``, which checks the inputs' versions); the region starts over empty."""
        nodes, inputs, versions, floats = self.nodes, self.inputs, self.versions, self.floats
        self.nodes, self.inputs, self.versions, self.floats = [], [], [], []
        self._pos = {}
        self._seen = {}
        self.device, self.device_type, self.cpu = None, "", False
        mesh, comm, self.mesh, self.comm = self.mesh, self.comm, None, False
        keep, self.keep = self.keep, []  # held until the plan holds them as outputs
        view_root, self.view_root = self.view_root, {}
        bases, self.bases = self.bases, {}
        plan = build(nodes, inputs, versions, floats, view_root, bases, self.grad)
        del keep
        if plan is None:
            return None
        plan.rng, plan.rng_state, self.rng, self.rng_state = self.rng, self.rng_state, None, None
        plan.mesh = mesh
        plan.comm = comm
        return plan
