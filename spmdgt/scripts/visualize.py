"""Draw a timeline from instruction logs or traces: one lane per rank, one bar per op.

    python -m spmdgt.scripts.visualize traces/trace_*.log --output timeline.png \
        [--chrome timeline.json] [--level 0]

Bars are coloured by op kind (matmul, elementwise, reduce, memory, backward); collectives are
red and drawn on top, so communication stands out; gaps are idle time. Ranks are aligned on the
wall clock recorded in each file's header. ``--chrome`` also writes the Chrome/Perfetto trace
JSON (one process per rank, one thread per level) that opens in ui.perfetto.dev, chrome://tracing
and TensorBoard's trace viewer.

Lines it cannot read (a truncated last line, binary bytes, an unknown kind, a NaN duration) and
files it cannot open are left out and counted in one line on stderr; the rest is drawn. With
nothing left to draw it says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from spmdgt.interceptor._logreader import LogRecord, Skipped, read_logs

__all__ = ["KIND_COLORS", "chrome_trace", "draw_timeline", "main"]

KIND_COLORS = {
    "matmul": "#1f77b4",
    "elementwise": "#2ca02c",
    "reduce": "#9467bd",
    "memory": "#bcbd22",
    "backward": "#8c564b",
    "comm": "#d62728",
    "wait": "#ff9896",
}


def chrome_trace(records: Sequence[LogRecord]) -> dict:
    """The records as Chrome trace events: pid = rank, tid = level, ts/dur in microseconds."""
    t0 = min((r.t_unix for r in records), default=0.0)
    events: list[dict] = []
    for rank in sorted({r.rank for r in records}):
        name = {"name": f"rank {rank}"}
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": name})
        for level, label in ((0, "torch ops"), (1, "aten ops (DTensor, backward)")):
            meta = {"ph": "M", "name": "thread_name", "pid": rank, "tid": level}
            events.append({**meta, "args": {"name": label}})
    for r in records:
        args = {"seq": r.seq, "inputs": r.inputs, "outputs": r.outputs, "phase": r.phase}
        if r.placements != "-":
            args["placements"] = r.placements
        if r.nbytes:
            args["bytes"] = r.nbytes
        if r.group != "-":  # the mesh dim a collective ran on (log column 15)
            args["group"] = r.group
        if r.signal:
            args["signal"] = r.signal
        events.append(
            {
                "ph": "X",
                "name": r.op,
                "cat": r.kind,
                "pid": r.rank,
                "tid": r.level,
                "ts": (r.t_unix - t0) * 1e6,
                "dur": r.dur_us,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_timeline(records: Sequence[LogRecord], output: str, title: str | None = None) -> None:
    """Write a PNG timeline of ``records`` (one lane per rank) to ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no records to draw: is the trace empty?")
    ranks = sorted({r.rank for r in records})
    t0 = min(r.t_unix for r in records)
    t1 = max(r.t_unix + r.dur_us * 1e-6 for r in records)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(ranks)))
    lane = {rank: i for i, rank in enumerate(ranks)}
    # layers: torch-level ops (faded where they contain ATen ops: backward, DTensor calls),
    # then the ATen ops inside them, then collectives on top
    layers = ((0, False), (1, False), (None, True))
    for level, draw_comm in layers:
        by_kind: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for r in records:
            is_comm = r.kind in ("comm", "wait")
            if is_comm != draw_comm or (level is not None and r.level != level):
                continue
            start = (r.t_unix - t0) * 1e3
            width = max(r.dur_us * 1e-3, (t1 - t0) * 1e3 / 4000)  # keep tiny ops visible
            by_kind.setdefault((r.rank, r.kind), []).append((start, width))
        for (rank, kind), spans in by_kind.items():
            y = lane[rank]
            height = 0.7 if kind in ("comm", "wait") else 0.5
            ax.broken_barh(
                spans,
                (y - height / 2, height),
                facecolors=KIND_COLORS.get(kind, "#7f7f7f"),
                alpha=0.35 if level == 0 and kind == "backward" else 1.0,
            )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (t1 - t0) * 1e3)
    order = list(KIND_COLORS)
    kinds = sorted(
        {r.kind for r in records}, key=lambda k: (order.index(k) if k in order else len(order), k)
    )
    ax.legend(
        handles=[Patch(color=KIND_COLORS.get(k, "#7f7f7f"), label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12),
        ncol=len(kinds),
        frameon=False,
    )
    n_comm = sum(r.kind == "comm" for r in records)
    ax.set_title(title or f"{len(records)} ops on {len(ranks)} ranks, {n_comm} collectives")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Draw the timeline (and the Chrome JSON); 1 when there is nothing to draw."""
    ap = argparse.ArgumentParser(description="Draw a per-rank op timeline from spmdgt traces.")
    ap.add_argument("files", nargs="+", help="trace/instruction-log files or folders")
    ap.add_argument("--output", "-o", default="timeline.png", help="PNG to write")
    ap.add_argument("--chrome", help="also write Chrome/Perfetto trace JSON here")
    ap.add_argument("--level", type=int, choices=(0, 1), help="only ops of this level")
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    skipped = Skipped()
    records = read_logs(args.files, skipped)
    skipped.report("visualize")
    if args.level is not None:
        records = [r for r in records if r.level == args.level]
    if not records:
        print("visualize: no ops to draw (empty trace, or nothing readable)", file=sys.stderr)
        return 1
    draw_timeline(records, args.output, args.title)
    print(f"wrote {args.output}: {len(records)} ops, ranks {sorted({r.rank for r in records})}")
    if args.chrome:
        Path(args.chrome).write_text(json.dumps(chrome_trace(records)))
        print(f"wrote {args.chrome} (open in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
