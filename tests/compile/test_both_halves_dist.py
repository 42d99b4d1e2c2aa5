"""Both halves of the compile pass at once: hot functions and lazy regions, on 2 and 3 ranks.

A training loop in a ``compile: true`` scope, against one-process eager torch (1e-5, forward
values and gradients). Each step feeds a hot function (the model's ``forward``, compiled by
dynamo after a few steps) a *pending* result of a sharded lazy region that needs grad, and
records a plain op on this rank's own shard, which the 7-row batch makes large enough to be
recorded on some ranks only (3 ranks: 144/144/48 elements against ``GT_LAZY_MIN_NUMEL=100``).
What this guards:

- a hot function's compiled graph never reads a placeholder unfilled: its runner, and a hot
  frame's compile, run the open region first;
- dynamo picks the hot graph by guards on ``requires_grad``, checked before any runner: a
  placeholder that will need grad shows it from the start (else a graph without backward was
  picked and ``backward()`` failed on its tangents);
- random numbers: dropout, ``cat`` and ``stack`` on plain tensors, at module level and in a hot
  function, draw eager's numbers.

``aot_eager`` on both halves keeps the compiles short.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks
from tests.compile._both import with_both_halves

D, STEPS = 48, 8
ENV = {"GT_LAZY_MIN_NUMEL": "100"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.lin1 = torch.nn.Linear(D, D)
        self.lin2 = torch.nn.Linear(D, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, h):
        for _ in range(6):
            h = torch.tanh(self.lin1(h)) * 0.5 + h * 0.5
        return self.lin2(h)


def noisy(a):
    """Random draws between recorded ops (a hot function after a few steps)."""
    c = torch.cat([a * 2.0, torch.sin(a)], 0)
    d = F.dropout(c, 0.3, training=True)
    return torch.stack([d, c * 0.5]).sum(0) + F.dropout(d * 0.5, 0.5, training=True)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(7, D, generator=g), torch.randn(7, 1, generator=g)


def _loop(make, scope):
    """The program: the same for spmdgt (``make`` a sharded tensor, ``scope`` the signal) and
    for one process. Returns per step the loss, the model's output, the input's gradient and
    the random case's value, then the parameters."""
    X, Y = _data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, keep = [], []
    for step in range(STEPS):
        with scope():
            x, y = make(X, requires_grad=True), make(Y)
            loc = getattr(x, "to_local", None)
            if loc is not None:  # this rank's shard: recorded where it is large enough
                keep.append(loc() * 2.0)
            h = torch.sin(x) * 1.5 + x * 0.5  # a pending sharded result that needs grad
            out = model(h)
            loss = ((out - y) ** 2).mean()
            torch.manual_seed(100 + step)
            a = torch.randn(12, 16) + 1.0  # plain, recorded
            b = torch.cat([a, a * a], 1)  # a module-level cat and dropout
            r = noisy(F.dropout(b, 0.2, training=True))
        loss.backward()
        opt.step()
        opt.zero_grad()
        # read inline: a helper issuing these ops would turn hot in place of the model
        steps.append((loss.item(), out.detach().numpy(), x.grad.numpy(), r.numpy()))
    return steps, [p.detach().numpy() for p in model.parameters()]


def _ranked(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0), compile=True))
    return with_both_halves(
        lambda: _loop(gt.tensor, lambda: gt.signal.context("rows")), every=2, hot_at=4, batch=64
    )


# 2 ranks: slow (3 ranks, uneven rows, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_both_halves_train_as_one_process(tmp_path, world):
    import contextlib

    ref, ref_params = _loop(
        lambda t, requires_grad=False: t.clone().requires_grad_(requires_grad),
        contextlib.nullcontext,
    )
    for rank, ((steps, params), st) in enumerate(
        run_ranks(_ranked, world, tmp_path, env=ENV, timeout=600)
    ):
        for i, (got, want) in enumerate(zip(steps, ref, strict=True)):
            np.testing.assert_allclose(got[0], want[0], 1e-5, 1e-6, err_msg=f"loss {i} r{rank}")
            for k, what in ((1, "output"), (2, "x.grad"), (3, "random case")):
                np.testing.assert_allclose(
                    got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=f"{what}, step {i}, r{rank}"
                )
        for p, q in zip(params, ref_params, strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-5)
        # both halves did run: the model's forward compiled and ran as a graph, regions too
        assert "Net.forward" in st["status"] and st["graph_runs"] >= STEPS // 2, st["status"]
        reg = st["regions"]
        assert reg["graph_runs"] >= STEPS and not reg["fallbacks"], reg
        assert reg["flushes"]["a hot function's graph"] >= 1, reg["flushes"]
