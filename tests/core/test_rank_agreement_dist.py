"""Ranks that stop running the same program (the README's table, ``tests/e2e/_diverge.py``):
every rank raises ``gt.RankDivergenceError`` naming each rank's call, before any value is
computed; by default and with ``GT_CHECK_RANKS=1``. Forked ranks; the e2e tests run some of
the same programs as real processes, for exit codes, timeouts and torchrun's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_ranks

CONFIG = Path(__file__).resolve().parents[1] / "e2e" / "_diverge.yaml"

# case -> a phrase every rank's error must hold (it names the disagreement)
TABLE = {
    "item": "rank 1: the end of the program",  # rank 0 reads .sum().item(), rank 1 skips it
    "numpy": "rank 1: numpy() of float32[5, 3] (Shard(dim=0),) on ranks [0, 1] at ",
    "dtype": "rank 1: gt.randn of float64[5, 3]",
    "signal": "rank 1: gt.randn of float32[6, 4], signal 'cols'",
    "dims16": "rank 1: gt.zeros of float32[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]",
    "outside": "rank 1: gt.randn of float32[6, 4], replicated on every rank (no signal)",
}


def _case(rank, world, name):
    import spmdgt as gt
    from tests.e2e import _diverge

    shown = []
    try:
        _diverge.CASES[name](rank, shown.append)
        gt.shutdown()  # the program's end: an agreement point too
    except gt.RankDivergenceError as e:
        return {"error": str(e), "rows": e.rows, "shown": shown}
    return {"error": None, "shown": shown}


# "op" (a gather on one rank only) needs GT_CHECK_RANKS: by default nothing pairs a gather
# with a read, and GT_TIMEOUT bounds the wait (tests/e2e/test_rank_agreement.py)
CASES = [(n, c) for n in (*TABLE, "agree") for c in ("0", "1")] + [("op", "1")]


@pytest.mark.parametrize(("name", "check"), CASES, ids=[f"{n}-check{c}" for n, c in CASES])
def test_every_rank_names_the_disagreement(tmp_path, name, check):
    env = {"GT_CONFIG": str(CONFIG), "GT_CHECK_RANKS": check}
    results = run_ranks(_case, 2, tmp_path, name, env=env, timeout=90)
    if name == "agree":
        assert results[0]["error"] is None and results[1]["error"] is None
        assert results[0]["shown"] == results[1]["shown"] != []
        return
    phrase = TABLE.get(name, "rank 0: TensorBase.matmul: redistribute float32[4, 6]")
    for r in results:
        assert r["error"] is not None and r["shown"] == [], r  # raised, and before any value
        assert phrase in r["error"], (phrase, r["error"])
        assert sorted(r["rows"]) == [0, 1]
    assert results[0]["error"] == results[1]["error"]  # one message, the same on every rank
