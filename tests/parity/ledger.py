"""The checked-in ledger (``tests/parity/ledger.csv``): the last accepted outcome of every row.

Columns: op, variant, placement, world, outcome, reason. A sweep compares its rows with it:

- a row the ledger calls ``equal`` that is now anything else is a **regression** (fails);
- a ``differs``/``disagree``/``hang``/``crash`` row fails whatever the ledger says;
- a row that is now ``equal`` where the ledger has anything else is an **improvement**
  (reported; ``--update-ledger`` writes it down).

``--update-ledger`` rewrites the rows it ran and keeps the others, so a partial run
(``--ops``) refreshes just those ops.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from tests.parity.prepare import RowKey
from tests.parity.verdict import EQUAL, FAILURES

__all__ = ["LEDGER", "Comparison", "compare", "read", "write"]

LEDGER = Path(__file__).with_name("ledger.csv")
FIELDS = ("op", "variant", "placement", "world", "outcome", "reason")


def read(path: Path = LEDGER) -> dict[RowKey, tuple[str, str]]:
    """Every row of the ledger (empty when there is none yet)."""
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {
            RowKey(r["op"], r["variant"], r["placement"], int(r["world"])): (
                r["outcome"],
                r["reason"],
            )
            for r in csv.DictReader(f)
        }


def write(rows: dict[RowKey, tuple[str, str]], path: Path = LEDGER) -> None:
    """Merge ``rows`` into the ledger at ``path`` (rows not run are kept), sorted."""
    merged = read(path)
    merged.update(rows)
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(FIELDS)
        for key in sorted(merged):
            outcome, reason = merged[key]
            w.writerow([key.op, key.variant, key.placement, key.world, outcome, reason])


@dataclass
class Comparison:
    """A sweep's rows against the ledger."""

    failures: list[RowKey] = field(default_factory=list)
    regressions: list[RowKey] = field(default_factory=list)
    improvements: list[RowKey] = field(default_factory=list)
    new: list[RowKey] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.regressions


def compare(
    rows: dict[RowKey, tuple[str, str]], ledger: dict[RowKey, tuple[str, str]]
) -> Comparison:
    """Sort a sweep's rows into failures, regressions, improvements and rows new to the ledger."""
    c = Comparison()
    for key in sorted(rows):
        outcome = rows[key][0]
        before = ledger.get(key, (None, ""))[0]
        if outcome in FAILURES:
            c.failures.append(key)
        elif before == EQUAL and outcome != EQUAL:
            c.regressions.append(key)
        if before is None:
            c.new.append(key)
        elif outcome == EQUAL and before != EQUAL:
            c.improvements.append(key)
    return c
