"""A sharded creation's agreement point is started at once and checked at the next point that
needs it (``runtime._agree.agree_soon``/``settle``): the ranks overlap its round trip with
their own work, and a divergence still raises on every rank before any value is seen,
however the program goes on (a local op, its shard, an op that moves data, a host read, the
program's end). Also: ``rows @ rows`` gathers the second operand (``tensor._contract``) and
equals one process's product, forward and backward."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

# how the program goes on after rank 1 created another shape: each must raise on every rank
AFTER = ("local_op", "to_local", "matmul", "numpy", "end", "then_agree")


def _no_compiled_frames():
    # creations agree at once in a process where torch.compile ran (a compiled graph could
    # move data before the check): a forked rank inherits the suite's compiles, a user's
    # process starts without
    from torch._dynamo.utils import counters

    counters["frames"].clear()


def _diverge(rank, world, after):
    import spmdgt as gt
    from spmdgt.runtime import _agree

    _no_compiled_frames()
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.device_mesh()  # made first: making a mesh checks the points in flight
    shown, in_flight = [], None
    try:
        with gt.signal.context("rows"):
            x = gt.randn(7 + (rank == 1), 3)  # rank 1: 8 rows
            y = gt.randn(7, 3)  # the same on every rank: agreed, but after x
        in_flight = len(_agree._soon)
        if after == "local_op":
            z = x * 2
            z = z * 2  # the second time a fast-path hit: local, so nothing is checked yet
            shown.append(z.numpy().sum())
        elif after == "to_local":
            shown.append(x.to_local().sum().item())
        elif after == "matmul":
            shown.append(x @ y.T)
        elif after == "numpy":
            shown.append(x.numpy().sum())
        elif after == "end":
            gt.shutdown()
        elif after == "then_agree":
            shown.append(y.numpy().sum())  # a later point that agrees: x's still raises
        gt.shutdown()
    except gt.RankDivergenceError as e:
        return {"error": str(e), "shown": shown, "in_flight": in_flight}
    return {"error": None, "shown": shown, "in_flight": in_flight}


@pytest.mark.parametrize("after", AFTER)
def test_a_creation_checked_later_still_raises_everywhere_before_any_value(tmp_path, after):
    results = run_ranks(_diverge, 2, tmp_path, after, timeout=90)
    for r in results:
        assert r["in_flight"] == 2, r  # both creations' exchanges were in flight
        assert r["error"] is not None and r["shown"] == [], r
        # the first point that differs is named, with each rank's shape and call site
        assert "rank 0: gt.randn of float32[7, 3]" in r["error"], r["error"]
        assert "rank 1: gt.randn of float32[8, 3]" in r["error"], r["error"]
        assert "test_agree_soon_dist.py" in r["error"]
    assert results[0]["error"] == results[1]["error"]


def _rows_at_rows(rank, world):
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt
    from spmdgt.runtime import _agree

    _no_compiled_frames()
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.device_mesh()
    out = {}
    torch.manual_seed(3)  # the same on every rank: the reference below draws the same values
    a0, b0, c0 = torch.randn(7, 5), torch.randn(5, 6), torch.randn(9, 5)
    with gt.signal.context("rows"):
        a = gt.tensor(a0.clone(), requires_grad=True)
        b = gt.tensor(b0.clone(), requires_grad=True)
        c = gt.tensor(c0.clone())  # 9 rows against b's 5 x 6: gathering b moves less
        big = gt.randn(2, 5)  # 2 rows of a 5 x 6 product: the second operand is the bigger
    # data digests too; requires_grad_ (an op on a and b) checked the first two already
    out["in_flight"] = len(_agree._soon)
    with CommDebugMode() as comm:
        y = a @ b
    out["placement"] = str(y.placements)
    out["comms"] = {str(k): v for k, v in comm.get_comm_counts().items()}
    out["y"] = y.numpy().copy()
    (y * y).sum().backward()
    out["ga"], out["gb"] = a.grad.numpy().copy(), b.grad.numpy().copy()
    out["cb"] = torch.matmul(c, b.detach()).numpy().copy()
    # products one after another, each result the next one's rows and all read at the end:
    # the second operand is read in place from the gather's shared staging (no copy out),
    # whose two halves alternate, so no product may see a later one's rows
    g = torch.Generator().manual_seed(4)
    with gt.signal.context("rows"):
        mats = [gt.tensor(torch.randn(5, 5, generator=g)) for _ in range(5)]
    x, chain = c, []
    for m in mats:
        x = x @ m
        chain.append(x)
    out["chain"] = [t.numpy().copy() for t in chain]
    from spmdgt.tensor import _contract

    pair = (big, b.detach())
    out["big_kept"] = _contract.gather_second(pair) is pair  # DTensor's own route stays
    out["big"] = (big @ b.detach()).numpy().copy()
    out["ref_big"] = big.numpy().copy() @ b0.numpy()
    # on a sub-mesh of ranks 0 and 1: a rank off it takes DTensor's path (it holds nothing)
    gt.register_config("pair", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1])))
    with gt.signal.context("pair"):
        pc, pb = gt.tensor(c0.clone()), gt.tensor(b0.clone())
    out["pair"] = (pc @ pb).numpy().copy()
    out["counts"] = dict(gt.debug.get_worker_stats()[rank]["rows_at_rows"])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_rows_at_rows_gathers_the_second_operand_and_equals_torch(tmp_path, world):
    import torch

    torch.manual_seed(3)
    a0, b0, c0 = torch.randn(7, 5), torch.randn(5, 6), torch.randn(9, 5)
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    y = a @ b
    (y * y).sum().backward()
    for r in run_ranks(_rows_at_rows, world, tmp_path, timeout=90):
        assert r["in_flight"] == 2
        assert r["placement"] == "(Shard(dim=0),)"  # rows stay rows: no Partial sum
        assert r["comms"] == {"c10d_functional.all_gather_into_tensor": 1}, r["comms"]
        torch.testing.assert_close(torch.from_numpy(r["y"]), y.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r["ga"]), a.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r["gb"]), b.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r["cb"]), c0 @ b0, rtol=1e-5, atol=1e-5)
        g, x = torch.Generator().manual_seed(4), c0
        for got in r["chain"]:
            x = x @ torch.randn(5, 5, generator=g)
            torch.testing.assert_close(torch.from_numpy(got), x, rtol=1e-5, atol=1e-5)
        assert r["big_kept"]
        torch.testing.assert_close(torch.from_numpy(r["pair"]), c0 @ b0, rtol=1e-5, atol=1e-5)
        # a @ b under CommDebugMode and with gradients: through DTensor; c @ b: directly
        assert r["counts"]["gathered"] >= 1 and r["counts"]["direct"] >= 6, r["counts"]
        torch.testing.assert_close(
            torch.from_numpy(r["big"]), torch.from_numpy(r["ref_big"]), rtol=1e-5, atol=1e-5
        )


def _after_compile(rank, world):
    import torch

    import spmdgt as gt
    from spmdgt.runtime import _agree

    _no_compiled_frames()
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.device_mesh()
    with gt.signal.context("rows"):
        gt.randn(6, 2)
    before = len(_agree._soon)
    f = torch.compile(lambda t: t * 2 + 1, backend="eager")
    f(torch.ones(3))
    with gt.signal.context("rows"):
        gt.randn(6, 2)
    return before, len(_agree._soon)


def test_creations_agree_at_once_once_compiled_code_may_run(tmp_path):
    # a compiled graph runs its ops (collectives too) with no eager check before them
    for before, after in run_ranks(_after_compile, 2, tmp_path, timeout=90):
        assert (before, after) == (1, 0)


def _diverge_in_a_fold(rank, world, case):
    import spmdgt as gt

    _no_compiled_frames()
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.device_mesh()
    try:
        with gt.signal.context("rows"):
            a = gt.randn(5, 3)
            if case == "middle":  # the second of three creations differs on the last rank
                gt.randn(6 + (rank == world - 1), 3)
            elif rank == world - 1:  # one creation more on the last rank
                gt.randn(9, 2)
            gt.randn(4, 3)
        a.numpy()  # one exchange carries every creation above and the read
    except gt.RankDivergenceError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["middle", "extra"])
def test_the_first_point_apart_in_a_folded_exchange_is_named_on_every_rank(tmp_path, world, case):
    errors = run_ranks(_diverge_in_a_fold, world, tmp_path, case, timeout=90)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    last = f"rank {world - 1}: gt.randn of float32"
    if case == "middle":  # the same position on every rank: both shapes shown
        assert "rank 0: gt.randn of float32[6, 3]" in errors[0], errors[0]
        assert f"{last}[7, 3]" in errors[0], errors[0]
    else:  # position 2: the others' last creation, the last rank's extra one
        assert "rank 0: gt.randn of float32[4, 3]" in errors[0], errors[0]
        assert f"{last}[9, 2]" in errors[0], errors[0]
