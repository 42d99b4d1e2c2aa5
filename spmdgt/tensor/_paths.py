"""Which path ops on ``gt.Tensor``s took: a watch that reads spmdgt's own counters.

Every op on a ``gt.Tensor`` ends up on one of these paths, from cheapest to dearest:

==============  ==========================================================================
path            what ran
==============  ==========================================================================
``fast``        the dispatch fast path (``_fastpath``): a cache hit, or a first call whose
                record proved the op local (its next call of the same key is a hit). Only
                where nothing watches the op: no autograd to record, no dispatch mode.
``dtensor``     DTensor's sharding propagation and its redistributions (``_dispatch``), or
                DTensor's redistribution and a local product (``_contract``'s direct
                ``rows @ rows``).
``rewrite``     DTensor ops, but spmdgt ran an exact rewrite or the op's decomposition in
                place of DTensor's rule (``_hook.counts``: ``nll_loss``'s weighted mean, the
                size-reading losses).
``fallback``    the exact fallback: every sharded argument gathered, the plain op on the
                global values (``_fallback.counts``; random ops, data-dependent shapes,
                writes through copied views and ops with no rule for the layout too).
``raised``      the op raised (an error of torch's, as one process gives it, or a refusal
                of spmdgt's naming the way out).
==============  ==========================================================================

``none`` means no op on a ``gt.Tensor`` ran at all (plain tensors only).

A watch is off by default and costs nothing then: the fast-path, fallback and rewrite
counters count anyway (each on a path that costs far more than a count), and while a watch
is open it puts a counting wrapper in place of ``_tensor._dispatch`` (the usual path, which
``__torch_function__`` looks up by name on each call); the wrapper goes when the last watch
closes. The path is decided from this rank's counters; ranks take the same path (the route
is decided from global metadata), so ``worst`` over ranks is a check, not a guess.

    with watch() as w:
        y = x @ W
    w.path  # "dtensor" (or "fast" with grad off, on a key seen before or proven local)
"""

from __future__ import annotations

from collections.abc import Iterable

from spmdgt.tensor import _contract, _fallback, _fastpath, _hook
from spmdgt.tensor import _tensor as _tensor_module

__all__ = ["PATHS", "Watch", "watch", "worst"]

PATHS: tuple[str, ...] = ("none", "fast", "dtensor", "rewrite", "fallback", "raised")
_RANK = {p: i for i, p in enumerate(PATHS)}

# [calls of the usual path, of them raised]; counted only while a watch is open
_seen = [0, 0]
_open = [0]
_usual: list = []  # the real _tensor._dispatch while the wrapper stands in for it


def worst(paths: Iterable[str]) -> str:
    """The dearest of ``paths`` (``none`` for none): the path a row took over ranks and
    samples."""
    return max(paths, key=_RANK.__getitem__, default="none")


def rank(path: str) -> int:
    """``path``'s place in ``PATHS`` (higher is dearer)."""
    return _RANK[path]


def _counting(func, args, kwargs):
    _seen[0] += 1
    try:
        return _usual[0](func, args, kwargs)
    except BaseException:
        _seen[1] += 1
        raise


def _snapshot() -> tuple[int, ...]:
    fp = _fastpath.counts
    return (
        fp["hits"],
        fp["misses"] - fp["uncacheable"],  # first calls proven local
        _seen[0] + _contract.counts["direct"],
        _seen[1],
        sum(_hook.counts.values()),
        sum(_fallback.counts.values()),
    )


class Watch:
    """The paths ops took between ``__enter__`` and ``__exit__`` (or now, while open)."""

    def __init__(self) -> None:
        self._start: tuple[int, ...] | None = None
        self._end: tuple[int, ...] | None = None

    def __enter__(self) -> Watch:
        if not _open[0]:
            if _tensor_module._dispatch is _counting:  # a watch left open by a fork's parent
                raise RuntimeError("spmdgt path watch: the dispatch wrapper is already in place")
            _usual[:] = [_tensor_module._dispatch]
            _tensor_module._dispatch = _counting
        _open[0] += 1
        self._start, self._end = _snapshot(), None
        return self

    def __exit__(self, *exc) -> None:
        self._end = _snapshot()
        _open[0] -= 1
        if not _open[0]:
            _tensor_module._dispatch = _usual.pop()

    def counts(self) -> dict[str, int]:
        """Ops by path. A first call that learned a fast-path key counts as ``fast``; an
        op that fell back or was rewritten counts under ``dtensor`` too (it entered the
        usual path) and under its own path."""
        if self._start is None:
            raise RuntimeError("spmdgt path watch: read before it was opened")
        end = self._end if self._end is not None else _snapshot()
        hits, learned, usual, raised, rewrites, fallbacks = (
            e - s for e, s in zip(end, self._start)
        )
        return {
            "fast": hits + learned,
            "dtensor": usual - learned,
            "rewrite": rewrites,
            "fallback": fallbacks,
            "raised": raised,
        }

    @property
    def path(self) -> str:
        """The dearest path any op took (``none``: no op on a ``gt.Tensor`` ran)."""
        return worst(p for p, n in self.counts().items() if n > 0)


def watch() -> Watch:
    """A context manager that sees which paths ops took on this rank (see the module
    docstring); off, and free, outside it."""
    return Watch()
