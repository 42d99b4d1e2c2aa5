"""Which user code object issues the ops: a stack sample every N top-level ops.

The compile pass (``spmdgt.compile``) asks the interceptor for a ``CodeSampler``: every
``every``-th level-0 op, the Python stack is walked from the op's caller outwards to the first
frame whose code ``classify`` calls *user* code, and that code object gets one sample; a code
reaching ``hot_at`` samples is handed to ``on_hot`` (once). ``classify(code)`` answers, once per
code object, ``LIBRARY`` (walk on: torch, spmdgt, the standard library), ``USER`` (count it) or
``STOP`` (drop the sample: the op runs inside code that must not be counted, e.g. a function
the user compiled).

By op count, never by time: ranks running the same program sample the same ops, so every rank
finds the same code hot at the same op. At level ``native`` the C++ observer samples
(``csrc/observer.cpp``: it takes the GIL on the rank's thread every ``every`` records, ~0.2 us)
and queues hot codes that the interceptor's drain hands on; at the Python levels the function
mode calls ``sample`` itself. Either way an op costs one countdown.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType, FrameType

__all__ = ["LIBRARY", "STOP", "USER", "CodeSampler"]

LIBRARY, USER, STOP = 0, 1, 2
_MAX_DEPTH = 64  # frames walked per sample (as the C++ sampler)


class CodeSampler:
    """Counts samples per user code object; calls ``on_hot([code])`` when one reaches
    ``hot_at``. ``every``: level-0 ops between samples."""

    def __init__(
        self,
        every: int,
        hot_at: int,
        classify: Callable[[CodeType], int],
        on_hot: Callable[[list[CodeType]], None],
    ) -> None:
        if every < 1 or hot_at < 1:
            raise ValueError(f"sampling needs every >= 1 and hot_at >= 1, got {every}, {hot_at}")
        self.every = every
        self.hot_at = hot_at
        self.classify = classify
        self.on_hot = on_hot
        self.left = every  # the function mode's countdown
        self._kinds: dict[CodeType, int] = {}
        self._counts: dict[CodeType, int] = {}
        self._native = None  # the C++ observer while it samples

    # -- Python levels ----------------------------------------------------------------------
    def sample(self, frame: FrameType | None) -> None:
        """One sample of the stack above ``frame`` (the op's caller)."""
        self.left = self.every
        kinds, classify = self._kinds, self.classify
        depth = 0
        while frame is not None and depth < _MAX_DEPTH:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = classify(code)
            if kind == STOP:
                return
            if kind == USER:
                n = self._counts.get(code, 0) + 1
                self._counts[code] = n
                if n == self.hot_at:
                    self.on_hot([code])
                return
            frame = frame.f_back
            depth += 1

    # -- native level -----------------------------------------------------------------------
    def attach_native(self, ext) -> None:
        """Let the C++ observer sample (counts start from zero there)."""
        self._native = ext
        ext.reset_sampling()
        ext.set_sampling(self.every, self.hot_at, self.classify)

    def detach_native(self) -> None:
        """Stop C++ sampling, keeping its counts in ``samples()``."""
        ext, self._native = self._native, None
        if ext is not None:
            self.deliver(ext)
            for code, n in ext.code_samples().items():
                self._counts[code] = self._counts.get(code, 0) + n
            ext.set_sampling(0, 0, None)
            ext.reset_sampling()

    def deliver(self, ext) -> None:
        """Hand codes the C++ sampler found hot to ``on_hot`` (the interceptor's drain)."""
        hot = ext.take_hot()
        if hot:
            self.on_hot(list(hot))

    def samples(self) -> dict[CodeType, int]:
        """Samples per user code object so far (both levels)."""
        out = dict(self._counts)
        if self._native is not None:
            for code, n in self._native.code_samples().items():
                out[code] = out.get(code, 0) + n
        return out
