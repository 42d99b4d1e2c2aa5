"""Draw PNG charts from benchmark result files (``benchmarks/*.py --json PATH``).

    python -m spmdgt.scripts.plot results/*.json [--out docs/charts] [--mode compute]

One or more charts per file, by the ``benchmark`` the file names:

- ``scaling`` (``benchmarks/scaling.py``): speedup over 1 rank against the rank count, one panel
  per workload and timing mode, spmdgt (solid), raw DTensor (dashed) and one torch process
  with the same threads (dotted) beside the ideal line (speedup = ranks); and overhead bars:
  spmdgt's time over DTensor's and over torch's at each rank count above 1;
- ``core`` (``benchmarks/bench_core.py``): overhead bars, spmdgt's time over its baseline
  (plain torch, raw DTensor, ...) per case, with the targets;
- ``interceptor`` (``benchmarks/bench_interceptor.py``): cost per op of each tool level over
  plain torch;
- ``trainer`` (``benchmarks/bench_trainer.py``): step time by strategy, the trainer beside the
  hand-written loop, and the compile section's step time per side;
- ``compile`` (``benchmarks/bench_compile.py``): speed-up over eager per case.

Every chart's footer names the machine, device, versions, git revision and date the file
records. A chart goes to ``--out`` (default: the JSON file's folder) as ``<file stem>-<chart>.png``.
This reads JSON only (it never imports ``benchmarks/``); matplotlib is needed (the ``dev`` extra).
Files it cannot read are named on stderr and skipped; with nothing drawn it exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["CHARTS", "draw", "main"]

FORMAT = "spmdgt-benchmark/1"


def _plt():
    """matplotlib.pyplot on the Agg backend, or a clear error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(
            "spmdgt.scripts.plot needs matplotlib to draw charts: pip install matplotlib "
            "(it is in the dev extra: pip install -e '.[dev]')"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _footer(doc: dict) -> str:
    """One line saying where the figures came from."""
    c = doc.get("context", {})
    m = c.get("machine", {})
    git = c.get("git") or {}
    rev = (git.get("revision") or "?")[:10] + ("+dirty" if git.get("dirty") else "")
    where = f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores"
    if m.get("gpu"):
        where += f", {m['gpu']}"
    return (
        f"{where}; device {c.get('device', '?')}; torch {c.get('torch', '?')}, spmdgt "
        f"{c.get('spmdgt', '?')} @ {rev}; {c.get('date', '?')}"
    )


def _save(fig, doc: dict, out: Path) -> Path:
    fig.text(0.01, 0.005, _footer(doc), fontsize=7, color="#555555", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _plt().close(fig)
    return out


def _log2_axis(axis, set_scale) -> None:
    """A base-2 log axis labelled in plain numbers (0.25, 1, 4), not powers of two."""
    from matplotlib.ticker import FuncFormatter

    set_scale("log", base=2)
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def _from_one(values: Sequence[float]) -> list[float]:
    """Bar widths for ratio bars drawn from 1 (left or right of the 1.0 line)."""
    return [v - 1.0 for v in values]


# ----------------------------------------------------------------------------- scaling

_GROUP_TITLES = {"square": "square matmuls", "batch": "large-batch matmuls", "mlp": "MLP forwards"}
_MODE_TITLES = {"compute": "compute only", "read": "with .numpy() (as GT timed it)"}
_SIDE_STYLE = {"spmdgt": ("-", "o"), "dtensor": ("--", "s"), "torch": (":", "^")}
_SIDE_LABEL = {"spmdgt": "spmdgt", "dtensor": "raw DTensor", "torch": "torch, 1 process"}


def _scaling_speedup(doc: dict, out: Path, modes: Sequence[str]) -> Path:
    plt = _plt()
    res = doc["results"]
    rows = res["rows"]
    groups = [g for g in _GROUP_TITLES if any(r["group"] == g for r in rows)]
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(
        len(modes), len(groups), figsize=(5 * len(groups), 4 * len(modes)), squeeze=False
    )
    from matplotlib.lines import Line2D

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, mode in enumerate(modes):
        for j, group in enumerate(groups):
            ax = axes[i][j]
            ax.plot(ranks, ranks, color="black", lw=1, ls="--")
            shapes = list(dict.fromkeys(r["shape"] for r in rows if r["group"] == group))
            handles = [Line2D([], [], color="black", lw=1, ls="--", label="ideal: speedup = ranks")]
            sides_seen = []
            for k, shape in enumerate(shapes):
                handles.append(Line2D([], [], color=colors[k % len(colors)], lw=4, label=shape))
                for side, (ls, marker) in _SIDE_STYLE.items():
                    pts = sorted(
                        (r["ranks"], r["speedup"])
                        for r in rows
                        if r["shape"] == shape and r["side"] == side and r["mode"] == mode
                    )
                    if not pts:
                        continue
                    if side not in sides_seen:
                        sides_seen.append(side)
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        ls=ls,
                        marker=marker,
                        color=colors[k % len(colors)],
                    )
            for side in sides_seen:
                ls, marker = _SIDE_STYLE[side]
                handles.append(
                    Line2D([], [], color="gray", ls=ls, marker=marker, label=_SIDE_LABEL[side])
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(r) for r in ranks])
            _log2_axis(ax.yaxis, ax.set_yscale)
            ax.set_xlabel("ranks")
            ax.set_ylabel("speedup over 1 rank")
            ax.set_title(f"{_GROUP_TITLES[group]}, {_MODE_TITLES[mode]}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(handles=handles, fontsize=6, loc="best", framealpha=0.7)
    cfg = res.get("config", {})
    threads = ""
    if cfg.get("device") == "cpu":
        k = cfg.get("threads_per_rank", 1)
        per = "r" if k == 1 else f"{k}r"
        threads = f"; r ranks x {k} thread vs torch: 1 process x {per} threads"
    fig.suptitle(
        f"scaling.py: speedup over 1 rank ({cfg.get('device', '?')}, seed 001 sizes / "
        f"{cfg.get('scale', '?')}{threads})",
        fontsize=11,
    )
    return _save(fig, doc, out)


def _scaling_overhead(doc: dict, out: Path, modes: Sequence[str]) -> Path | None:
    plt = _plt()
    rows = doc["results"]["rows"]
    by = {(r["shape"], r["ranks"], r["side"], r["mode"]): r["mean_s"] for r in rows}
    ranks = sorted({r["ranks"] for r in rows if r["ranks"] > 1})
    if not ranks:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    sides = [s for s in ("dtensor", "torch") if any(r["side"] == s for r in rows)]
    fig, axes = plt.subplots(
        1, len(modes), figsize=(7 * len(modes), 0.45 * len(shapes) * len(ranks) + 2), squeeze=False
    )
    for i, mode in enumerate(modes):
        ax = axes[0][i]
        labels, height = [], 0.8 / len(sides)
        for s_i, side in enumerate(sides):
            vals = []
            for shape in shapes:
                for r in ranks:
                    g, b = by.get((shape, r, "spmdgt", mode)), by.get((shape, r, side, mode))
                    vals.append(g / b if g and b else float("nan"))
                    if s_i == 0:
                        labels.append(f"{shape}, {r} ranks")
            ys = [y + s_i * height for y in range(len(vals))]
            who = "raw DTensor, same ranks" if side == "dtensor" else "torch, 1 process"
            ax.barh(ys, _from_one(vals), left=1.0, height=height, label=f"spmdgt / {who}")
            for y, v in zip(ys, vals):
                side_of_one = "left" if v >= 1 else "right"
                ax.text(v, y, f" {v:.2f}x ", va="center", ha=side_of_one, fontsize=6)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_yticks([y + 0.4 - height / 2 for y in range(len(labels))], labels, fontsize=7)
        ax.invert_yaxis()
        _log2_axis(ax.xaxis, ax.set_xscale)
        ax.set_xlabel("time ratio (above 1: spmdgt slower)")
        ax.set_title(f"spmdgt's time over its baselines, {_MODE_TITLES[mode]}", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("scaling.py: what spmdgt adds (vs DTensor) and what the cores allow (vs torch)")
    return _save(fig, doc, out)


def _scaling(doc: dict, stem: Path, modes: Sequence[str]) -> list[Path]:
    out = [_scaling_speedup(doc, stem.with_name(stem.name + "-speedup.png"), modes)]
    bars = _scaling_overhead(doc, stem.with_name(stem.name + "-overhead.png"), modes)
    return out + ([bars] if bars else [])


# ----------------------------------------------------------------------------- the others


def _bars(
    doc: dict,
    out: Path,
    labels: list[str],
    values: list[float],
    groups: list[str],
    title: str,
    xlabel: str,
    targets: list[float | None] | None = None,
) -> Path:
    """Horizontal ratio bars (log scale, 1.0 marked), coloured by ``groups``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(labels) + 1.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    palette = {g: colors[i % len(colors)] for i, g in enumerate(dict.fromkeys(groups))}
    ax.barh(range(len(values)), _from_one(values), left=1.0, color=[palette[g] for g in groups])
    for g, c in palette.items():
        ax.barh([0], [0], color=c, label=f"against {g}")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}x ", va="center", ha="left" if v >= 1 else "right", fontsize=7)
    if targets:
        for y, t in enumerate(targets):
            if t is not None:
                ax.plot([t, t], [y - 0.45, y + 0.45], color="black", lw=2.5, ls=":")
        ax.plot([], [], color="black", lw=2.5, ls=":", label="target (at most)")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    _log2_axis(ax.xaxis, ax.set_xscale)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    return _save(fig, doc, out)


def _core(doc: dict, stem: Path, modes: Sequence[str]) -> list[Path]:
    pairs = doc["results"]["pairs"]
    return [
        _bars(
            doc,
            stem.with_name(stem.name + "-overhead.png"),
            [p["name"] for p in pairs],
            [p["ratio"] for p in pairs],
            [p["baseline"] for p in pairs],
            "bench_core.py: spmdgt's time over its baseline (plain torch, raw DTensor, ...)",
            "time ratio (above 1: spmdgt slower)",
            [p.get("target_max_ratio") for p in pairs],
        )
    ]


def _interceptor(doc: dict, stem: Path, modes: Sequence[str]) -> list[Path]:
    cases = doc["results"]["cases"]
    return [
        _bars(
            doc,
            stem.with_name(stem.name + "-overhead.png"),
            [c["name"] for c in cases],
            [c["ratio_to_plain"] for c in cases],
            ["plain torch"] * len(cases),
            f"bench_interceptor.py: cost per op over plain torch ({doc['results']['workload']})",
            "time per op / plain torch's",
        )
    ]


def _trainer(doc: dict, stem: Path, modes: Sequence[str]) -> list[Path]:
    plt = _plt()
    res = doc["results"]
    panels = [p for p in ("strategies", "compile") if res.get(p)]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "strategies":
            names = list(res["strategies"])
            tr = [res["strategies"][s]["trainer_step_time"] * 1e3 for s in names]
            raw = [res["strategies"][s]["raw_step_time"] * 1e3 for s in names]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], tr, width=0.4, label="spmdgt trainer")
            ax.bar([x + 0.2 for x in xs], raw, width=0.4, label="hand-written torch loop")
            for x, t, r in zip(xs, tr, raw):
                ax.text(x - 0.2, t, f"{(t / r - 1) * 100:+.0f}%", ha="center", va="bottom")
            ax.set_xticks(list(xs), names)
            cfg = res.get("config", {})
            ax.set_title(
                f"step time by strategy, 2 ranks (dim {cfg.get('dim')}, layers "
                f"{cfg.get('layers')}, seq {cfg.get('seq_len')})",
                fontsize=10,
            )
        else:
            sides = res["compile"]["sides"]
            names = list(sides)
            vals = [sides[n]["step_s_median"] * 1e3 for n in names]
            ax.bar(range(len(names)), vals, color="#2ca02c")
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
            ax.set_title(
                f"compile: one training step, world of one ({res['compile'].get('device')})",
                fontsize=10,
            )
        ax.set_ylabel("ms per optimizer step (median over rounds)")
        ax.grid(True, axis="y", alpha=0.3)
        if panel == "strategies":
            ax.legend(fontsize=8)
    fig.suptitle("bench_trainer.py")
    return [_save(fig, doc, stem.with_name(stem.name + "-steps.png"))]


def _compile(doc: dict, stem: Path, modes: Sequence[str]) -> list[Path]:
    cases = doc["results"]["cases"]
    labels, vals = [], []
    if "chain" in cases:
        labels += ["chain: hand torch.compile", "chain: GT_AUTO_COMPILE pass"]
        vals += [cases["chain"]["speedup_hand"], cases["chain"]["speedup_pass"]]
    if "small" in cases:
        labels.append("small ops: pass")
        vals.append(cases["small"]["speedup"])
    if "module" in cases:
        labels.append("module loop, pass watching")
        vals.append(1 / cases["module"]["ratio"])
    if "scope1" in cases:
        s = cases["scope1"]
        labels += ["chain, 1 rank: hand compile", "chain, 1 rank: compile scope"]
        vals += [s["eager"] / s["hand"], s["eager"] / s["scope"]]
    for r, s in enumerate(cases.get("scope2") or []):
        labels.append(f"chain sharded, rank {r}: compile scope")
        vals.append(s["eager"] / s["scope"])
    if not vals:
        return []
    return [
        _bars(
            doc,
            stem.with_name(stem.name + "-speedup.png"),
            labels,
            vals,
            ["eager"] * len(vals),
            "bench_compile.py: speed-up over eager (above 1: faster)",
            "eager time / this time",
        )
    ]


CHARTS: dict[str, Callable[[dict, Path, Sequence[str]], list[Path]]] = {
    "scaling": _scaling,
    "core": _core,
    "interceptor": _interceptor,
    "trainer": _trainer,
    "compile": _compile,
}
"""benchmark name -> the function drawing its charts (document, output stem, timing modes)."""


def load(path: str | Path) -> dict:
    """A benchmark result file, checked to be one (a ``ValueError`` naming the file if not)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a benchmark result file (no 'format': {FORMAT!r}; write one with "
            "benchmarks/<script>.py --json PATH)"
        )
    return doc


def draw(path: str | Path, out_dir: str | Path | None = None, modes=("compute", "read")) -> list:
    """Draw ``path``'s charts into ``out_dir`` (default: beside the file); their paths."""
    doc = load(path)
    name = doc.get("benchmark")
    if name not in CHARTS:
        raise ValueError(f"{path}: no chart for benchmark {name!r} (known: {sorted(CHARTS)})")
    src = Path(path)
    stem = Path(out_dir or src.parent) / src.stem
    return CHARTS[name](doc, stem, list(modes))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="result files written with --json")
    ap.add_argument("--out", help="folder for the PNGs (default: beside each file)")
    ap.add_argument(
        "--mode",
        choices=["compute", "read", "both"],
        default="both",
        help="scaling: which timing mode(s) to draw",
    )
    args = ap.parse_args(argv)
    modes = ("compute", "read") if args.mode == "both" else (args.mode,)
    _plt()  # a missing matplotlib is one clear error, before any file is read
    drawn: list[Path] = []
    for f in args.files:
        try:
            drawn += draw(f, args.out, modes)
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e) if isinstance(e, ValueError) else f"{f}: unexpected layout ({e!r})"
            print(f"plot: skipped {msg}", file=sys.stderr)
    for p in drawn:
        print(p)
    if not drawn:
        print("plot: nothing drawn", file=sys.stderr)
        return 1
    return 0


def _cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _cli()
