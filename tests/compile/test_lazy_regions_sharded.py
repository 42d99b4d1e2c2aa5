"""Sharded lazy regions (``spmdgt.compile._sharded``): ``gt.Tensor`` ops recorded, run as one
graph with DTensor's propagation and collectives in it, against one-process torch.

2 and 3 forked gloo ranks, uneven sizes (1001 rows), ``aot_eager`` (results then match eager
to float rounding), ``GT_LAZY_MIN_NUMEL`` lowered so that small tensors are recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS, COLS = 1001, 37
ENV = {"GT_LAZY_MIN_NUMEL": "1000", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, COLS, generator=g), torch.randn(ROWS, COLS, generator=g)


def _steps(x, b, steps=3):
    """A chain with a float that changes per step (a dynamic graph input from the second
    change on), ``**`` (a wrapper FX cannot name), a softmax over the sharded dim (a
    collective), a sum (a Partial result)."""
    losses = []
    y = x
    for it in range(steps):
        y = x
        for _ in range(3):
            y = torch.sin(y) * (1.0 + 0.1 * it) + y * b - 0.01 * y**2
        s = torch.softmax(y, 0)
        t = (s * y).sum()  # y stays live and needs grad: two grad outputs, one backward
        t.backward()
        losses.append(t)
    return losses, y


def _sharded(rank, world, backend, fail_on):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    if backend == "failing":

        def backend(gm, args):  # this rank's compile fails; the others' succeed
            if rank == fail_on:
                raise RuntimeError("no backend on this rank")
            return gm.forward

    assert gt_compile.enable_regions(backend=backend)
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0), compile=True))
    xa, ba = _data()
    with gt.signal.context("rows"):
        x = gt.from_numpy(xa.numpy(), requires_grad=True)
        b = gt.from_numpy(ba.numpy())
        y = torch.sin(x) * b
        pending = "_gt_lazy" in y.__dict__
        placements = tuple(y.placements)  # known before the region runs
        with torch.no_grad():
            local = y.to_local()  # a read that is no op: the region runs first
        eager_local = (torch.sin(x) * b).to_local()
        first = torch.equal(local, eager_local.detach())
        losses, y = _steps(x, b)
        values = [t.item() for t in losses]
        out = {
            "pending": pending,
            "placements": placements,
            "to_local": first,
            "losses": values,
            "y": y.numpy(),
            "grad": x.grad.numpy(),
        }
    out["stats"] = gt_compile.stats()["regions"]
    return out


def _reference():
    xa, ba = _data()
    x = xa.clone().requires_grad_()
    losses, y = _steps(x, ba)
    return [t.item() for t in losses], y.detach().numpy(), x.grad.numpy()


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_sharded_regions_match_one_process(tmp_path, world):
    losses, y, grad = _reference()
    for r, got in enumerate(run_ranks(_sharded, world, tmp_path, "aot_eager", -1, env=ENV)):
        assert got["pending"] and got["to_local"], r
        assert got["placements"][0].is_shard(0)
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["grad"], grad, rtol=1e-5, atol=1e-5)
        st = got["stats"]
        assert st["compiled"] >= 2 and st["graph_runs"] >= 4, st  # collectives compiled in
        assert st["dynamic_floats"] >= 1 and not st["fallbacks"], st


def test_a_compile_failure_on_one_rank_is_a_fallback_on_every_rank(tmp_path):
    losses, _, grad = _reference()
    got = run_ranks(_sharded, 2, tmp_path, "failing", 1, env=ENV)
    for g in got:
        np.testing.assert_allclose(g["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(g["grad"], grad, rtol=1e-5, atol=1e-5)
        assert g["stats"]["graph_runs"] == 0 and g["stats"]["compiled"] == 0
        assert g["stats"]["eager_runs"] >= 4
    fb0, fb1 = got[0]["stats"]["fallbacks"], got[1]["stats"]["fallbacks"]
    assert set(fb0) == {"another rank's compile failed"}, fb0
    assert all(k.startswith("compile error: RuntimeError: no backend") for k in fb1), fb1
    assert sum(fb0.values()) == sum(fb1.values())  # the same regions, the same decisions


def _runtime(rank, world, with_collective):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    def backend(gm, args):
        def run(*a):
            if rank == 0 or with_collective:
                raise RuntimeError("kernel failed")
            return gm.forward(*a)

        return run

    assert gt_compile.enable_regions(backend=backend)
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0), compile=True))
    xa, ba = _data()
    with gt.signal.context("rows"):
        x, b = gt.from_numpy(xa.numpy()), gt.from_numpy(ba.numpy())
        try:
            y = torch.softmax(x * b, 0) if with_collective else torch.sin(x) * b
            value = y.numpy()
        except RuntimeError as e:
            return str(e)
    return value, gt_compile.stats()["regions"]["fallbacks"]


def test_runtime_failures(tmp_path):
    # no collective in the graph: the failing rank reruns it eagerly, alone, exactly
    xa, ba = _data()
    (v0, fb0), (v1, fb1) = run_ranks(_runtime, 2, tmp_path, False, env=ENV)
    np.testing.assert_allclose(v0, torch.sin(xa) * ba, rtol=1e-6)
    np.testing.assert_allclose(v1, v0, rtol=0)
    assert list(fb0) == ["runtime error: RuntimeError: kernel failed"] and not fb1
    # collectives in it: no rank reruns it alone; the error names the region and the way out
    for msg in run_ranks(_runtime, 2, tmp_path, True, env=ENV):
        assert "lazy region 'rows'" in msg and "moves data between ranks" in msg, msg
        assert "GT_COMPILE=0" in msg


def _mlp(x, w1, b1, w2):
    return torch.nn.functional.gelu(x @ w1 + b1) @ w2


def _matmuls(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    assert gt_compile.enable_regions(backend="aot_eager")
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0), compile=True))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    xa, _ = _data()
    g = torch.Generator().manual_seed(1)
    w1, b1 = torch.randn(COLS, 64, generator=g), torch.randn(64, generator=g)
    w2 = torch.randn(64, 8, generator=g, requires_grad=True)
    with gt.signal.context("cols"):
        w1s = gt.from_numpy(w1.numpy())  # Shard(1): the product moves data in the graph
    with gt.signal.context("rows"):
        x = gt.from_numpy(xa.numpy(), requires_grad=True)
        # plain b1 is a replicated value inside the graph; plain w2 needs grad: not recorded
        loss = _mlp(x, w1s, b1, w2).sum()
        loss.backward()
        out = loss.item(), x.grad.numpy(), w2.grad.numpy()
    return out, gt_compile.stats()["regions"]


@pytest.mark.parametrize("world", [2, 3])
def test_matmuls_and_plain_values_in_sharded_regions(tmp_path, world):
    xa, _ = _data()
    g = torch.Generator().manual_seed(1)
    w1, b1 = torch.randn(COLS, 64, generator=g), torch.randn(64, generator=g)
    w2 = torch.randn(64, 8, generator=g, requires_grad=True)
    x = xa.clone().requires_grad_()
    ref = _mlp(x, w1, b1, w2).sum()
    ref.backward()
    for (value, gx, gw2), st in run_ranks(_matmuls, world, tmp_path, env=ENV):
        assert value == pytest.approx(ref.item(), rel=1e-5)
        np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gw2, w2.grad.numpy(), rtol=1e-4, atol=1e-4)
        assert st["compiled"] >= 1 and st["ops_captured"] >= 3 and not st["fallbacks"], st
