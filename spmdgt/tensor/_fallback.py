"""Exact fallbacks: run an op as one process would, on the global values, on every rank.

Used where DTensor has no rule for an op on a layout, where the output shape depends on the
data, for random ops, for in-place ops outside DTensor's pointwise table, and for writes
through views that DTensor had to copy (``_views``; ``_optable`` decides which). Each fallback:

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
from spmdgt.tensor._moves import gather, scatter, target_of

__all__ = [
    "NoRule",
    "NotTraceable",
    "counts",
    "refuse_traced_write",
    "run_global",
    "run_inplace",
    "tracing",
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

    fulls: list[tuple[DTensor, torch.Tensor, int]] = []

    def full_of(a):
        f = in_layout_of(gather(a), a) if strided else gather(a)
        fulls.append((a, f, f._version))
        return f

    full_args, full_kwargs = _map(
        lambda a: full_of(a) if isinstance(a, DTensor) else a, (args, kwargs)
    )
    with _DisableSubclass():
        out = func(*full_args, **full_kwargs)
    _write_side_effects(func, fulls)
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


def _write_side_effects(func, fulls) -> None:
    """Write back what a function run on global values wrote into its arguments' global
    copies by itself: ``F.embedding(ids, w, max_norm=1.0)`` renormalises the rows of ``w``
    it looks up in place, ``F.batch_norm`` updates the running statistics. In one process
    the argument itself is written; here the gathered copy was, so each rank copies its part
    back (a plain tensor lifted for the call: all of it, into the plain tensor). The version
    counter tells (it advances alike on every rank: the same op on the same global values).
    A copy sharing the DTensor's own memory (a replicated value) was written already. Written
    as under ``no_grad``, as those functions write."""
    for a, full, version in fulls:
        if full._version == version:
            continue
        with torch.no_grad():
            source = a.__dict__.get("_gt_lifted")
            if source is not None:
                if full.data_ptr() != source.data_ptr():
                    source.copy_(full)
            elif full.data_ptr() != a._local_tensor.data_ptr():
                _write_back(a, full.detach(), op_name(func))


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
