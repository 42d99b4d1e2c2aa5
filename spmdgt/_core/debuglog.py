"""Status and debug lines: ``GT_VERBOSE`` and ``GT_DEBUG_*``, prefixed with rank and component.

GT had a client, a dispatcher and workers; an SPMD rank is all three at once. The mapping:

    GT_VERBOSE=1           component "gt"          status: startup, tools enabled, files written
    GT_DEBUG_CLIENT=1      component "tensor"      tensor API: creation, conversion, sync points
    GT_DEBUG_DISPATCHER=1  component "sharding"    placements, redistribution, every collective
    GT_DEBUG_WORKER=1      component "interceptor" every op this rank executes (from the stream)
    GT_DEBUG_COMPILE=1     component "compile"     hot paths, compilation, recompiles

Lines go to stderr as ``[gt r1 sharding +2.318s] message``. Call sites guard with the
module-level flag so a disabled component costs one global read::

    from spmdgt._core import debuglog as _debuglog
    if _debuglog.SHARDING:
        _debuglog.debug("sharding", f"redistribute {src} -> {dst}")

``debug`` checks the flag itself too, so unguarded calls are correct, just not free. ``notice``
prints whatever the flags say, in the same format: for the few things a user must hear about
unasked (a ~1 min native build, a log rotated or a profile capped at its size limit). Nothing
here imports torch: ``maybe_enable_from_env`` runs at ``import spmdgt``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from spmdgt._core import env as _env

__all__ = ["COMPONENTS", "configure", "debug", "enabled", "notice", "verbose"]

# GT env var -> spmdgt component
COMPONENTS = {
    "GT_VERBOSE": "gt",
    "GT_DEBUG_CLIENT": "tensor",
    "GT_DEBUG_DISPATCHER": "sharding",
    "GT_DEBUG_WORKER": "interceptor",
    "GT_DEBUG_COMPILE": "compile",
}

VERBOSE = False
TENSOR = False
SHARDING = False
INTERCEPTOR = False
COMPILE = False

_FLAG_OF = {
    "gt": "VERBOSE",
    "tensor": "TENSOR",
    "sharding": "SHARDING",
    "interceptor": "INTERCEPTOR",
    "compile": "COMPILE",
}
# GT's names work too, so GT-era call sites keep reading naturally
_ALIASES = {"client": "tensor", "dispatcher": "sharding", "worker": "interceptor", "verbose": "gt"}
_T0 = time.perf_counter()


def configure(env: Mapping[str, str] | None = None, **components: bool) -> None:
    """Set the component flags from ``env`` (default ``os.environ``, parsed as every GT flag
    is: ``spmdgt._core.env``) and/or keyword overrides."""
    g = globals()
    for var, comp in COMPONENTS.items():
        g[_FLAG_OF[comp]] = _env.flag(var, env)
    for comp, on in components.items():
        comp = _ALIASES.get(comp, comp)
        if comp not in _FLAG_OF:
            raise ValueError(f"unknown debug component {comp!r}; known: {sorted(_FLAG_OF)}")
        g[_FLAG_OF[comp]] = bool(on)


def enabled(component: str) -> bool:
    """Whether ``component`` (spmdgt or GT name) prints."""
    comp = _ALIASES.get(component, component)
    return bool(globals().get(_FLAG_OF.get(comp, ""), False))


def _rank() -> int:
    rt = sys.modules.get("spmdgt.runtime._state")  # not imported: this layer is below it
    r = rt.current_runtime() if rt is not None else None
    if r is not None:
        return r.rank
    return _env.launcher_int("RANK", 0)


def debug(component: str, msg: str) -> None:
    """Print ``msg`` for ``component`` if its flag is on: ``[gt r<rank> <component> +<t>s] msg``."""
    comp = _ALIASES.get(component, component)
    if not globals().get(_FLAG_OF.get(comp, ""), False):
        return
    _print(comp, msg)


def notice(component: str, msg: str) -> None:
    """Print ``msg`` whatever the flags say, as ``[gt r<rank> <component> +<t>s] msg``.

    For what a user must hear about unasked, once: a native build (a ~1 min stall otherwise
    silent), a log rotated or a profile stopped at its size cap. ``component`` is free text.
    """
    _print(component, msg)


def _print(component: str, msg: str) -> None:
    # one write per line: ranks share the terminal, and two ranks' prints must not interleave
    sys.stderr.write(f"[gt r{_rank()} {component} +{time.perf_counter() - _T0:.3f}s] {msg}\n")
    sys.stderr.flush()


def verbose(msg: str) -> None:
    """A ``GT_VERBOSE`` status line."""
    debug("gt", msg)
