"""The per-rank op interceptor and the stream it produces: the source of every observability tool.

Off by default and then absent: no mode is pushed, nothing runs per op. ``enable(...)`` (or a
GT_* variable at ``import spmdgt``: see ``_control``) pushes one interception point per rank
and attaches *sinks* to its event stream: the instruction log (``_instruction_log``), counters,
hot paths and the tape (``_stats``), the run-folder publisher for ``scripts.top`` and
``scripts.trace`` (``_publish``), debug printing. ``_mode`` explains how ops are seen and what it
costs. A new consumer (the compile-and-batch pass) implements ``Sink`` and calls ``add_sink``.
``_events`` holds the one table of op kinds, log columns and dtype names that every level (the
C++ observer of ``_native`` included) classifies and writes with; ``classify`` reads it.

Run on one process: ``GT_INSTRUCTION_LOG=/tmp/ops.log python train.py``; on N:
``GT_INSTRUCTION_LOG=/tmp/ops.log torchrun --nproc_per_node=N train.py`` (one file per rank).
User-facing API: ``spmdgt.debug``; guide: ``docs/observability.md``.
"""

from __future__ import annotations

from typing import Any

from spmdgt._core import debuglog as _debuglog
from spmdgt._core.debuglog import debug, verbose
from spmdgt.interceptor import _control
from spmdgt.interceptor._control import disable, enable, is_enabled, tool, tools
from spmdgt.interceptor._events import OpEvent, Sink, TensorSpec, classify

__all__ = [
    "OpEvent",
    "Sink",
    "TensorSpec",
    "add_sink",
    "classify",
    "debug",
    "disable",
    "enable",
    "is_enabled",
    "maybe_enable_from_env",
    "read_log",
    "remove_sink",
    "tool",
    "tools",
    "verbose",
    "_debuglog",
]


def maybe_enable_from_env() -> bool:
    """Turn on the tools whose GT_* variables are set (``_control``), and start
    ``GT_PROFILE``'s TensorBoard profile, which the interceptor then owns until ``disable()``;
    returns whether the interceptor is on. Called once at ``import spmdgt``."""
    on = _control.maybe_enable_from_env()
    from spmdgt._core import env as _env

    profile_dir = _env.text("GT_PROFILE")
    if profile_dir:
        from spmdgt.interceptor._profile import profile

        p = profile(profile_dir)
        p.__enter__()
        _control.attach("profile", p)
    return on


def add_sink(sink: Sink) -> Sink:
    """Attach a consumer of the op stream (the interceptor must be enabled to produce events)."""
    from spmdgt.interceptor._mode import get_interceptor

    return get_interceptor().add_sink(sink)


def remove_sink(sink: Sink) -> None:
    """Detach a consumer added with ``add_sink``."""
    from spmdgt.interceptor._mode import get_interceptor

    get_interceptor().remove_sink(sink)


def read_log(path: Any) -> list:
    """Parse an instruction log or trace file into ``LogRecord``s (see ``_logreader``)."""
    from spmdgt.interceptor._logreader import read_log as _read

    return _read(path)
