"""Compare two training runs' losses step by step; fail past a tolerance (a CI check).

    python -m spmdgt.scripts.compare_runs runs/ddp runs/fsdp                 # TensorBoard logdirs
    python -m spmdgt.scripts.compare_runs ddp.json fsdp.json --rtol 1e-3     # summary JSONs
    python -m spmdgt.scripts.compare_runs runs/ddp fsdp.json --atol 1e-4 --rtol 0

The check to run when a parallelism setting changes (strategy, world size, placements,
compile, accumulation): the same model, data and seed should give the same losses, up to
floating-point reduction order. Each side is one of:

- a **TensorBoard logdir** written by ``DistributedTrainer(logdir=...)``: its ``train/loss``
  scalars (``--tag`` picks another, e.g. ``val/loss``), by global step. The folder itself,
  one event file, or a parent folder holding exactly one run with that tag. Reading event
  files needs the ``tensorboard`` package (the ``tensorboard`` and ``dev`` extras);
- a **summary JSON**: the dict ``DistributedTrainer.train()`` returns, dumped with
  ``json.dump`` (its ``losses``: the per-step losses, averaged over the ranks; step 1 is the
  first); or a bare JSON list of losses; ``--key`` picks another list.

For every step both runs logged: ``|A - B| <= atol + rtol * |B|`` (numpy's ``isclose``, B the
reference; a NaN matches only a NaN). It prints the largest absolute difference with its step
and both values, then either ``OK`` (exit 0) or the steps past the tolerance, each with both
values (exit 1). Steps only one run logged fail the check too, unless ``--common-only``.
Exit 2: a side could not be read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Comparison", "Series", "compare", "main", "read_series"]

DEFAULT_TAG = "train/loss"  # what DistributedTrainer's MetricsLogger writes per step
DEFAULT_KEY = "losses"  # the per-step losses in the trainer's summary dict
EVENTS = "events.out.tfevents"


class ReadError(ValueError):
    """A run could not be read: the message names the path and what was looked for."""


@dataclass(frozen=True)
class Series:
    """One run's losses by step, and where they came from."""

    path: str
    source: str  # "TensorBoard tag 'train/loss'" / "summary JSON key 'losses'"
    values: dict[int, float]


@dataclass(frozen=True)
class Comparison:
    """The step-by-step comparison of two runs."""

    common: list[int]
    only_a: list[int]
    only_b: list[int]
    worst_step: int | None  # the largest |A - B| (a NaN mismatch counts as infinite)
    worst_abs: float
    failures: list[tuple[int, float, float, float]]  # step, A, B, allowed difference

    @property
    def ok(self) -> bool:
        return not self.failures


# ----------------------------------------------------------------------------- reading


def _event_dirs(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) that hold TensorBoard event files."""
    found = []
    for d, _dirs, files in os.walk(root):
        if any(f.startswith(EVENTS) for f in files):
            found.append(Path(d))
    return sorted(found)


def _read_tensorboard(path: Path, tag: str) -> Series:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise ReadError(
            f"{path}: reading a TensorBoard logdir needs the tensorboard package: pip install "
            "tensorboard (or spmdgt's tensorboard / dev extra); summary JSON files need nothing"
        ) from e

    def scalars(p: Path) -> dict[int, float] | None:
        acc = EventAccumulator(str(p), size_guidance={"scalars": 0})  # 0: keep every point
        acc.Reload()
        if tag not in acc.Tags().get("scalars", []):
            return None
        return {int(e.step): float(e.value) for e in acc.Scalars(tag)}  # a re-logged step: last

    if path.is_file():
        runs = {path: scalars(path)}
    else:
        dirs = _event_dirs(path)
        if not dirs:
            raise ReadError(f"{path}: no TensorBoard event files ({EVENTS}*) in it or below")
        runs = {d: scalars(d) for d in dirs}
    with_tag = {p: v for p, v in runs.items() if v is not None}
    if not with_tag:
        tags = set()
        for p in runs:
            acc = EventAccumulator(str(p))
            acc.Reload()
            tags.update(acc.Tags().get("scalars", []))
        raise ReadError(
            f"{path}: no scalar tag {tag!r} (scalars found: {sorted(tags) or 'none'}; pick one "
            "with --tag)"
        )
    if len(with_tag) > 1:
        names = ", ".join(str(p) for p in with_tag)
        raise ReadError(f"{path}: {len(with_tag)} runs log {tag!r} ({names}): name one folder")
    (run, values), *_ = with_tag.items()
    return Series(str(run), f"TensorBoard tag {tag!r}", values)


def _read_json(path: Path, key: str) -> Series:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReadError(f"{path}: cannot read it as JSON ({e})") from e
    where = f"summary JSON key {key!r}"
    first = 1
    if isinstance(doc, dict):
        if key not in doc:
            has = ", ".join(sorted(doc)[:12])
            hint = (
                " (a summary from an older spmdgt holds only final_loss / avg_loss: compare "
                "TensorBoard logdirs instead)"
                if "final_loss" in doc
                else ""
            )
            raise ReadError(f"{path}: no {key!r} in it (keys: {has}){hint}")
        first = int(doc.get("first_step", 0)) + 1  # after a resume, if the summary says so
        doc = doc[key]
    else:
        where = "JSON list"
    if isinstance(doc, dict):  # {"step": loss}
        try:
            values = {int(k): _number(v) for k, v in doc.items()}
        except (TypeError, ValueError) as e:
            raise ReadError(f"{path}: {where} is not a step -> loss mapping ({e})") from e
    elif isinstance(doc, list):
        try:
            values = {first + i: _number(v) for i, v in enumerate(doc)}
        except (TypeError, ValueError) as e:
            raise ReadError(f"{path}: {where} is not a list of numbers ({e})") from e
    else:
        raise ReadError(f"{path}: {where} is a {type(doc).__name__}, not a list of losses")
    if not values:
        raise ReadError(f"{path}: {where} is empty")
    return Series(str(path), where, values)


def _number(v: object) -> float:
    if v is None:  # strict JSON writers store NaN as null
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def read_series(path: str | os.PathLike, tag: str = DEFAULT_TAG, key: str = DEFAULT_KEY) -> Series:
    """One run's losses by step: a TensorBoard logdir / event file, or a summary JSON."""
    p = Path(path)
    if not p.exists():
        raise ReadError(f"{p}: no such file or folder")
    if p.is_dir() or p.name.startswith(EVENTS):
        return _read_tensorboard(p, tag)
    return _read_json(p, key)


# ----------------------------------------------------------------------------- comparing


def compare(a: Series, b: Series, atol: float, rtol: float) -> Comparison:
    """Every step both runs logged: ``|A - B| <= atol + rtol * |B|``, NaN only matching NaN."""
    common = sorted(set(a.values) & set(b.values))
    worst_step, worst = None, -1.0
    failures = []
    for step in common:
        x, y = a.values[step], b.values[step]
        if math.isnan(x) or math.isnan(y):
            diff = 0.0 if (math.isnan(x) and math.isnan(y)) else math.inf
        else:
            diff = abs(x - y)
        allowed = atol + rtol * abs(y) if not math.isnan(y) else 0.0
        if diff > worst:
            worst_step, worst = step, diff
        if diff > allowed:
            failures.append((step, x, y, allowed))
    return Comparison(
        common=common,
        only_a=sorted(set(a.values) - set(b.values)),
        only_b=sorted(set(b.values) - set(a.values)),
        worst_step=worst_step,
        worst_abs=max(worst, 0.0),
        failures=failures,
    )


def _steps(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    if list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"{len(steps)} ({steps[0]}..{steps[-1]})" if len(steps) > 1 else str(steps[0])
    head = ", ".join(map(str, steps[:8]))
    return f"{len(steps)} ({head}{', ...' if len(steps) > 8 else ''})"


def report(a: Series, b: Series, c: Comparison, atol: float, rtol: float, common_only: bool):
    """Print the comparison; return the exit status (0 OK, 1 past the tolerance)."""
    print(f"A: {a.path} ({a.source}, {len(a.values)} steps)")
    print(f"B: {b.path} ({b.source}, {len(b.values)} steps)")
    print(f"steps in both: {_steps(c.common)}")
    if c.only_a or c.only_b:
        print(f"steps only in A: {_steps(c.only_a)}; only in B: {_steps(c.only_b)}")
    if not c.common:
        print("FAILED: the runs have no step in common")
        return 1
    s = c.worst_step
    x, y = a.values[s], b.values[s]
    rel = c.worst_abs / abs(y) if y and math.isfinite(c.worst_abs) else math.nan
    print(
        f"largest difference: {c.worst_abs:.3e} at step {s} (A {x:.9g}, B {y:.9g}; "
        f"relative {rel:.3e})"
    )
    print(f"tolerance: |A - B| <= atol + rtol * |B| with atol {atol:g}, rtol {rtol:g}")
    missing = (c.only_a or c.only_b) and not common_only
    if c.ok and not missing:
        print(f"OK: all {len(c.common)} common steps within tolerance")
        return 0
    if c.failures:
        step, x, y, allowed = c.failures[0]
        print(
            f"FAILED: {len(c.failures)} of {len(c.common)} steps past the tolerance; the first at "
            f"step {step}: A {x:.9g}, B {y:.9g} (|A - B| {abs(x - y):.3e} > {allowed:.3e})"
        )
        for step, x, y, allowed in c.failures[1:10]:
            print(f"  step {step}: A {x:.9g}, B {y:.9g} (|A - B| {abs(x - y):.3e} > {allowed:.3e})")
        if len(c.failures) > 10:
            print(f"  ... {len(c.failures) - 10} more")
    if missing:
        print("FAILED: the runs logged different steps (--common-only compares the shared ones)")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[6:]),
    )
    ap.add_argument("a", help="run A: a TensorBoard logdir / event file, or a summary JSON")
    ap.add_argument("b", help="run B (the reference for rtol), same kinds")
    ap.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (1e-6)")
    ap.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="relative tolerance, times |B| (1e-4: fp32 losses under two parallelism "
        "settings agree to ~1e-6 relative at first and drift apart with the steps; "
        "loosen it for long runs or bf16)",
    )
    ap.add_argument("--tag", default=DEFAULT_TAG, help=f"TensorBoard scalar ({DEFAULT_TAG})")
    ap.add_argument("--key", default=DEFAULT_KEY, help=f"summary JSON list ({DEFAULT_KEY})")
    ap.add_argument("--common-only", action="store_true", help="compare the shared steps only")
    args = ap.parse_args(argv)
    if args.atol < 0 or args.rtol < 0:
        ap.error("--atol and --rtol must be >= 0")
    try:
        a = read_series(args.a, args.tag, args.key)
        b = read_series(args.b, args.tag, args.key)
    except ReadError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    c = compare(a, b, args.atol, args.rtol)
    return report(a, b, c, args.atol, args.rtol, args.common_only)


if __name__ == "__main__":
    sys.exit(main())
