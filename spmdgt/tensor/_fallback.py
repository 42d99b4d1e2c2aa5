"""Exact fallbacks: run an op as one process would, on the global values, on every rank.

Used where DTensor has no rule for an op on a layout, where the output shape depends on the
data, for random ops, for in-place ops outside DTensor's pointwise table, and for writes
through views that DTensor had to copy (``_optable`` decides which). Each fallback:

1. gathers every sharded argument's global value on every rank (differentiably: the gradient
   goes back to the argument's own layout);
2. runs the plain torch op on those values: the same computation, numbers and errors as one
   process, on every rank alike (the ranks' generators agree, so random ops draw alike too);
3. lays the outputs out again (an output shaped like the first sharded argument takes its
   placement; any other is replicated), or, for a mutation, writes each rank's part of the
   new value back into the tensor that was mutated.

Cost: an all-gather of each sharded argument (and a broadcast on a sub-mesh) plus the op on
the full size. ``gt.debug.get_worker_stats()`` counts fallbacks; a warning says once per op
when one moves a whole tensor (``GT_DEBUG_DISPATCHER=1`` prints every one).
"""

from __future__ import annotations

import sys
import types
import warnings

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from spmdgt._core import debuglog as _debuglog
from spmdgt.tensor._meshes import spans_world
from spmdgt.tensor._moves import gather, move, refresh, scatter, target_of

__all__ = [
    "NoRule",
    "NotTraceable",
    "alias_of",
    "counts",
    "refuse_traced_write",
    "run_global",
    "run_inplace",
    "tag_views",
    "tracing",
    "write_through",
    "written",
]


class NoRule(RuntimeError):
    """DTensor's sharding propagation found no rule for an op on this layout.

    Raised before any data moves, from global metadata alone, so every rank raises it at the
    same op; spmdgt then runs the op exactly on global values instead."""

    def __init__(self, op, cause: BaseException) -> None:
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"{op}: no sharding rule for this layout ({first})")
        self.op = op

    def reason(self) -> str:
        """Why the op took the exact fallback, for the fallback's counters and warning."""
        return f"no DTensor rule for {self.op} on this layout"


_DisableSubclass = torch._C.DisableTorchFunctionSubclass

# op name -> number of fallbacks on this rank (read by gt.debug.get_worker_stats)
counts: dict[str, int] = {}
_warned: set[str] = set()


def op_name(func) -> str:
    """The name of torch function or aten op ``func`` (a property's, for ``x.T``)."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property's getter (``x.T``) reaches __torch_function__ as __get__
        name = getattr(getattr(func, "__self__", None), "__name__", "") or ""
    return name


def tracing(args, kwargs=None) -> bool:
    """Is torch.compile tracing this call (fake, functional or meta tensors: no data)?"""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, DTensor):
            local = a._local_tensor
            return local.is_meta or type(local) is not torch.Tensor
    return False


class NotTraceable(RuntimeError):
    """An exact fallback reached while torch.compile traces, where the graph cannot hold it.

    An out-of-place fallback over the whole world traces as it runs: DTensor's all-gather
    (a functional collective) and each rank's slice of the result (an ``nn.Linear``'s view
    of unevenly sharded rows, compiled, equals eager). Two parts do not: the broadcast a
    sub-mesh's value takes to the ranks outside it (a c10d call on fake tensors: nothing in
    the graph), and the write-back of a mutation into the written tensor's shards (a
    compiled ``kron(..., out=)`` on ``Shard(0)`` inputs left ``out`` all zeros). Those raise
    this, from global metadata, so at the same op on every rank: the compile fails there,
    spmdgt's hot functions run the function eagerly, and a ``torch.compile`` of the user's
    says why."""

    def __init__(self, func, why: str, what: str = "") -> None:
        what = what or f"spmdgt runs it exactly on gathered global values ({why})"
        super().__init__(
            f"{op_name(func) or func}: {what}, which a compiled graph cannot hold; call it "
            "outside torch.compile (torch.compiler.disable), or lay its inputs out so that "
            "DTensor has a rule"
        )


def _refuse_traced(func, args, kwargs, why: str, mutates: bool) -> None:
    """Raise ``NotTraceable`` while torch traces a fallback that writes into a sharded
    tensor (``mutates``) or gathers a value held on a sub-mesh."""
    if not tracing(args, kwargs):
        return
    if mutates or any(_on_sub_mesh(a) for a in (*args, *(kwargs or {}).values())):
        raise NotTraceable(func, why)


_traced_copies = [0]  # views made as copies while torch traced (``_mark_copy``)


def _mark_copy(func, out) -> None:
    """Mark the outputs of a view op that a traced fallback made as copies: a write into one
    would not reach the viewed tensor (``kron(..., out=out)`` writes ``out`` through an
    ``_unsafe_view`` of it: out of a sharded ``out``, a copy), so ``refuse_traced_write``
    raises at such a write. Eagerly, spmdgt writes through these views instead (``tag_views``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    # ``_unsafe_view`` is a view its schema does not annotate (kron's out= writes through it)
    if schema.name != "aten::_unsafe_view" and all(r.alias_info is None for r in schema.returns):
        return
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, DTensor):
            t._gt_traced_copy = True
            _traced_copies[0] += 1


def refuse_traced_write(func, args, kwargs) -> None:
    """Raise ``NotTraceable`` where a mutation traced by torch writes into a view a traced
    fallback made as a copy (``_mark_copy``); ``gt.Tensor.__torch_dispatch__`` asks, once any
    such copy was made."""
    if not tracing(args, kwargs):
        return
    if any(getattr(t, "_gt_traced_copy", False) for t in written(func, args, kwargs)):
        what = (
            "it writes into a view of a sharded tensor that spmdgt made as a copy (no DTensor "
            "rule for the view), so the write would not reach the tensor"
        )
        raise NotTraceable(func, "", what)


def _on_sub_mesh(a) -> bool:
    if isinstance(a, (list, tuple)):
        return any(_on_sub_mesh(x) for x in a)
    return isinstance(a, DTensor) and not spans_world(a.device_mesh)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line (first frame outside
    spmdgt and torch)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("spmdgt.", "torch.")) or name in ("spmdgt", "torch")):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _note(func, why: str, args, kwargs) -> None:
    """Count a fallback; warn once per op when it moved a sharded tensor whole."""
    name = op_name(func)
    counts[name] = counts.get(name, 0) + 1
    if _debuglog.SHARDING:
        _debuglog.debug("sharding", f"{name}: {why}; computed on global values")
        return
    if name in _warned:
        return
    moved = []

    def see(a):
        if isinstance(a, DTensor) and not all(isinstance(p, Replicate) for p in a.placements):
            moved.append(a)
        return a

    _map(see, (args, kwargs))
    if moved:
        _warned.add(name)
        warnings.warn(
            f"spmdgt: {name} on a sharded tensor ran on the gathered global value ({why}); "
            "exact, but it moves whole tensors. GT_DEBUG_DISPATCHER=1 prints each such op",
            stacklevel=_user_stacklevel(),
        )


def _map(fn, obj):
    """Apply ``fn`` to the tensors in ``obj``, through lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):  # torch.return_types too: they take one sequence
        return type(obj)([_map(fn, o) for o in obj])
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return obj


def _first_dtensor(args, kwargs):
    found = []

    def see(a):
        if isinstance(a, DTensor) and not found:
            found.append(a)
        return a

    _map(see, (args, kwargs))
    return found[0] if found else None


def _layout_outputs(out, like):
    """Outputs shaped like ``like`` take its placement; the rest are replicated on its mesh
    (still ``gt.Tensor``s, as every op on one returns: ``.numpy()`` answers on them)."""
    mesh = like.device_mesh
    replicated = target_of(mesh, [Replicate()] * mesh.ndim)
    same = target_of(mesh, like.placements)

    def lay(o):
        if not isinstance(o, torch.Tensor) or isinstance(o, DTensor):
            return o
        if (
            o.shape == like.shape
            and o.dim()
            and not all(isinstance(p, Replicate) for p in same.placements)
        ):
            return scatter(o, same)
        return scatter(o, replicated)

    return _map(lay, out)


# Outputs torch's kernels read on the host as sizes, which must stay plain CPU tensors as
# torch gives them: a packed sequence's batch sizes (an RNN reads them: as a sharded wrapper
# they hold no data, "data is not allocated yet") and the lengths pad_packed_sequence returns.
# op name -> the output's index
_HOST_OUTPUTS = {"_pack_padded_sequence": 1, "_pad_packed_sequence": 1}


def in_layout_of(full: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``full`` laid out in memory as DTensor ``a``'s global strides say (a transposed value
    stays transposed), where those strides are a permutation of a dense layout; ``full``
    itself otherwise. A random op fills memory in order (``x.t().uniform_()``, and dropout's
    ``empty_like(x).bernoulli_()``), so one process's numbers land where ``x``'s layout puts
    them; a gathered value is contiguous. A copy (differentiable) when the layouts differ."""
    stride = tuple(a.stride())
    if tuple(full.stride()) == stride or full.dim() < 2:
        return full
    expected = 1  # a permutation of a dense layout: sorted by stride, each the inner size
    for size, st in sorted(zip(a.shape, stride), key=lambda p: p[1]):
        if size != 1:
            if st != expected:
                return full
            expected *= size
    out = torch.empty_strided(a.shape, stride, dtype=full.dtype, device=full.device)
    return out.copy_(full)


def run_global(func, args, kwargs, why: str, strided: bool = False):
    """``func`` on the global values of its arguments; outputs laid out again. ``strided``
    (random ops): each global value in its DTensor's memory layout (``in_layout_of``)."""
    _refuse_traced(func, args, kwargs, why, mutates=False)
    like = _first_dtensor(args, kwargs)
    _note(func, why, args, kwargs)

    def full_of(a):
        return in_layout_of(gather(a), a) if strided else gather(a)

    full_args, full_kwargs = _map(
        lambda a: full_of(a) if isinstance(a, DTensor) else a, (args, kwargs)
    )
    with _DisableSubclass():
        out = func(*full_args, **full_kwargs)
    if like is None:
        return out
    host = _HOST_OUTPUTS.get(op_name(func).split(".")[0])
    if host is not None:
        outs = list(out)
        outs[:host] = _layout_outputs(outs[:host], like)
        outs[host + 1 :] = _layout_outputs(outs[host + 1 :], like)
        return type(out)(outs)
    laid = _layout_outputs(out, like)
    if tracing(args, kwargs):
        _mark_copy(func, laid)
    return laid


def _check_leaf(t: torch.Tensor, name: str) -> None:
    if torch.is_grad_enabled() and t.requires_grad and t.is_leaf:
        raise RuntimeError(
            f"{name}: a leaf Variable that requires grad is being used in an in-place operation."
        )


def _write_back(dst: DTensor, full: torch.Tensor, name: str) -> None:
    """Write global value ``full`` into sharded ``dst``: each rank copies its own part."""
    if tuple(full.shape) != tuple(dst.shape):
        raise RuntimeError(
            f"{name}: the result has shape {tuple(full.shape)} but the sharded tensor written "
            f"to has shape {tuple(dst.shape)}; a sharded tensor cannot be resized in place "
            "(pass an out= of the result's shape, or use the out-of-place op)"
        )
    new = scatter(full.to(dst.dtype), target_of(dst.device_mesh, dst.placements))
    with _DisableSubclass():
        if any(isinstance(p, Partial) for p in dst.placements):
            dst._spec = new._spec
        dst.copy_(new)


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


_written_args: dict[str, tuple[tuple[int, str], ...]] = {}


def _schema_writes(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument aten's schema of ``func`` marks written
    (``Tensor(a!)``, ``Tensor(a!)[]``), over all its overloads (``out`` excluded: ``run_inplace``
    reads it itself); () when ``func`` is no aten op (``__setitem__``, the dunders)."""
    schema = getattr(func, "_schema", None)
    key = str(schema.name) + "." + schema.overload_name if schema is not None else op_name(func)
    r = _written_args.get(key)
    if r is None:
        if schema is not None:
            schemas = [schema]
        else:
            packet = getattr(torch.ops.aten, key, None)
            schemas = [getattr(packet, o)._schema for o in packet.overloads()] if packet else []
        found = {
            (i, a.name)
            for s in schemas
            for i, a in enumerate(s.arguments)
            if a.alias_info is not None and a.alias_info.is_write and a.name != "out"
        }
        r = _written_args[key] = tuple(sorted(found))
    return r


def written(func, args, kwargs) -> list:
    """The tensors a mutation ``func(*args, **kwargs)`` writes into, lists flattened: those
    passed as ``out=``, else every argument aten's schema marks written (all five lists of
    ``_fused_adam_``: params, grads and states), else ``args[0]`` (``__setitem__``, the
    in-place dunders, ``F.dropout(x, inplace=True)``), else the first DTensor keyword
    (``nn.init.uniform_`` passes its tensor as ``tensor=``)."""
    out_arg = kwargs.get("out") if kwargs else None
    if out_arg is not None:
        found = [out_arg]
    else:
        found = []
        for i, name in _schema_writes(func):
            if i < len(args):
                found.append(args[i])
            elif kwargs and name in kwargs:
                found.append(kwargs[name])
        if not found and args:
            found = [args[0]]
        if not found:
            found = [_first_dtensor(args, kwargs)]
    flat: list = []
    for f in found:
        for t in f if isinstance(f, (list, tuple)) else (f,):
            if isinstance(t, torch.Tensor) and not any(t is g for g in flat):
                flat.append(t)
    return flat


def run_inplace(func, args, kwargs, why: str):
    """A mutation (in-place op, ``__setitem__``, ``out=``, a foreach or fused optimizer op
    that writes lists) computed on global values, then written back into each rank's shard
    of every sharded tensor it mutates (``written``). Plain tensors it mutates are written by
    the op itself, alike on every rank."""
    _refuse_traced(func, args, kwargs, why, mutates=True)
    name = op_name(func)
    targets = written(func, args, kwargs)
    # A Python function (nn.init.kaiming_uniform_) decides itself: its body may run under
    # no_grad, where writing into a leaf that requires grad is allowed. Its copy of such a
    # leaf is a leaf too, so torch raises in it exactly where it would raise in one process.
    composite = isinstance(func, types.FunctionType)
    for t in targets:
        if not composite:
            _check_leaf(t, name)
    _note(func, why, args, kwargs)
    fulls: dict[int, torch.Tensor] = {}

    def full_of(a):
        if not isinstance(a, DTensor):
            return a
        f = fulls.get(id(a))
        if f is None:
            f = gather(a)
            if any(a is t for t in targets):
                # the op mutates it: a copy, so the gathered value saved for backward stays,
                # in the target's memory layout (a random fill follows it: in_layout_of)
                g = in_layout_of(f, a)
                f = g if g is not f else f.clone()
                if composite and a.is_leaf and a.requires_grad:
                    f = f.detach().requires_grad_()
            fulls[id(a)] = f
        return f

    full_args, full_kwargs = _map(full_of, (args, kwargs))
    with _DisableSubclass():
        res = func(*full_args, **full_kwargs)
    for t in targets:
        if isinstance(t, DTensor):
            if t.is_leaf and t.requires_grad:  # allowed above: written as under no_grad
                with torch.no_grad():
                    _write_back(t, fulls[id(t)].detach(), name)
            else:
                _write_back(t, fulls[id(t)], name)
    back = {id(fulls[id(t)]): t for t in targets if isinstance(t, DTensor)}
    return _map(lambda r: back.get(id(r), r), res)


# -- views that DTensor had to copy ---------------------------------------------------------


_is_alias_of = torch._C._is_alias_of
# a view where strides allow
_VIEW_OR_COPY = frozenset({"reshape", "reshape_as", "flatten", "ravel"})


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


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
    if any(isinstance(a, DTensor) for a in args[1:]) or any(
        isinstance(v, DTensor) for v in (kwargs or {}).values()
    ):
        return  # tensor indices: advanced indexing, a copy in torch too
    parent = getattr(src, "_gt_view", None)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    src_local = src._local_tensor
    # a real view where it shares the shard's memory. Decided alike on every rank: DTensor's
    # local view ops run below autograd (no ``_base`` to go by), a pure view op's local result
    # shares the shard's memory on every rank, and a redistribution's result on none; but a
    # view-or-copy op (``reshape``) may copy on one rank's shard and not another's (their
    # strides differ where shards are uneven), and a rank off a sub-mesh holds a placeholder
    real = parent is None and op_name(func) not in _VIEW_OR_COPY and spans_world(src.device_mesh)
    rest, kw = args[1:], dict(kwargs or {})
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

        # the base's version now: a later write to the base makes this copy stale (refresh)
        o._gt_view = (base, replay, base._version)
        # for good, whatever becomes of the copy (set in program order, alike on every rank):
        # the replay reads the base in its shape now, which an in-place view may not change
        base._gt_copied = True


def alias_of(src: DTensor, replay) -> tuple:
    """``_gt_alias`` of a real view ``replay(src)``: (root, the root's spec when the view was
    taken, how to take the view from a tensor laid out so). Views of real views chain to
    the first root. The spec says the root's global size and strides then: an in-place view
    of the root later gives it a new spec and shape, not new memory. Two reads a view op."""
    alias = getattr(src, "_gt_alias", None)
    if alias is not None:
        root, spec, inner = alias
        return root, spec, lambda full, _outer=replay, _inner=inner: _outer(_inner(full))
    return src, src._spec, replay


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
    recorded = torch.is_grad_enabled() and (
        base.requires_grad
        or view.requires_grad
        or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:])
    )
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
        if _root(full_view) is not _root(full_base):
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
