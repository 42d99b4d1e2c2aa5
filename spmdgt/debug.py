"""``gt.debug``: what this job's ranks are doing, from the interceptor's op stream.

    import spmdgt as gt
    gt.debug.enable()                   # or any GT_* tool variable at launch
    ... run the workload ...
    gt.debug.print_worker_stats()       # every rank must call it (it is a collective)
    gt.debug.print_tape(20)             # last ops of this rank

Counters only count while the interceptor is on (``enable()``, ``GT_INSTRUCTION_LOG``,
``GT_RUN_DIR``, ``GT_DEBUG_WORKER``...). With it off, stats report zero ops and say so in
``"interceptor": "off"``. ``compiled``/``compilation`` stay 0 unless the compile pass
(``spmdgt.compile``, ``GT_AUTO_COMPILE=1``) registers its counters with
``set_compilation_stats_provider``; its fields are described in ``spmdgt/compile/_stats.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from spmdgt.interceptor import disable, enable, is_enabled
from spmdgt.interceptor._profile import profile

__all__ = [
    "disable",
    "enable",
    "get_tape",
    "get_worker_stats",
    "is_enabled",
    "print_tape",
    "print_worker_stats",
    "profile",
    "set_compilation_stats_provider",
]

_compilation_provider: Callable[[], dict[str, Any]] | None = None


def set_compilation_stats_provider(fn: Callable[[], dict[str, Any]] | None) -> None:
    """Let the compile pass report its counters (None: no pass).

    ``fn()`` returns ``spmdgt.compile._stats.CompileStats.snapshot()``'s dict: it becomes the
    entry's ``compilation`` (plus ``hit_rate``), and its ``compiled_ops`` the entry's
    ``operations.compiled``.
    """
    global _compilation_provider
    _compilation_provider = fn


def _local_stats() -> dict[str, Any]:
    from spmdgt.interceptor import _control
    from spmdgt.interceptor._mode import env_rank, get_interceptor
    from spmdgt.interceptor._stats import StatsSink

    rank, _ = env_rank()
    st = _control.tool("stats")
    if st is not None:
        get_interceptor().drain()
    entry = (st if st is not None else StatsSink(tape_size=1)).snapshot(rank)
    entry["interceptor"] = "on" if is_enabled() else "off"
    # Counters run only when asked (GT_STATS=1, gt.debug.enable(stats=True), top, debug lines):
    # say so rather than let zeros pass for a quiet rank.
    entry["stats_enabled"] = st is not None
    # Exact fallbacks (spmdgt.tensor._fallback); the module is loaded only once a sharded
    # tensor exists, so a world of one reads an empty dict without importing DTensor.
    fallback = sys.modules.get("spmdgt.tensor._fallback")
    entry["fallbacks"] = dict(fallback.counts) if fallback is not None else {}
    # The dispatch fast path's cache (spmdgt.tensor._fastpath): hits, misses, evictions and
    # keys found not cacheable, this rank's (keys are alike on every rank).
    fastpath = sys.modules.get("spmdgt.tensor._fastpath")
    entry["fastpath"] = (
        dict(fastpath.counts)
        if fastpath is not None
        else {"hits": 0, "misses": 0, "evictions": 0, "uncacheable": 0}
    )
    # Ops whose DTensor rule spmdgt replaced by an exact rewrite or decomposition (_hook), by
    # aten op: the ``rewrite`` path of ``spmdgt.tensor._paths``
    hook = sys.modules.get("spmdgt.tensor._hook")
    entry["rewrites"] = dict(hook.counts) if hook is not None else {}
    # rows @ rows products whose second operand was gathered (spmdgt.tensor._contract):
    # ``direct`` ran on the local tensors, ``gathered`` through DTensor's Shard(0) @ Replicate
    contract = sys.modules.get("spmdgt.tensor._contract")
    entry["rows_at_rows"] = (
        dict(contract.counts) if contract is not None else {"direct": 0, "gathered": 0}
    )
    if _compilation_provider is not None:
        c = dict(_compilation_provider())
        compiled = int(c.get("compiled_ops", 0))
        # recorded ops ran eagerly (or launched a compiled graph's kernels); compiled ops are
        # the op nodes of the pass's graphs times their runs
        entry["operations"]["compiled"] = compiled
        entry["operations"]["eager"] = entry["operations"]["total"]
        entry["operations"]["total"] += compiled
        hits, misses = int(c.get("cache_hits", 0)), int(c.get("cache_misses", 0))
        c["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
        entry["compilation"] = c
    return entry


def get_worker_stats() -> dict[int, dict[str, Any]]:
    """One stats dict per rank, keyed by rank as GT's was (``stats[0]``), with GT's fields plus
    collective counters, ``fallbacks`` (ops spmdgt ran on gathered global values, by op),
    ``rewrites`` (ops whose DTensor rule spmdgt replaced by an exact rewrite, by aten op),
    ``fastpath`` (the dispatch fast path's cache: hits, misses, evictions, uncacheable keys)
    and ``rows_at_rows`` (row-sharded products run by gathering the second operand).
    Which path single ops took: ``spmdgt.tensor._paths.watch()``.

    Collective when the world has more than one rank: every rank must call it, in the same order
    relative to other collectives (it does an object all-gather), or the job hangs.
    """
    import torch.distributed as dist

    entry = _local_stats()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        was = is_enabled()
        # the gather's own ops are bookkeeping, not the user's: keep them out of the stream
        from spmdgt.interceptor._mode import get_interceptor

        ic = get_interceptor()
        if was:
            ic.stop(close_sinks=False)
        try:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, entry)
        finally:
            if was:
                ic.start(ic.level)
        return dict(enumerate(out))
    return {0: entry}


def print_worker_stats() -> None:
    """Print ``get_worker_stats()`` as a table on rank 0 (a collective, like it)."""
    stats = get_worker_stats()
    from spmdgt.interceptor._mode import env_rank

    if env_rank()[0] != 0:
        return
    print(format_worker_stats(stats))


def format_worker_stats(stats: dict[int, dict[str, Any]]) -> str:
    """The table ``print_worker_stats`` prints."""
    lines = [
        f"{'rank':>4} {'ops':>9} {'compiled':>8} {'hot':>9} {'seqs':>6} {'hotseq':>6} "
        f"{'colls':>6} {'coll MB':>9} {'coll s':>8} {'hit%':>5}"
    ]
    for s in stats.values():
        op, hp, c, cm = s["operations"], s["hotpath"], s["collectives"], s["compilation"]
        lines.append(
            f"{s['rank']:>4} {op['total']:>9} {op['compiled']:>8} {hp['hot_instructions']:>9} "
            f"{hp['unique_sequences']:>6} {hp['hot_sequences']:>6} {c['total']:>6} "
            f"{c['bytes'] / 1e6:>9.3f} {c['time_s']:>8.4f} {100 * cm['hit_rate']:>5.1f}"
        )
        for seq in hp["top_sequences"][:3]:
            lines.append(f"       hot x{seq['count']}: {' '.join(seq['ops'])}")
    if stats and next(iter(stats.values())).get("interceptor") == "off":
        lines.append("(interceptor off: enable it with gt.debug.enable() or a GT_* variable)")
    return "\n".join(lines)


def get_tape(n: int | None = None) -> list[Any]:
    """This rank's most recent op events (``OpEvent``), oldest first; at most ``n``."""
    from spmdgt.interceptor import _control
    from spmdgt.interceptor._mode import get_interceptor

    st = _control.tool("stats")
    if st is None:
        return []
    get_interceptor().drain()
    tape = list(st.tape)
    return tape[-n:] if n else tape


def print_tape(n: int = 50) -> None:
    """Print the last ``n`` op events of this rank in the instruction-log format."""
    from spmdgt.interceptor._instruction_log import format_events
    from spmdgt.interceptor._mode import env_rank, get_interceptor

    tape = get_tape(n)
    print(format_events(tape, env_rank()[0], get_interceptor().origin_ns), end="")
