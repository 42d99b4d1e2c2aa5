"""Both halves of the compile pass on one rank, around a call (aot_eager: short compiles)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def with_both_halves(run: Callable[[], Any], *, every: int, hot_at: int, batch: int) -> tuple:
    """``run()`` with hot functions (sampled every ``every`` ops, hot at ``hot_at`` samples) and
    lazy regions everywhere (``batch`` ops at most), then both off; (its result, the stats)."""
    import spmdgt.compile as gt_compile

    gt_compile.enable(backend="aot_eager", every=every, hot_at=hot_at)
    assert gt_compile.enable_regions(batch=batch, backend="aot_eager")
    try:
        got = run()
        return got, gt_compile.stats()
    finally:
        gt_compile.disable()
        gt_compile.disable_regions()
