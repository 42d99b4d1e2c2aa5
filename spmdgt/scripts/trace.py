"""Capture a window of a running job: every rank records ``-s`` seconds of ops, merged in one file.

    GT_RUN_DIR=runs/job torchrun --nproc_per_node=2 train.py     # the job
    python -m spmdgt.scripts.trace -s 10 --dir traces/ --run-dir runs/job

Writes ``runs/job/trace_request.json``; each rank sees it on its next ~1 s tick and records the
window into ``trace_<id>.rank<r>.log``. Ranks write only inside the run folder or inside the
``GT_TRACE_DIR`` the job was started with (they publish both as ``trace_dirs``): when ``--dir``
is inside one of them the ranks write there, otherwise into ``runs/job/traces/``. This command
waits for every rank's file (the world size comes from the ranks' status files), merges them
into ``<--dir>/trace_<id>.log``, removes the per-rank files and prints the merged path. A rank
that rejects the request says why in its status; when every rank has, this command prints the
reason and stops waiting. Lines it cannot read in a rank's file are left out of the merge and
counted in one line on stderr. Draw the result with ``python -m spmdgt.scripts.visualize``.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import sys
import time
from collections.abc import Sequence

from spmdgt._core import env as _env
from spmdgt.interceptor._logreader import MalformedLine, Skipped, parse_line, read_statuses
from spmdgt.interceptor._publish import (
    DEFAULT_TRACE_SUBDIR,
    TRACE_REQUEST,
    check_trace_request,
    write_json_atomic,
)

__all__ = ["main", "merge", "new_trace_id", "request_trace", "writable_dir"]


def new_trace_id() -> str:
    """A fresh request id: the time, and random bits so two requests in a second differ."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def request_trace(run_dir: str, seconds: float, out_dir: str, trace_id: str | None = None) -> str:
    """Ask the job publishing into ``run_dir`` for a trace written into ``out_dir``; returns the
    trace id. Ranks only honour an ``out_dir`` inside the run folder or the job's
    ``GT_TRACE_DIR`` (``writable_dir`` picks one); a path inside the run folder is sent relative
    to it, so ranks that mount it elsewhere find the same folder."""
    trace_id = trace_id or new_trace_id()
    os.makedirs(out_dir, exist_ok=True)
    real_out, real_run = os.path.realpath(out_dir), os.path.realpath(run_dir)
    inside_run = real_out == real_run or real_out.startswith(real_run.rstrip(os.sep) + os.sep)
    sent = os.path.relpath(real_out, real_run) if inside_run else real_out
    request = {"id": trace_id, "seconds": seconds, "dir": sent}
    check_trace_request(request)  # the ranks would reject it: say so here, before asking
    write_json_atomic(os.path.join(run_dir, TRACE_REQUEST), request)
    return trace_id


def writable_dir(run_dir: str, out_dir: str, statuses: Sequence[dict]) -> str:
    """Where ranks can write ``out_dir``'s trace: ``out_dir`` itself when it is inside the run
    folder or inside every publishing rank's ``trace_dirs``, else ``<run_dir>/traces``."""
    real = os.path.realpath(out_dir)

    def within(root: str) -> bool:
        root = os.path.realpath(root)
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    if within(run_dir):
        return out_dir
    roots = [s.get("trace_dirs") for s in statuses]
    if roots and all(
        isinstance(r, list) and any(isinstance(d, str) and within(d) for d in r) for r in roots
    ):
        return out_dir
    return os.path.join(run_dir, DEFAULT_TRACE_SUBDIR)


def _world(statuses: Sequence[dict]) -> int:
    return max((int(s.get("world", 1)) for s in statuses), default=1)


def merge(paths: Sequence[str], output: str, skipped: Skipped | None = None) -> str:
    """Concatenate per-rank trace files into ``output`` and remove them (so a glob over the
    folder does not read a rank twice); headers are kept: the reader aligns ranks by them.

    Only lines that parse are kept; the others (a truncated last line, binary bytes, an unknown
    kind, a NaN duration) are counted in ``skipped``, or raise ``ValueError`` without one.
    """
    out_lines: list[str] = []
    for p in sorted(paths):
        with open(p, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if not line.startswith("#"):
                try:
                    parse_line(line)
                except MalformedLine as e:
                    if skipped is None:
                        raise
                    skipped.line(f"{p}:{n}", e.why)
                    continue
            out_lines.append(line)
    with open(output, "w", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in out_lines))
    for p in paths:
        os.remove(p)
    return output


def _rejections(run_dir: str, trace_id: str) -> list[str]:
    """Each rank's reason, if every publishing rank rejected request ``trace_id``."""
    statuses = read_statuses(run_dir)
    reasons = []
    for s in statuses:
        t = s.get("trace")
        if not (isinstance(t, dict) and t.get("state") == "rejected" and t.get("id") == trace_id):
            return []
        detail = t.get("detail")
        shown = detail if isinstance(detail, str) and detail.isprintable() else repr(detail)
        reasons.append(f"rank {s['rank']}: {shown[:300]}")
    return reasons


def main(argv: Sequence[str] | None = None) -> int:
    """Request a trace, wait for every rank's file, merge them; 0 when every rank answered."""
    ap = argparse.ArgumentParser(description="Capture a window of a running spmdgt job.")
    ap.add_argument("-s", "--seconds", type=float, default=10.0)
    ap.add_argument("--dir", default="traces", help="where the merged trace goes")
    ap.add_argument("--run-dir", default=_env.text("GT_RUN_DIR") or ".gt_run")
    ap.add_argument("--timeout", type=float, default=None, help="give up after (default s+30)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"no run dir {args.run_dir!r}: start the job with GT_RUN_DIR={args.run_dir}")
        return 2
    skipped = Skipped()
    statuses = read_statuses(args.run_dir, skipped)
    rank_dir = writable_dir(args.run_dir, args.dir, statuses)
    try:
        trace_id = request_trace(args.run_dir, args.seconds, rank_dir)
    except ValueError as e:
        print(f"cannot ask for this trace: {e}")
        return 2
    world = _world(statuses)
    print(f"trace {trace_id}: asked {world} rank(s) for {args.seconds:g}s ...", flush=True)
    pattern = os.path.join(glob.escape(rank_dir), f"trace_{trace_id}.rank*.log")
    deadline = time.time() + (args.timeout or args.seconds + 30)
    while time.time() < deadline:
        found = glob.glob(pattern)
        if len(found) >= world:
            break
        reasons = _rejections(args.run_dir, trace_id)
        if reasons:
            print("every rank rejected the request:\n  " + "\n  ".join(reasons))
            skipped.report("trace")
            return 1
        time.sleep(0.5)
    found = sorted(glob.glob(pattern))
    if not found:
        print("no rank answered (is the job running ops with GT_RUN_DIR set?)")
        skipped.report("trace")
        return 1
    os.makedirs(args.dir, exist_ok=True)
    merged = merge(found, os.path.join(args.dir, f"trace_{trace_id}.log"), skipped)
    missing = world - len(found)
    note = f" ({missing} rank(s) missing)" if missing > 0 else ""
    print(f"{merged}: {len(found)} rank(s){note}")
    skipped.report("trace")
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main())
