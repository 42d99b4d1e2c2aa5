"""TensorBoard profiling: ``torch.profiler`` with one trace per rank, plus scalar summaries.

    with spmdgt.debug.profile("runs/prof") as prof:    # gt.profile(...) is the same
        for step in range(10):
            train_step()
            prof.step()                                 # optional: per-step scalars

Each rank writes ``<logdir>/rank<r>.<pid>.<ts>.pt.trace.json`` via ``tensorboard_trace_handler``
(open with ``tensorboard --logdir <logdir>``, PyTorch Profiler tab, or in Perfetto), and rank r
writes scalars under ``<logdir>/scalars/rank<r>``: ops/s, collective time and count, busy
fraction, and memory (CUDA max allocated, or CPU RSS). The op counts come from the interceptor,
which ``profile`` turns on for its duration if it was off (at the native level when it builds:
its C++ counters cost least and count what the profiler records, every ATen op).

Bounded: torch.profiler keeps every event in memory until the trace is written at the end, so a
long run (``GT_PROFILE`` profiles the whole run) grew without limit, ~190 MB per rank in 25 s of
small ops. ``max_mb`` (default ``GT_PROFILE_MAX_MB``, 200 MB: what TensorBoard's trace viewer
and Perfetto still open) caps the trace: when the ops recorded since the start reach
``max_mb / ~430 B`` (the measured size of one op event with shapes, torch 2.13), collection
stops (``toggle_collection_dynamic``; the profiler keeps running, so its ranges stay closed),
one rank-prefixed line says so, and the trace of the run up to there is written as usual. The
first minutes of a run are what a profile is for; ``0`` turns the cap off. The count is the
interceptor's, which at the native level is what the profiler records (the trace of a 0.05 MB
cap came out 0.051 MB). The Python levels count fewer events than the profiler records (torch:
one torch call is several ATen ops, ~4x in an MLP step; aten: the profiler also records each
op's re-entry from the dispatch mode, ~3x), so there the trace passes the cap by that factor.
"""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any

from spmdgt._core import env as _env

__all__ = ["BYTES_PER_EVENT", "DEFAULT_MAX_MB", "profile"]

DEFAULT_MAX_MB = 200.0
# Trace bytes per recorded op (record_shapes=True), measured on torch 2.13: 410-432 B for a small
# MLP's training steps (AdamW) and for ``c = c*b + a``; the profiler's events are the ATen ops
# the native observer counts (12,703 trace events for 12,052 counted ops in that MLP run).
BYTES_PER_EVENT = 430


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class profile:  # named like torch.profiler.profile, which it wraps
    """Profile a region to TensorBoard: per-rank Chrome traces and scalar summaries.

    ``max_mb``: the trace's size cap in MB (default ``GT_PROFILE_MAX_MB`` or 200; 0: none);
    past it collection stops and ``capped`` turns True (module docstring).
    """

    def __init__(
        self,
        logdir: str = "runs/profile",
        *,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
        scalars: bool = True,
        max_mb: float | None = None,
    ) -> None:
        from spmdgt.interceptor._instruction_log import _env_mb

        self.logdir = logdir
        self.max_bytes = (
            _env_mb("GT_PROFILE_MAX_MB") if max_mb is None else _env_mb_value("max_mb", max_mb)
        )
        self.capped = False
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.scalars = scalars
        self.step_num = 0
        self._prof: Any = None
        self._writer: Any = None
        self._enabled_interceptor = False
        self._level_before = "torch"
        self._last: tuple[float, int, int, int] = (0.0, 0, 0, 0)

    def __enter__(self) -> profile:
        import torch
        from torch.profiler import ProfilerActivity, tensorboard_trace_handler

        from spmdgt.interceptor import _control
        from spmdgt.interceptor._mode import env_rank, get_interceptor

        self.rank, self.world = env_rank()
        if not _control.is_enabled():
            from spmdgt.interceptor import _native

            # the C++ counters: cheapest, and they count what the profiler records
            native = _env.text("GT_INTERCEPT") is None and _native.available()
            self._level_before = get_interceptor().level
            _control.enable(stats=not native, level="native" if native else None)
            self._enabled_interceptor = True
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        os.makedirs(self.logdir, exist_ok=True)
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            on_trace_ready=tensorboard_trace_handler(self.logdir, worker_name=f"rank{self.rank}"),
        )
        self._prof.__enter__()
        if self.max_bytes:
            ic = get_interceptor()
            self._start_ops = ic.recorded()
            cap_ops = max(self.max_bytes // BYTES_PER_EVENT, 1)
            ic.set_alarm(self._start_ops + cap_ops, self._cap)
        if self.scalars:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.logdir, "scalars", f"rank{self.rank}"))
        self._last = self._counters()
        return self

    def _cap(self) -> None:
        """The alarm: stop collecting (the trace so far is still written at exit), say so once."""
        if self._prof is None or self.capped:
            return
        from torch.profiler import ProfilerActivity

        from spmdgt._core import debuglog as _debuglog
        from spmdgt.interceptor._mode import get_interceptor

        # every activity at once: toggling CPU alone makes torch warn about GPU tracks
        self._prof.toggle_collection_dynamic(
            False, [ProfilerActivity.CPU, ProfilerActivity.CUDA, ProfilerActivity.XPU]
        )
        self.capped = True
        ops = get_interceptor().recorded() - self._start_ops
        _debuglog.notice(
            "profile",
            f"profile reached ~{self.max_bytes / 1e6:g} MB ({ops} ops, cap GT_PROFILE_MAX_MB): "
            f"stopped recording; the trace up to here is written to {self.logdir} at the end",
        )

    def _counters(self) -> tuple[float, int, int, int]:
        from spmdgt.interceptor import _control

        st = _control.tool("stats")
        if st is None:
            return (time.perf_counter(), 0, 0, 0)
        from spmdgt.interceptor._mode import get_interceptor

        get_interceptor().drain()
        return (time.perf_counter(), st.total, st.collective_ns, st.busy_ns)

    def step(self) -> None:
        """Mark a step: writes this step's scalars (ops/s, collective time, busy, memory)."""
        self.step_num += 1
        if self._writer is None:
            return
        import torch

        now = self._counters()
        dt = max(now[0] - self._last[0], 1e-9)
        w, s = self._writer, self.step_num
        w.add_scalar("spmdgt/ops_per_s", (now[1] - self._last[1]) / dt, s)
        w.add_scalar("spmdgt/collective_time_s", (now[2] - self._last[2]) * 1e-9, s)
        w.add_scalar("spmdgt/busy_frac", min((now[3] - self._last[3]) * 1e-9 / dt, 1.0), s)
        w.add_scalar("spmdgt/step_time_s", dt, s)
        if torch.cuda.is_available():  # the tensors' peak, where an allocator counts it
            w.add_scalar("spmdgt/peak_memory_allocated_bytes", torch.cuda.max_memory_allocated(), s)
        w.add_scalar("spmdgt/rss_bytes", _rss_bytes(), s)  # the process's, tensors or not
        self._last = now

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._writer is not None:
            self.step()
            self._writer.close()
            self._writer = None
        if self._prof is not None:
            from spmdgt.interceptor._mode import get_interceptor

            get_interceptor().set_alarm(None)
            self._prof.__exit__(exc_type, exc, tb)
            self._prof = None
        if self._enabled_interceptor:
            from spmdgt.interceptor import _control
            from spmdgt.interceptor._mode import get_interceptor

            _control.disable()
            get_interceptor().level = self._level_before  # as the profile found it
            self._enabled_interceptor = False


def _env_mb_value(name: str, mb: float) -> int:
    """``mb`` MB as bytes, checked as the env var is (a size >= 0; 0: no cap)."""
    if not mb >= 0:
        raise ValueError(f"{name}={mb!r}: expected a size in MB >= 0 (0: no limit)")
    return int(mb * 1_000_000)
