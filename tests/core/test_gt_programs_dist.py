"""GT's own test programs under N ranks: data from unseeded ``np.random`` and Python's
``random`` is one process's data on every rank, a seed the program sets itself wins, and a
program that caught a ``gt.RankDivergenceError`` gets one again at the next divergence instead
of a value mixed from the ranks' different data.

Forked ranks (``tests/_dist.py``): each child reseeds torch, numpy and ``random`` as a fresh
process would before ``gt.init()``, so any agreement comes from spmdgt. Every program is
compared with what one process gives, computed here in the test process.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from tests._dist import run_ranks

WORLDS = [2, 3]


def _rows() -> None:
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))


def _unseeded(rank, world):
    import spmdgt as gt

    _rows()
    start = np.random.get_state(legacy=True)  # after init: what every rank draws from
    py_start = random.getstate()
    b = np.random.randn(64, 32)  # no seed anywhere, as GT's test programs draw
    with gt.signal.context("rows"):
        x = gt.from_numpy(b)
        total = float(x.sum().numpy())
    return {"start": start, "py_start": py_start, "sum": total, "random": random.random()}


@pytest.mark.parametrize("world", WORLDS)
def test_unseeded_numpy_and_random_are_one_process_draws(tmp_path, world):
    results = run_ranks(_unseeded, world, tmp_path, timeout=90)
    first = results[0]
    for r in results[1:]:
        assert r["sum"] == first["sum"] and r["random"] == first["random"], results
        assert np.array_equal(r["start"][1], first["start"][1])
        assert r["start"][2:] == first["start"][2:]
    # the value one process gets from the stream every rank took (rank 0's)
    one = np.random.RandomState()
    one.set_state(first["start"])
    assert first["sum"] == pytest.approx(float(one.randn(64, 32).sum()), rel=1e-12)
    py = random.Random()
    py.setstate(first["py_start"])
    assert first["random"] == py.random()


def _seeded_after_import(rank, world):
    import spmdgt as gt

    _rows()
    np.random.seed(5)  # the program's own seeds, set after import and init: they win
    random.seed(5)
    b = np.random.randn(64, 32)
    with gt.signal.context("rows"):
        total = float(gt.from_numpy(b).sum().numpy())
    return {"data": b, "sum": total, "random": random.random()}


@pytest.mark.parametrize("world", WORLDS)
def test_a_seed_the_program_sets_wins(tmp_path, world):
    results = run_ranks(_seeded_after_import, world, tmp_path, timeout=90)
    expected = np.random.RandomState(5).randn(64, 32)  # np.random.seed(5)'s numbers
    for r in results:
        assert np.array_equal(r["data"], expected)
        assert r["sum"] == results[0]["sum"] == pytest.approx(float(expected.sum()), rel=1e-12)
        assert r["random"] == random.Random(5).random()


def _diverge_then_agree(rank, world):
    import spmdgt as gt

    _rows()
    errors = []
    for _ in range(3):  # per-rank data on purpose: every try must raise, never compute
        b = np.random.default_rng(rank).standard_normal((64, 32))
        try:
            with gt.signal.context("rows"):
                errors.append(("value", float(gt.from_numpy(b).sum().numpy())))
        except gt.RankDivergenceError as e:
            errors.append(("error", str(e)))
    b = np.random.default_rng(7).standard_normal((64, 32))  # agreeing data again
    with gt.signal.context("rows"):
        total = float(gt.from_numpy(b).sum().numpy())
    return {"tries": errors, "sum": total}


@pytest.mark.parametrize("world", WORLDS)
def test_a_caught_divergence_is_raised_again_at_the_next(tmp_path, world):
    results = run_ranks(_diverge_then_agree, world, tmp_path, timeout=90)
    for r in results:
        assert [kind for kind, _ in r["tries"]] == ["error"] * 3, r["tries"]
        for n, (_, text) in enumerate(r["tries"], 1):
            assert f"at agreement point #{n}:" in text, text
            assert "gt.from_numpy of float64[64, 32] (data crc" in text, text
    for n in range(3):  # one message, the same on every rank, at every try
        assert len({r["tries"][n][1] for r in results}) == 1
    expected = float(np.random.default_rng(7).standard_normal((64, 32)).sum())
    assert len({r["sum"] for r in results}) == 1
    assert results[0]["sum"] == pytest.approx(expected, rel=1e-12)


def _one_rank_ends(rank, world):
    import spmdgt as gt

    _rows()
    if rank == world - 1:  # the last rank ends its program while the others create
        try:
            gt.shutdown()
        except gt.RankDivergenceError as e:
            return {"tries": [str(e)]}
        return {"tries": []}
    errors = []
    for _ in range(3):
        try:
            with gt.signal.context("rows"):
                errors.append(f"value {float(gt.zeros(4, 3).sum().numpy())}")
        except gt.RankDivergenceError as e:
            errors.append(str(e))
    return {"tries": errors}


@pytest.mark.parametrize("world", WORLDS)
def test_after_a_peer_ended_every_later_point_raises_without_waiting(tmp_path, world):
    results = run_ranks(_one_rank_ends, world, tmp_path, timeout=90)
    ended = f"rank {world - 1}: the end of the program"
    assert len(results[-1]["tries"]) == 1 and ended in results[-1]["tries"][0]
    for r in results[:-1]:
        first, *later = r["tries"]
        assert "at agreement point #1:" in first and ended in first, first
        assert len(later) == 2
        for text in later:  # raised at once, without an exchange a gone peer never answers
            assert "an earlier error left the ranks out of step" in text, text
            assert f"where rank(s) [{world - 1}] ended the program" in text, text
            assert "gt.zeros of float32[4, 3]" in text, text


def test_out_of_step_raises_the_earlier_errors_kind(monkeypatch):
    import spmdgt as gt
    from spmdgt.runtime import _agree, _rank_errors

    monkeypatch.setattr(_agree, "_group", object())  # as if a side group were there
    state = (gt.RankTimeoutError, "a collective in f", {})
    monkeypatch.setattr(_rank_errors, "out_of_step", state)
    with pytest.raises(gt.RankTimeoutError, match="earlier error left the ranks out of step"):
        _agree.agree("gt.zeros of float32[2]")
    rows = {0: "a", 1: "b"}
    monkeypatch.setattr(_rank_errors, "out_of_step", (gt.RankDivergenceError, "a divergence", rows))
    with pytest.raises(gt.RankDivergenceError, match=r"\(a divergence\)") as caught:
        _agree.agree("gt.zeros of float32[2]")
    assert caught.value.rows == rows
    _agree.end()  # returns: waiting for a peer that may be gone would hang


def _import_seeding(rank, world):
    import torch

    from spmdgt.runtime import _seed

    # torchrun's variables: every rank of one launch derives the same seeds from them
    os.environ.update(TORCHELASTIC_RUN_ID="run-7", MASTER_ADDR="127.0.0.1", MASTER_PORT="2")

    def fresh() -> None:  # each stream as a new process starts it: different on every rank
        torch.seed()
        np.random.set_state(np.random.RandomState().get_state())
        random.seed()

    out = {}
    fresh()
    _seed.agree_at_import()
    out["fresh"] = (np.random.randn(5), random.random(), torch.randn(3))
    fresh()
    np.random.seed(5)  # a numpy seed set before the import is kept
    _seed.agree_at_import()
    out["numpy seeded"] = np.random.randn(5)
    fresh()
    torch.manual_seed(3)  # a program that seeds torch before the import seeds random too
    random.seed(3)
    _seed.agree_at_import()
    out["torch seeded"] = (random.random(), torch.randn(3))
    fresh()
    np.random.randn(1)  # a stream the program already drew from is its own
    before = np.random.get_state()[1].copy()
    _seed.agree_at_import()
    out["drawn kept"] = np.array_equal(np.random.get_state()[1], before)
    # another launch (torchrun gives each a fresh run id) draws anew, as torch's own
    # per-process seeding does
    fresh()
    os.environ["TORCHELASTIC_RUN_ID"] = "run-8"
    _seed.agree_at_import()
    out["next launch"] = (np.random.randn(5), random.random(), torch.randn(3))
    return out


def test_import_under_a_launcher_seeds_numpy_and_random_alike(tmp_path):
    import torch

    r0, r1 = run_ranks(_import_seeding, 2, tmp_path, timeout=90)
    (a0, p0, t0), (a1, p1, t1) = r0["fresh"], r1["fresh"]
    assert np.array_equal(a0, a1) and p0 == p1 and torch.equal(t0, t1)
    for r in (r0, r1):
        assert np.array_equal(r["numpy seeded"], np.random.RandomState(5).randn(5))
        value, drawn = r["torch seeded"]
        assert value == random.Random(3).random()
        assert torch.equal(drawn, torch.randn(3, generator=torch.Generator().manual_seed(3)))
        assert r["drawn kept"]
    (a2, p2, t2), (a3, p3, t3) = r0["next launch"], r1["next launch"]
    assert np.array_equal(a2, a3) and p2 == p3 and torch.equal(t2, t3)  # alike on its ranks
    assert not np.array_equal(a0, a2) and p0 != p2 and not torch.equal(t0, t2)  # and anew
