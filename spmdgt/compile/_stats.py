"""The pass's counters, as ``gt.debug.get_worker_stats()[rank]["compilation"]`` reports them.

Units, since a frame and a graph are not the same thing: dynamo compiles a *frame* (one call of
a hot function, or of a resume function after a graph break) into one or more *graphs*.

- ``functions_seen``: user code objects the sampler attributed ops to; ``hot``: those that
  reached the threshold and were handed to dynamo; ``compiled``: hot functions with at least
  one successful frame compile; ``skipped``: hot codes not compiled, by reason (module-level
  code, generators, functions the user compiled).
- ``cache_misses``: frame compiles (no cached entry's guards held: the first call, or a
  recompile); ``recompiles``: the misses of a frame that already had an entry.
- ``cache_hits``: runs of a compiled graph after its first; ``cache_size``: graphs compiled.
- ``fallbacks``: frames or graphs sent back to eager, by reason; ``compile_time_s``: time in
  dynamo and the backend, agreement included.
- ``compiled_ops``: op nodes of the compiled graphs times their runs (the ops that ran compiled;
  ``operations.compiled`` of the stats entry).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["CompileStats"]


class CompileStats:
    """Counters of one pass session (see the module docstring for each one's unit)."""

    def __init__(self) -> None:
        self.hot = 0
        self.compiled_codes: set[Any] = set()
        self.skipped: Counter[str] = Counter()
        self.cache_misses = 0
        self.recompiles = 0
        self.cache_hits = 0
        self.graphs = 0
        self.graph_ops = 0
        self.graph_runs = 0
        self.compiled_ops = 0
        self.fallbacks: Counter[str] = Counter()
        self.compile_ns = 0

    def snapshot(self, functions_seen: int) -> dict[str, Any]:
        """A plain dict (picklable: ``get_worker_stats`` gathers it)."""
        return {
            "functions_seen": functions_seen,
            "hot": self.hot,
            "compiled": len(self.compiled_codes),
            "skipped": dict(self.skipped),
            "cache_size": self.graphs,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "recompiles": self.recompiles,
            "fallbacks": dict(self.fallbacks),
            "compile_time_s": self.compile_ns * 1e-9,
            "graph_runs": self.graph_runs,
            "compiled_ops": self.compiled_ops,
        }
