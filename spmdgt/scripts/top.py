"""Live view of a running job, one row per rank: ops/s, time share per op kind, collectives, idle.

    GT_RUN_DIR=runs/job torchrun --nproc_per_node=4 train.py
    python -m spmdgt.scripts.top --run-dir runs/job          # refreshes every second; Ctrl-C
    python -m spmdgt.scripts.top --run-dir runs/job --once   # one frame (scripts, tests)

Reads the ``rank<r>.json`` status files ranks rewrite about once a second (``_publish``), so it
can start before the job (it waits) or after it. Columns: ops/s and busy% over the rank's last
interval; the share of wall time in each op kind; collectives/s and bytes so far; ``age``, the
seconds since the rank last published (a rank stuck in one long op or a hang shows here). On a
2-D (or N-D) mesh a last column, ``by mesh dim``, splits the collectives so far by the mesh dim
they ran on (``tp:24 dp_shard:12``): TP's inside a node, FSDP's across. A 1-D run, whose
collectives all run on the ``world`` group, prints without it, as before.

A status file that is not one (half-written, binary, a JSON list, a NaN count) is left out and
counted: ``--once`` says so in one line on stderr, the live view in the frame's last line. While
no rank has published, the frame names the folder it waits on (absolute path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from spmdgt._core import env as _env
from spmdgt.interceptor._logreader import Skipped, read_statuses

__all__ = ["load_statuses", "main", "render"]

_KINDS = ("matmul", "elementwise", "reduce", "memory", "backward", "comm")
_SHORT = {"matmul": "mm", "elementwise": "elem", "reduce": "red", "memory": "mem",
          "backward": "bwd", "comm": "comm"}  # fmt: skip


def load_statuses(run_dir: str, skipped: Skipped | None = None) -> list[dict]:
    """Every rank's latest status, by rank; files that are not a status are counted in
    ``skipped`` and left out (see ``_logreader.read_statuses``)."""
    return read_statuses(run_dir, skipped)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GB"


def _by_dim(s: dict) -> str:
    groups = s.get("collectives_by_group", {})
    return " ".join(f"{g}:{n}" for g, n in sorted(groups.items()) if g != "-") or "-"


def _has_mesh_dims(statuses: list[dict]) -> bool:
    """Whether any rank ran a collective on a named mesh dim (not the world group)."""
    return any(g not in ("world", "-") for s in statuses for g in s.get("collectives_by_group", {}))


def render(
    statuses: list[dict],
    now: float | None = None,
    width: int | None = None,
    run_dir: str | None = None,
    skipped: Skipped | None = None,
) -> str:
    """One frame of the view as text (no terminal control codes).

    ``run_dir`` is named (absolute) while no rank has published; ``skipped``, when it counted
    something, adds its one-line summary at the bottom. ``width`` cuts lines (default 110, 160
    with the mesh-dim column).
    """
    now = time.time() if now is None else now
    dims = _has_mesh_dims(statuses)
    if width is None:
        width = 160 if dims else 110
    head = (
        f"{'rank':>4} {'ops/s':>9} {'busy%':>6} "
        + " ".join(f"{_SHORT[k]:>5}" for k in _KINDS)
        + f" {'idle%':>6} {'coll/s':>7} {'colls':>7} {'coll B':>8} {'phase':>5} {'age':>5}"
        + ("  by mesh dim" if dims else "")
    )
    lines = [f"spmdgt top  {time.strftime('%H:%M:%S', time.localtime(now))}", head]
    if not statuses:
        where = f" {os.path.abspath(run_dir)}" if run_dir is not None else ""
        lines.append(
            f"  (waiting for ranks to publish in{where}: start the job with GT_RUN_DIR set to "
            "this folder)"
        )
    for s in statuses:
        shares = s.get("time_share", {})
        age = now - s.get("updated_unix", now)
        lines.append(
            f"{s.get('rank', '?'):>4} {s.get('ops_per_s', 0):>9.0f} "
            f"{100 * s.get('busy_frac', 0):>6.1f} "
            + " ".join(f"{100 * shares.get(k, 0):>5.1f}" for k in _KINDS)
            + f" {100 * s.get('idle_frac', 0):>6.1f} {s.get('collectives_per_s', 0):>7.1f} "
            f"{s.get('collectives_total', 0):>7} {_bytes(s.get('collective_bytes', 0)):>8} "
            f"{s.get('phase', '-'):>5} {age:>5.1f}" + (f"  {_by_dim(s)}" if dims else "")
        )
    total = sum(s.get("ops_per_s", 0) for s in statuses)
    if statuses:
        lines.append(f"total {total:.0f} ops/s over {len(statuses)} rank(s)")
    out = [line[:width] for line in lines]
    if not statuses:  # the folder's path is the point of this line: never cut it
        out[-1] = lines[-1]
    if skipped:
        out.append(skipped.summary("top"))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run top: live frames until Ctrl-C, or one frame with ``--once``."""
    ap = argparse.ArgumentParser(description="Live per-rank view of a running spmdgt job.")
    ap.add_argument("--run-dir", default=_env.text("GT_RUN_DIR") or ".gt_run")
    ap.add_argument("--width", type=int, default=None, help="characters per line")
    ap.add_argument("--once", action="store_true", help="print one frame and exit")
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.once:
        skipped = Skipped()
        print(render(load_statuses(args.run_dir, skipped), width=args.width, run_dir=args.run_dir))
        skipped.report("top")
        return 0
    try:
        while True:
            skipped = Skipped()
            statuses = load_statuses(args.run_dir, skipped)
            frame = render(statuses, width=args.width, run_dir=args.run_dir, skipped=skipped)
            sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")  # home + clear: plain ANSI
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
