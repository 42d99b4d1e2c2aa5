"""CI's slice of the "random" scenario family (tests/parity/random_ops.py): every op or module
that draws, on sharded layouts, gives one process's values and leaves the generator where
one process leaves it; and a scenario that advances the generator once more on sharded
inputs comes out ``differs`` (the family's ``PLANTED``), so the comparison of states bites.

The whole family: ``python -m tests.parity.scenarios --family random`` (a few minutes here).
"""

from __future__ import annotations

from tests.parity import random_ops
from tests.parity.scenarios import check_family, run_planted
from tests.parity.verdict import DIFFERS


def test_random_slice_is_exact():
    # 30 rows drawn with a fixed seed: well under a minute on CI's two cores
    assert check_family("random", sample=30, seed=0) == []


def test_planted_extra_draw_differs():
    rows = run_planted(random_ops.PLANTED, worlds=(2, 3))
    assert rows, "no planted rows ran"
    for key, (outcome, reason) in rows.items():
        assert outcome == DIFFERS, (key, outcome, reason)
        assert "rng_state" in reason, (key, reason)  # the values agree: the state is caught
