"""Lazy regions and ``split``/``chunk``/``unbind`` of a pending result (calls returning views).

Recorded when the pending base needs no grad: the views handed back are eager's own views of
the base's placeholder (``_base``, aliasing, an in-place change of either seen by the other),
the base is filled in place when the region runs, and a later recorded op on a view reads the
graph's value. A base that will need grad ends the region first (autograd forbids an in-place
fill under the views of a multi-view call), so eager makes its views: exact either way. Graphs
use ``aot_eager`` (eager kernels, values to float rounding).
"""

from __future__ import annotations

import pytest
import torch

import spmdgt.compile as gt_compile
from tests._dist import run_ranks

ROWS, COLS = 7, 5  # uneven: chunk(2, dim=1) gives 3 + 2 columns; 4/3 and 3/3/1 rows on ranks


def _reg():
    return gt_compile.stats()["regions"]


def _views(x):
    """Views of a pending result and of a view of it, used by later recorded ops."""
    y = x * 2.0 + 1.0
    a, b = y.chunk(2, dim=1)
    s = torch.split(y, [2, 3], dim=1)
    u = b.unbind(1)  # a view of a view
    z = a.sum(1) + s[1].sum(1) * 0.5 + u[0] * 3.0
    return y, (a, b), s, u, z


def _check(got, want):
    y = got[0]
    for g, w in zip(got, want, strict=True):
        for gg, ww in zip(g, w, strict=True) if isinstance(g, tuple) else [(g, w)]:
            assert gg.shape == ww.shape and gg.stride() == ww.stride()
            torch.testing.assert_close(gg, ww, rtol=1e-6, atol=1e-6)
            if isinstance(g, tuple):
                assert gg._base is y  # eager's views of the result, as eager's are


def test_views_of_a_pending_result_are_recorded_as_eager_views(regions, monkeypatch):
    monkeypatch.setenv("GT_LAZY_MIN_NUMEL", "1")  # 7x5 tensors open a region
    x = torch.randn(ROWS, COLS)
    want = _views(x)
    regions()
    got = _views(x)
    st = _reg()
    assert st["flushes"] == {} and st["ops_captured"] >= 8, st  # nothing ended the region
    assert "_gt_lazy" in got[1][0].__dict__  # still pending
    _check(got, want)  # reading runs the region
    assert "_gt_lazy" not in got[1][0].__dict__ and "_gt_lazy" not in got[3][0].__dict__


def test_in_place_on_a_view_or_its_base_reaches_the_other(regions, monkeypatch):
    monkeypatch.setenv("GT_LAZY_MIN_NUMEL", "1")  # 7x5 tensors open a region
    x = torch.randn(ROWS, COLS)
    regions()
    y = x * 2.0
    a, b = y.chunk(2, dim=1)
    c = a * 1.0  # recorded from the view, before the in-place change
    a.mul_(0.0)  # the region runs first (y filled in place), then eager's mul_ on the view
    assert _reg()["flushes"] == {"mul_": 1}
    assert torch.equal(y[:, :3], torch.zeros(ROWS, 3)) and torch.equal(b, x[:, 3:] * 2.0)
    assert torch.equal(c, x[:, :3] * 2.0)
    y2 = x * 3.0
    u = y2.unbind(0)
    y2.add_(1.0)  # in place on the base: its views see it
    assert torch.equal(u[6], x[6] * 3.0 + 1.0)
    w = x * 4.0
    d, _ = w.chunk(2, dim=1)
    del w  # the base dropped, its view kept: still eager's view of the filled result
    assert torch.equal(d, x[:, :3] * 4.0) and d._base is not None


def test_a_base_that_needs_grad_ends_the_region_and_matches_eager(regions, monkeypatch):
    monkeypatch.setenv("GT_LAZY_MIN_NUMEL", "1")  # 7x5 tensors open a region
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, COLS, generator=g)
    w = torch.randn(ROWS, COLS, generator=g, requires_grad=True)
    want = _views(x * w)
    want[4].sum().backward()
    want_grad, w.grad = w.grad, None
    regions()
    got = _views(x * w)
    assert _reg()["flushes"] == {"chunk": 1}  # the base needs grad: eager's views
    got[4].sum().backward()
    _check(got, want)
    torch.testing.assert_close(w.grad, want_grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="view"):  # as eager: a multi-view output in place
        got[1][0].mul_(2.0)


def _ranks_views(rank, world):
    """On a ``compile: true`` scope: views of a pending sharded result (the region ends: eager,
    exact), of this rank's pending plain shard (recorded), and of a plain result that needs
    grad (the region ends); forward and backward."""
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("hot", gt.SignalConfig(compile=True))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(ROWS, COLS, generator=g)
    wfull = torch.randn(ROWS, COLS, generator=g)
    with gt.signal.context("rows"):
        x = gt.tensor(full.numpy())
        xw = gt.tensor(wfull.numpy()).requires_grad_()
    with gt.signal.context("hot"):
        y = x * xw + 1.0  # sharded, recorded
        a, b = y.chunk(2, dim=1)  # views of a pending gt.Tensor: the region runs first
        loss = (a * 2.0).sum() + (b * b).sum()
        local = y.to_local().detach() * 3.0  # this rank's rows, a plain region
        views = _views(local)
        recorded = "_gt_lazy" in views[1][0].__dict__
        lw = torch.ones_like(local).requires_grad_()
        graded = _views(local * lw)
        gloss = graded[4].sum()
        va, _ = views[1]
        va.mul_(-1.0)  # in place on a recorded view: the region runs, then the base changes
    loss.backward()
    gloss.backward()
    return {
        "loss": loss.item(),
        "grad": xw.grad.numpy(),
        "views": [t.numpy() for t in (views[0], *views[1], *views[2], *views[3], views[4])],
        "bases": all(t._base is views[0] for t in (*views[1], *views[2])),
        "graded": graded[4].detach().numpy(),
        "lgrad": lw.grad.numpy(),
        "recorded": recorded,
        "flushes": dict(gt.compile.stats()["regions"]["flushes"]),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_views_on_ranks_match_one_process(world, tmp_path):
    env = {"GT_LAZY_MIN_NUMEL": "1", "GT_COMPILE_BACKEND": "aot_eager"}
    res = run_ranks(_ranks_views, world, tmp_path, env=env, timeout=240)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(ROWS, COLS, generator=g)
    w = torch.randn(ROWS, COLS, generator=g).requires_grad_()
    y = full * w + 1.0
    a, b = y.chunk(2, dim=1)
    loss = (a * 2.0).sum() + (b * b).sum()
    loss.backward()
    rows = [len(c) for c in torch.arange(ROWS).chunk(world)]  # 4/3 and 3/3/1, as Shard(0)
    start = 0
    for rank, r in enumerate(res):
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(r["grad"]), w.grad)
        local = y.detach()[start : start + rows[rank]] * 3.0
        v = _views(local)
        v[1][0].mul_(-1.0)
        for got, want in zip(r["views"], (v[0], *v[1], *v[2], *v[3], v[4]), strict=True):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-6)
        lw = torch.ones_like(local).requires_grad_()
        gv = _views(local * lw)[4]
        gv.sum().backward()
        torch.testing.assert_close(torch.from_numpy(r["graded"]), gv.detach())
        torch.testing.assert_close(torch.from_numpy(r["lgrad"]), lw.grad)
        assert r["bases"] and r["recorded"]
        assert r["flushes"].get("chunk") == 2, r["flushes"]  # the sharded and the graded base
        start += rows[rank]
