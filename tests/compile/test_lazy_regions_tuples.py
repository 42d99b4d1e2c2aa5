"""Lazy regions and calls that return a tuple, and the hook's cheap path.

Tuple-returning pure calls (``max(dim)``, ``sort``, ``topk``, ``var_mean``...) are recorded:
one node for the call, one ``getitem`` node and placeholder per element, handed back in
eager's own tuple type. ``split``/``chunk`` return views: on real tensors they run eagerly and
the region goes on (the views alias their input as eager's do); on a pending result they are
recorded, as eager's views of its placeholder (``test_lazy_regions_views.py``). Graphs use
``aot_eager`` (eager kernels: values match eager to float rounding); the data has ties, so
index results check tie-breaking too.
"""

from __future__ import annotations

import pytest
import torch

import spmdgt.compile as gt_compile
from tests._dist import run_ranks

N = 256  # 65536 elements: the capture threshold


def _reg():
    return gt_compile.stats()["regions"]


def _tuples(x, w):
    """Tuple calls on pending results, their elements used by later recorded ops."""
    y = x * 2.0 + 1.0
    m = torch.max(y, dim=1)
    s = y.sort(dim=0, descending=True)
    t = torch.topk(y * w, 3, dim=1)
    vm = torch.var_mean(y * w, dim=0)
    mn = (y * w).min(1, keepdim=True)
    am = torch.aminmax(y, dim=0)
    loss = (
        t.values.sum()
        + vm[0].sum()
        + vm[1].sum()
        + (mn.values * 2.0).sum()
        + (m.values * s.values.mean(0)).sum()
    )
    return (m, s, t, vm, mn, am), loss


def test_tuple_calls_are_recorded_with_eager_values_and_grads(regions):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (N, N), generator=g).float()  # ties everywhere
    w = torch.randn(N, N, generator=g, requires_grad=True)
    want, want_loss = _tuples(x, w)
    want_loss.backward()
    want_grad, w.grad = w.grad, None
    regions()
    got, loss = _tuples(x, w)
    st = _reg()
    assert st["flushes"] == {} and st["ops_captured"] >= 12, st  # nothing ended the region
    loss.backward()
    assert set(_reg()["flushes"]) == {"backward"}
    for g_, w_ in zip(got, want, strict=True):
        assert type(g_) is type(w_)
        for a, b in zip(g_, w_, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(w.grad, want_grad, rtol=1e-6, atol=1e-6)


def test_views_of_real_tensors_keep_the_region_and_alias(regions):
    x = torch.arange(float(2 * N * N)).reshape(2 * N, N)
    base = x.clone()
    regions()
    y = x * 2.0  # a region is open
    a, b = x.chunk(2)  # views of a real tensor: eager, the region goes on
    c = torch.split(x, N)[1]
    assert _reg()["flushes"] == {}
    z = a * 3.0  # a recorded op on the eager view
    a.add_(1.0)  # in place on the view: the region runs first, then x changes as eager's
    assert set(_reg()["flushes"]) == {"add_"}
    assert torch.equal(x[:N], base[:N] + 1.0) and torch.equal(b, base[N:])
    assert torch.equal(c, base[N:]) and torch.equal(z, base[:N] * 3.0)
    assert torch.equal(y, base * 2.0)
    p = x * 1.0  # pending
    q, r = p.chunk(2)  # views of a pending result: recorded, eager's views of its placeholder
    assert "chunk" not in _reg()["flushes"] and q._base is p and r._base is p
    assert "_gt_lazy" in q.__dict__
    q.mul_(0.0)  # in place on a view: the region runs first (p filled in place), then mul_
    assert _reg()["flushes"]["mul_"] == 1 and "_gt_lazy" not in q.__dict__
    assert torch.equal(p[:N], torch.zeros(N, N)) and torch.equal(r, x[N:])


def test_small_calls_with_no_region_open_are_not_recorded(regions):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    big = torch.randn(N, N)
    want = a * b + a
    regions()
    got = a * b + a  # no region open, nothing big: eager, nothing recorded
    assert torch.equal(got, want) and _reg()["ops_captured"] == 0
    y = big * 2.0  # opens a region
    s = a * b  # small and real while it is open: eager, the region goes on
    z = y + 1.0
    assert _reg()["ops_captured"] == 2 and _reg()["flushes"] == {}
    assert torch.equal(s, a * b) and torch.equal(z, big * 2.0 + 1.0)


ROWS, COLS = 7, 5


def _ranks_tuples(rank, world):
    """Tuple calls on a sharded ``gt.Tensor`` (its region cannot hold them: eager, exact) and
    on this rank's plain shard (recorded in a plain region), in a ``compile: true`` scope."""
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("hot", gt.SignalConfig(compile=True))
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, 4, (ROWS, COLS), generator=g).float()
    w = torch.randn(ROWS, COLS, generator=g)
    with gt.signal.context("rows"):
        x = gt.tensor(full.numpy())
        xw = gt.tensor(w.numpy()).requires_grad_()
    with gt.signal.context("hot"):
        y = x * xw + 1.0
        m = torch.max(y, dim=1)
        s = torch.sort(y, dim=1)
        loss = (m.values * 2.0).sum() + s.values[:, 0].sum()
        local = y.to_local().detach() * 3.0  # this rank's rows, a plain region
        t = torch.topk(local, 2, dim=1)
        lt = (t.values * 2.0, t.indices)
    loss.backward()
    out = {
        "types": (type(m).__name__, type(s).__name__, type(t).__name__),
        "values": m.values.numpy(),
        "indices": m.indices.numpy(),
        "sorted": s.values.numpy(),
        "loss": loss.item(),
        "grad": xw.grad.numpy(),
        "local": [v.numpy() for v in lt],
        "captured": gt.compile.stats()["regions"]["ops_captured"],
    }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_tuple_calls_on_ranks_match_one_process(world, tmp_path):
    env = {"GT_LAZY_MIN_NUMEL": "1", "GT_COMPILE_BACKEND": "aot_eager"}
    res = run_ranks(_ranks_tuples, world, tmp_path, env=env, timeout=240)
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, 4, (ROWS, COLS), generator=g).float()
    w = torch.randn(ROWS, COLS, generator=g).requires_grad_()
    y = full * w + 1.0
    m, s = torch.max(y, dim=1), torch.sort(y, dim=1)
    loss = (m.values * 2.0).sum() + s.values[:, 0].sum()
    loss.backward()
    rows = [len(c) for c in torch.arange(ROWS).chunk(world)]  # 4/3 and 3/3/1, as Shard(0)
    start = 0
    for rank, r in enumerate(res):
        assert r["types"] == ("max", "sort", "topk")
        torch.testing.assert_close(torch.from_numpy(r["values"]), m.values.detach())
        assert (r["indices"] == m.indices.numpy()).all()
        torch.testing.assert_close(torch.from_numpy(r["sorted"]), s.values.detach())
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(r["grad"]), w.grad)
        mine = (y.detach()[start : start + rows[rank]] * 3.0).topk(2, dim=1)
        torch.testing.assert_close(torch.from_numpy(r["local"][0]), mine.values * 2.0)
        assert (r["local"][1] == mine.indices.numpy()).all()
        assert r["captured"] > 0
        start += rows[rank]
