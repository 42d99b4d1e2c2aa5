"""The autograd scenario family in CI: a seeded slice of its rows against one process and the
ledger, and its planted scenario (a gradient scaled by the world size) caught as ``differs``.

The whole family: ``python -m tests.parity.scenarios --family autograd``.
"""

from __future__ import annotations

from tests.parity import autograd_apis
from tests.parity.scenarios import check_family, run_planted
from tests.parity.verdict import DIFFERS


def test_autograd_family_slice_equals_one_process():
    assert check_family("autograd", sample=30, seed=0) == []


def test_planted_autograd_scenario_differs():
    rows = run_planted(autograd_apis.PLANTED, worlds=(2, 3))
    assert rows  # the planted scenario ran on every layout
    for key, (outcome, reason) in rows.items():
        assert outcome == DIFFERS, (key, outcome, reason)
