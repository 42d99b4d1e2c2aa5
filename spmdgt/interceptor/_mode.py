"""The per-rank op interceptor: one switch, one event stream, sinks on the stream.

How it sees every op, and why it is built this way (numbers from ``benchmarks/
bench_interceptor.py``, ``c = c*b + a`` on 64x64, 1 CPU thread, ~5.5 us/op untraced):

* A bare ``TorchDispatchMode`` costs ~20 us/op here. ~3 us of that is the
  ``torch._disable_dynamo`` wrapper ``TorchDispatchMode.__init_subclass__`` puts around every
  ``__torch_dispatch__`` (``_should_skip_dynamo``; we opt out below); the rest is the C++ ->
  Python mode trampoline (unboxing the stack into Python, ``find_torch_dispatch_rule``,
  re-entering the op through ``OpOverload.__call__``). No Python dispatch mode fits a 2x budget.
* A ``TorchFunctionMode`` costs ~5 us/op: it sees every torch call made from Python: forward ops,
  the optimizer's ``_foreach_*`` calls, ``dist.all_reduce`` and friends (they honour
  ``__torch_function__``), and ``Tensor.backward``. It does not see inside autograd or inside
  DTensor's dispatch.
* So the default (``level="torch"``) pushes only the function mode, and *escalates* the calls
  that hide work: a call with a DTensor argument, and ``backward``/``autograd.grad``, run under
  the dispatch mode (``_AtenMode``), which lets DTensor desugar first (it returns
  ``NotImplemented`` for DTensor args, as ``CommDebugMode`` does) and then records the local
  ATen ops and the functional collectives DTensor issues, and every op the autograd engine runs.
  Those inner events have ``level=1`` and complete before their torch-level parent (level 0).
* ``level="aten"`` pushes the dispatch mode for everything: exact ATen op counts, ~4x cost.
* ``level="native"`` pushes no mode: a compiled ``at::RecordFunction`` observer records every
  ATen/c10d op in C++ and writes the instruction log from C++ (``_native``); Python sinks get
  its records in bulk. ~1.3-1.5x on this loop. ``GT_INSTRUCTION_LOG`` uses it when it builds.

Every level classifies with ``_events``' table (the C++ observer is handed it at load), so an op
is one kind whichever level saw it; ops of kind ``overhead`` (the dispatcher's Python-key
records, ``record_function``'s ops) are run but never recorded, at any level.

When nothing is enabled no mode is pushed (``torch._C._len_torch_function_stack()`` and
``_len_torch_dispatch_stack()`` stay 0) and nothing here is on any path. Events are buffered as
raw tuples and handed to sinks in batches (``_BATCH``) and on a ~1 s tick, so memory is bounded.
DDP's C++ reducer issues its all-reduces from C++ threads below every Python hook: invisible.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from spmdgt._core import scope as _scope
from spmdgt.interceptor._events import COMM, OVERHEAD, OpEvent, Sink, classify
from spmdgt.interceptor._events import op_name as _op_name
from spmdgt.interceptor._groups import group_of_call

__all__ = ["Interceptor", "get_interceptor"]

_BATCH = 2048  # events buffered before sinks see them
_TICK_NS = 1_000_000_000  # sinks' flush tick (top publication, log flush)
_MAX_SPECS = 4  # tensor args remembered per op (foreach ops pass hundreds)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_perf_ns = time.perf_counter_ns
_tuple_new = tuple.__new__
_getframe = sys._getframe
# Dynamo inlines a function mode's __torch_function__ into the graph it traces. It folds this
# call to True (no guard), so the user's own torch.compile traces the op alone: recording
# would graph-break on the clock and guard on the counters (a recompile per call).
_compiling = torch.compiler.is_compiling


def _specs(values: Any) -> tuple:
    """``(shape, dtype, placements)`` of the tensor arguments (first few of a list of tensors).

    Plain tuples, built inline: this runs twice per op and a helper call or a NamedTuple per
    tensor doubled its cost.
    """
    out = []
    for a in values:
        t = type(a)
        if t is _Tensor or t is _Parameter:
            out.append((a.shape, a.dtype, None))
        elif isinstance(a, _Tensor):
            out.append((a.shape, a.dtype, getattr(a, "placements", None)))
        elif (t is list or t is tuple) and a and isinstance(a[0], _Tensor):
            for x in a[:_MAX_SPECS]:
                if isinstance(x, _Tensor):
                    out.append((x.shape, x.dtype, getattr(x, "placements", None)))
        else:
            continue
        if len(out) >= _MAX_SPECS:
            break
    return tuple(out)


def _out_specs(out: Any) -> tuple:
    t = type(out)
    if t is _Tensor or t is _Parameter:
        return ((out.shape, out.dtype, None),)
    if isinstance(out, _Tensor):
        return ((out.shape, out.dtype, getattr(out, "placements", None)),)
    if t is list or t is tuple:
        return _specs(out)
    return ()


class _AtenMode(TorchDispatchMode):
    """Records ATen ops (level 1 when escalated, 0 in ``level="aten"``); DTensor runs first."""

    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wraps __torch_dispatch__ in torch._disable_dynamo: ~3 us per op. The mode
        # is never active while dynamo traces (ignore_compile_internals below).
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, ic: Interceptor, level: int) -> None:
        super().__init__()
        self.ic = ic
        self.level = level
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        self._untracked: dict[Any, bool] = {}  # func -> run without a record (once per func)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        untracked = self._untracked.get(func)
        if untracked is None:
            untracked = self._untracked[func] = _untracked(func)
        if untracked is True:
            return func(*args, **(kwargs or {}))
        for t in types:
            if issubclass(t, self._dtensor):
                if self.level == 0:  # aten level: a marker that carries the placements
                    ic = self.ic
                    t0 = _perf_ns()
                    ic._record(func, t0, 0, 0, _specs(args), ())
                return NotImplemented
        ic = self.ic
        t0 = _perf_ns()
        out = func(*args, **kwargs) if kwargs else func(*args)
        t1 = _perf_ns()
        if untracked == _COMM_OP:
            grp, nbytes = group_of_call(func, args, kwargs), _comm_bytes(args, kwargs, out)
        else:
            grp, nbytes = None, 0
        ic._record(func, t0, t1 - t0, self.level, _specs(args), _out_specs(out), grp, nbytes)
        return out


_COMM_OP = 2  # ``_untracked``'s answer for a collective: recorded with its group's mesh dim


def _untracked(func: Any) -> bool | int:
    """Higher-order operators (their inner ops are recorded) and ``overhead`` ops (the
    profiler's ``record_function`` ops: ``_events.KINDS``): not instructions at any level
    (True). A collective: ``_COMM_OP``; anything else False."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return True
    kind = classify(_op_name(func))
    return True if kind == OVERHEAD else (_COMM_OP if kind == COMM else False)


_RECORD, _BACKWARD, _SKIP, _COMM = 0, 1, 2, 3  # _COMM: recorded with its group's mesh dim
# Metadata queries reach __torch_function__ too (``t.shape`` is ``Tensor.shape.__get__``); they
# run no kernel, so they are not instructions.
_METADATA = {
    "__get__", "__set__", "size", "dim", "stride", "numel", "is_contiguous", "data_ptr",
    "__len__", "__repr__", "__format__", "__hash__", "__bool__", "element_size", "nelement",
    "is_floating_point", "is_complex", "storage_offset", "untyped_storage", "get_device",
    "__reduce_ex__", "__deepcopy__", "__iter__", "__contains__", "__array__", "dim_order",
    "ndimension", "is_set_to", "_is_view", "is_pinned", "__torch_function__",
    "_has_compatible_shallow_copy_type", "__setstate__", "__getstate__", "type", "__dir__",
    "register_hook", "retain_grad", "requires_grad_", "has_names", "_version", "__index__",
}  # fmt: skip


_BOOKKEEPING = ("_record_function", "profiler.", "_set_grad_enabled", "_C._", "is_grad_enabled")


def _verdict(func: Any) -> int:
    if getattr(func, "__name__", "") in _METADATA:
        return _SKIP
    name = _op_name(func)
    kind = classify(name)
    if name.startswith(_BOOKKEEPING) or kind == OVERHEAD:
        return _SKIP
    return _COMM if kind == COMM else _RECORD


class _TorchMode(TorchFunctionMode):
    """Records torch-level calls; escalates DTensor calls and backward to ``_AtenMode``."""

    def __init__(self, ic: Interceptor) -> None:
        super().__init__()
        self.ic = ic
        self.aten = _AtenMode(ic, 1)
        # func -> _RECORD / _BACKWARD / _SKIP, decided once per callable (one dict lookup/op)
        self.verdict: dict[Any, int] = {
            _Tensor.backward: _BACKWARD,
            torch.autograd.backward: _BACKWARD,
            torch.autograd.grad: _BACKWARD,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compiling():  # dynamo traces modes: it folds this to True and traces only func
            return func(*args, **kwargs) if kwargs else func(*args)
        verdict = self.verdict.get(func)
        if verdict is None:
            verdict = self.verdict[func] = _verdict(func)
        if verdict == _SKIP:
            return func(*args, **kwargs) if kwargs else func(*args)
        ic = self.ic
        ins = _specs(args)
        escalate = verdict == _BACKWARD
        if not escalate:
            for s in ins:
                if s[2] is not None:
                    escalate = True
                    break
        if escalate:
            old_phase = ic.phase
            if verdict == _BACKWARD:
                ic.phase = "bwd"
            t0 = _perf_ns()
            try:
                with self.aten:
                    out = func(*args, **kwargs) if kwargs else func(*args)
                grp, nbytes = _comm_of(verdict, func, args, kwargs, out)
                ic._record(func, t0, _perf_ns() - t0, 0, ins, _out_specs(out), grp, nbytes)
            finally:
                ic.phase = old_phase
        else:
            t0 = _perf_ns()
            out = func(*args, **kwargs) if kwargs else func(*args)
            t1 = _perf_ns()
            grp, nbytes = _comm_of(verdict, func, args, kwargs, out)
            ic._record(func, t0, t1 - t0, 0, ins, _out_specs(out), grp, nbytes)
        sampler = ic.sampler
        if sampler is not None:  # the compile pass's hot-function detector (``_sampler``)
            sampler.left -= 1
            if sampler.left <= 0:
                sampler.sample(_getframe(1))
        return out


class Interceptor:
    """This rank's interceptor: the mode(s), the event buffer and the sinks.

    One per process (``get_interceptor()``). ``start``/``stop`` push and pop the mode;
    ``add_sink``/``remove_sink`` attach consumers. Not thread-safe by design: ops of one rank
    are issued from one thread (the backward engine on CPU runs in the caller's thread; on CUDA
    its worker threads inherit the mode and append under the GIL, which is safe for lists).
    """

    def __init__(self) -> None:
        self.sinks: list[Sink] = []
        self.level = "torch"
        self.phase = "fwd"
        self.seq = 0
        self.active = False
        self.origin_ns = _perf_ns()
        self.origin_unix_ns = time.time_ns()
        self._buf: list[tuple] = []
        self._next_tick = 0
        self._mode: Any = None
        self._names: dict[Any, tuple[str, str]] = {}
        self._signal: Callable[[], str | None] = _scope.current
        self._opt_hooks: list[Any] = []
        self._tick_callbacks: list[Callable[[], None]] = []
        self._lock = threading.RLock()
        self._froze_gc = False  # tick callbacks add/remove sinks
        self._native: Any = None  # the compiled observer while level == "native"
        self.count_only = False  # native level: counting and sampling only (see start)
        self.fresh = True  # the next start begins a session (native: counters from zero)
        self._batch = _BATCH  # events buffered before a drain (less while an alarm is near)
        self._alarm: tuple[int, Callable[[], None]] | None = None
        self.sampler: Any = None  # a ``_sampler.CodeSampler`` while the compile pass runs

    # -- hot path ---------------------------------------------------------------------------
    def _record(
        self,
        func,
        t0: int,
        dur: int,
        level: int,
        ins: tuple,
        outs: tuple,
        group=None,
        nbytes: int = 0,
    ) -> None:
        # ``group``: the mesh dim a collective ran on (``_groups``), None for other ops;
        # ``nbytes``: a collective's buffer bytes (``_comm_bytes``), 0 for other ops
        self.seq += 1
        buf = self._buf
        sig = self._signal()
        buf.append((self.seq, t0, dur, func, level, self.phase, sig, ins, outs, group, nbytes))
        if len(buf) >= self._batch or t0 > self._next_tick:
            self.drain(tick=t0 > self._next_tick)

    # -- batch path -------------------------------------------------------------------------
    def _name(self, func) -> tuple[str, str]:
        got = self._names.get(func)
        if got is None:
            name = _op_name(func)
            got = self._names[func] = (name, classify(name))
        return got

    def drain(self, tick: bool = False) -> None:
        """Hand buffered events to the sinks (and, on a tick, let them flush/publish)."""
        with self._lock:
            if self._native is not None:
                self._drain_native(tick)
            else:
                self._drain_python(tick)
            if self._alarm is not None:
                self._check_alarm()

    def _drain_python(self, tick: bool) -> None:
        raw, self._buf = self._buf, []
        if raw and self.sinks:
            events = []
            append = events.append
            cache, names = self._names, self._name
            for seq, t0, dur, func, level, phase, sig, ins, outs, grp, nbytes in raw:
                got = cache.get(func)
                name, kind = got if got is not None else names(func)
                append(
                    _tuple_new(
                        OpEvent,
                        (seq, t0, dur, name, kind, level, phase, sig, ins, outs, nbytes, grp),
                    )
                )
            for sink in self.sinks:
                sink.on_events(events)
        if tick:
            self._tick()

    # -- alarm ------------------------------------------------------------------------------
    def recorded(self) -> int:
        """Events recorded this session (the C++ count at the native level)."""
        if self._native is not None:
            return int(self._native.counts()[0])
        return self.seq

    def set_alarm(self, at: int | None, fn: Callable[[], None] | None = None) -> None:
        """Call ``fn()`` once, on the rank's thread between ops, as soon as ``recorded()``
        reaches ``at`` (``None``: no alarm). For size caps (``_profile``): the Python levels
        drain exactly at ``at`` (the batch shrinks to fit), the C++ observer calls back at the
        first top-level op end past it."""
        with self._lock:
            self._alarm = None if at is None or fn is None else (at, fn)
            self._arm()

    def _arm(self) -> None:
        if self._alarm is None:
            self._batch = _BATCH
            if self._native is not None:
                self._native.set_alarm(0)
            return
        left = self._alarm[0] - self.recorded()
        if self._native is not None:
            self._native.set_alarm(max(self._alarm[0], 1))
        else:
            self._batch = max(1, min(_BATCH, left + len(self._buf)))

    def _check_alarm(self) -> None:
        assert self._alarm is not None
        at, fn = self._alarm
        if self.recorded() < at:
            self._arm()  # the C++ alarm is one-shot; the batch shrinks as ``at`` nears
            return
        self._alarm = None
        self._arm()
        fn()

    def _tick(self) -> None:
        """Flush every sink and run the tick callbacks (top's publisher), ~once a second."""
        self._next_tick = _perf_ns() + _TICK_NS
        for sink in self.sinks:
            sink.flush()
        for cb in self._tick_callbacks:
            cb()

    def _drain_native(self, tick: bool) -> None:
        ext = self._native
        if self.sampler is not None:
            self.sampler.deliver(ext)
        raw = ext.drain()  # also formats/writes pending log lines
        if raw:
            self.seq = raw[-1][0]
            sinks = [s for s in self.sinks if not getattr(s, "native", False)]
            if sinks:
                new = _tuple_new
                # the C++ observer sees no process group: no mesh dim (``OpEvent.group``)
                events = [new(OpEvent, (*r, None)) for r in raw]
                for sink in sinks:
                    sink.on_events(events)
        if tick:
            self._tick()

    def _native_callback(self) -> None:
        # called by the C++ observer (GIL held) every 4096 records or ~1 s
        self.drain(tick=_perf_ns() > self._next_tick)

    def _sync_keep(self) -> None:
        """Native level: keep records for Python only while a Python sink wants them."""
        if self._native is not None:
            want = any(not getattr(s, "native", False) for s in self.sinks)
            self._native.set_keep(1 << 16 if want else 0)

    # -- switch -----------------------------------------------------------------------------
    def start(self, level: str = "torch", count_only: bool | None = None) -> None:
        """Start recording (``level`` "torch": cheap, escalating; "aten": every ATen op;
        "native": the compiled observer, see ``_native``; raises if it is unavailable).

        ``count_only`` (native level): the observer counts ops and samples the stack for the
        compile pass but records nothing (~0.1 us an op instead of ~0.45 us): for the pass
        alone, with no tool on. None keeps the current choice (a restart keeps it)."""
        if level not in ("torch", "aten", "native"):
            raise ValueError(
                f"interceptor level must be 'torch', 'aten' or 'native', got {level!r}"
            )
        if count_only is not None:
            if self.active and count_only != self.count_only:
                self.stop(close_sinks=False)  # restarted below in the other mode
            self.count_only = count_only
        if self.active:
            if level == self.level:
                return
            self.stop(close_sinks=False)
        if level == "native":
            from spmdgt.interceptor import _native

            ext = _native.load()
            if ext is None:
                raise RuntimeError(f"native interceptor unavailable: {_native.error()}")
            self.level = level
            self._native = ext
            if self.fresh:  # enable() began a session; a restart continues its numbering
                ext.reset_counters()
                self.fresh = False
            ext.start(env_rank()[0], self.origin_ns, True, 0, count_only=self.count_only)
            self._sync_keep()
            signal = _signal_provider()()
            ext.set_signal(signal)
            _scope.listeners.append(ext.set_signal)
            if self.sampler is not None:
                self.sampler.attach_native(ext)
            ext.set_phase({"fwd": 0, "bwd": 1, "opt": 2}.get(self.phase, 0))
            ext.set_callback(self._native_callback)
            self._arm()  # a restart (get_worker_stats pauses) keeps an alarm set before
            self._install_optimizer_hooks()
            self._freeze_gc()
            self._next_tick = _perf_ns() + _TICK_NS
            self.active = True
            return
        self.level = level
        self._signal = _signal_provider()
        self._mode = _TorchMode(self) if level == "torch" else _AtenMode(self, 0)
        self._mode.__enter__()
        self._arm()  # an alarm set at another level: the batch shrinks to meet it
        self._install_optimizer_hooks()
        self._freeze_gc()
        self._next_tick = _perf_ns() + _TICK_NS
        self.active = True

    def _freeze_gc(self) -> None:
        # Tracing allocates small tuples per op (the native level in bulk at each drain); with
        # torch's ~200k module-level objects in the oldest GC generation, the collections those
        # allocations trigger cost more than the tracing itself (measured: 81 -> 37 us/op at
        # the torch level; 40 -> 23 us/op for native log + stats, drain included). Freezing
        # moves what exists now out of the collector's sight until stop(); nothing is leaked
        # that was not already alive.
        if not self._froze_gc:
            gc.freeze()
            self._froze_gc = True

    def stop(self, close_sinks: bool = True) -> None:
        """Pop the mode, deliver what is buffered, and (by default) close and drop the sinks."""
        if self.active and self._native is not None:
            if self._native.set_signal in _scope.listeners:
                _scope.listeners.remove(self._native.set_signal)
            if self.sampler is not None:
                self.sampler.detach_native()
            self._native.stop()
            self._native.set_callback(None)
            self.drain(tick=False)
            for h in self._opt_hooks:
                h.remove()
            self._opt_hooks.clear()
            self._native = None
            self.active = False
        if self.active:
            _pop_mode(self._mode)
            self._mode = None
            self.active = False
            for h in self._opt_hooks:
                h.remove()
            self._opt_hooks.clear()
        self.drain(tick=True)
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if close_sinks:
            for sink in self.sinks:
                sink.close()
            self.sinks.clear()
            self._tick_callbacks.clear()

    def add_sink(self, sink: Sink) -> Sink:
        """Attach a sink; it sees events recorded from now on."""
        self.drain()
        self.sinks.append(sink)
        self._sync_keep()
        return sink

    def remove_sink(self, sink: Sink) -> None:
        """Detach (and flush, not close) a sink."""
        self.drain()
        if sink in self.sinks:
            self.sinks.remove(sink)
            sink.flush()
        self._sync_keep()

    def set_sampler(self, sampler: Any) -> None:
        """Sample which user code issues the ops (``_sampler.CodeSampler``; None: stop). At the
        native level the C++ observer samples; at the Python levels the function mode does
        (level ``aten`` does not sample)."""
        old, self.sampler = self.sampler, None
        if old is not None and self._native is not None:
            old.detach_native()
        self.sampler = sampler
        if sampler is not None and self._native is not None and self.active:
            sampler.attach_native(self._native)

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (the compile pass compiling: dynamo's fake-tensor ops are not
        the program's). The Python levels need nothing: dynamo clears the function mode stack
        while it traces."""
        ext = self._native if self.active else None
        if ext is None:
            yield
            return
        ext.set_paused(True)
        try:
            yield
        finally:
            ext.set_paused(False)

    def elapsed_s(self, t_ns: int) -> float:
        return (t_ns - self.origin_ns) * 1e-9

    def _install_optimizer_hooks(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        ext = self._native

        def pre(*_):
            self.phase = "opt"
            if ext is not None:
                ext.set_phase(2)

        def post(*_):
            self.phase = "fwd"
            if ext is not None:
                ext.set_phase(0)

        self._opt_hooks = [
            register_optimizer_step_pre_hook(pre),
            register_optimizer_step_post_hook(post),
        ]


def _pop_mode(mode: Any) -> None:
    # Modes must leave in LIFO order; ours is pushed once at start and popped here.
    mode.__exit__(None, None, None)


def _signal_provider() -> Callable[[], str | None]:
    # the scope stack is the bottom layer's (``spmdgt._core.scope``): no import upward
    from spmdgt._core import scope

    return scope.current


def _comm_of(verdict: int, func: Any, args: tuple, kwargs: dict | None, out: Any) -> tuple:
    """A torch-level call's ``(mesh dim, buffer bytes)`` when it is a collective, else
    ``(None, 0)``."""
    if verdict != _COMM:
        return None, 0
    return group_of_call(func, args, kwargs), _comm_bytes(args, kwargs, out)


def _payload(value: Any) -> int:
    """Bytes of a tensor, or of the tensors of a list (of lists) of tensors; 0 otherwise."""
    if isinstance(value, _Tensor):
        return value.numel() * value.element_size()
    if type(value) is list or type(value) is tuple:
        return sum(_payload(v) for v in value)
    return 0


def _comm_bytes(args: tuple, kwargs: dict | None, out: Any) -> int:
    """A collective's bytes on this rank: its buffer, the larger of its input and its output
    payload (an all-gather's gathered output, a reduce-scatter's whole input, an all-reduce's
    tensor), as nccl-tests' ``size`` and the trainer's ``CollectiveLog`` count it.

    ``dist.*`` and ``c10d.*`` calls take their output buffer as an argument
    (``all_gather_into_tensor(output, input)``), functional collectives return it: so the
    largest single argument (a list of tensors counts as one: ``dist.all_gather``'s outputs)
    or the returned value. Never input plus output, which counted an all-gather's bytes
    ``(n + 1) / n`` times and a reduce-scatter's as much."""
    values = (*args, *kwargs.values()) if kwargs else args
    return max(max((_payload(v) for v in values), default=0), _payload(out))


_INTERCEPTOR: Interceptor | None = None


def get_interceptor() -> Interceptor:
    """The process's interceptor (created on first use; creating it pushes nothing)."""
    global _INTERCEPTOR
    if _INTERCEPTOR is None:
        _INTERCEPTOR = Interceptor()
    return _INTERCEPTOR


def env_rank() -> tuple[int, int]:
    """(rank, world) without initialising anything: the runtime if up, else torchrun's env."""
    try:
        from spmdgt.runtime import _state

        rt = _state.current_runtime()
        if rt is not None:
            return rt.rank, rt.world_size
    except ImportError:
        pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from spmdgt._core import env as _env

    return _env.launcher_int("RANK", 0), _env.launcher_int("WORLD_SIZE", 1)
