"""What one rank alone meets in a hot function, on 2 and 3 ranks: never a rank running on alone.

1. An agreement point reached inside dynamo's compile, on one rank only: the compile fails on
   every rank and the function runs eagerly, equal to one process; no exchange leaves the rank.
2. A compiled graph over sharded ``gt.Tensor``s that raises at run time: where every rank's run
   raised, every rank reruns it eagerly (equal to one process); where one rank's alone did,
   every rank raises the same ``RankFailedError`` naming it, instead of that rank rerunning
   the graph's collectives alone.

Dynamo runs code on real tensors while it compiles, on its own and per rank: the parity sweep
(both halves on) found it formatting a sub-mesh ``gt.Tensor`` into an internal error's message
on the rank outside the sub-mesh only. That ``repr`` is a host read, an agreement point: on one
rank it paired with the other ranks' compile result and the ranks hung. Exchanges are now
closed while dynamo compiles (``runtime/_agree.closed``). Here a backend does what dynamo did:
on rank 0 only, it formats a sharded ``gt.Tensor`` while it compiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS, D, CALLS = 7, 5, 6  # 4/3 over 2 ranks, 3/3/1 over 3


def step(x, w):
    return (torch.tanh(x @ w) * x).sum(1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, D, generator=g), torch.randn(D, D, generator=g)


def _calls(x, w):
    out = []
    for i in range(CALLS):
        y = step(x * (1 + i), w)
        y.sum().backward()
        out.append((y.detach().numpy(), w.grad.numpy().copy()))
        w.grad = None
    return out


def _ranked(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    x, w = _inputs()
    with gt.signal.context("rows"):
        x = gt.tensor(x)
        probe = gt.tensor(torch.ones(3, 2))
    formatted = []

    def backend(gm, example_inputs):
        if rank == 0:  # what dynamo did on one rank: a gt.Tensor formatted while compiling
            try:
                formatted.append(repr(probe))
            except Exception as e:
                formatted.append(type(e).__name__)
        return gm.forward

    gt_compile.enable(backend=backend, every=1, hot_at=2)
    try:
        got = _calls(x, w.requires_grad_())
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return got, dict(st["fallbacks"]), formatted, float(probe.sum())


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_agreement_point_inside_a_compile_falls_back_on_every_rank(tmp_path, world):
    x, w = _inputs()
    ref = _calls(x, w.requires_grad_())
    results = run_ranks(_ranked, world, tmp_path, timeout=120)
    for rank, (got, fallbacks, formatted, total) in enumerate(results):
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            for k, what in enumerate(("y", "w.grad")):
                np.testing.assert_allclose(
                    g[k], r[k], rtol=1e-5, atol=1e-6, err_msg=f"{what}, call {i}, rank {rank}"
                )
        why = "an agreement point inside dynamo's compile" if rank == 0 else "another rank's"
        assert len(fallbacks) == 1 and why in next(iter(fallbacks)), fallbacks
        assert formatted == (["ClosedError"] if rank == 0 else []), formatted
        assert total == 6.0  # the exchanges are open again after the compile


def mixed(x, w):
    # the sum is a partial value on each rank: the product needs it whole (a collective)
    return x * (x @ w).sum()


def _failing(rank, world, fail_on):
    """Graphs of ``mixed`` that raise from their second run on the ranks in ``fail_on``."""
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    x, w = _inputs()
    with gt.signal.context("rows"):
        x = gt.tensor(x)
    runs = []

    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            if len(runs) > 1 and rank in fail_on:
                raise RuntimeError(f"a compiled graph's bug on rank {rank}")
            return gm.forward(*args)

        return run

    gt_compile.enable(backend=backend, every=1, hot_at=2)
    out = []
    try:
        for i in range(CALLS):
            out.append(mixed(x * (1 + i), w).numpy())
    except Exception as e:
        out.append((type(e).__name__, str(e)))
    finally:
        st = gt_compile.stats()
        gt_compile.disable()
    return out, dict(st["fallbacks"])


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_graph_failing_on_every_rank_reruns_everywhere(tmp_path, world):
    x, w = _inputs()
    ref = [mixed(x * (1 + i), w).numpy() for i in range(CALLS)]
    results = run_ranks(_failing, world, tmp_path, set(range(world)), env=_WAIT, timeout=120)
    for rank, (got, fallbacks) in enumerate(results):
        assert len(got) == CALLS, got[-1]
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"call {i}, rank {rank}")
        assert list(fallbacks) == [
            f"runtime error: RuntimeError: a compiled graph's bug on rank {rank}"
        ]


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_graph_failing_on_one_rank_fails_every_rank(tmp_path, world):
    results = run_ranks(_failing, world, tmp_path, {0}, env=_WAIT, timeout=120)
    for rank, (got, _) in enumerate(results):
        name, text = got[-1]
        assert name == "RankFailedError", (rank, got[-1])
        assert "rank 0 failed in the compiled graph of mixed" in text, text
        assert "a compiled graph's bug on rank 0" in text, text


_WAIT = {"GT_RANK_ERROR_WAIT": "3"}
