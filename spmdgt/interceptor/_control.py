"""Turning the interceptor and its tools on and off: from Python and from GT's env vars.

``enable(...)`` pushes the mode (once) and attaches the requested sinks; ``disable()`` pops it,
flushes and closes every sink. ``maybe_enable_from_env()`` is what ``import spmdgt`` calls: with
no observability variable set it reads the environment a few times (``spmdgt._core.env``, where
each variable is declared and parsed), sets nothing up and imports nothing (torch included), so
the tools cost nothing when off.

Environment variables (all per rank; every rank of a job sees the same ones):

    GT_INSTRUCTION_LOG=path   instruction log (``path``, or ``path`` with ``.rank<r>`` when world>1)
    GT_VERBOSE, GT_DEBUG_CLIENT/DISPATCHER/WORKER/COMPILE=1   status/debug lines (``_debuglog``);
                              DISPATCHER also prints every collective, WORKER every op
    GT_RUN_DIR=dir            publish status for ``scripts.top``, accept ``scripts.trace`` requests;
                              enough on its own (counters are attached for it, no hot paths)
    GT_TRACE_DIR=dir          besides the run dir, the one folder trace requests may write into
                              (read when the job starts; see ``_publish``)
    GT_PROFILE=logdir         torch.profiler + TensorBoard for the whole run (short runs only;
                              ``spmdgt.debug.profile`` records a window)
    GT_INTERCEPT=torch|aten|native   interception level (default torch; aten: every ATen op,
                              ~4x cost; native: compiled RecordFunction observer, ~1.5x, the
                              default for GT_INSTRUCTION_LOG when it builds: see ``_native``)
    GT_NATIVE=0               never build/use the native observer (GT_INSTRUCTION_LOG then
                              uses level torch)
    GT_TAPE_SIZE=n            events kept for ``get_tape`` (default 1000)
    GT_INSTRUCTION_LOG_MAX_MB=mb   rotate the log at this size (default 256; 0 never; see
                              ``_instruction_log``)
    GT_PROFILE_MAX_MB=mb      stop profiling at this trace size (default 200; 0 never; see
                              ``_profile``)
    GT_AUTO_COMPILE=1         the compile pass, hot functions (``spmdgt.compile``; GT_COMPILE=0
    vetoes)
    GT_HOTPATH_WINDOW/MIN_SEQ/THRESHOLD   GT's repeated-sequence statistics (``_stats``)
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import env as _env
from spmdgt._core.session import session

__all__ = ["disable", "enable", "is_enabled", "maybe_enable_from_env", "tool", "tools"]

_ENV_VARS = (
    "GT_INSTRUCTION_LOG",
    "GT_STATS",
    "GT_RUN_DIR",
    "GT_PROFILE",
    "GT_INTERCEPT",
    "GT_AUTO_COMPILE",
    "GT_WORKER_BATCH_SIZE",
    *_debuglog.COMPONENTS,
)

_tools: dict[str, Any] = {}
_atexit_registered = False


def is_enabled() -> bool:
    """True while the interceptor's mode is pushed on this rank."""
    mode = sys.modules.get("spmdgt.interceptor._mode")
    ic = getattr(mode, "_INTERCEPTOR", None) if mode is not None else None
    return bool(ic is not None and ic.active)


def tools() -> dict[str, Any]:
    """The attached tools by name (``stats``, ``log``, ``publisher``, ``debug``, ``profile``)."""
    return dict(_tools)


def tool(name: str) -> Any:
    """One attached tool, or None."""
    return _tools.get(name)


class _DebugPrintSink:
    """GT_DEBUG_WORKER: every op; GT_DEBUG_DISPATCHER: collectives only. Prints log lines."""

    def __init__(self, rank: int, origin_ns: int) -> None:
        from spmdgt.interceptor._instruction_log import _Formatter

        self._fmt = _Formatter(rank, origin_ns)

    def on_events(self, events: list) -> None:
        if _debuglog.INTERCEPTOR:
            for line in self._fmt.lines(events).splitlines():
                _debuglog.debug("interceptor", line)
        elif _debuglog.SHARDING:
            comms = [e for e in events if e.kind in ("comm", "wait")]
            for line in self._fmt.lines(comms).splitlines():
                _debuglog.debug("sharding", line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def enable(
    *,
    instruction_log: str | None = None,
    run_dir: str | None = None,
    stats: bool = True,
    hotpath: bool = True,
    debug_ops: bool = False,
    level: str | None = None,
    tape_size: int | None = None,
    trace_dir: str | None = None,
    sampling_only: bool = False,
) -> None:
    """Turn the interceptor on with the given tools (tools already on stay on).

    ``instruction_log``: path of the text log; ``run_dir``: publish for ``top``/``trace``;
    ``stats``: counters, tape and hot paths for ``get_worker_stats``/``get_tape``; ``debug_ops``:
    print ops per ``GT_DEBUG_WORKER``/``GT_DEBUG_DISPATCHER``; ``level``: "torch" (default,
    cheap), "aten" (every ATen op) or "native" (compiled observer; falls back to "torch" with a
    verbose line when it cannot be built); ``trace_dir``: besides ``run_dir``, the folder trace
    requests may write into (default ``GT_TRACE_DIR``; a request naming any other is ignored).
    ``sampling_only``: the caller (the compile pass) needs the stack samples alone: with no
    tool asked for now or on before, the native observer records nothing (it counts); a later
    call that asks for a tool restarts it recording.
    """
    from spmdgt.interceptor._mode import env_rank, get_interceptor
    from spmdgt.interceptor._stats import StatsSink

    global _atexit_registered
    ic = get_interceptor()
    rank, world = env_rank()
    # a running session keeps its level; a new one starts at the default, whatever an earlier
    # session used (a forked test rank inherited "aten" from its parent's last test this way)
    level = level or _env.text("GT_INTERCEPT") or (ic.level if ic.active else "torch")
    if level == "native" and (not ic.active or ic.level != "native"):
        from spmdgt.interceptor import _native

        if not _native.available():
            _debuglog.verbose(f"native interceptor unavailable ({_native.error()}); using torch")
            level = "torch"
    if not ic.active:  # a fresh session: its own clock origin and instruction numbers
        ic.origin_ns = time.perf_counter_ns()
        ic.origin_unix_ns = time.time_ns()
        ic.seq = 0
        ic.phase = "fwd"
        ic.fresh = True
    events = getattr(_tools.get("stats"), "events", None) is not None  # Python stats are on
    tools = stats or instruction_log or run_dir or debug_ops or events or _tools.keys() - {"stats"}
    ic.start(level, count_only=level == "native" and sampling_only and not tools)
    size = tape_size or _env.integer("GT_TAPE_SIZE")
    if ic.level == "native":
        # Counters cost nothing extra in C++: always on. Hot paths and the tape need every
        # record in Python (~3x): only when stats are asked for (GT_STATS=1, GT_AUTO_COMPILE).
        from spmdgt.interceptor._stats import NativeCounters

        counters = _tools.get("stats")
        if counters is None:
            counters = _tools["stats"] = ic.add_sink(NativeCounters(ic._native))
        if stats and getattr(counters, "events", True) is None:
            counters.events = ic.add_sink(StatsSink(tape_size=size, hotpath=hotpath))
    else:
        old = _tools.get("stats")
        if old is not None and getattr(old, "native", False):
            # the C++ counters of a native session this one left: they count nothing now
            ic.remove_sink(old)
            if getattr(old, "events", None) is not None:
                ic.remove_sink(old.events)
            del _tools["stats"]
        if (stats or run_dir) and "stats" not in _tools:
            _tools["stats"] = ic.add_sink(StatsSink(tape_size=size, hotpath=hotpath))
    if instruction_log and "log" not in _tools:
        from spmdgt.interceptor._instruction_log import InstructionLogSink, header, rank_path

        if ic.level == "native":
            from spmdgt.interceptor._native import NativeLogSink

            path = rank_path(instruction_log, rank, world)
            head = header(rank, world, ic.origin_unix_ns, ic.level)
            sink = NativeLogSink(ic._native, path, head)
        else:
            sink = InstructionLogSink(
                instruction_log, rank, world, ic.origin_ns, ic.origin_unix_ns, ic.level
            )
        _tools["log"] = ic.add_sink(sink)
        _debuglog.verbose(f"instruction log -> {sink.path}")
    if debug_ops and "debug" not in _tools:
        _tools["debug"] = ic.add_sink(_DebugPrintSink(rank, ic.origin_ns))
    if run_dir and "publisher" not in _tools:
        from spmdgt.interceptor._publish import RunDirPublisher

        pub = RunDirPublisher(ic, _tools["stats"], run_dir, rank, world, trace_dir=trace_dir)
        ic._tick_callbacks.append(pub.tick)
        _tools["publisher"] = pub
        _debuglog.verbose(f"publishing to run dir {run_dir}")
    if not _atexit_registered:
        atexit.register(disable)
        _atexit_registered = True
    _debuglog.verbose(f"interceptor on (level={ic.level}, tools={sorted(_tools)})")


def disable() -> None:
    """Pop the interceptor and close every tool (files flushed and closed). Idempotent."""
    mode = sys.modules.get("spmdgt.interceptor._mode")
    ic = getattr(mode, "_INTERCEPTOR", None) if mode is not None else None
    prof = _tools.pop("profile", None)
    if prof is not None:  # attached by the package (GT_PROFILE)
        prof.__exit__(None, None, None)
    if ic is not None:
        pub = _tools.get("publisher")
        ic.stop(close_sinks=False)
        if pub is not None:
            pub.close()
        for sink in list(ic.sinks):
            sink.close()
        ic.sinks.clear()
        ic._tick_callbacks.clear()
    _tools.clear()


def maybe_enable_from_env() -> bool:
    """Turn on the tools whose GT_* variables are set; returns whether the interceptor is on.

    Called once at ``import spmdgt``. With none set it costs a few dict lookups and imports
    nothing.
    """
    if not any(_env.raw(v) for v in _ENV_VARS):
        return False
    _debuglog.configure()
    log = _env.text("GT_INSTRUCTION_LOG")
    run_dir = _env.text("GT_RUN_DIR")
    debug_ops = _debuglog.INTERCEPTOR or _debuglog.SHARDING
    # Pay for what is asked: the log is written and counted in C++ (~1.0-1.5x on a 5 us op);
    # hot paths and the tape take every record into Python (~3x): GT_STATS, auto-compile and
    # op debug lines ask for them. top (GT_RUN_DIR) reads counters: C++ ones with the log,
    # else enable() adds Python ones; GT_RUN_DIR alone is enough to publish (the documented
    # top/trace recipe sets nothing else), and then pays for counters only, not hot paths.
    # (GT_AUTO_COMPILE samples the stack from the C++ observer: it needs no Python stats)
    stats = _env.flag("GT_STATS") or debug_ops
    intercept = _env.text("GT_INTERCEPT")
    want = bool(log or stats or run_dir or intercept)
    if want:
        # the log's default level is the compiled observer (falls back to torch in enable)
        level = None if intercept or not log or not _env.flag("GT_NATIVE") else "native"
        enable(
            instruction_log=log,
            run_dir=run_dir,
            debug_ops=debug_ops,
            stats=stats,
            hotpath=stats,
            level=level,
        )
    # GT_AUTO_COMPILE / GT_WORKER_BATCH_SIZE: the compile pass sits above the interceptor and
    # reads this stream; ``import spmdgt`` starts it after this (``spmdgt._boot_tools``).
    # GT_PROFILE: the package starts the profile and hands it over (``attach``).
    return want


def attach(name: str, tool: Any) -> None:
    """Own ``tool`` (an entered context manager: ``GT_PROFILE``'s profile) until ``disable()``
    or the program's end exits it."""
    _tools[name] = tool
    if not _atexit_registered:
        _register_atexit()


def _register_atexit() -> None:
    global _atexit_registered
    atexit.register(disable)
    _atexit_registered = True


session.register("interceptor", disable)  # the mode popped, every tool flushed and closed
