"""CI's slice of the training-pattern sweep (patterns.py), and the sweep's check of itself.

The slice: a fixed, seeded sample of the ``train.*`` rows on 2 and 3 ranks must have no
failing row and no row that regressed from ``equal`` in the ledger (``python -m tests.parity
--family train`` runs them all). The check of itself: two patterns wrong by the world size on
purpose, one in the loss value and one only in the upstream parameters' gradients, must come
out ``differs``: a harness that passed them could not see the defect it exists for.
"""

from __future__ import annotations

import random

import pytest

from tests.parity.prepare import RowKey

SAMPLE_ROWS = 200  # of ~2,500 rows: ~25 s on a 2-core machine (python -m tests.parity: all)
SAMPLE_ROWS_QUICK = 60  # the default run's share of them (a seeded split); ``slow`` the rest
SEED = 0


def _line(key, outcome: str, reason: str) -> str:
    return f"{outcome:8} {key.op} {key.variant} {key.placement} w{key.world}: {reason}"


def _rows():
    from tests.parity import sweep

    rows = sweep.pick_rows(sweep.family_ops("train"), SAMPLE_ROWS, SEED, worlds=(2, 3))
    order = random.Random(SEED).sample(rows, len(rows))  # the same split each run
    return sorted(order[:SAMPLE_ROWS_QUICK]), sorted(order[SAMPLE_ROWS_QUICK:])


def _check(rows) -> None:
    from tests.parity import ledger, sweep

    result = sweep.run_sweep(rows, progress=False)
    cmp = ledger.compare(result.rows, ledger.read())
    problems = [_line(k, *result.rows[k]) for k in cmp.failures]
    problems += [_line(k, *result.rows[k]) + " (ledger: equal)" for k in cmp.regressions]
    assert not problems, "\n".join([*problems, sweep.summary(result)])
    assert len(result.rows) >= len(rows) * 0.9, sweep.summary(result)  # rows really ran


def test_training_patterns_sample():
    _check(_rows()[0])


@pytest.mark.slow
def test_training_patterns_sample_rest():
    _check(_rows()[1])


def test_planted_world_size_errors_are_seen():
    from tests.parity import patterns, sweep
    from tests.parity.verdict import DIFFERS

    ops = patterns.planted_ops()
    keys = [RowKey(name, "fn", "shard0", w) for name in patterns.PLANTED for w in (2, 3)]
    result = sweep.run_sweep(keys, progress=False, ops=ops)
    outcomes = {k: result.rows[k] for k in keys}
    assert all(o == DIFFERS for o, _ in outcomes.values()), outcomes
    for w in (2, 3):  # the gradient one is caught in backward, on a parameter upstream
        reason = outcomes[RowKey("planted.grad", "fn", "shard0", w)][1]
        assert "backward: grad args[1]" in reason, reason
