"""The checked-in ledger (``tests/parity/ledger.csv``): the last accepted outcome of every row.

Columns: op, variant, placement, world, outcome, reason, path. A sweep compares its rows
with it:

- a row the ledger calls ``equal`` that is now anything else is a **regression** (fails);
- a ``differs``/``disagree``/``hang``/``crash`` row fails whatever the ledger says;
- a row that is now ``equal`` where the ledger has anything else is an **improvement**
  (reported; ``--update-ledger`` writes it down);
- a row ``equal`` both times whose path is now dearer than the ledger's (``fast`` <
  ``dtensor`` < ``rewrite`` < ``fallback`` < ``raised``, ``spmdgt.tensor._paths``) is
  **slower** (fails: an op slid from DTensor's path to the gather fallback, say); one that
  is now cheaper is **faster** (reported). An empty ``path`` (never recorded) compares with
  nothing. docs/exactness.md says how to read the column.

``--update-ledger`` rewrites the rows it ran and keeps the others, so a partial run
(``--ops``) refreshes just those ops.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from tests.parity.prepare import RowKey
from tests.parity.verdict import EQUAL, FAILURES

__all__ = ["LEDGER", "Comparison", "compare", "read", "read_paths", "write"]

LEDGER = Path(__file__).with_name("ledger.csv")
FIELDS = ("op", "variant", "placement", "world", "outcome", "reason", "path")


def _records(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _key(r: dict[str, str]) -> RowKey:
    return RowKey(r["op"], r["variant"], r["placement"], int(r["world"]))


def read(path: Path = LEDGER) -> dict[RowKey, tuple[str, str]]:
    """Every row's (outcome, reason) (empty when there is no ledger yet)."""
    return {_key(r): (r["outcome"], r["reason"]) for r in _records(path)}


def read_paths(path: Path = LEDGER) -> dict[RowKey, str]:
    """Every row's recorded path ("" where none was recorded)."""
    return {_key(r): r.get("path") or "" for r in _records(path)}


def write(
    rows: dict[RowKey, tuple[str, str]],
    path: Path = LEDGER,
    paths: dict[RowKey, str] | None = None,
) -> None:
    """Merge ``rows`` and their ``paths`` into the ledger at ``path`` (rows not run are
    kept, their paths too; a row run without a path keeps the one recorded), sorted."""
    merged = read(path)
    merged.update(rows)
    merged_paths = read_paths(path)
    merged_paths.update((k, p) for k, p in (paths or {}).items() if p)
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(FIELDS)
        for key in sorted(merged):
            outcome, reason = merged[key]
            row = [key.op, key.variant, key.placement, key.world, outcome, reason]
            w.writerow([*row, merged_paths.get(key, "")])


@dataclass
class Comparison:
    """A sweep's rows against the ledger."""

    failures: list[RowKey] = field(default_factory=list)
    regressions: list[RowKey] = field(default_factory=list)
    improvements: list[RowKey] = field(default_factory=list)
    new: list[RowKey] = field(default_factory=list)
    slower: list[RowKey] = field(default_factory=list)  # equal both times, a dearer path
    faster: list[RowKey] = field(default_factory=list)  # equal both times, a cheaper path

    @property
    def ok(self) -> bool:
        return not self.failures and not self.regressions and not self.slower


def compare(
    rows: dict[RowKey, tuple[str, str]],
    ledger: dict[RowKey, tuple[str, str]],
    paths: dict[RowKey, str] | None = None,
    ledger_paths: dict[RowKey, str] | None = None,
) -> Comparison:
    """Sort a sweep's rows into failures, regressions, improvements and rows new to the
    ledger; with ``paths`` and ``ledger_paths``, rows equal both times into slower and faster
    (see the module docstring)."""
    c = Comparison()
    if paths and ledger_paths:
        from spmdgt.tensor._paths import rank  # the path order; loaded by the sweep already

        for key in sorted(paths):
            now, before = paths[key], ledger_paths.get(key, "")
            if not now or not before or now == before:
                continue
            if rows.get(key, ("", ""))[0] != EQUAL or ledger.get(key, ("", ""))[0] != EQUAL:
                continue  # a raising or failing row is judged by its outcome
            (c.slower if rank(now) > rank(before) else c.faster).append(key)
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
