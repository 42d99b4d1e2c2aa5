"""The run folder: what ranks publish for ``scripts.top``; trace requests from ``scripts.trace``.

Layout of ``GT_RUN_DIR`` (any folder every rank and the tools can see):

    rank<r>.json          this rank's status, rewritten atomically about once a second:
                          cumulative counters and the last interval's rates and time shares
    trace_request.json    written by ``scripts.trace``: {"id", "seconds", "dir"}; each rank picks
                          it up on its next tick and records that many seconds of events
    <dir>/trace_<id>.rank<r>.log   the captured window, in the instruction-log format

Publishing happens on the interceptor's ~1 s tick (one ``os.replace`` and one ``os.stat`` per
second), never per op. A rank that runs no op does not tick: ``top`` shows how old each status is.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from spmdgt.interceptor._events import OpEvent
from spmdgt.interceptor._instruction_log import _Formatter, header
from spmdgt.interceptor._stats import StatsSink

__all__ = ["RunDirPublisher", "TraceSink", "status_path", "write_json_atomic"]

TRACE_REQUEST = "trace_request.json"


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.json")


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON so readers never see half a file (tmp file + ``os.replace``)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class TraceSink:
    """Records the events of one time window into a trace file, then detaches itself."""

    def __init__(self, ic: Any, path: str, seconds: float, rank: int, world: int) -> None:
        self.ic = ic
        self.path = path
        self.end_ns = time.perf_counter_ns() + int(seconds * 1e9)
        self.start_ns = time.perf_counter_ns()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._tmp = f"{path}.partial"
        self._file: Any = open(self._tmp, "w")  # noqa: SIM115
        self._file.write(header(rank, world, ic.origin_unix_ns, ic.level))
        self._fmt = _Formatter(rank, ic.origin_ns)
        self.done = False

    def on_events(self, events: list[OpEvent]) -> None:
        if self.done:
            return
        keep = [e for e in events if self.start_ns <= e.t0_ns <= self.end_ns]
        if keep:
            self._file.write(self._fmt.lines(keep))
        if events and events[-1].t0_ns > self.end_ns:
            self.close()

    def flush(self) -> None:
        if not self.done and time.perf_counter_ns() > self.end_ns:
            self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._file.close()
            os.replace(self._tmp, self.path)


class RunDirPublisher:
    """Publishes ``rank<r>.json`` each tick and starts traces that ``scripts.trace`` requests."""

    def __init__(self, ic: Any, stats: StatsSink, run_dir: str, rank: int, world: int) -> None:
        self.ic, self.stats, self.run_dir = ic, stats, run_dir
        self.rank, self.world = rank, world
        os.makedirs(run_dir, exist_ok=True)
        self.path = status_path(run_dir, rank)
        self._last = (time.time(), 0, 0, 0, dict(stats.time_ns_by_kind))
        # A request still inside its window when this rank starts is taken on the first tick
        # (ranks start at different moments); an expired one is history.
        req = os.path.join(run_dir, TRACE_REQUEST)
        self._request_mtime = 0.0 if self._request_live(req) else self._mtime(req)
        self._trace: TraceSink | None = None
        self.start_unix = time.time()
        self.publish()

    @staticmethod
    def _mtime(path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return 0.0

    @classmethod
    def _request_live(cls, path: str) -> bool:
        mtime = cls._mtime(path)
        if not mtime:
            return False
        try:
            with open(path) as f:
                seconds = float(json.load(f)["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return time.time() < mtime + seconds

    def publish(self) -> None:
        """Write this rank's status: totals, and rates/time shares since the last publish."""
        s = self.stats
        now = time.time()
        t_last, ops_last, busy_last, coll_last, kinds_last = self._last
        interval = max(now - t_last, 1e-6)
        ops = s.total
        coll = sum(s.collectives.values())
        shares = {
            k: (v - kinds_last.get(k, 0)) * 1e-9 / interval
            for k, v in s.time_ns_by_kind.items()
            if v - kinds_last.get(k, 0) > 0
        }
        busy = min((s.busy_ns - busy_last) * 1e-9 / interval, 1.0)
        status = {
            "rank": self.rank,
            "world": self.world,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_unix": self.start_unix,
            "updated_unix": now,
            "interval_s": interval,
            "ops_total": ops,
            "ops_per_s": (ops - ops_last) / interval,
            "busy_frac": busy,
            "idle_frac": max(0.0, 1.0 - busy),
            "time_share": shares,
            "collectives_total": coll,
            "collectives_per_s": (coll - coll_last) / interval,
            "collective_bytes": s.collective_bytes,
            "phase": self.ic.phase,
            "level": self.ic.level,
        }
        write_json_atomic(self.path, status)
        self._last = (now, ops, s.busy_ns, coll, dict(s.time_ns_by_kind))

    def tick(self) -> None:
        self.publish()
        req = os.path.join(self.run_dir, TRACE_REQUEST)
        mtime = self._mtime(req)
        if mtime and mtime != self._request_mtime:
            self._request_mtime = mtime
            try:
                with open(req) as f:
                    r = json.load(f)
                self.start_trace(str(r["id"]), float(r["seconds"]), str(r["dir"]))
            except (OSError, ValueError, KeyError):
                pass  # a half-written or foreign request: the next tick retries on a new mtime
        if self._trace is not None and self._trace.done:
            self.ic.remove_sink(self._trace)
            self._trace = None

    def start_trace(self, trace_id: str, seconds: float, out_dir: str) -> str:
        """Record the next ``seconds`` of this rank's events to ``out_dir``; returns the path."""
        if self._trace is not None:
            self._trace.close()
            self.ic.remove_sink(self._trace)
        path = os.path.join(out_dir, f"trace_{trace_id}.rank{self.rank}.log")
        self._trace = TraceSink(self.ic, path, seconds, self.rank, self.world)
        self.ic.add_sink(self._trace)
        return path

    def close(self) -> None:
        self.publish()
        if self._trace is not None:
            self._trace.close()
