"""CI's slice of the "state" scenario family (tests/parity/state_patterns.py): patterns whose
result lives beside an op's outputs (generator states restored, modules writing their own
state in place, custom autograd Functions, hooks, gradients accumulated), on sharded
layouts, give one process's values and leave that state where one process leaves it. The
rows that were wrong (2026-11-30: the rows ``nn.Embedding(max_norm=)`` and ``EmbeddingBag``
renormalise, BatchNorm's and InstanceNorm's running statistics, left unwritten or written on
some ranks only) run on the layouts they were wrong on; a sample of the rest besides.

The whole family: ``python -m tests.parity.scenarios --family state`` (~30 s here).
"""

from __future__ import annotations

from tests.parity import ledger, state_patterns
from tests.parity.scenarios import VARIANT, check_family, run_planted, run_rows
from tests.parity.sweep import RowKey, line
from tests.parity.verdict import DIFFERS, EQUAL

WERE_WRONG = (
    "state.embedding.max_norm.sharded_weight",
    "state.embedding.max_norm.sharded_ids",
    "state.embedding_bag.max_norm",
    "state.batchnorm.running_stats",
    "state.instance_norm.running_stats",
)


def test_rows_that_were_wrong_are_exact():
    rows = [
        RowKey(name, VARIANT, layout, world)
        for name in WERE_WRONG
        for layout, world in (("shard1", 2), ("subrep", 3), ("shard0", 3))
    ]
    got = run_rows(rows).rows
    bad = [line(k, *got[k]) for k in rows if got[k][0] != EQUAL]
    assert not bad, bad
    assert not ledger.compare(got, ledger.read()).regressions


def test_state_sample_is_exact():
    assert check_family("state", sample=16, seed=0) == []


def test_planted_stale_statistics_differ():
    rows = run_planted(state_patterns.PLANTED, worlds=(2,))
    assert rows, "no planted rows ran"
    for key, (outcome, reason) in rows.items():
        assert outcome == DIFFERS and "mean" in reason, (key, outcome, reason)
