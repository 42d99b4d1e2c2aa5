"""CI's slice of the parity sweep: a fixed, seeded sample of rows on 2 and 3 ranks must have
no failing row (differs, disagree, hang, crash) and no row that regressed from ``equal`` in
the ledger. The whole sweep is ``python -m tests.parity --all`` (see tests/parity/sweep.py).
"""

from __future__ import annotations

# Rows drawn from all ~11k (op, variant, placement, world) rows with SEED: about 1 in 5.
# 2000 rows are ~3500 cases: ~2 minutes on a 2-core machine (imports and sample drawing
# ~15 s, ~30 cases a second), plus 20 s for each row that hangs. Lower it for speed, raise
# it for coverage (``python -m tests.parity --all`` runs every row in ~14 minutes).
SAMPLE_ROWS = 2000
SEED = 0


def _line(key, outcome: str, reason: str) -> str:
    return f"{outcome:8} {key.op} {key.variant} {key.placement} w{key.world}: {reason}"


def test_parity_sample():
    from tests.parity import ledger, sweep

    rows = sweep.pick_rows(None, SAMPLE_ROWS, SEED, worlds=(2, 3))
    result = sweep.run_sweep(rows, progress=False)
    cmp = ledger.compare(result.rows, ledger.read())
    problems = [_line(k, *result.rows[k]) for k in cmp.failures]
    problems += [_line(k, *result.rows[k]) + " (ledger: equal)" for k in cmp.regressions]
    assert not problems, "\n".join([*problems, sweep.summary(result)])
