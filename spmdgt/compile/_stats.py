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

__all__ = ["CompileStats", "RegionStats", "first_line"]


def first_line(e: BaseException | None) -> str:
    """An error's first line, cut at 160 characters: a fallback reason's tail (the counters
    are keyed by reason, so a long message must not make each key unique)."""
    lines = str(e).strip().splitlines() if e is not None else []
    return lines[0][:160] if lines else ""


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


class RegionStats:
    """Counters of lazy regions, the lazy regions (``compilation["regions"]``).

    - ``regions_seen``: regions that reached a sync point with ops recorded; ``dead``: those
      whose results were all dropped by the program (nothing ran); ``ops_captured``: calls
      recorded; ``flushes``: sync points that ended a region, by reason (``item``, ``numpy``,
      ``__bool__`` ... the call that needed a value, ``batch size``, ``scope end``, ``grad
      mode``, ``scope change``);
    - ``compiled``: graphs compiled; ``cache_size``: graphs held now; ``cache_hits`` /
      ``cache_misses``: regions whose key was / was not in the cache; ``evictions``: graphs
      dropped by the LRU cap; ``dynamic_floats``: float slots turned into graph inputs;
    - ``graph_runs`` / ``compiled_ops``: runs of compiled graphs and their op nodes times runs;
      ``eager_runs``: regions run eagerly (a fallback or a cap); ``fallbacks``: by reason
      (``compile error: ...``, ``runtime error: ...``, ``region graph cap (n)``, ``another
      rank's compile failed``); ``compile_time_s``.
    """

    def __init__(self) -> None:
        self.regions_seen = 0
        self.dead = 0
        self.ops_captured = 0
        self.flushes: Counter[str] = Counter()
        self.compiled = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.evictions = 0
        self.dynamic_floats = 0
        self.graph_runs = 0
        self.compiled_ops = 0
        self.eager_runs = 0
        self.fallbacks: Counter[str] = Counter()
        self.compile_ns = 0

    def snapshot(self, cache_size: int) -> dict[str, Any]:
        """A plain dict (picklable)."""
        return {
            "regions_seen": self.regions_seen,
            "dead": self.dead,
            "ops_captured": self.ops_captured,
            "flushes": dict(self.flushes),
            "compiled": self.compiled,
            "cache_size": cache_size,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "evictions": self.evictions,
            "dynamic_floats": self.dynamic_floats,
            "graph_runs": self.graph_runs,
            "compiled_ops": self.compiled_ops,
            "eager_runs": self.eager_runs,
            "fallbacks": dict(self.fallbacks),
            "compile_time_s": self.compile_ns * 1e-9,
        }
