"""The backend dynamo hands each graph of a hot function: the real one, counted and guarded.

``CountingBackend(name)`` compiles with torch's backend of that name (``inductor`` by default,
``aot_eager`` in tests) and wraps the compiled graph in a ``_Runner`` that counts runs and ops.
A compiled graph that raises at run time is rerun eagerly (the FX graph dynamo traced, same
inputs): if eager raises too, the error is the program's and propagates as it would without the
pass; if eager succeeds, its result is returned, the graph runs eagerly from then on and the
function falls back (``on_runtime_error``). So a compiler bug costs speed, never a wrong answer
or a crash that eager would not have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spmdgt.compile._stats import CompileStats, first_line

__all__ = ["CountingBackend"]

_OP_NODES = ("call_function", "call_method", "call_module")


class CountingBackend:
    """A dynamo backend: ``backend(gm, example_inputs) -> callable``; ``name`` is a registered
    backend's name or a backend callable."""

    def __init__(
        self,
        name: Any,
        stats: CompileStats,
        on_runtime_error: Callable[[Any, str], None],
    ) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.name = name
        self._real = lookup_backend(name)
        self._stats = stats
        self._on_runtime_error = on_runtime_error
        self.code: Any = None  # the hot code being compiled (set by the frame hook)

    def __call__(self, gm: Any, example_inputs: list) -> Callable[..., Any]:
        compiled = self._real(gm, example_inputs)
        ops = sum(1 for n in gm.graph.nodes if n.op in _OP_NODES)
        self._stats.graphs += 1
        self._stats.graph_ops += ops
        return _Runner(compiled, gm, ops, self.code, self)


class _Runner:
    """One compiled graph: counts runs (the first is the compile's, the rest are cache hits)
    and falls back to the traced graph on a run-time error that eager does not raise."""

    def __init__(self, compiled: Any, gm: Any, ops: int, code: Any, owner: CountingBackend):
        self._fn = compiled
        self._gm = gm
        self._ops = ops
        self._code = code
        self._owner = owner
        self._first = True

    def __call__(self, *args: Any) -> Any:
        st = self._owner._stats
        st.graph_runs += 1
        st.compiled_ops += self._ops
        if self._first:
            self._first = False
        else:
            st.cache_hits += 1
        try:
            return self._fn(*args)
        except Exception as e:
            if self._fn is self._gm:
                raise  # already eager: the program's own error
            t0 = time.perf_counter_ns()
            out = self._gm(*args)  # raises the program's error if it is one
            st.compile_ns += time.perf_counter_ns() - t0
            self._fn = self._gm
            reason = f"runtime error: {type(e).__name__}: {first_line(e)}"
            self._owner._on_runtime_error(self._code, reason)
            return out
