"""Lazy regions of the compile pass: lazy regions (``compile: true`` scopes,
``GT_WORKER_BATCH_SIZE``).

While a region is open, capturable calls (``_lazy_ops``) on tensors of at least
``GT_LAZY_MIN_NUMEL`` elements (65536: below that a compiled graph's launch costs more than it
saves), and every capturable call on a pending result, are recorded instead of run; the program
gets placeholders (``_region``). At a sync point the region runs as one compiled graph
(``_graphs``) and the placeholders are filled. Sync points: a call that needs a value or that
the region cannot hold (``.item()``, ``.numpy()``, ``print``, ``bool()``, ``backward``, an
in-place op, a view (``split``/``chunk``/``unbind`` of a pending plain result that needs no
grad are recorded, as eager's views), ``out=``, a random op, a sharded or unknown argument,
any call the table does not know), a change of grad mode, the end (or start) of a scope, and
``GT_WORKER_BATCH_SIZE`` recorded ops. Small pure calls on real tensors run eagerly without
ending the region (they cannot see or change what it holds).

Capture needs a hook before each op: the interceptor's before-op hooks (``_mode``), added while
a region can open (inside a ``compile: true`` scope; always with ``GT_WORKER_BATCH_SIZE``) and
removed after, so the rest of the program pays nothing.

While a region holds ops, ``torch.compiler`` is set to the ``force_eager`` stance: a function
the user compiled, called with a pending result, would otherwise read it from C++ before it is
filled; run eagerly, its ops reach the hook, which fills the result first. Hot functions
(``GT_AUTO_COMPILE``) may run too: their frames are entered from C++ (guards, then the graph),
so their graph runner and their compile run the open region first (``sync``), and placeholders
that will need grad show ``requires_grad`` from the start, as dynamo's guards check it.

Ops on ``gt.Tensor``s of a mesh spanning the world are recorded too (``_sharded``: placements
from a meta run, collectives inside the graph); their graphs have their own cache, which sees
the same keys on every rank, and a compile is an agreement point. Plain regions have no
collectives, so a rank's fallback is its own and needs no agreement: every rank's results are
eager-exact or graph-exact either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from spmdgt.compile import _lazy_ops
from spmdgt.compile._before_op import PASS
from spmdgt.compile._graphs import Graphs
from spmdgt.compile._plan import fill
from spmdgt.compile._region import _SLOW, NOFLUSH, Region
from spmdgt.compile._stats import RegionStats

__all__ = ["LazyPass"]

_verdict, _SAFE, _CAPTURE = _lazy_ops.verdict, _lazy_ops.SAFE, _lazy_ops.CAPTURE
_VIEWS, _OTHER = _lazy_ops.VIEWS, _lazy_ops.OTHER
_table_get = _lazy_ops.TABLE.get  # ``verdict`` of a call without kwargs
_Tensor = torch.Tensor
_SCALARS = (int, float, bool)
MIN_NUMEL = 65536  # elements; the study's break-even for one compiled graph over eager ops
DEFAULT_BATCH = 256  # ops a region holds at most when GT_WORKER_BATCH_SIZE is not set


class LazyPass:
    """This rank's lazy regions: the open region, the graphs, the hook and the scope depth."""

    def __init__(
        self,
        backend: Any = "inductor",
        batch: int | None = None,
        min_numel: int = MIN_NUMEL,
        cache: int = 64,
        per_region: int = 8,
        keys: int = 1024,
    ) -> None:
        from spmdgt.compile import _note

        self.backend = backend
        self.everywhere = batch is not None  # GT_WORKER_BATCH_SIZE: regions outside scopes too
        self.batch = batch or DEFAULT_BATCH
        self.min_numel = min_numel
        self.stats = RegionStats()
        self.graphs = Graphs(backend, self.stats, cache, per_region, keys, _note)
        # sharded regions' graphs apart: their cache sees the same keys in the same order on
        # every rank (plain regions' keys may differ per rank), so every rank hits, misses,
        # compiles and evicts alike, and a compile is an agreement point
        self.sharded = Graphs(backend, self.stats, cache, per_region, keys, _note)
        self.region = Region(min_numel)
        self.scopes: list[str] = []
        self.busy = False
        self.hooked = False
        self._stance: Any = None
        self._note = _note

    # -- switch -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.everywhere:
            self._hook(True)

    def stop(self) -> None:
        self.flush("disable")
        self._hook(False)
        self.graphs.clear()
        self.sharded.clear()

    def _hook(self, on: bool) -> None:
        from spmdgt.compile import _before_op

        if on and not self.hooked:
            _before_op.add_before_op_hook(self.before_op)
            _function_apply(self)
            self.hooked = True
        elif not on and self.hooked:
            _before_op.remove_before_op_hook(self.before_op)
            _function_apply(None)
            self.hooked = False

    def on_scope(self, name: str, entering: bool, compiles: bool) -> None:
        """A signal scope starts or ends (``_scope``): a sync point; ``compile: true`` scopes
        open the hook while they last."""
        if self.region.nodes:
            self.flush("scope end" if compiles and not entering else "scope change")
        if not compiles:
            return
        if entering:
            self.scopes.append(name)
            self._hook(True)
        else:
            if self.scopes:
                self.scopes.pop()
            if not self.scopes and not self.everywhere:
                self._hook(False)

    # -- per op -----------------------------------------------------------------------------
    def before_op(self, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        """The hook: record ``func``'s call (its placeholder), or ``PASS`` to let it run
        eagerly, ending the open region first where the call needs its values. It runs
        before every torch-level call while the hook is in: with no region open, a call on
        small plain tensors only is told apart with one look at each argument (the common
        case; no key is built and nothing is allocated). Written for speed, as
        ``Region._fast``: a recorded call's whole cost is this and that."""
        if self.busy:
            return PASS
        if kwargs:
            v = _verdict(func, kwargs)
        else:
            try:
                v = _table_get(func, _OTHER)
            except TypeError:  # an unhashable callable
                v = _OTHER
        if v == _SAFE:
            return PASS
        reg = self.region
        if v == _CAPTURE:
            if reg.nodes:
                if not kwargs:  # the common case: straight to the region's fast path
                    got = reg._fast(func, args)
                    if got is _SLOW:
                        return self._capture(reg, func, args, kwargs, False)
                    if got is None or got is NOFLUSH:
                        return self._capture(reg, func, args, kwargs, got)
                    if len(reg.nodes) >= self.batch:
                        self.flush("batch size")
                    return got
            elif not kwargs and _small(args, self.min_numel):
                return PASS  # no region open (so nothing pending) and nothing to open one
            return self._capture(reg, func, args, kwargs)
        if v == _VIEWS:
            if not (reg.nodes and _pending(args, kwargs)):
                return PASS  # views of real tensors: eager, the region goes on
            got = reg.record_views(func, args, kwargs)  # views of a pending result
            if got is not None:
                if len(reg.nodes) >= self.batch:
                    self.flush("batch size")
                return got
        if reg.nodes:
            self.flush(_name(func), eager=_twice(func, args, kwargs))
        return PASS

    def _capture(
        self, reg: Region, func: Any, args: tuple, kwargs: dict | None, fast: Any = True
    ) -> Any:
        """A capturable call: its placeholder, or ``PASS`` (run eagerly, the open region
        first where the region cannot hold the call). ``fast``: False when ``reg._fast``
        has said ``_SLOW``; ``NOFLUSH`` or None when it has answered that."""
        opens = not reg.nodes
        got = reg.record(func, args, kwargs, fast) if fast is True or fast is False else fast
        if got is NOFLUSH:
            return PASS
        if got is None and reg.nodes:
            self.flush("grad mode" if reg.grad != _grad() else f"uncapturable {_name(func)}")
            reg = self.region
            got = reg.record(func, args, kwargs)  # it may start the next region
            opens = True
        if got is None or got is NOFLUSH:
            return PASS
        if opens:
            self._open()
        if len(reg.nodes) >= self.batch:
            self.flush("batch size")
        return got

    # -- sync -------------------------------------------------------------------------------
    def sync(self, what: str) -> None:
        """A pending ``gt.Tensor`` is read without an op (``to_local`` ...): run the region."""
        if not self.busy:
            self.flush(what)

    def flush(self, reason: str, eager: bool = False) -> None:
        """Run the open region (compiled, else eagerly; ``eager``: op by op) and fill its
        placeholders."""
        reg = self.region
        if not reg.nodes:
            return
        self.region = Region(self.min_numel)  # stale placeholders never match a new region
        self.busy = True
        plan = None
        try:
            st = self.stats
            st.ops_captured += reg.calls
            st.regions_seen += 1
            st.flushes[reason] += 1
            device_type = reg.device_type  # take() clears it
            plan = reg.take()
            if plan is None:
                st.dead += 1
                return
            graphs = self.graphs if plan.mesh is None else self.sharded
            with _as_recorded(device_type):
                fill(plan, graphs.run(plan, self.scopes[-1] if self.scopes else "batch", eager))
            plan = None
        finally:
            if plan is not None:  # the program's own error propagates: no result is kept
                _poison(plan)
            self.busy = False
            self._close()

    def _open(self) -> None:
        """A region holds ops: user-compiled functions run eagerly until it is filled
        (dynamo's ``force_eager`` stance)."""
        from torch._dynamo import eval_frame

        self._stance = eval_frame._stance
        # what torch.compiler.set_stance("force_eager") sets; it refuses while any dynamo
        # callback is set (a region opening in the eager part of a function the user compiled),
        # but the stance only decides how a compiled function's next call runs
        eval_frame._stance = eval_frame.DynamoStance("force_eager")

    def _close(self) -> None:
        st, self._stance = self._stance, None
        if st is not None:
            from torch._dynamo import eval_frame

            eval_frame._stance = st

    def snapshot(self) -> dict[str, Any]:
        got = self.stats.snapshot(len(self.graphs) + len(self.sharded))
        got["ops_captured"] += self.region.calls  # the open region's too
        return got


# where ``create_graph`` is among the positional arguments of the calls that differentiate
_CREATE_GRAPH_AT = {torch.autograd.grad: 4, torch.autograd.backward: 3, _Tensor.backward: 3}


def _twice(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether ``func`` is a backward with ``create_graph=True``: the region it ends then runs
    op by op. A compiled graph's backward is not differentiable again (AOTAutograd): its
    gradients would reach no input, and ``torch.autograd.functional.hessian`` and the like,
    which take an unreached input's gradient as zero, returned zeros where eager gives the
    Hessian (found by the autograd scenario sweep with both halves on). The same calls on
    every rank decide it alike."""
    at = _CREATE_GRAPH_AT.get(func)
    if at is None:
        return False
    if kwargs and "create_graph" in kwargs:
        return bool(kwargs["create_graph"])
    return len(args) > at and bool(args[at])


@contextlib.contextmanager
def _as_recorded(device_type: str) -> Iterator[None]:
    """The modes a region's calls were recorded in (``Region._admits``: never inference mode
    or autocast), for a region ended from inside one: ``c = b @ w`` under
    ``torch.autocast`` with ``b`` pending ran ``b``'s own calls in bfloat16 (``set_`` then
    raised), and under ``torch.inference_mode`` made ``b`` an inference tensor without
    history (its backward raised). Two reads when neither is on."""
    inference = torch.is_inference_mode_enabled()
    autocast = torch.is_autocast_enabled(device_type)
    if not (inference or autocast):
        yield
        return
    with contextlib.ExitStack() as stack:
        if inference:
            stack.enter_context(torch.inference_mode(False))
        if autocast:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _grad() -> bool:
    return torch.is_grad_enabled()


def _small(args: tuple, least: int) -> bool:
    """Whether every argument is a plain tensor of fewer than ``least`` elements or a
    number: such a call is never recorded in a new region (anything else: ``record``
    decides)."""
    for a in args:
        t = type(a)
        if t is _Tensor:
            if a.numel() >= least:
                return False
        elif t not in _SCALARS:
            return False
    return True


_APPLY = torch.autograd.Function.__dict__["apply"]  # torch's classmethod


def _function_apply(lazy: LazyPass | None) -> None:
    """While the hook is in, a custom ``torch.autograd.Function`` runs its pending inputs'
    region first. ``apply`` takes its inputs' autograd edges before ``forward`` runs, and no
    torch-function hook sees it: a placeholder that needs grad is a leaf until its region
    runs, so the Function's backward pointed at that leaf's gradient accumulator, gone once
    the region filled it (the backward aborted the process, 2026-11-30). One look at each
    argument per call; torch's own ``apply`` back when the hook goes."""
    if lazy is None:
        torch.autograd.Function.apply = _APPLY
        return
    run = _APPLY.__func__

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if lazy.region.nodes and not lazy.busy and _pending(args, kwargs):
            lazy.flush("autograd.Function")
        return run(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)


def _pending(args: tuple, kwargs: dict | None) -> bool:
    """Whether an argument is a placeholder (of any region: a stale one is filled first)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor) and "_gt_lazy" in a.__dict__:
            return True
    return False


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def _poison(plan: Any) -> None:
    """A region whose run raised: its float results hold NaN, never stale memory."""
    import torch

    with torch._C.DisableTorchFunction(), torch.no_grad():
        for v in plan.views:  # views of the outputs: NaN through their bases
            v.__dict__.pop("_gt_lazy", None)
        for p in plan.outputs:
            p.__dict__.pop("_gt_lazy", None)
            p = getattr(p, "_local_tensor", p)  # a sharded placeholder: its shard
            if p.dtype.is_floating_point or p.dtype.is_complex:
                p.fill_(float("nan"))
            else:
                p.zero_()
