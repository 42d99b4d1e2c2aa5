"""A hot function over ``gt.Tensor``s whose shapes change from call to call, on 2 and 3 ranks,
both halves of the compile pass on: every call equals one process, forward and backward, and
each new global shape is a recompile on every rank at the same call.

What it guards (``spmdgt/tensor/_dynamo_guards.py``, ``spmdgt/compile/_guards.py``), two
faults of torch 2.13's dynamo on DTensors:

- its guards check a DTensor input's local shape and its spec without the global shape, so
  a graph compiled for 5 rows (3+2 over 2 ranks) passed rank 0's guards for 6 rows (3+3) and
  returned a result of global shape 5 (plain ``torch.compile`` of ``x.amax(1)`` on a
  ``Shard(0)`` DTensor of 5 then 6 rows shows it); here the ranks then read different shapes;
- with automatic dynamic shapes, the recompile made the graph dynamic, and it failed on some
  ranks only at run time (``DTensor.__tensor_unflatten__`` given a size of None), whose
  fallback ran the graph's collectives again alone: a hang in the parity sweep, a fallback
  to eager here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.compile._both import with_both_halves

# uneven over 2 and 3 ranks; hot after the first call, so it compiles for 5 rows, then 6 rows
# (3+2 -> 3+3 on 2 ranks, 2+2+1 -> 2+2+2 on 3: rank 0's shard unchanged), 7, then hits 5's
ROWS = [7, 5, 6, 7, 5]
D = 6


def head(x, w):
    h = torch.tanh(x @ w) + x.sum(1, keepdim=True) * 0.1
    return (h * h).mean(0), h.amax(1)


def _inputs(rows=ROWS):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, D, generator=g) for n in rows], torch.randn(D, D, generator=g)


def _calls(make, scope, w, rows=ROWS):
    out = []
    for x in _inputs(rows)[0]:
        with scope():
            xs = make(x)
        m, a = head(xs, w)
        (m.sum() + a.sum()).backward()
        out.append((m.detach().numpy(), a.detach().numpy(), w.grad.numpy().copy()))
        w.grad = None
    return out


def _ranked(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    w = _inputs()[1].requires_grad_()
    run = lambda: _calls(gt.tensor, lambda: gt.signal.context("rows"), w)  # noqa: E731
    return with_both_halves(run, every=1, hot_at=2, batch=16)


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_hot_function_on_changing_shapes_equals_one_process(tmp_path, world):
    import contextlib

    ref = _calls(lambda t: t, contextlib.nullcontext, _inputs()[1].requires_grad_())
    results = run_ranks(_ranked, world, tmp_path, env={"GT_LAZY_MIN_NUMEL": "1"}, timeout=300)
    for rank, (got, st) in enumerate(results):
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            for k, what in enumerate(("mean", "amax", "w.grad")):
                np.testing.assert_allclose(
                    g[k], r[k], rtol=1e-5, atol=1e-6, err_msg=f"{what}, call {i}, rank {rank}"
                )
        assert "head" in st["status"] and st["recompiles"] >= 2, st["status"]


# Past dynamo's recompile limit (2 here, 8 by default) dynamo runs a cached graph where its
# guards pass and the code eagerly where none does: a choice each rank made from its own
# shards. The pass makes the limit a fallback to eager on every rank at the same call.
LIMIT_ROWS = [7, 5, 6, 7]  # compiles for 5 and 6 rows, then meets the limit at 7


def _ranked_limit(rank, world):
    import torch._dynamo.config as dynamo_config

    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    w = _inputs()[1].requires_grad_()
    scope = lambda: gt.signal.context("rows")  # noqa: E731
    run = lambda: _calls(gt.tensor, scope, w, LIMIT_ROWS)  # noqa: E731
    import spmdgt.compile as gt_compile

    gt_compile.enable(backend="aot_eager", every=1, hot_at=2)  # hot functions alone
    try:
        with dynamo_config.patch(recompile_limit=2):
            return run(), gt_compile.stats()
    finally:
        gt_compile.disable()


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_recompile_limit_is_an_agreed_fallback(tmp_path, world):
    import contextlib

    w = _inputs()[1].requires_grad_()
    ref = _calls(lambda t: t, contextlib.nullcontext, w, LIMIT_ROWS)
    results = run_ranks(_ranked_limit, world, tmp_path, timeout=300)
    for rank, (got, st) in enumerate(results):
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            for k, what in enumerate(("mean", "amax", "w.grad")):
                np.testing.assert_allclose(
                    g[k], r[k], rtol=1e-5, atol=1e-6, err_msg=f"{what}, call {i}, rank {rank}"
                )
        assert st["fallbacks"] == {"past dynamo's recompile limit": 1}, (rank, st["fallbacks"])
