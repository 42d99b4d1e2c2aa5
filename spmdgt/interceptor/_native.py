"""``level="native"``: a compiled ``at::RecordFunction`` observer (``csrc/observer.cpp``).

What it is: a global C++ callback on every op the dispatcher runs (``RecordScope::FUNCTION``:
every ATen op, and the c10d ops ``dist.*`` issues, e.g. ``c10d.allreduce_.default`` with its
bytes; a c10d op inside a functional collective being recorded is skipped: one collective, one
record), plus one on autograd nodes (``BACKWARD_FUNCTION``) to tag ops that run inside backward
with phase ``bwd``. Per op it keeps name, start/duration (``CLOCK_MONOTONIC``, the clock of
``time.perf_counter_ns``), the first 4 input tensors' shapes and dtypes, up to 2 outputs, the
nesting level (0: called from Python or the autograd engine, 1: called inside another op),
phase, signal and a completion-order sequence number, in a buffer under one mutex (backward
worker threads append too). The instruction log is formatted and written from C++ in batches
of 4096 (same columns as ``_instruction_log``, so ``_logreader`` reads it unchanged); no Python
runs per op. Python sinks (stats, tape, publisher) get the same records as ``OpEvent``s in bulk:
the observer calls back into Python every 4096 records or ~1 s, only on a thread that already
holds the GIL (the rank's own thread), never from a backward worker.

Classification is not in the C++ source: ``_init`` hands the observer ``_events``' table (op
kinds, event words, log columns, dtype names) before it records anything, so every level
classifies an op the same way. Records of kind ``overhead`` (the dispatcher's Python-key
kernels, ``PythonSubclass``/``PythonDispatchMode``) are never recorded.

Differences from ``level="torch"``: op names are ATen overloads (``aten.mul.Tensor``), every
ATen op is seen (composite ops show their parts at level 1), ``Tensor.backward`` itself is not
an event, placements are always ``-`` (DTensor is desugared before the dispatcher records).

Build cache: ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/spmdgt/torch_extensions``, one folder per
``cache_key()``: a hash of the C++ source, torch's version, the compiler flags, the compiler and
the Python ABI. So checkouts with different sources never share (nor silently rebuild) one
build, and a cached build is imported directly, without ninja. A build (~45 s-1 min on 2
cores; needs a C++ compiler and ninja) prints one rank-prefixed line on stderr saying so and
where. ``GT_NATIVE=0`` disables the observer; a failed build falls back to ``level="torch"``
with one verbose line.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
from types import ModuleType

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import env as _env

__all__ = ["NativeLogSink", "available", "build_dir", "cache_key", "error", "load"]

_NAME = "spmdgt_observer"  # the module name the .so exports (PyInit_spmdgt_observer)
_SRC = os.path.join(os.path.dirname(__file__), "csrc", "observer.cpp")
_CFLAGS = ("-O2", "-DNDEBUG")
_ext: ModuleType | None = None
_error: str | None = None
_tried = False


def _disabled() -> bool:
    return not _env.flag("GT_NATIVE")


def cache_key(
    source: bytes | None = None,
    torch_version: str | None = None,
    cflags: tuple[str, ...] = _CFLAGS,
) -> str:
    """The build's identity: 16 hex digits of a hash of everything the ``.so`` depends on.

    The C++ source (``csrc/observer.cpp`` unless ``source`` is given), torch's version and
    commit (its headers and ABI), the compiler flags and compiler (``$CXX``), and the Python
    ABI tag and machine (pybind11 ties the module to them). Any change gives a new folder, so a
    build is never reused for another source and two checkouts never overwrite each other's.
    """
    import torch

    if source is None:
        with open(_SRC, "rb") as f:
            source = f.read()
    h = hashlib.sha256(source)
    for part in (
        torch_version or torch.__version__,
        getattr(torch.version, "git_version", ""),
        " ".join(cflags),
        os.environ.get("CXX", "c++"),
        sys.implementation.cache_tag or "",
        platform.machine(),
    ):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()[:16]


def build_dir(key: str | None = None) -> str:
    """The cache folder of the build with ``key`` (default: this checkout's ``cache_key()``)."""
    return os.path.join(_env.build_root(), f"{_NAME}_{key or cache_key()}")


def load() -> ModuleType | None:
    """The compiled observer (building it on first use), or None when it cannot be had."""
    global _ext, _error, _tried
    if _ext is not None or _tried:
        return _ext
    if _disabled():
        _error = "disabled by GT_NATIVE=0"
        return None
    _tried = True
    try:
        ext = _load_or_build()
    except Exception as e:  # no compiler, no ninja, headers mismatch: fall back
        msg = str(e).strip().splitlines()
        _error = f"{type(e).__name__}: {msg[0] if msg else ''}"[:200]
        return None
    _init(ext)
    _ext = ext
    return ext


def _load_or_build() -> ModuleType:
    with open(_SRC, "rb") as f:
        source = f.read()
    build = build_dir(cache_key(source))
    so = os.path.join(build, f"{_NAME}.so")
    # Built before for exactly this source, torch and flags, and not being linked right now (a
    # build holds cpp_extension's ``lock`` file; load() below waits for it instead).
    if os.path.exists(so) and not os.path.exists(os.path.join(build, "lock")):
        spec = importlib.util.spec_from_file_location(
            _NAME, so, loader=importlib.machinery.ExtensionFileLoader(_NAME, so)
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {so}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    os.makedirs(build, exist_ok=True)
    # Build from a copy inside the cache folder: ninja then never sees another checkout's file
    # (a newer mtime there would rebuild this one).
    src = os.path.join(build, "observer.cpp")
    tmp = f"{src}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(source)
    os.replace(tmp, src)
    _debuglog.notice(
        "native",
        f"compiling the native op observer into {build} (once per source, torch version and "
        "compiler flags; ~1 min on 2 cores; GT_NATIVE=0 skips it)",
    )
    return cpp_extension.load(
        name=_NAME,
        sources=[src],
        build_directory=build,
        extra_cflags=list(_CFLAGS),
        verbose=False,
    )


def _table(ext: ModuleType) -> dict:
    """``_events``' table in the form ``set_table`` takes (see ``csrc/observer.cpp``)."""
    from spmdgt.interceptor import _events

    dtypes = ext.scalar_types()  # ScalarType int -> torch.dtype (None: no dtype for it)
    return {
        "namespaces": list(_events.NAMESPACES),
        "kinds": _events.kind_table(),
        "namespace_kinds": dict(_events.NAMESPACE_KINDS),
        "events": dict(_events.EVENTS),
        "default_kind": _events.DEFAULT_KIND,
        "default_event": _events.event_of(_events.DEFAULT_KIND),
        "skip_kind": _events.OVERHEAD,
        "comm_kind": _events.COMM,
        "wait_kind": _events.WAIT,
        "columns": list(_events.COLUMNS),
        "dtypes": [
            _events.dtype_short(d) if d is not None else f"dtype{i}" for i, d in enumerate(dtypes)
        ],
    }


def _init(ext: ModuleType) -> None:
    ext.set_table(_table(ext))


def available() -> bool:
    """Whether ``level="native"`` can be used (builds the extension on first call)."""
    return load() is not None


def error() -> str | None:
    """Why the observer is unavailable (None if it loaded or was never tried)."""
    return _error


class NativeLogSink:
    """The instruction log written by the C++ observer: a sink only for flush/close.

    ``max_bytes`` (default: ``GT_INSTRUCTION_LOG_MAX_MB``, see ``_instruction_log``) rotates
    the file as ``InstructionLogSink`` does; the C++ writer rotates, this sink says so once.
    """

    native = True  # no Python events needed (see Interceptor._sync_keep)

    def __init__(
        self, ext: ModuleType, path: str, header: str, max_bytes: int | None = None
    ) -> None:
        from spmdgt.interceptor._instruction_log import max_log_bytes

        self._ext = ext
        self.path = path
        self.max_bytes = max_log_bytes() if max_bytes is None else max_bytes
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        ext.open_log(path, header, self.max_bytes)
        self._open = True
        self._told = False

    def on_events(self, events: list) -> None:
        pass

    def _tell(self) -> None:
        if not self._told and self._ext.log_rotations() > 0:
            from spmdgt.interceptor._instruction_log import rotation_message

            self._told = True
            _debuglog.notice("log", rotation_message(self.path, self.max_bytes))

    def flush(self) -> None:
        if self._open:
            self._ext.flush()
            self._tell()

    def close(self) -> None:
        if self._open:
            self._ext.close_log()
            self._open = False
            self._tell()
