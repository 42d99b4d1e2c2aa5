"""The cached dispatch fast path (spmdgt/tensor/_fastpath.py): an op proven local the first
time runs on the local shards after, and still gives one process's values.

On 2 and 3 ranks, 7 rows (4/3 and 3/3/1): each op of the sweep runs twice without autograd
(the second run must be a hit for the common ops of a training step: no collective, the
same count DTensor itself issues) and once with autograd (never a hit; forward and
backward equal one process). A key that differs in placement, shape or dtype misses; views,
random ops and ops DTensor must redistribute for are never taken.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks

ROWS, COLS, OUT = 7, 5, 4

# name -> op on (x, y, w, b, t); x, y sharded by rows, w, b plain (replicated), t row targets
OPS = {
    "add": lambda x, y, w, b, t: x + y,
    "mul": lambda x, y, w, b, t: x * y,
    "sub": lambda x, y, w, b, t: x - y,
    "div": lambda x, y, w, b, t: x / (y * y + 1),
    "scalar": lambda x, y, w, b, t: x * 2.0 + 1,
    "relu": lambda x, y, w, b, t: torch.relu(x),
    "tanh": lambda x, y, w, b, t: torch.tanh(x),
    "sigmoid": lambda x, y, w, b, t: torch.sigmoid(x),
    "exp": lambda x, y, w, b, t: torch.exp(x),
    "gelu": lambda x, y, w, b, t: F.gelu(x),
    "pow": lambda x, y, w, b, t: x.pow(2),
    "softmax": lambda x, y, w, b, t: torch.softmax(x, -1),
    "log_softmax": lambda x, y, w, b, t: F.log_softmax(x, -1),
    "sum_dim": lambda x, y, w, b, t: x.sum(1),
    "mean_dim": lambda x, y, w, b, t: x.mean(1),
    "sum": lambda x, y, w, b, t: x.sum(),
    "mean": lambda x, y, w, b, t: x.mean(),
    "matmul": lambda x, y, w, b, t: x @ w,
    "linear": lambda x, y, w, b, t: F.linear(x, w.T, b),
    "cross_entropy": lambda x, y, w, b, t: F.cross_entropy(x, t, reduction="none"),
    "cross_entropy_mean": lambda x, y, w, b, t: F.cross_entropy(x, t),
}
# the common ops of a training step: their second run must be a hit (``cross_entropy`` takes
# the losses' guarded route, _losses.py, and ``mean`` over uneven rows _hook's rewrite: never
# a hit)
MUST_HIT = {
    "add",
    "mul",
    "sub",
    "scalar",
    "relu",
    "tanh",
    "softmax",
    "log_softmax",
    "sum_dim",
    "mean_dim",
    "sum",
    "matmul",
    "linear",
}


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, COLS, generator=g)
    y = torch.randn(ROWS, COLS, generator=g)
    w = torch.randn(COLS, OUT, generator=g)
    b = torch.randn(OUT, generator=g)
    t = torch.randint(0, COLS, (ROWS,), generator=g)
    return x, y, w, b, t


def _same_grad(ours, ref) -> bool:
    if ours is None or ref is None:
        return ours is None and ref is None
    return np.allclose(ours.numpy(), ref.numpy(), atol=1e-5)


def _collectives(fn) -> int:
    """Collectives ``fn`` issues, as the profiler sees them (no dispatch mode: a mode would
    turn the fast path off)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if "c10d" in e.name and "wait" not in e.name)


def _sweep(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt
    from spmdgt.tensor import _fastpath

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    x, y, w, b, t = _data()
    with gt.signal.context("rows"):
        gx, gy, gt_t = gt.tensor(x), gt.tensor(y), gt.tensor(t)
    mesh = gx.device_mesh
    dx, dy, dt = (distribute_tensor(v, mesh, [Shard(0)]) for v in (x, y, t))
    dw, db = (distribute_tensor(v, mesh, [Replicate()]) for v in (w, b))
    out = {}
    for name, op in OPS.items():
        ref = op(x, y, w, b, t)
        with torch.no_grad():
            before = _fastpath.counts["hits"]
            first = op(gx, gy, w, b, gt_t)
            learned = _fastpath.counts["hits"] - before
            second_colls = _collectives(lambda: op(gx, gy, w, b, gt_t))  # noqa: B023
            before = _fastpath.counts["hits"]
            second = op(gx, gy, w, b, gt_t)
            hits = _fastpath.counts["hits"] - before
            with CommDebugMode() as ours:
                op(gx, gy, w, b, gt_t)
            theirs = CommDebugMode()
            try:  # raw DTensor refuses some layouts (a mean over uneven rows): None then
                with theirs:
                    op(dx, dy, dw, db, dt)
                their_count = theirs.get_total_counts()
            except RuntimeError:
                their_count = None
        # with autograd: never the fast path; forward and backward as one process
        xr, yr, wr = (v.clone().requires_grad_() for v in (x, y, w))
        op(xr, yr, wr, b, t).sum().backward()
        with gt.signal.context("rows"):
            gxr, gyr = gt.tensor(x, requires_grad=True), gt.tensor(y, requires_grad=True)
        gwr = w.clone().requires_grad_()
        before = _fastpath.counts["hits"]
        res = op(gxr, gyr, gwr, b, gt_t)
        grad_hits = _fastpath.counts["hits"] - before
        res.sum().backward()
        out[name] = {
            "values": [np.allclose(v.numpy(), ref.numpy(), atol=1e-5) for v in (first, second)],
            "grad_value": np.allclose(res.detach().numpy(), ref.detach().numpy(), atol=1e-5),
            "x_grad": _same_grad(gxr.grad, xr.grad),
            "w_grad": _same_grad(gwr.grad, wr.grad) and _same_grad(gyr.grad, yr.grad),
            "learned_hits": learned,
            "hits": hits,
            "hit_collectives": second_colls,
            "comms": (ours.get_total_counts(), their_count),
            "grad_hits": grad_hits,
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sweep_fast_path_values_and_collectives(tmp_path, world):
    results = run_ranks(_sweep, world, tmp_path)
    for rank, out in enumerate(results):
        for name, r in out.items():
            where = f"{name} on rank {rank}/{world}"
            assert r["values"] == [True, True], where
            assert r["grad_value"] and r["x_grad"] and r["w_grad"], where
            assert r["grad_hits"] == 0, where  # autograd records: the usual path
            if name in MUST_HIT:
                assert r["hits"] >= 1, where
            if r["hits"]:  # collectives as DTensor's: none, on the usual path and a hit
                assert r["comms"][0] == r["comms"][1] == 0, where
                assert r["hit_collectives"] == 0, where


def _keys(rank, world):
    import spmdgt as gt
    from spmdgt.tensor import _fastpath

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    base = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS) - 17
    with gt.signal.context("rows"):
        rows = gt.tensor(base)
        shorter = gt.tensor(base[:6])
        doubles = gt.tensor(base.double())
        other = gt.tensor(base)
    with gt.signal.context("cols"):
        cols = gt.tensor(base)
    seen = []
    c = _fastpath.counts
    with torch.no_grad():
        for v in (rows, cols, shorter, doubles):
            m0, h0 = c["misses"], c["hits"]
            first = torch.tanh(v)
            m1, h1 = c["misses"], c["hits"]
            second = torch.tanh(v)
            seen.append((m1 - m0, h1 - h0, c["hits"] - h1))
            ref = torch.tanh(base[: v.shape[0]].to(v.dtype))
            assert np.allclose(first.numpy(), ref.numpy()) and np.allclose(second.numpy(), ref)
            assert second.placements == v.placements and second.dtype == v.dtype
        # never taken: a view (aliasing stays DTensor's), a random op, a redistribution
        h0 = c["hits"]
        for _ in range(2):
            view = rows.view(-1)
            drop = F.dropout(rows, 0.5, training=True)
            gathered = rows @ rows.T
        never = c["hits"] - h0
        view.mul_(2)  # a write through the view reaches its base, as in torch
        shared = rows.numpy().copy()
        assert drop.shape == rows.shape and gathered.shape == (ROWS, ROWS)
        # in place on self: the second call a hit, values and version as torch's
        acc, ref = rows.clone(), base.clone() * 2
        h0 = c["hits"]
        version = acc._version
        for _ in range(3):
            acc.add_(other, alpha=0.5)
            ref.add_(base, alpha=0.5)
        inplace_hits = c["hits"] - h0
        acc_ok = np.allclose(acc.numpy(), ref.numpy()) and acc._version >= version + 3
    stats = gt.debug.get_worker_stats()[rank]["fastpath"]
    return seen, never, shared, inplace_hits, acc_ok, stats


@pytest.mark.parametrize("world", [2, 3])
def test_keys_miss_on_other_specs_and_unsafe_ops_never_hit(tmp_path, world):
    base = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS) - 17
    for rank, (seen, never, shared, inplace_hits, acc_ok, stats) in enumerate(
        run_ranks(_keys, world, tmp_path)
    ):
        # each of placement, shape, dtype is a new key: a miss, then a hit
        assert seen == [(1, 0, 1)] * 4, (rank, seen)
        assert never == 0, rank
        assert np.array_equal(shared, (base * 2).numpy()), rank
        assert inplace_hits >= 2 and acc_ok, rank
        assert stats["hits"] > 0 and stats["misses"] > 0, stats
        assert set(stats) >= {"hits", "misses", "evictions"}
