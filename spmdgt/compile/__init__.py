"""The compile pass: unchanged eager code runs compiled where it pays (issue 10).

Tier 1, hot functions (``GT_AUTO_COMPILE=1`` or ``spmdgt.compile.enable()``): the interceptor
samples which user function issues the ops (by op count, so every rank decides at the same
op); a function with enough samples is handed to ``torch.compile``'s own frame machinery,
which compiles it at its next call with guards, graph breaks, recompiles and a compiled
backward. A compile error, a failed agreement or a run-time error sends that function back to
eager (on every rank when any rank failed). Functions the user compiled are left alone. Guide:
``docs/compilation.md``; machinery: ``_pass`` (decisions), ``_frames`` (dynamo's frame hook),
``_backend`` (the counted backend), ``_consensus`` (the agreement), ``_stats`` (the counters).

Tier 2 (lazy regions: YAML ``compile: true``, ``GT_WORKER_BATCH_SIZE``) is not built yet.

Environment (read by ``maybe_enable_from_env``, which ``import spmdgt`` reaches through the
interceptor's start-up; with none of these set nothing here is imported):

    GT_AUTO_COMPILE=1            tier 1 on
    GT_COMPILE=0                 every compilation off, whatever else is set
    GT_COMPILE_BACKEND=name      the torch.compile backend (default inductor)
    GT_COMPILE_SAMPLE_EVERY=n    top-level ops between stack samples (default 16)
    GT_COMPILE_HOT_SAMPLES=n     samples that make a function hot (default 8)
    GT_DEBUG_COMPILE=1           print each decision, rank-prefixed
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["disable", "enable", "is_enabled", "maybe_enable_from_env", "stats"]

_pass: Any = None
_atexit = False


def enable(
    backend: str | Callable[..., Any] | None = None,
    every: int | None = None,
    hot_at: int | None = None,
) -> None:
    """Turn tier 1 on for this rank (every rank must: the decisions are collective).

    Turns the interceptor on if it is off (level ``native`` when it builds: the sampling then
    costs what the C++ log costs; else ``torch``). ``backend``, ``every``, ``hot_at``: as the
    ``GT_COMPILE_*`` variables (``backend`` may also be a dynamo backend callable). A no-op
    with ``GT_COMPILE=0``.
    """
    global _pass
    if compile_disabled():
        _note("GT_COMPILE=0: compilation off")
        return
    if _pass is not None:
        return
    from spmdgt import debug
    from spmdgt.compile._pass import HotFunctionPass
    from spmdgt.interceptor import _control
    from spmdgt.interceptor._mode import get_interceptor

    ic = get_interceptor()
    if not ic.active:
        from spmdgt.interceptor import _native

        level = os.environ.get("GT_INTERCEPT") or ("native" if _native.available() else "torch")
        _control.enable(stats=False, hotpath=False, level=level)
    p = HotFunctionPass(
        backend=backend or os.environ.get("GT_COMPILE_BACKEND") or "inductor",
        every=every or _env_int("GT_COMPILE_SAMPLE_EVERY", 16),
        hot_at=hot_at or _env_int("GT_COMPILE_HOT_SAMPLES", 8),
    )
    p.start(ic)
    _pass = p
    global _atexit
    if not _atexit:  # the frame hook must be out before the interpreter tears modules down
        import atexit

        atexit.register(disable)
        _atexit = True
    debug.set_compilation_stats_provider(p.snapshot)
    _note(
        f"compile pass on (tier 1, backend {p.backend_name}, a sample every {p.every} ops, "
        f"hot at {p.hot_at} samples, interceptor level {ic.level})"
    )


def disable() -> None:
    """Turn tier 1 off: sampling stops, the frame hook and its marks go, functions run eagerly."""
    global _pass
    p, _pass = _pass, None
    if p is not None:
        p.stop()
        from spmdgt import debug

        debug.set_compilation_stats_provider(None)


def is_enabled() -> bool:
    """Whether tier 1 runs on this rank."""
    return _pass is not None


def stats() -> dict[str, Any]:
    """This rank's compile counters (``_stats.CompileStats``); empty when the pass is off."""
    return _pass.snapshot() if _pass is not None else {}


def compile_disabled() -> bool:
    """``GT_COMPILE=0``: no compilation of any kind."""
    return (os.environ.get("GT_COMPILE") or "").strip().lower() in ("0", "false", "no", "off")


def maybe_enable_from_env() -> bool:
    """``GT_AUTO_COMPILE=1`` (and not ``GT_COMPILE=0``): ``enable()``. Returns whether on."""
    raw = (os.environ.get("GT_AUTO_COMPILE") or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    enable()
    return is_enabled()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer >= 1")
    return value


def _note(msg: str) -> None:
    from spmdgt.interceptor import _debuglog

    _debuglog.verbose(msg)
    if _debuglog.COMPILE:
        _debuglog.debug("compile", msg)
