"""The lazy regions' graphs: keyed, compiled once, run, capped, and eager when they fail.

A region's ``Plan`` is keyed by its structure (each op, where each of its inputs comes from, its
constants), the inputs' shapes, strides, dtypes, devices and ``requires_grad``, which results
are live, and grad mode: the key *is* the guard, so a graph only ever runs on what it was
compiled for. Ints and other constants are part of the key. A Python float argument of
add/sub/mul/div is baked in until its slot has seen two values; from then on it is a graph
input (a 0-d tensor), as dynamo's automatic dynamic does, so a changing learning rate or scale
costs one more compile, not one per value. The table of float slots seen is capped (LRU).

Compiling calls the backend (``inductor`` by default; ``GT_COMPILE_BACKEND``) on an FX graph of
the recorded calls, as dynamo would after tracing: AOTAutograd compiles forward and backward
together, so results that need grad get a ``grad_fn`` into the compiled backward. The cache
holds at most ``GT_LAZY_CACHE`` graphs (LRU) and at most ``GT_LAZY_REGION_GRAPHS`` per region
(its name: the scope's signal, or ``batch``); a region past its cap runs its new keys eagerly.

Never a wrong answer: a compile error runs the region eagerly (the same FX graph, op by op) and
keeps that key eager; a graph that raises while it runs is rerun eagerly with the same inputs
(an error eager raises too is the program's and propagates).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from typing import Any

import torch

from spmdgt.compile._backend import refuse_double_backward
from spmdgt.compile._plan import Plan
from spmdgt.compile._stats import first_line

__all__ = ["Graphs"]

_DYN = "dyn"
_EAGER = "eager"


class _Entry:
    __slots__ = ("fn", "gm", "ops", "region", "runs")

    def __init__(self, fn: Any, gm: Any, region: str, ops: int) -> None:
        self.fn = fn
        self.gm = gm
        self.region = region
        self.ops = ops
        self.runs = 0


class Graphs:
    """This rank's compiled regions (see the module docstring)."""

    def __init__(
        self, backend: Any, stats: Any, cap: int, per_region: int, keys_cap: int, note: Any
    ) -> None:
        self.backend = backend
        self.stats = stats
        self.cap = cap
        self.per_region = per_region
        self.keys_cap = keys_cap
        self._note = note
        self._cache: OrderedDict[Any, _Entry] = OrderedDict()
        self._per_region: Counter[str] = Counter()
        self._floats: OrderedDict[Any, list] = OrderedDict()

    def run(self, plan: Plan, region: str, eager: bool = False) -> Any:
        """The plan's results (a sequence, one per live placeholder). ``eager``: its FX graph
        op by op, nothing compiled or cached (a region whose results will be differentiated
        twice: ``LazyPass``)."""
        rng = plan.rng
        if rng is None:
            return self._eager(plan) if eager else self._run(plan, region)
        # the region's draws start from the state its first draw was recorded at, as eager's
        # did; if the program moved the generator since (``manual_seed``, which no hook sees),
        # eager's draws came before that and the program's state is kept
        now = rng.get_state()
        rng.set_state(plan.rng_state)
        try:
            return self._eager(plan) if eager else self._run(plan, region)
        finally:
            if not torch.equal(now, plan.rng_state):
                rng.set_state(now)

    def _eager(self, plan: Plan) -> Any:
        gm = _build(plan, (False,) * len(plan.floats))
        self.stats.eager_runs += 1
        with torch._C.DisableTorchFunction(), torch.set_grad_enabled(plan.grad), _layouts(plan):
            return gm(*plan.inputs)

    def _run(self, plan: Plan, region: str) -> Any:
        key, dyn = self._key(plan)
        st = self.stats
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            st.cache_hits += 1
        else:
            st.cache_misses += 1
            entry = self._compile(plan, dyn, key, region)
        args = list(plan.inputs)
        for v, dt, d in zip(plan.floats, plan.float_dtypes, dyn, strict=True):
            if d:
                args.append(torch.tensor(v, dtype=dt, device=plan.inputs[0].device))
        entry.runs += 1
        with torch._C.DisableTorchFunction(), torch.set_grad_enabled(plan.grad), _layouts(plan):
            if entry.fn is None:
                st.eager_runs += 1
                return entry.gm(*args)
            st.graph_runs += 1
            st.compiled_ops += entry.ops
            try:
                out = entry.fn(*args)
                return refuse_double_backward(out, lambda: f"lazy region {region!r}")
            except Exception as e:
                if plan.comm:
                    # the other ranks ran (or wait in) this graph's collectives: an eager
                    # rerun here alone would pair with the wrong ones
                    raise RuntimeError(
                        f"spmdgt lazy region {region!r}: its compiled graph, which moves data "
                        f"between ranks, failed on this rank ({type(e).__name__}: "
                        f"{first_line(e)}); it cannot be rerun eagerly on one rank. Run with "
                        "GT_COMPILE=0 to run it eagerly on every rank."
                    ) from e
                if plan.rng is not None:  # the rerun draws what the graph would have
                    plan.rng.set_state(plan.rng_state)
                out = entry.gm(*args)  # raises the program's own error if it is one
                entry.fn = None
                self._fallback(f"runtime error: {type(e).__name__}: {first_line(e)}", region)
                return out

    # -- keys -------------------------------------------------------------------------------
    def _key(self, plan: Plan) -> tuple[Any, tuple[bool, ...]]:
        seen = self._floats.get(plan.base)
        vals = [v.hex() for v in plan.floats]
        if seen is None:
            seen = list(vals)
            self._floats[plan.base] = seen
            if len(self._floats) > self.keys_cap:
                self._floats.popitem(last=False)
        else:
            self._floats.move_to_end(plan.base)
            for i, v in enumerate(vals):
                if seen[i] != _DYN and seen[i] != v:
                    seen[i] = _DYN
                    self.stats.dynamic_floats += 1
        dyn = tuple(s == _DYN for s in seen)
        return (plan.base, tuple(_DYN if d else v for d, v in zip(dyn, vals))), dyn

    # -- compile ----------------------------------------------------------------------------
    def _compile(self, plan: Plan, dyn: tuple[bool, ...], key: Any, region: str) -> _Entry:
        st = self.stats
        gm = _build(plan, dyn)
        t0 = time.perf_counter_ns()
        entry = _Entry(None, gm, region, plan.ops)
        if self._per_region[region] >= self.per_region:
            self._fallback(f"region graph cap ({self.per_region})", region)
        else:
            args = list(plan.inputs)
            for v, dt, d in zip(plan.floats, plan.float_dtypes, dyn, strict=True):
                if d:
                    args.append(torch.tensor(v, dtype=dt, device=plan.inputs[0].device))
            fn, error = None, None
            try:
                from torch._dynamo.backends.registry import lookup_backend

                from spmdgt.compile._backend import dead_collectives_dropped, eager_random

                with (
                    torch._C.DisableTorchFunction(),
                    _paused(),
                    eager_random(),
                    dead_collectives_dropped(),
                    torch.set_grad_enabled(plan.grad),
                    _layouts(plan),
                ):
                    fn = lookup_backend(self.backend)(gm, args)
            except Exception as e:
                error = f"compile error: {type(e).__name__}: {first_line(e)}"
            if plan.mesh is not None:
                # every rank compiles this key now (sharded keys are global): if any failed,
                # every rank runs it eagerly, as a graph's collectives may be ordered otherwise
                from spmdgt.runtime import _agree

                what = f"compile of lazy region {region} ({plan.ops} ops)"
                if _agree.any_rank(error is not None, what, region) and error is None:
                    fn, error = None, "another rank's compile failed"
            if error is None:
                entry = _Entry(fn, gm, region, plan.ops)
                st.compiled += 1
                self._per_region[region] += 1
                self._note(
                    f"region {region}: compiled {plan.ops} ops, {len(plan.outputs)} outputs "
                    f"in {(time.perf_counter_ns() - t0) * 1e-9:.2f}s"
                    + (" (sharded)" if plan.mesh is not None else "")
                )
            else:
                self._fallback(error, region)
        st.compile_ns += time.perf_counter_ns() - t0
        self._cache[key] = entry
        if len(self._cache) > self.cap:
            _, old = self._cache.popitem(last=False)
            if old.fn is not None:
                self._per_region[old.region] -= 1
            st.evictions += 1
        return entry

    def _fallback(self, reason: str, region: str) -> None:
        self.stats.fallbacks[reason] += 1
        self._note(f"region {region}: eager ({reason})")

    def clear(self) -> None:
        self._cache.clear()
        self._per_region.clear()
        self._floats.clear()

    def __len__(self) -> int:
        return sum(1 for e in self._cache.values() if e.fn is not None)


# Calls whose FX name does not resolve (``Tensor.__pow__`` is a wrapper FX names
# ``torch._tensor.pow``): the same call under a name the generated code can reach
_SPELLING = {torch.Tensor.__pow__: torch.Tensor.pow}


def _build(plan: Plan, dyn: tuple[bool, ...]) -> Any:
    """The FX graph of the plan: its inputs, then its dynamic floats, as placeholders."""
    import torch.fx as fx

    g = fx.Graph()
    ins = [g.placeholder(f"in{i}") for i in range(len(plan.inputs))]
    fls = [g.placeholder(f"f{i}") if d else None for i, d in enumerate(dyn)]
    vals: list[Any] = []

    def arg(d: tuple) -> Any:
        kind, v = d
        if kind == "L":
            return [arg(x) for x in v]
        if kind == "n":
            return vals[v]
        if kind == "i":
            return ins[v]
        if kind == "f":
            return fls[v] if fls[v] is not None else plan.floats[v]
        return v

    for func, a, k in plan.nodes:
        func = _SPELLING.get(func, func)
        vals.append(g.call_function(func, tuple(arg(d) for d in a), {n: arg(d) for n, d in k}))
    g.output(tuple(vals[i] for i in plan.base[2]))  # the live results, in node order
    return fx.GraphModule(torch.nn.Module(), g)


def _layouts(plan: Plan) -> Any:
    """A sharded plan runs with DTensor's implicit replication on, as ``gt.Tensor`` ops do."""
    if plan.mesh is None:
        return contextlib.nullcontext()
    from spmdgt.compile._sharded import implicit

    return implicit()


class _paused:
    """The interceptor records nothing while a graph compiles (its fake-tensor ops)."""

    def __enter__(self) -> None:
        from spmdgt.interceptor._mode import get_interceptor

        self._cm = get_interceptor().paused()
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
