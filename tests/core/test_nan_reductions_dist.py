"""Maxima and minima keep NaN as torch does, on sharded inputs: DTensor combines the ranks
with a max/min all-reduce, which dropped it (a number where one process gives NaN)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

CASES = [
    ("max()", lambda x: x.max()),
    ("min()", lambda x: x.min()),
    ("amax(0)", lambda x: x.amax(0)),
    ("amax(1)", lambda x: x.amax(1)),
    ("amin((0, 1))", lambda x: x.amin((0, 1))),
    ("amax(0, keepdim)", lambda x: torch.amax(x, 0, keepdim=True)),
    ("aminmax()", lambda x: torch.aminmax(x)),
    ("aminmax(dim=0)", lambda x: torch.aminmax(x, dim=0)),
    ("max(1).values", lambda x: x.max(1).values),
    ("max(axis=1).values", lambda x: x.max(axis=1).values),
    ("amax(axis=0)", lambda x: torch.amax(x, axis=0)),
    ("max(x, y)", lambda x: torch.max(x, x * 2)),
]


def _run(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    failures = []
    for where in [None, (0, 0), (6, 4), (3, 2)]:
        x = torch.arange(35, dtype=torch.float32).reshape(7, 5).sin()
        if where is not None:
            x[where] = float("nan")
        for signal in ("rows", "cols"):
            with gt.signal.context(signal):
                gx = gt.tensor(x)
            for name, fn in CASES:
                want, got = fn(x), fn(gx)
                pairs = zip(want, got) if isinstance(want, tuple) else [(want, got)]
                for w, g in pairs:
                    g = torch.as_tensor(g.numpy() if hasattr(g, "placements") else g)
                    if not torch.equal(w.isnan(), g.isnan()) or not torch.allclose(
                        w.nan_to_num(), g.nan_to_num()
                    ):
                        failures.append(f"{name} {signal} nan at {where}: {g} vs torch {w}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_maxima_keep_nan_like_torch(tmp_path, world):
    results = run_ranks(_run, world, tmp_path)
    assert results == [[]] * world, "\n".join(results[0])
