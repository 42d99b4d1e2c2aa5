"""A cached dispatch fast path for ops on ``gt.Tensor``: the local op on the local shards,
wrapped with the output spec learned the first time, without DTensor's dispatch.

Most ops of a program repeat with the same layouts. The first call of a key (the torch
function, each tensor argument's global spec, the other arguments) takes the usual path
(``gt.Tensor.__torch_function__``) under a recording dispatch mode that sees every ATen op
DTensor is handed. The key is cacheable only when that record proves the op is local:

- every recorded op ran on DTensor with a sharding DTensor found without any redistribution
  (so DTensor ran exactly ``op(local args)``: no collective, no argument rewritten to local
  sizes), none draws random numbers, mutates, has a custom DTensor handler or one of spmdgt's
  hook interventions (its record in ``_registry``: decompositions, rewrites, intercepts such
  as masks and scalar reads; and random ops),
  and each tensor it took is an input of the call or an output of an earlier recorded op;
- the call's result is the output of a recorded op that is not a view (aliasing stays
  DTensor's), and needs no gradient;
- running the torch function on the local shards (plain tensors) records the very same
  ATen ops on the same arguments, and returns the corresponding output.

Then DTensor computed exactly what the local call computes, on every later call of the key
too (the key fixes the layouts, hence every rank's local shapes), and a hit is: the local
call, then ``torch.Tensor._dtensor__new__`` with the learned spec (DTensor's own C++
constructor, without its Python ``__init__``). A Partial output replays exactly as well: it
is DTensor's own local value with DTensor's own spec.

The fast path is taken only where nothing else watches or changes the op: no autograd to
record (grad mode off, or no tensor argument needs a gradient), no torch function or
dispatch mode (the interceptor's levels, ``CommDebugMode``, the compile pass, fake tensors),
no lazy region, no forward-AD or functorch transform, not while dynamo traces, no autocast,
no view spmdgt had to copy (``_gt_view``). Everything else, and every key that failed the
proof, goes the usual way. The cache is bounded (``MAX_ENTRIES``, oldest key out first) and
counted in ``gt.debug.get_worker_stats()["fastpath"]``. Keys depend on global metadata only,
so they are alike on every rank (a tensor on a sub-mesh, whose proof would hold on its own
ranks only, is never cached); a hit or a miss issues no collective either way (a
cacheable key's usual path has none), so ranks never wait on each other over it.
``GT_FASTPATH=0`` turns it off.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from spmdgt._core import env as _env
from spmdgt._core import scope as _scope
from spmdgt.tensor import _overlap
from spmdgt.tensor._meshes import spans_world

__all__ = ["MAX_ENTRIES", "clear", "counts", "enabled", "learn", "lookup", "replay"]

MAX_ENTRIES = 4096  # keys remembered; the oldest goes first when full
# a torch function refused for this many keys is not tried again (``Tensor.size``, ``item``)
_MAX_REFUSALS = 16

counts = {"hits": 0, "misses": 0, "evictions": 0, "uncacheable": 0}
enabled = [bool(_env.flag("GT_FASTPATH"))]

_cache: dict = {}  # key -> (learned output specs, tuple output?) or None (not cacheable)
_refusals: dict = {}  # torch function -> keys refused
_NEVER = 1 << 30

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_new = torch.Tensor._dtensor__new__
_fn_stack = torch._C._len_torch_function_stack
_mode_stack = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_autocast = torch._C._is_any_autocast_enabled
_inference = torch.is_inference_mode_enabled
_bump = torch._C._increment_version
_is_alias_of = torch._C._is_alias_of
_Tensor = torch.Tensor
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)

_gt_tensor: list = []  # [gt.Tensor], set by ``set_tensor_class``


def set_tensor_class(cls) -> None:
    """Tell this module ``gt.Tensor`` (it cannot import it: ``_tensor`` imports this)."""
    _gt_tensor[:] = [cls]


def clear() -> None:
    """Forget every learned key and zero the counters (a new session)."""
    _cache.clear()
    _refusals.clear()
    for k in counts:
        counts[k] = 0


def _arg_key(a, gt):
    """One argument's part of the key, or ``_NO`` when the call is not for the fast path."""
    t = type(a)
    if t is gt:
        if a._gt_view is not None or (a.requires_grad and _grad_enabled()):
            return _NO
        spec = a._spec
        # a sub-mesh is not for the fast path: a rank off it records no local op, so the
        # proof that the op is local would hold on some ranks only, and a hit (which settles
        # no agreement) on the mesh's ranks against a miss elsewhere (which does) would leave
        # the ranks' exchanges unpaired
        return spec if spans_world(spec.mesh) else _NO
    if t in _SCALARS:
        return (t, a)
    if isinstance(a, _Tensor):
        if isinstance(a, DTensor) or (a.requires_grad and _grad_enabled()):
            return _NO
        return (t, a.shape, a.stride(), a.dtype, a.device)
    if t is list or t is tuple:
        parts = tuple(_arg_key(b, gt) for b in a)
        return _NO if any(p is _NO for p in parts) else (t, *parts)
    return _NO


_NO = object()  # a part that rules the fast path out


def lookup(func, args, kwargs):
    """``(key, entry)`` for this call: ``entry`` is the learned output, None for a key that is
    not cacheable, ``_MISSING`` for a new key; ``(None, None)`` when the call is not for the
    fast path at all (see the module docstring)."""
    if (
        _fn_stack()
        or _mode_stack()
        or _scope.lazy_sync is not None
        or _fwad._current_level >= 0
        or _functorch_active()
        or _autocast()
        or _inference()
        or _compiling()
        or _refusals.get(func, 0) >= _MAX_REFUSALS
    ):
        return None, None
    gt = _gt_tensor[0]
    with _DisableSubclass():  # attribute reads on gt.Tensor without its __torch_function__
        parts = [_arg_key(a, gt) for a in args]
        for p in parts:
            if p is _NO:
                return None, None
        if kwargs:
            if "out" in kwargs:
                return None, None
            for k, v in kwargs.items():
                p = _arg_key(v, gt)
                if p is _NO:
                    return None, None
                parts.append((k, p))
    key = (func, _scope.stack[-1] if _scope.stack else None, *parts)
    try:
        return key, _cache.get(key, _MISSING)
    except TypeError:  # an unhashable argument value
        return None, None


_MISSING = object()


def _local(a, gt):
    if type(a) is gt:
        return a._local_tensor
    if type(a) is list or type(a) is tuple:
        return type(a)(_local(b, gt) for b in a)
    return a


def replay(entry, func, args, kwargs):
    """A hit: ``func`` on the local shards, wrapped with the learned spec(s); an in-place
    op writes ``self``'s shard, bumps ``self``'s version as torch would, and returns it."""
    counts["hits"] += 1
    gt = _gt_tensor[0]
    specs, many = entry
    if many is None:  # in place, on self
        if _may_alias(args, kwargs, gt):  # then torch's way (_overlap), as the usual path
            out = _overlap.through_model(func, args, kwargs)
            if type(out) is _overlap.Copies:  # autograd records (not on the fast path)
                args, kwargs = out
            elif out is not NotImplemented:
                return out
        with _DisableSubclass():
            largs = [_local(a, gt) for a in args]
            if kwargs:
                func(*largs, **{k: _local(v, gt) for k, v in kwargs.items()})
            else:
                func(*largs)
            _bump((args[0],))
        return args[0]
    with _DisableSubclass():
        largs = [_local(a, gt) for a in args]
        if kwargs:
            res = func(*largs, **{k: _local(v, gt) for k, v in kwargs.items()})
        else:
            res = func(*largs)
    if not many:
        return _new(gt, res, specs, requires_grad=False)
    return type(res)(_new(gt, r, s, requires_grad=False) for r, s in zip(res, specs))


def _may_alias(args, kwargs, gt) -> bool:
    """Might an operand share memory with ``self`` (``args[0]``, no ``_gt_view``: the key
    says so)? Yes for a view spmdgt copied (``_overlap`` follows it to its base) and for an
    operand on ``self``'s wrapper storage; ``_overlap.through_model`` then decides."""
    w = args[0]
    with _DisableSubclass():
        for a in (*args[1:], *kwargs.values()) if kwargs else args[1:]:
            for b in a if type(a) is list or type(a) is tuple else (a,):
                if type(b) is gt and b is not w and (b._gt_view is not None or _is_alias_of(b, w)):
                    return True
    return False


# -- learning a key ---------------------------------------------------------------------------


class _Record(TorchDispatchMode):
    """Records each ATen op as (op, its arguments with tensors named by ``name``); tensors
    nobody named make the record unusable (``ok`` False)."""

    def __init__(self, names: dict, on_dtensor: bool, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.names = names  # id(tensor) -> ("in", i) or ("tmp", op index, output index)
        self.keep: list = []  # the named tensors, alive while ids are compared
        self.ops: list = []
        self.outs: dict = {}  # id(output) -> the op that made it
        self.ok = True
        self.on_dtensor = on_dtensor

    def name(self, a):
        if isinstance(a, _Tensor):
            n = self.names.get(id(a))
            if n is not None:
                return n
            if type(a) is _Tensor and a.dim() == 0 and not a.requires_grad:
                return ("const", a.dtype, a.item())  # a wrapped Python number
            self.ok = False
            return ("?",)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ok:
            self.ok = _local_op(func, args, kwargs, self.inplace) if self.on_dtensor else True
            self.ops.append((func, tree_map(self.name, (args, kwargs))))
        out = func(*args, **kwargs)
        if self.ok:
            k = len(self.ops) - 1
            for j, o in enumerate(tree_flatten(out)[0]):
                if isinstance(o, _Tensor):
                    self.names[id(o)] = ("tmp", k, j)
                    self.outs[id(o)] = func
                    self.keep.append(o)
        return out


def _writes_self_only(func) -> bool:
    """Is ``func`` an in-place op that writes its first argument and nothing else?"""
    a = func._schema.arguments
    return (
        bool(a)
        and a[0].alias_info is not None
        and a[0].alias_info.is_write
        and not any(x.alias_info is not None and x.alias_info.is_write for x in a[1:])
    )


def _local_op(func, args, kwargs, inplace: bool) -> bool:
    """Did DTensor run ``func`` as ``func(local args)``, with nothing of spmdgt's hook? (An
    op on plain tensors only, a replicated weight's ``t()``, runs alike in the local call.)
    A mutation only where ``inplace``: one writing a DTensor ``self`` only, whose layout it
    keeps (DTensor then returns ``self`` as it is)."""
    from spmdgt.tensor import _random, _registry

    if not isinstance(func, torch._ops.OpOverload):
        return False
    if func._schema.is_mutable and not (
        inplace and _writes_self_only(func) and args and isinstance(args[0], DTensor)
    ):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False  # draws random numbers
    dispatcher = DTensor._op_dispatcher
    if func in dispatcher._random_ops or func in dispatcher._custom_op_handlers:
        return False
    if not any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
        return True
    if _random.draws(func, args, kwargs) or _registry.intervenes(func, args):
        return False
    try:
        info = dispatcher.unwrap_to_op_info(func, args, kwargs)
        if not info.compute_mesh._is_current_rank_part_of_mesh():
            return False
        sharding = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
    except Exception:
        return False
    if sharding.needs_redistribute or sharding.output_spec is None:
        return False
    specs = tree_flatten(sharding.output_spec)[0]
    if func._schema.is_mutable and sharding.output_spec != args[0]._spec:
        return False
    return all(isinstance(s, DTensorSpec) for s in specs)


def _inputs(args, kwargs, gt, local: bool) -> dict:
    """id -> ("in", i) for each tensor argument (one list level deep), by position."""
    names: dict = {}
    flat = [*args, *kwargs.values()] if kwargs else list(args)
    i = 0
    for a in flat:
        for b in a if type(a) is list or type(a) is tuple else (a,):
            if isinstance(b, _Tensor):
                t = b._local_tensor if local and type(b) is gt else b
                names.setdefault(id(t), ("in", i))
            i += 1
    return names


def _outputs(out, gt):
    """The call's tensor results and whether they came as a tuple/list, or None."""
    if type(out) is gt:
        return [out], False
    if type(out) in (tuple, list) and out and all(type(o) is gt for o in out):
        return list(out), True
    return None


def learn(key, func, args, kwargs, slow, inplace: bool = False):
    """A new key: the usual path ``slow`` under a record, then the proof (see the module
    docstring); its result either way. ``inplace``: an in-place op (``_optable.INPLACE``),
    whose local call the proof makes on copies of the shards."""
    counts["misses"] += 1
    gt = _gt_tensor[0]
    kwargs = kwargs or {}
    before = _copies(args, kwargs, gt) if inplace else None
    rec = _Record(_inputs(args, kwargs, gt, False), True, inplace)
    with rec:
        out = slow(func, args, kwargs)
    entry = None
    try:
        if inplace:
            entry = _prove_inplace(rec, func, args, kwargs, out, gt, before)
        else:
            entry = _prove(rec, func, args, kwargs, out, gt)
    finally:
        _store(key, func, entry)
    return out


def _copies(args, kwargs, gt):
    """The call's arguments with each gt.Tensor's shard as a copy (the in-place proof's
    local call must not write the real shards), and the names of those copies."""
    with _DisableSubclass():

        def copy(a):
            if type(a) is gt:
                return a._local_tensor.clone()
            if type(a) is list or type(a) is tuple:
                return type(a)(copy(b) for b in a)
            return a

        cargs = [copy(a) for a in args]
        ckw = {k: copy(v) for k, v in kwargs.items()}
    return cargs, ckw, _inputs(cargs, ckw, gt, False)


def _prove_inplace(rec, func, args, kwargs, out, gt, before):
    """The proof for an in-place op: one recorded op, writing ``self`` and keeping its
    layout (``_local_op``), returning ``self``; the local call on copies records the same."""
    if not rec.ok or len(rec.ops) != 1 or out is not args[0] or type(out) is not gt:
        return None
    with _DisableSubclass():
        if out.requires_grad and _grad_enabled():
            return None
    cargs, ckw, names = before
    local = _Record(names, False)
    with _DisableSubclass(), local:
        res = func(*cargs, **ckw)
    if not local.ok or local.ops != rec.ops or res is not cargs[0]:
        return None
    return (out._spec, None)


def _prove(rec, func, args, kwargs, out, gt):
    found = _outputs(out, gt)
    if not rec.ops or found is None:
        _refusals[func] = _refusals.get(func, 0) + 1  # no tensor result of an op: a size read
        return None
    if not rec.ok:
        return None
    outs, many = found
    with _DisableSubclass():
        if any(o.requires_grad for o in outs):
            return None
    for o in outs:
        op = rec.outs.get(id(o))
        if op is None:
            return None  # not the result of a recorded op (an input, a copy the path made)
        if any(r.alias_info is not None for r in op._schema.returns):
            _refusals[func] = _MAX_REFUSALS  # a view: aliasing stays DTensor's, for good
            return None
    names = [rec.names[id(o)] for o in outs]
    local = _Record(_inputs(args, kwargs, gt, True), False)
    with _DisableSubclass(), local:
        largs = [_local(a, gt) for a in args]
        res = func(*largs, **{k: _local(v, gt) for k, v in kwargs.items()})
    lres = res if many else [res]
    if not local.ok or local.ops != rec.ops or not isinstance(lres, (list, tuple)):
        return None
    if len(lres) != len(outs) or [local.names.get(id(r)) for r in lres] != names:
        return None
    specs = tuple(o._spec for o in outs)
    return (specs if many else specs[0], many)


def _store(key, func, entry) -> None:
    if entry is None:
        counts["uncacheable"] += 1
    if len(_cache) >= MAX_ENTRIES:
        del _cache[next(iter(_cache))]
        counts["evictions"] += 1
    _cache[key] = entry


from spmdgt._core.session import session  # noqa: E402  (below: the module's functions exist)

session.register("fastpath", clear)
