"""``python -m tests.parity``: run the parity sweep (all of it, a seeded sample, or some ops),
print failing rows and the per-outcome counts, compare with the ledger, optionally update it.

Exit status 1 when a row fails (differs, disagree, hang, crash) or regresses from ``equal``.
"""

from __future__ import annotations

import argparse
import os
import sys

from tests.parity import sweep
from tests.parity.layouts import PLACEMENTS


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.parity", description=__doc__)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--all", action="store_true", help="every row (the default)")
    what.add_argument("--sample", type=int, metavar="N", help="N rows drawn with --seed")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument("--ops", type=_csv, help="comma-separated op names (OpInfo full names)")
    p.add_argument(
        "--family",
        choices=("opinfo", "train", "all"),
        default="all",
        help="OpInfo's ops, the training patterns (train.*), or both (default)",
    )
    p.add_argument("--variants", type=_csv, default=list(sweep.VARIANTS))
    p.add_argument("--placements", type=_csv, default=list(PLACEMENTS))
    p.add_argument("--worlds", type=lambda s: [int(w) for w in _csv(s)], default=[2, 3])
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a case may take")
    p.add_argument("--update-ledger", action="store_true", help="write the rows run")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--list-excluded", action="store_true", help="print the ops left out")
    p.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep every rank's log in DIR (a failing row names its files; with GT_DEBUG_*)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if args.keep_logs:
        os.environ["PARITY_LOGS"] = args.keep_logs  # the runner's (a harness setting)
    if args.list_excluded:
        for name, why in sweep.excluded():
            print(f"{name:45} {why}")
        return 0
    ops = args.ops if args.ops or args.family == "all" else sweep.family_ops(args.family)
    rows = sweep.pick_rows(ops, args.sample, args.seed, args.variants, args.placements, args.worlds)
    result = sweep.run_sweep(rows, timeout=args.timeout, progress=not args.quiet)
    return 0 if sweep.report(result, update_ledger=args.update_ledger) else 1


if __name__ == "__main__":
    sys.exit(main())
