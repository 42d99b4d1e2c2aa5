"""CI's slice of the optimizer sweep (``tests/parity/optimizers.py``, family ``optim``).

A seeded sample of the family's rows must have no failing row and none that regressed from
``equal`` in the ledger; the planted scenarios (Adam whose sharded parameters take the
learning rate times the world size) must come out ``differs``: a sweep that passed them could
not see the defect it exists for. The whole family: ``python -m tests.parity.scenarios
--family optim`` (docs/exactness.md, "Optimizers").
"""

from __future__ import annotations

import pytest

from tests.parity import optimizers
from tests.parity.scenarios import check_family, run_planted
from tests.parity.verdict import DIFFERS


# 16 of the family's ~1,160 rows (~10 s on 2 cores); the slow test draws 120 more
def test_optim_slice_has_no_failing_row():
    assert check_family("optim", sample=16, seed=0) == []


@pytest.mark.slow
def test_optim_wider_slice_has_no_failing_row():
    assert check_family("optim", sample=120, seed=1) == []


def test_planted_optimizer_bugs_come_out_differs():
    rows = run_planted(optimizers.PLANTED, worlds=(2,))
    assert rows, "no planted row ran"
    wrong = {key: verdict for key, verdict in rows.items() if verdict[0] != DIFFERS}
    assert not wrong, wrong
