"""An op error on one rank only reaches every rank: each raises the same RankFailedError,
naming the rank, the op and torch's message, within seconds and with GT_TIMEOUT at its
default (30 min); an error every rank raises stays the program's own and the ranks go on.

The data: 7 ids over 2 and 3 ranks (4/3 and 3/3/1 rows), the first out of range, so only
rank 0's shard of ``F.embedding``'s input holds it (and, for ``F.cross_entropy``'s even
rule, only rank 0's shard of the targets). Without the mechanism the other ranks wait in the
next collective until the harness kills them, and the elapsed-time assertions fail.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks

IDS = [9, 1, 2, 3, 4, 0, 1]  # 9: out of range for 5 rows, in rank 0's shard only
ENV = {"GT_RANK_ERROR_WAIT": "3"}  # seconds; GT_TIMEOUT stays torch's 30 min


def _torch_error(fn) -> str:
    """torch's own message for the op, in one process: what every rank must name."""
    with pytest.raises(Exception) as info:
        fn()
    return str(info.value).strip().splitlines()[0]


def _ids_and_weight():
    return torch.tensor(IDS), torch.arange(15.0).reshape(5, 3)


def _caught(rank, world):
    """Every rank's program catches the error and carries on to the next collective."""
    import spmdgt as gt

    gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    ids, w = _ids_and_weight()
    good = ids.clamp(max=4)
    with gt.signal.context("data"):
        gbad, ggood, gall_bad = gt.tensor(ids), gt.tensor(good), gt.tensor(torch.full((7,), 9))
    out = {}
    # an error every rank raises is the program's own: each rank raises it unchanged and
    # the ranks go on computing (a wrongly ended group would fail the read below)
    try:
        F.embedding(gall_bad, w)
    except Exception as e:
        out["uniform"] = type(e).__name__
    out["after_uniform"] = F.embedding(ggood, w).cumsum(0).numpy()
    t0 = time.monotonic()
    try:
        emb = F.embedding(gbad, w)  # raises on rank 0 only
    except Exception as e:  # rank 0 catches it and goes on, as a notebook would
        out["first"] = (type(e).__name__, str(e), type(e.__cause__).__name__)
        emb = F.embedding(ggood, w)
    try:
        emb.cumsum(0).numpy()  # a collective: every rank must raise here
    except gt.RankFailedError as e:
        out["next"] = str(e)
    out["elapsed"] = time.monotonic() - t0
    try:  # and the ended groups stay ended: later collectives raise at once
        gbad.numpy()
    except gt.RankFailedError as e:
        out["later"] = str(e)
    return out


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_error_on_one_rank_reaches_every_rank_when_caught(tmp_path, world):
    ids, w = _ids_and_weight()
    expected = _torch_error(lambda: F.embedding(ids, w))
    uniform = _torch_error(lambda: F.embedding(torch.full((7,), 9), w))
    reference = F.embedding(ids.clamp(max=4), w).cumsum(0).numpy()
    results = run_ranks(_caught, world, tmp_path, env=ENV)
    for rank, out in enumerate(results):
        assert out["uniform"] == "IndexError", (rank, out)
        assert uniform == expected
        assert (out["after_uniform"] == reference).all()
        assert out["elapsed"] < 30, (rank, out["elapsed"])
        named = f"rank 0 failed in torch.nn.functional.embedding at {__file__}"
        assert named in out["next"] and f"IndexError: {expected}" in out["next"], out["next"]
        assert "No collective can run in this process any more" in out["next"]
        assert "not run" in out["later"] and named in out["later"], out["later"]
        if rank == 0:  # the raising rank raised the named error too, caused by torch's
            kind, text, cause = out["first"]
            assert (kind, cause) == ("RankFailedError", "IndexError")
            assert named in text and "rank 0 raised it" in text
        else:
            assert "first" not in out
            assert f"rank {rank} was waiting in a collective" in out["next"]


def _uncaught(rank, world, out_dir):
    """The error ends the program on rank 0 (the harness reports it); the others wait.

    Each rank writes its time to its own file: ranks printing to one captured stdout
    interleave (a print is two writes there: the text, then the newline)."""
    import spmdgt as gt

    gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    n = 3 * world  # even shards: cross_entropy's sharded rule, a local loss then a reduction
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(n, 5, generator=gen), torch.randint(0, 5, (n,), generator=gen)
    target[0] = 7  # out of range, in rank 0's shard only
    with gt.signal.context("data"):
        glogits, gtarget = gt.tensor(logits), gt.tensor(target)
    t0 = time.monotonic()
    try:
        float(F.cross_entropy(glogits, gtarget))
    finally:
        (out_dir / f"elapsed{rank}").write_text(f"{time.monotonic() - t0:.3f}")


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_error_on_one_rank_reaches_every_rank_when_uncaught(tmp_path, world):
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(3 * world, 5, generator=gen), torch.zeros(3 * world).long()
    target[0] = 7
    expected = _torch_error(lambda: F.cross_entropy(logits, target))
    with pytest.raises(AssertionError) as info:
        run_ranks(_uncaught, world, tmp_path, tmp_path, env=ENV, timeout=60)
    report = str(info.value)
    ranks = report.split("--- rank ")[1:]
    assert len(ranks) == world, report
    for text in ranks:
        assert "spmdgt.RankFailedError: rank 0 failed in torch.nn.functional.cross_entropy" in text
        assert f"IndexError: {expected}" in text, text
    elapsed = [float((tmp_path / f"elapsed{rank}").read_text()) for rank in range(world)]
    assert len(elapsed) == world and max(elapsed) < 30, elapsed
