"""``level="kineto"``: the op stream from torch's C++ RecordFunction observers (the profiler).

Instead of a Python mode called per op, this level turns on torch's Kineto profiler (CPU
activity, input shapes recorded) for a *window*, and at a flush point stops it, converts the
window's ``_KinetoEvent``s into ``OpEvent``s and restarts it. Per op the cost is the C++
observer (no Python runs); the Python cost is paid per event at flush. Measured here
(``c = c*b + a``, 64x64, 1 thread, ~5.4 us/op untraced):

* recording with shapes: ~1.5-2x; without shapes ~1.5x;
* ``_disable_profiler()``: ~17-30 us per event with shapes (~5 without): torch's own
  post-processing (tensor ids, metadata strings, the libkineto trace), all in C++ and not
  switchable off from Python (``trace_only`` skips only the Python ``EventList``);
* ``result.events()``: ~4 us per event; each ``_KinetoEvent`` accessor ~0.8 us (pybind);
* restart (disable + prepare + enable with an empty window): ~1.2 ms.

So converting costs more than recording, and the total is not below the ``torch`` level: the
2x bar is out of reach through the profiler (see docs/observability.md for the numbers). What
this level buys: every ATen op the process runs (backward engine and optimizer included, with
their nested ops as ``level`` 1), dispatcher-level collectives (``c10d.allreduce_``,
``_c10d_functional.all_reduce``, ``.wait_tensor``), phase from the autograd engine's own
``evaluate_function`` ranges, and nothing at all in Python per op.

Restrictions, and why:

* Only ``RecordScope.FUNCTION`` ranges are observed. Stopping the profiler while a range it
  observed is still open (``record_function``, ``Optimizer.step#...``, a DDP range) and starting
  a new one crashes the process when the range closes (measured: segfault). ATen op ranges are
  never open at our flush points, and user ranges are simply not observed. Flushes are also
  skipped while the autograd engine runs (``torch._C._current_graph_task_id() != -1``).
* Hence signals and the optimizer phase cannot be profiler ranges: they are recorded as
  *marks* ``(unix_ns, signal, phase)`` when they change (scope push/pop via
  ``_control.scope_observer``, optimizer pre/post hooks) and each op takes the last mark at or
  before its start time (the profiler's timestamps are unix ns, the same clock).
* Sinks see events in batches at flush points: ``drain()`` (``get_worker_stats``, ``get_tape``,
  ``add_sink``, ``disable``, atexit), and, if >= 1 s passed since the last flush, an optimizer
  step post-hook or a signal scope change. A program with neither buffers in the profiler until
  it calls one of the above (memory grows with the number of ops in the window).
* c10d ops (``c10d.allreduce_``...) take a ``TensorList``, for which the profiler reports
  shapes but no dtype: their inputs log as ``16x4:?`` and their bytes assume 4-byte elements.
* Outputs are not recorded by the profiler (column "-"); DTensor placements are not visible
  (the profiler sees the local ATen ops DTensor issues): column "-".
* One profiler per process: ``gt.profile``/``torch.profiler`` cannot run alongside this level.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _ExperimentalConfig,
)

from spmdgt.interceptor._events import OpEvent, classify

__all__ = ["KinetoBackend", "kineto_name"]

_FLUSH_NS = 1_000_000_000  # at most one opportunistic flush a second
_MAX_SPECS = 4
_ACTIVITIES = {ProfilerActivity.CPU}
_SCOPES = {RecordScope.FUNCTION}
_UNKNOWN_ITEMSIZE = 4  # bytes per element assumed where the profiler gives no dtype
_BWD_RANGE = "autograd::engine::evaluate_function:"
_tuple_new = tuple.__new__

# the profiler's dtype strings (c10's type names) -> torch dtypes
_DTYPES = {
    "float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
    "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32,
    "short int": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8,
    "bool": torch.bool, "c10::complex<float>": torch.complex64,
    "c10::complex<double>": torch.complex128, "c10::Float8_e4m3fn": torch.float8_e4m3fn,
    "c10::Float8_e5m2": torch.float8_e5m2,
}  # fmt: skip


def kineto_name(raw: str) -> tuple[str, str]:
    """The stream's name and kind of a profiler event name: ``aten::mul`` -> ``aten.mul``."""
    name = raw.replace("::", ".")
    return name, classify(name)


def _profiler_busy() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


class KinetoBackend:
    """Owns the profiler window for one interceptor; ``collect()`` is the flush point."""

    def __init__(self, ic: Any) -> None:
        self.ic = ic
        self.running = False
        self.marks: list[tuple[int, str | None, str]] = []
        self._names: dict[str, tuple[str, str] | None] = {}
        self._next_flush = 0
        self._unix_minus_perf = 0
        self._hooks: list[Any] = []
        self.windows = 0  # profiler windows opened (for tests and the benchmark)

    # -- window ------------------------------------------------------------------------------
    def _config(self) -> ProfilerConfig:
        return ProfilerConfig(
            ProfilerState.KINETO, True, False, False, False, False, _ExperimentalConfig()
        )

    def _open(self) -> None:
        cfg = self._config()
        _prepare_profiler(cfg, _ACTIVITIES)
        _enable_profiler(cfg, _ACTIVITIES, _SCOPES)
        self.running = True
        self.windows += 1
        now_perf = time.perf_counter_ns()
        self._unix_minus_perf = time.time_ns() - now_perf
        self._next_flush = now_perf + _FLUSH_NS
        ic = self.ic
        self.marks = [(time.time_ns(), ic._signal(), ic.phase)]

    def start(self) -> None:
        """Open the first window and hook the optimizer (phase marks + flush point)."""
        if _profiler_busy():
            raise RuntimeError(
                "interceptor level 'kineto' needs torch's profiler, which is already running "
                "(gt.profile / torch.profiler): use level 'torch' alongside a profiler"
            )
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._hooks = [
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        ]
        self._open()

    def stop(self) -> list[OpEvent]:
        """Close the window for good; returns its events."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return self._close() if self.running else []

    def _close(self) -> list[OpEvent]:
        self.running = False
        result = _disable_profiler()
        return self._convert(result.events())

    def collect(self, force: bool = True) -> list[OpEvent]:
        """Flush point: stop the window, convert its events, open the next one.

        Skipped (returns []) while the autograd engine runs: a flush inside an open profiled
        range is not safe (module docstring). ``force=False`` flushes only if >= 1 s passed.
        """
        if not self.running:
            return []
        if not force and time.perf_counter_ns() < self._next_flush:
            return []
        if torch._C._current_graph_task_id() != -1:
            return []
        events = self._close()
        self._open()
        return events

    # -- marks (signal, phase) ---------------------------------------------------------------
    def mark(self) -> None:
        """Record the current signal/phase; called when either changes."""
        ic = self.ic
        self.marks.append((time.time_ns(), ic._signal(), ic.phase))

    def _opt_pre(self, *_: Any) -> None:
        self.ic.phase = "opt"
        self.mark()

    def _opt_post(self, *_: Any) -> None:
        self.ic.phase = "fwd"
        self.mark()
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Cheap periodic trigger: hand the window to the sinks if >= 1 s passed."""
        if self.running and time.perf_counter_ns() >= self._next_flush:
            self.ic.drain(tick=True)

    # -- conversion ----------------------------------------------------------------------------
    def _convert(self, kevents: list) -> list[OpEvent]:
        """``_KinetoEvent``s -> ``OpEvent``s in start order, with nesting level and marks."""
        names = self._names
        rows = []
        for e in kevents:
            raw = e.name()
            got = names.get(raw, 0)
            if got == 0:
                got = names[raw] = None if raw.startswith(_BWD_RANGE) else kineto_name(raw)
            rows.append((e.start_ns(), e.duration_ns(), e.start_thread_id(), got, e))
        rows.sort(key=lambda r: r[0])
        ic = self.ic
        offset = self._unix_minus_perf
        marks = self.marks
        n_marks = len(marks)
        mi = 0
        _, sig, phase = marks[0]
        stacks: dict[int, list[list[int]]] = {}  # thread -> [[end_ns, is_bwd_range], ...]
        out: list[OpEvent] = []
        append = out.append
        seq = ic.seq
        dtypes = _DTYPES
        for start, dur, tid, got, e in rows:
            while mi < n_marks and marks[mi][0] <= start:
                _, sig, phase = marks[mi]
                mi += 1
            stack = stacks.get(tid)
            if stack is None:
                stack = stacks[tid] = []
            while stack and stack[-1][0] <= start:
                stack.pop()
            in_bwd = False
            depth = 0
            for frame in stack:
                if frame[1]:
                    in_bwd = True
                else:
                    depth += 1
            stack.append([start + dur, got is None])
            if got is None:
                continue
            ins = []
            for shape, dt in zip(e.shapes(), e.dtypes(), strict=False):
                t = dtypes.get(dt)
                if t is not None:
                    ins.append((tuple(shape), t, None))
                    if len(ins) >= _MAX_SPECS:
                        break
            name, kind = got
            nbytes = 0
            if kind == "comm":
                if not ins:  # c10d ops take a TensorList: shapes only, no dtypes reported
                    for shapes in e.structured_input_shapes():
                        if shapes and isinstance(shapes[0], list):
                            ins.extend((tuple(s), None, None) for s in shapes[:_MAX_SPECS])
                for shape, t, _ in ins:
                    n = 1
                    for d in shape:
                        n *= d
                    nbytes += n * (t.itemsize if t is not None else _UNKNOWN_ITEMSIZE)
            ins_t = tuple(ins)
            seq += 1
            append(
                _tuple_new(
                    OpEvent,
                    (
                        seq,
                        start - offset,
                        dur,
                        name,
                        kind,
                        1 if depth else 0,
                        "bwd" if in_bwd else phase,
                        sig,
                        ins_t,
                        (),
                        nbytes,
                    ),
                )
            )
        ic.seq = seq
        return out
