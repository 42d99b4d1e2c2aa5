"""Counters over the op stream: GT's worker stats, hot-path detection, and the tape.

``StatsSink`` counts every event (by op and kind, time per kind, collectives and their bytes)
and keeps the last ``tape_size`` events (the tape). At the native level the counters are kept in
C++ instead (``NativeCounters``, on whenever the observer is), and a ``StatsSink`` runs beside
them only for hot paths and the tape. ``HotPathDetector`` finds repeated op
sequences with GT's knobs (``GT_HOTPATH_WINDOW=20``, ``GT_HOTPATH_MIN_SEQ=3``,
``GT_HOTPATH_THRESHOLD=10``); the compile-and-batch pass will read the same detector.

Hot-path semantics (documented because GT never wrote them down): the detector watches the
level-0 op names. When an op repeats within the last ``window`` ops, the ops since its previous
occurrence form a candidate period; a period shorter than ``min_seq`` is repeated until it is at
least ``min_seq`` long (``mul add`` -> ``mul add mul add``). Each completed period counts one
occurrence of that sequence. A sequence seen ``threshold`` times is hot; ``hot_instructions``
counts the ops in occurrences of hot sequences (from the occurrence that made it hot on).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from spmdgt._core import env as _env
from spmdgt.interceptor._events import COLLECTIVE_KINDS, OpEvent

__all__ = ["HotPathDetector", "NativeCounters", "StatsSink"]


class HotPathDetector:
    """Counts repeated op sequences in a stream of op names (see module docstring)."""

    def __init__(
        self, window: int | None = None, min_seq: int | None = None, threshold: int | None = None
    ) -> None:
        self.window = window if window is not None else _env.integer("GT_HOTPATH_WINDOW")
        self.min_seq = min_seq if min_seq is not None else _env.integer("GT_HOTPATH_MIN_SEQ")
        self.threshold = (
            threshold if threshold is not None else _env.integer("GT_HOTPATH_THRESHOLD")
        )
        if self.min_seq < 1 or self.window < self.min_seq or self.threshold < 1:
            raise ValueError(
                f"hot-path settings need 1 <= min_seq <= window and threshold >= 1, got "
                f"window={self.window} min_seq={self.min_seq} threshold={self.threshold}"
            )
        self.total = 0
        self.hot_instructions = 0
        self.counts: Counter[tuple[str, ...]] = Counter()
        self._recent: deque[str] = deque(maxlen=self.window)
        self._last_pos: dict[str, int] = {}
        self._since_boundary = 0  # ops since the last counted occurrence ended

    def feed(self, names: list[str]) -> None:
        """Consume op names in order."""
        recent, last_pos, counts = self._recent, self._last_pos, self.counts
        window, min_seq, threshold = self.window, self.min_seq, self.threshold
        for name in names:
            pos = self.total
            self.total += 1
            recent.append(name)
            self._since_boundary += 1
            prev = last_pos.get(name)
            last_pos[name] = pos
            if prev is None:
                continue
            period = pos - prev
            length = period * -(-min_seq // period)  # smallest multiple of period >= min_seq
            if length > window or length > len(recent) or self._since_boundary < length:
                continue
            seq = tuple(recent)[-length:]
            n = counts[seq] + 1
            counts[seq] = n
            self._since_boundary = 0
            if n >= threshold:
                self.hot_instructions += length

    def prune(self, keep: int = 10_000) -> None:
        """Bound memory: keep the ``keep`` most frequent sequences."""
        if len(self.counts) > 2 * keep:
            self.counts = Counter(dict(self.counts.most_common(keep)))

    def summary(self, top: int = 5) -> dict[str, Any]:
        hot = [(s, n) for s, n in self.counts.items() if n >= self.threshold]
        hot.sort(key=lambda x: -x[1])
        return {
            "total_instructions": self.total,
            "hot_instructions": self.hot_instructions,
            "unique_sequences": len(self.counts),
            "hot_sequences": len(hot),
            "top_sequences": [{"ops": list(s), "count": n} for s, n in hot[:top]],
        }


class StatsSink:
    """Per-rank counters plus the tape (the last ``tape_size`` events)."""

    def __init__(self, tape_size: int = 1000, hotpath: bool = True) -> None:
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.time_ns_by_kind: Counter[str] = Counter()
        self.count_by_kind: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.collective_bytes = 0
        self.by_group: Counter[str] = Counter()  # collectives per mesh dim (``OpEvent.group``)
        self.bytes_by_group: Counter[str] = Counter()
        self.collective_ns = 0
        self.busy_ns = 0  # time inside level-0 ops (children are inside their parent)
        self.first_ns: int | None = None
        self.last_ns = 0
        self.tape: deque[OpEvent] = deque(maxlen=tape_size)
        self.hotpath = HotPathDetector() if hotpath else None
        self._child_comm_ns = 0

    def on_events(self, events: list[OpEvent]) -> None:
        self.total += len(events)
        self.tape.extend(events)
        if self.first_ns is None and events:
            self.first_ns = events[0].t0_ns
        top_names = []
        collective = COLLECTIVE_KINDS  # comm and wait: communication time (``_events``)
        for e in events:
            self.by_op[e.op] += 1
            kind = e.kind
            self.count_by_kind[kind] += 1
            if kind in collective:
                if kind == "comm":
                    self.collectives[e.op] += 1
                    self.collective_bytes += e.nbytes
                    group = e.group or "-"
                    self.by_group[group] += 1
                    self.bytes_by_group[group] += e.nbytes
                self.collective_ns += e.dur_ns
            if e.level == 0:
                top_names.append(e.op)
                self.busy_ns += e.dur_ns
                # a DTensor op's time minus the collectives inside it is its own kind's time
                self.time_ns_by_kind[kind] += e.dur_ns - self._child_comm_ns
                self.time_ns_by_kind["comm"] += self._child_comm_ns
                self._child_comm_ns = 0
            elif kind in collective:
                self._child_comm_ns += e.dur_ns
            end = e.t0_ns + e.dur_ns
            if end > self.last_ns:
                self.last_ns = end
        if self.hotpath is not None:
            self.hotpath.feed(top_names)
            self.hotpath.prune()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def snapshot(self, rank: int) -> dict[str, Any]:
        """GT's ``get_worker_stats`` entry for this rank, plus spmdgt's collective counters."""
        return _entry(self, rank, self.hotpath, self.total)


def _entry(c: Any, rank: int, hotpath: HotPathDetector | None, top_level: int) -> dict[str, Any]:
    """A ``get_worker_stats`` entry from counters ``c`` (``StatsSink`` or ``NativeCounters``)."""
    hp = (
        hotpath.summary()
        if hotpath is not None
        else HotPathDetector().summary() | {"total_instructions": top_level}
    )
    return {
        "rank": rank,
        "operations": {"total": c.total, "compiled": 0, "eager": c.total},
        "hotpath": hp,
        "hotpath_enabled": hotpath is not None,
        "compilation": {"cache_size": 0, "cache_hits": 0, "cache_misses": 0, "hit_rate": 0.0},
        "collectives": {
            "total": sum(c.collectives.values()),
            "bytes": c.collective_bytes,
            "time_s": c.collective_ns * 1e-9,
            "by_op": dict(c.collectives),
            # per mesh dim (``tp``, ``dp_shard``, ``world``...); empty at the native level
            "by_group": dict(getattr(c, "by_group", {})),
            "bytes_by_group": dict(getattr(c, "bytes_by_group", {})),
        },
        "by_kind": dict(c.count_by_kind),
        "time_s_by_kind": {k: v * 1e-9 for k, v in c.time_ns_by_kind.items()},
        "top_ops": c.by_op.most_common(10),
    }


class NativeCounters:
    """The same counters, kept in C++ by the native observer for every record (a few adds per
    op, no Python), read when asked and re-read only when they have moved. Hot paths and the
    tape need every record in Python: they come from an optional ``StatsSink`` (``events``)
    beside it, attached with ``GT_STATS=1``.
    """

    native = True  # needs no Python events (see Interceptor._sync_keep)
    _FIELDS = frozenset(
        [
            "total",
            "busy_ns",
            "first_ns",
            "last_ns",
            "by_op",
            "count_by_kind",
            "time_ns_by_kind",
            "collectives",
            "collective_bytes",
            "collective_ns",
            "top_level",
        ]
    )

    def __init__(self, ext: Any, events: StatsSink | None = None) -> None:
        self._ext = ext
        self.events = events
        self._c: dict[str, Any] = {}
        self._seen = -1

    def __getattr__(self, name: str) -> Any:
        if name in NativeCounters._FIELDS:  # StatsSink's attribute names, read from C++
            if self._ext.counts()[0] != self._seen:
                self._read()
            return self._c[name]
        raise AttributeError(name)

    @property
    def tape(self) -> deque[OpEvent]:
        return self.events.tape if self.events is not None else deque()

    def _read(self) -> None:
        total, busy, child_comm, first, last, _dropped, rows = self._ext.counters()
        by_op: Counter[str] = Counter()
        by_kind: Counter[str] = Counter()
        time_by_kind: Counter[str] = Counter()
        collectives: Counter[str] = Counter()
        nbytes_total = comm_ns = top_level = 0
        for op, kind, count, count0, dur, own0, nbytes in rows:
            by_op[op] += count
            by_kind[kind] += count
            top_level += count0
            if own0:
                time_by_kind[kind] += own0
            if kind == "comm":
                collectives[op] += count
                nbytes_total += nbytes
            if kind in COLLECTIVE_KINDS:
                comm_ns += dur
        if child_comm:
            time_by_kind["comm"] += child_comm
        self._seen = total
        self._c = {
            "total": total,
            "busy_ns": busy,
            "first_ns": first if first >= 0 else None,
            "last_ns": last,
            "by_op": by_op,
            "count_by_kind": by_kind,
            "time_ns_by_kind": time_by_kind,
            "collectives": collectives,
            "collective_bytes": nbytes_total,
            "collective_ns": comm_ns,
            "top_level": top_level,
        }

    def on_events(self, events: list[OpEvent]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def snapshot(self, rank: int) -> dict[str, Any]:
        hotpath = self.events.hotpath if self.events is not None else None
        return _entry(self, rank, hotpath, self.top_level)
