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

Differences from ``level="torch"``: op names are ATen overloads (``aten.mul.Tensor``), every
ATen op is seen (composite ops show their parts at level 1), ``Tensor.backward`` itself is not
an event, placements are always ``-`` (DTensor is desugared before the dispatcher records).

Built once per torch version with ``torch.utils.cpp_extension.load`` (needs a C++ compiler and
ninja; ~1 min on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/spmdgt/torch_extensions``.
``GT_NATIVE=0`` disables it; a failed build falls back to ``level="torch"`` with one verbose
line.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["available", "error", "load"]

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "observer.cpp")
_ext: ModuleType | None = None
_error: str | None = None
_tried = False


def _disabled() -> bool:
    return (os.environ.get("GT_NATIVE") or "").strip().lower() in ("0", "false", "no", "off")


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
        import torch
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        build = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "spmdgt", "torch_extensions"
        )
        tag = torch.__version__.replace("+", "_").replace(".", "_")
        build = os.path.join(build, f"spmdgt_observer_{tag}")
        os.makedirs(build, exist_ok=True)
        if not os.path.exists(os.path.join(build, "spmdgt_observer.so")):
            import sys

            print(
                "spmdgt: compiling the native op observer for the instruction log (once per "
                f"machine and torch version, ~1 min; cached in {build}; GT_NATIVE=0 skips it)",
                file=sys.stderr,
                flush=True,
            )
        ext = cpp_extension.load(
            name="spmdgt_observer",
            sources=[_SRC],
            build_directory=build,
            extra_cflags=["-O2", "-DNDEBUG"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, headers mismatch: fall back
        msg = str(e).strip().splitlines()
        _error = f"{type(e).__name__}: {msg[0] if msg else ''}"[:200]
        return None
    _init(ext)
    _ext = ext
    return ext


def _init(ext: ModuleType) -> None:
    import torch

    from spmdgt.interceptor import _events

    kinds: dict[str, str] = {}
    for kind, names in (
        ("comm", _events._COMM),
        ("matmul", _events._MATMUL),
        ("reduce", _events._REDUCE),
        ("memory", _events._MEMORY),
    ):
        for n in names:
            kinds.setdefault(n, kind)
    kinds.setdefault("backward", "backward")
    kinds.setdefault("grad", "backward")
    ext.set_kinds(kinds)
    # ScalarType int -> torch.dtype (the C++ records store the enum value)
    table = {
        0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64,
        5: torch.float16, 6: torch.float32, 7: torch.float64, 8: torch.complex32,
        9: torch.complex64, 10: torch.complex128, 11: torch.bool, 15: torch.bfloat16,
    }  # fmt: skip
    ext.set_dtypes([table.get(i, i) for i in range(64)])


def available() -> bool:
    """Whether ``level="native"`` can be used (builds the extension on first call)."""
    return load() is not None


def error() -> str | None:
    """Why the observer is unavailable (None if it loaded or was never tried)."""
    return _error


class NativeLogSink:
    """The instruction log written by the C++ observer: a sink only for flush/close."""

    native = True  # no Python events needed (see Interceptor._sync_keep)

    def __init__(self, ext: ModuleType, path: str, header: str) -> None:
        self._ext = ext
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        ext.open_log(path, header)
        self._open = True

    def on_events(self, events: list) -> None:
        pass

    def flush(self) -> None:
        if self._open:
            self._ext.flush()

    def close(self) -> None:
        if self._open:
            self._ext.close_log()
            self._open = False
