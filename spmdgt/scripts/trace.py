"""Capture a window of a running job: every rank records ``-s`` seconds of ops to ``--dir``.

    GT_RUN_DIR=runs/job torchrun --nproc_per_node=2 train.py     # the job
    python -m spmdgt.scripts.trace -s 10 --dir traces/ --run-dir runs/job

Writes ``runs/job/trace_request.json``; each rank sees it on its next ~1 s tick, records the
window into ``traces/trace_<id>.rank<r>.log``, and this command waits for every rank's file
(the world size comes from the ranks' status files), merges them into ``traces/trace_<id>.log``
and prints its path. Draw it with ``python -m spmdgt.scripts.visualize``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections.abc import Sequence

from spmdgt.interceptor._publish import TRACE_REQUEST, write_json_atomic

__all__ = ["main", "merge", "request_trace"]


def request_trace(run_dir: str, seconds: float, out_dir: str) -> str:
    """Ask the job publishing into ``run_dir`` for a trace; returns the trace id."""
    trace_id = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(out_dir, exist_ok=True)
    write_json_atomic(
        os.path.join(run_dir, TRACE_REQUEST),
        {"id": trace_id, "seconds": seconds, "dir": os.path.abspath(out_dir)},
    )
    return trace_id


def _world(run_dir: str) -> int:
    worlds = []
    for path in glob.glob(os.path.join(run_dir, "rank*.json")):
        try:
            with open(path) as f:
                worlds.append(int(json.load(f)["world"]))
        except (OSError, ValueError, KeyError):
            continue
    return max(worlds, default=1)


def merge(paths: Sequence[str], output: str) -> str:
    """Concatenate per-rank trace files into ``output`` and remove them (so a glob over the
    folder does not read a rank twice); headers are kept: the reader aligns ranks by them."""
    with open(output, "w") as out:
        for p in sorted(paths):
            with open(p) as f:
                out.write(f.read())
    for p in paths:
        os.remove(p)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Capture a window of a running spmdgt job.")
    ap.add_argument("-s", "--seconds", type=float, default=10.0)
    ap.add_argument("--dir", default="traces", help="where trace files go")
    ap.add_argument("--run-dir", default=os.environ.get("GT_RUN_DIR", ".gt_run"))
    ap.add_argument("--timeout", type=float, default=None, help="give up after (default s+30)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"no run dir {args.run_dir!r}: start the job with GT_RUN_DIR={args.run_dir}")
        return 2
    trace_id = request_trace(args.run_dir, args.seconds, args.dir)
    world = _world(args.run_dir)
    print(f"trace {trace_id}: asked {world} rank(s) for {args.seconds:g}s ...", flush=True)
    pattern = os.path.join(args.dir, f"trace_{trace_id}.rank*.log")
    deadline = time.time() + (args.timeout or args.seconds + 30)
    while time.time() < deadline:
        found = [p for p in glob.glob(pattern) if not p.endswith(".partial")]
        if len(found) >= world:
            break
        time.sleep(0.5)
    found = sorted(p for p in glob.glob(pattern) if not p.endswith(".partial"))
    if not found:
        print("no rank answered (is the job running ops with GT_RUN_DIR set?)")
        return 1
    merged = merge(found, os.path.join(args.dir, f"trace_{trace_id}.log"))
    missing = world - len(found)
    note = f" ({missing} rank(s) missing)" if missing > 0 else ""
    print(f"{merged}: {len(found)} rank(s){note}")
    return 0 if not missing else 1


if __name__ == "__main__":
    raise SystemExit(main())
