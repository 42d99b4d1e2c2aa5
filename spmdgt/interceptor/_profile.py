"""TensorBoard profiling: ``torch.profiler`` with one trace per rank, plus scalar summaries.

    with spmdgt.debug.profile("runs/prof") as prof:    # gt.profile(...) is the same
        for step in range(10):
            train_step()
            prof.step()                                 # optional: per-step scalars

Each rank writes ``<logdir>/rank<r>.<pid>.<ts>.pt.trace.json`` via ``tensorboard_trace_handler``
(open with ``tensorboard --logdir <logdir>``, PyTorch Profiler tab, or in Perfetto), and rank r
writes scalars under ``<logdir>/scalars/rank<r>``: ops/s, collective time and count, busy
fraction, and memory (CUDA max allocated, or CPU RSS). The op counts come from the interceptor,
which ``profile`` turns on for its duration if it was off.
"""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any

__all__ = ["profile"]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class profile:  # named like torch.profiler.profile, which it wraps
    """Profile a region to TensorBoard: per-rank Chrome traces and scalar summaries."""

    def __init__(
        self,
        logdir: str = "runs/profile",
        *,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
        scalars: bool = True,
    ) -> None:
        self.logdir = logdir
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.scalars = scalars
        self.step_num = 0
        self._prof: Any = None
        self._writer: Any = None
        self._enabled_interceptor = False
        self._last: tuple[float, int, int, int] = (0.0, 0, 0, 0)

    def __enter__(self) -> profile:
        import torch
        from torch.profiler import ProfilerActivity, tensorboard_trace_handler

        from spmdgt.interceptor import _control
        from spmdgt.interceptor._mode import env_rank

        self.rank, self.world = env_rank()
        if not _control.is_enabled():
            _control.enable(stats=True)
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
        if self.scalars:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.logdir, "scalars", f"rank{self.rank}"))
        self._last = self._counters()
        return self

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
        if torch.cuda.is_available():
            w.add_scalar("spmdgt/memory_bytes", torch.cuda.max_memory_allocated(), s)
        else:
            w.add_scalar("spmdgt/memory_bytes", _rss_bytes(), s)
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
            self._prof.__exit__(exc_type, exc, tb)
            self._prof = None
        if self._enabled_interceptor:
            from spmdgt.interceptor import _control

            _control.disable()
