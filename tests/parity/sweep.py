"""The OpInfo parity sweep: every op variant on every placement equals one process, or raises
on every rank.

Rows are (op, variant, placement, world): OpInfo's ops (``op_db``) with float32 samples on
the CPU, variants ``fn`` (OpInfo's function/method call), ``inplace`` and ``out`` (where
OpInfo has them), the placements of ``layouts.py``, worlds of 2 and 3 ranks. Each row runs up
to two samples, forward and (where the op supports autograd) backward.

Ops left out, and why (everything else in ``op_db`` runs):

| op / rule                                             | why                                 |
|-------------------------------------------------------|-------------------------------------|
| OpInfo lists no float32 CPU dtype (25 ops): bitwise_*,| the sweep samples float32: integer-,|
| __rand__/__ror__/__rxor__, gcd, lcm, bincount,        | complex- or low-precision-only ops  |
| one_hot, view_as_real, imag, istft, tril/triu_indices,| have no sample to take              |
| unravel_index, _scaled_mm(_v2), flash/efficient       |                                     |
| attention, silu.complex, batch_norm.without_cudnn     |                                     |
| no sample with a strided tensor input of 1+ dims      | nothing to lay out: factory         |
| (28 ops): arange, ones, zeros, full, eye, empty*,     | functions (gt's creation ops have   |
| randn, randint, linspace, logspace, scalar_tensor,    | their own tests in tests/core)      |
| normal.number_mean, signal.windows.*, broadcast_shapes|                                     |
| to_sparse, sparse.sampled_addmm, sparse.mm.reduce     | sparse layouts: DTensor has none    |

Random ops (bernoulli, normal, dropout, rand_like, ...) stay in: OpInfo wraps them in a
fixed seed, so one process gives a reference that a sharded run must reproduce. Ops whose
results are uninitialised memory (``METADATA_ONLY``) are compared on shape and dtype only.
``python -m tests.parity --list-excluded`` prints the ops each rule leaves out.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from tests.parity import ledger, patterns, prepare, runner
from tests.parity.layouts import PLACEMENTS, fits, min_dim
from tests.parity.observe import primary_tensor
from tests.parity.prepare import RowKey, full_name
from tests.parity.verdict import CRASH, EQUAL, FAILURES, HANG, OUTCOMES, RAISES, judge, worst

__all__ = [
    "EXCLUDED",
    "METADATA_ONLY",
    "VARIANTS",
    "WORLDS",
    "SweepResult",
    "all_rows",
    "excluded",
    "family",
    "family_ops",
    "pick_rows",
    "run_sweep",
    "summary",
    "sweep_ops",
]

EXCLUDED: dict[str, str] = {
    "to_sparse": "returns a sparse tensor: DTensor has no sparse layouts",
    "sparse.sampled_addmm": "sparse CSR inputs: DTensor has no sparse layouts",
    "sparse.mm.reduce": "sparse CSR inputs: DTensor has no sparse layouts",
}
METADATA_ONLY: frozenset[str] = frozenset({"empty_like", "new_empty", "new_empty_strided"})
VARIANTS: tuple[str, ...] = ("fn", "inplace", "out")
WORLDS: tuple[int, ...] = (2, 3)


@cache
def _op_db() -> tuple[Any, ...]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return tuple(op_db)


@cache
def excluded() -> tuple[tuple[str, str], ...]:
    """(op, reason) for every op of ``op_db`` the sweep leaves out."""
    out = []
    for op in _op_db():
        name = full_name(op)
        if name in EXCLUDED:
            out.append((name, EXCLUDED[name]))
        elif torch.float32 not in op.supported_dtypes("cpu"):
            out.append((name, "no float32 CPU dtype in OpInfo"))
        elif not prepare.candidates(op):
            out.append((name, "no sample with a strided tensor input of 1+ dims"))
    return tuple(out)


@cache
def sweep_ops() -> dict[str, Any]:
    """The ops the sweep runs, by full name (``name.variant_test_name``): OpInfo's, then the
    training patterns (``train.*``, see patterns.py)."""
    left_out = {name for name, _ in excluded()}
    ops = {full_name(op): op for op in _op_db() if full_name(op) not in left_out}
    ops.update(patterns.pattern_ops())
    return ops


def family(name: str) -> str:
    """``train`` for a training pattern's row, ``opinfo`` for an OpInfo op's."""
    return "train" if name.startswith("train.") else "opinfo"


def family_ops(which: str) -> list[str]:
    """The names of one family's ops (``opinfo`` or ``train``), sorted."""
    return sorted(n for n in sweep_ops() if family(n) == which)


def _variants(op: Any) -> list[str]:
    found = ["fn"]
    if op.inplace_variant is not None:
        found.append("inplace")
    if op.supports_out:
        found.append("out")
    return found


def all_rows(
    ops: Iterable[str] | None = None,
    worlds: Iterable[int] = WORLDS,
    placements: Iterable[str] = PLACEMENTS,
    variants: Iterable[str] = VARIANTS,
) -> list[RowKey]:
    """Every row the sweep can run, restricted to the given ops, worlds, placements, variants
    (a placement needing 2-D inputs only for ops that have such a sample; a 2-D mesh layout
    only at its world, 4)."""
    table = sweep_ops()
    names = sorted(table) if ops is None else list(ops)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"not in the sweep: {', '.join(unknown)} (see --list-excluded)")
    rows = []
    for name in names:
        op = table[name]
        top = _max_dim(op)
        for variant in _variants(op):
            if variant not in variants:
                continue
            for placement in placements:
                if top < min_dim(placement):
                    continue
                rows.extend(
                    RowKey(name, variant, placement, w) for w in worlds if fits(placement, w)
                )
    return sorted(rows)


def pick_rows(
    ops: list[str] | None,
    sample: int | None,
    seed: int,
    variants: Iterable[str] = VARIANTS,
    placements: Iterable[str] = PLACEMENTS,
    worlds: Iterable[int] = WORLDS,
) -> list[RowKey]:
    """The rows a run asks for: all of them, or ``sample`` of them drawn with ``seed``."""
    rows = all_rows(ops, worlds, placements, variants)
    if sample is not None and sample < len(rows):
        rows = sorted(random.Random(seed).sample(rows, sample))
    return rows


def _max_dim(op: Any) -> int:
    return max(primary_tensor(s).dim() for s in prepare.candidates(op))


@dataclass
class SweepResult:
    """Each row's (outcome, reason); each row's path (the dearest any rank's op took in any
    of its samples: ``spmdgt.tensor._paths``); rows that found no sample; the time it took."""

    rows: dict[RowKey, tuple[str, str]] = field(default_factory=dict)
    paths: dict[RowKey, str] = field(default_factory=dict)
    unrun: dict[RowKey, str] = field(default_factory=dict)
    seconds: float = 0.0


def run_sweep(
    keys: list[RowKey],
    *,
    timeout: float = 20.0,
    progress: bool = True,
    ops: dict[str, Any] | None = None,
) -> SweepResult:
    """Run the rows ``keys``: prepare their cases, run them world by world, judge them.
    ``ops`` maps the rows' op names to their ops (default: ``sweep_ops()``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference too: two shared cores, and ranks to come
    try:
        return _run(keys, timeout, progress, sweep_ops() if ops is None else ops)
    finally:
        torch.set_num_threads(threads)


def _run(keys: list[RowKey], timeout: float, progress: bool, ops: dict[str, Any]) -> SweepResult:
    start = time.monotonic()
    cases, unrun = prepare.build_cases(keys, ops, METADATA_ONLY)
    if progress:
        print(
            f"parity: {len(keys)} rows, {len(cases)} cases prepared in "
            f"{time.monotonic() - start:.0f} s",
            file=sys.stderr,
        )
    verdicts: dict[RowKey, list[tuple[int, str, str]]] = {}
    paths: dict[RowKey, list[str]] = {}
    for world in sorted({c.key.world for c in cases}):
        todo = [c for c in cases if c.key.world == world]
        last = [time.monotonic()]

        def note(i: int, run: runner.CaseRun, todo=todo, last=last, world=world) -> None:
            case = todo[i]
            outcome, reason = prepare.plain_torch(
                judge, case.reference, run.status, run.observations, run.note
            )
            verdicts.setdefault(case.key, []).append((case.sample_no, outcome, reason))
            if run.path:
                paths.setdefault(case.key, []).append(run.path)
            if progress and (outcome in FAILURES or time.monotonic() - last[0] > 30):
                last[0] = time.monotonic()
                k = case.key
                what = f"{outcome} {k.op} {k.variant} {k.placement}" if outcome in FAILURES else ""
                print(f"  [world {world}] {i + 1}/{len(todo)} {what}", file=sys.stderr)

        def lost(i: int, todo=todo) -> bool:
            # A row whose sample hung or crashed is settled: its other samples would most
            # likely cost another timeout each.
            return any(v[1] in (HANG, CRASH) for v in verdicts.get(todo[i].key, ()))

        runner.run_cases(todo, world, timeout=timeout, on_result=note, skip=lost)
    result = SweepResult(unrun=unrun)
    result.rows = {k: worst(v) for k, v in sorted(verdicts.items())}
    from spmdgt.tensor._paths import worst as worst_path  # loaded already (runner)

    result.paths = {k: worst_path(v) for k, v in sorted(paths.items())}
    result.seconds = time.monotonic() - start
    return result


def summary(result: SweepResult) -> str:
    """Per-outcome counts and the pass rate (ops x variants x placements x worlds)."""
    rows = result.rows
    counts = Counter(outcome for outcome, _ in rows.values())
    total = len(rows) or 1
    ops = len({k.op for k in rows})
    lines = [
        f"parity: {len(rows)} rows ({ops} ops x variants x placements x worlds) "
        f"in {result.seconds:.0f} s; {len(result.unrun)} rows had no sample"
    ]
    for outcome in OUTCOMES:
        lines.append(f"  {outcome:9}{counts[outcome]:6}  {100 * counts[outcome] / total:5.1f}%")
    failures = sum(counts[o] for o in FAILURES)
    passed = counts[EQUAL] + counts[RAISES]
    by_path = Counter(result.paths.values())
    lines.append("paths: " + ", ".join(f"{p} {n}" for p, n in sorted(by_path.items())))
    lines.append(
        f"pass rate {100 * passed / total:.1f}% ({counts[EQUAL]} equal + {counts[RAISES]} "
        f"raises of {len(rows)}), equal {100 * counts[EQUAL] / total:.1f}%, "
        f"{failures} failures"
    )
    return "\n".join(lines)


def line(key: RowKey, outcome: str, reason: str) -> str:
    """One row as the sweeps print it."""
    where = f"{key.op} {key.variant} {key.placement} w{key.world}"
    return f"  {outcome:8} {where}: {reason}" if reason else f"  {outcome:8} {where}"


def report(result: SweepResult, update_ledger: bool = False) -> bool:
    """Print a run against the ledger (failures, regressions, improvements, the counts),
    write its rows when asked; True when nothing failed or regressed."""
    before = ledger.read()
    before_paths = ledger.read_paths()
    cmp = ledger.compare(result.rows, before, result.paths, before_paths)
    for title, keys in (("failures", cmp.failures), ("regressions from equal", cmp.regressions)):
        if keys:
            print(f"{title}:")
            for k in keys:
                print(line(k, *result.rows[k]))
    for title, keys in (("slower paths", cmp.slower), ("faster paths", cmp.faster)):
        if keys:
            print(f"{title} (ledger -> now):")
            for k in keys:
                print(line(k, f"{before_paths[k]} -> {result.paths[k]}", ""))
    if cmp.improvements:
        print("improvements (now equal):")
        for k in cmp.improvements:
            print(line(k, before[k][0] + " -> equal", ""))
    if cmp.new and before:
        print(f"{len(cmp.new)} rows are not in the ledger yet")
    print(summary(result))
    if update_ledger:
        ledger.write(result.rows, paths=result.paths)
        print(f"ledger: {len(result.rows)} rows written to {ledger.LEDGER}")
    return cmp.ok
