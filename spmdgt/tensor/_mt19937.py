"""Move torch's CPU generator past N numbers without drawing them, for ``_draw``.

Why: under a signal, ``gt.randn`` gives every rank one process's numbers, so each rank moves its
CPU generator (mt19937) over the whole tensor and draws only its own part. Skipping with a
torch draw (an int64 ``random_()``, the cheapest) still runs the per-number kernel: on a
``rows`` split over 2 ranks it made creation ~1.6x raw DTensor's, which draws its local block
alone (other numbers than one process's). mt19937's state only changes when it twists every 624
words; the words between are read out and tempered. So a skip is the twists alone: a few lines
of C (``csrc/mt19937_skip.c``) on the bytes ``Generator.get_state()`` returns, ~10x cheaper
than ``random_()``.

How: the C file is compiled once per machine and loaded with ``ctypes``
(``_core/cbuild.py``). Before its first use it must skip a private generator exactly as
torch's own draws move it; if that check fails, or there is no compiler, ``skip`` returns
False and the caller skips with torch (the same numbers either way, only slower).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

from spmdgt._core import cbuild as _cbuild
from spmdgt._core import debuglog as _debuglog

__all__ = ["MIN_WORDS", "error", "skip"]

MIN_WORDS = 1 << 12  # fewer words cost less to draw than a state round trip (~10 us)
_SRC = os.path.join(os.path.dirname(__file__), "csrc", "mt19937_skip.c")
_fn: Callable[[int, int], int] | None = None
_tried = False
_error: str | None = None


def skip(words: int, generator: torch.Generator | None = None) -> bool:
    """Move ``generator`` (default: torch's default CPU generator) past ``words`` 32-bit
    outputs, as ``words`` float32 ``torch.rand`` numbers would; False, with the generator
    untouched, when the compiled skip is not available (the caller then draws to skip)."""
    fn = _fn if _tried else _load()
    if fn is None:
        return False
    g = torch.default_generator if generator is None else generator
    state = g.get_state()
    if fn(state.data_ptr(), words) != 0:
        return False
    g.set_state(state)
    return True


def error() -> str | None:
    """Why the compiled skip is unavailable (None if it loaded or was never tried)."""
    return _error


def _load() -> Callable[[int, int], int] | None:
    global _fn, _tried, _error
    _tried = True
    try:
        lib = _cbuild.load(_SRC)
        fn = lib.gt_mt19937_skip
        fn.argtypes = (ctypes.c_void_p, ctypes.c_uint64)
        fn.restype = ctypes.c_int
        _check(fn)
    except Exception as e:  # no compiler, a failed build, another torch's state layout
        lines = str(e).strip().splitlines()
        _error = f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]
        _debuglog.verbose(f"generator skip: torch's own draws ({_error})")
        return None
    _fn = fn
    return fn


def _check(fn: Callable[[int, int], int]) -> None:
    """Skip a private generator across twists and compare with torch's own draws: a torch
    whose state bytes are laid out otherwise fails here, before any user number is skipped."""
    for words in (1, 623, 624, 5000):
        ref, got = torch.Generator().manual_seed(29), torch.Generator().manual_seed(29)
        torch.rand(3, generator=ref)
        torch.rand(3, generator=got)
        torch.rand(words, generator=ref)  # one 32-bit word per float32 number
        state = got.get_state()
        if fn(state.data_ptr(), words) != 0:
            raise RuntimeError("the generator's state is not mt19937's as expected")
        got.set_state(state)
        if not torch.equal(torch.rand(8, generator=ref), torch.rand(8, generator=got)):
            raise RuntimeError(f"skipping {words} words differs from torch's draws")
