"""The ledger's ``path`` column: written and read back, and compared as test_parity does (a
row equal both times whose path got dearer fails; cheaper is reported; raising rows and
unrecorded paths compare with nothing). No ranks: made-up rows."""

from __future__ import annotations

from tests.parity import ledger
from tests.parity.prepare import RowKey

EQ, RAISES = ("equal", ""), ("raises", "ValueError: no")


def _key(op: str) -> RowKey:
    return RowKey(op, "fn", "shard0", 2)


def test_paths_are_written_and_kept(tmp_path):
    path = tmp_path / "ledger.csv"
    ledger.write({_key("a"): EQ, _key("b"): EQ}, path, paths={_key("a"): "dtensor"})
    assert ledger.read_paths(path) == {_key("a"): "dtensor", _key("b"): ""}
    # a later run of b alone: a's path stays; a run without a path keeps the recorded one
    ledger.write({_key("b"): EQ}, path, paths={_key("b"): "fallback"})
    ledger.write({_key("a"): EQ}, path, paths={_key("a"): ""})
    assert ledger.read_paths(path) == {_key("a"): "dtensor", _key("b"): "fallback"}
    assert ledger.read(path) == {_key("a"): EQ, _key("b"): EQ}


def test_a_dearer_path_fails_a_cheaper_one_is_reported():
    keys = [_key(op) for op in ("slid", "sped", "same", "raising", "unrecorded")]
    rows = {k: EQ for k in keys} | {keys[3]: RAISES}
    before = dict(rows)
    now = dict(zip(keys, ("fallback", "fast", "dtensor", "raised", "fallback")))
    recorded = dict(zip(keys, ("dtensor", "dtensor", "dtensor", "fallback", "")))
    cmp = ledger.compare(rows, before, now, recorded)
    assert cmp.slower == [keys[0]] and cmp.faster == [keys[1]]
    assert not cmp.ok
    # without paths, the same rows compare on outcomes alone (the scenario sweeps)
    assert ledger.compare(rows, before).ok
