"""Seed 001's auto-shard benchmark, run for real: speedup of sharded work over 1, 2, 4, 8 ranks.

    python benchmarks/scaling.py --quick --ranks 1 2              # CPU sizes, ~2 min on 2 cores
    python benchmarks/scaling.py --quick --ranks 1 2 --auto-shard # GT_AUTO_SHARD=1, no signal
    python benchmarks/scaling.py --quick --ranks 1 2 --auto-shard plan  # GT_AUTO_SHARD=plan
    python benchmarks/scaling.py --device cuda --ranks 1 2 4 8    # seed 001's sizes, 1 GPU a rank
    python benchmarks/scaling.py --quick --ranks 1 2 --json results/scaling.json

The script starts and stops its ranks itself (forked gloo CPU ranks, or one spawned NCCL process
per GPU with ``--device cuda``), once per rank count: no torchrun, no manual launcher. A rank
that fails fails the run with its traceback; a hang is killed at ``--timeout``.

Workloads (seed 001's; ``--quick`` divides every dimension by 8): square matmuls (4K, 8K, 16K),
large-batch matmuls ((8K,4K)@(4K,4K), (16K,4K)@(4K,4K), (32K,2K)@(2K,2K)) and MLP forwards
(batch 4K, widths 4K-4K-4K; 8K, 4K-8K-4K; 16K, 2K-4K-2K: GT's "3-layer" MLP is three widths,
two ``Linear`` + ReLU, under ``no_grad``). Every input is made under a ``rows`` signal (axis 0
split over every rank), or with ``--auto-shard`` under ``GT_AUTO_SHARD=1`` and no signal (the
same placement: each dimension here divides by the rank counts). The MLP's weights are
ordinary ``nn.Linear`` parameters (replicated).

Three sides do the same work at each rank count r, taking turns in every order (each side
follows each other side as often) so the machine's drift hits them alike: **spmdgt**
(``gt.randn`` under the signal, the op, ``.numpy()``), **raw DTensor** (each rank draws its
``Shard(0)`` block, ``DTensor.from_local``, the op, ``.full_tensor().numpy()``; replicated
DTensor weights for the MLP), and on the CPU **torch**: one process with all r ranks'
threads (rank 0 runs it while the other ranks wait in a barrier).
The first two say what spmdgt adds to DTensor; the third what the cores allow one process.

Threads on the CPU: every rank count r runs on r x ``--threads-per-rank`` (default 1) threads
in all, whichever side: spmdgt and DTensor as r ranks x 1 thread, torch as 1 process x r
threads; so the 1-rank baseline is one thread and the ideal speedup at r ranks is r.

Timing: ``--warmup`` (2; 3 with ``--quick``) untimed then ``--runs`` (5; 20 with ``--quick``,
whose runs take milliseconds and spread by 10-40% on a shared CPU) timed runs per side and
mode; before each run every rank meets in a barrier, each rank times its own run, and a
run's time is the slowest rank's (all-reduce MAX). Two modes: **compute** (inputs made
before the timer; the ops only, the result left sharded; on CUDA synchronised) and
**+read**, as GT timed it (make the inputs, the ops, then the result's global value on the
host with ``.numpy()`` on every rank).
Per shape and side: mean +- std (population, as numpy's) of the timed runs, achieved TFLOP/s,
speedup over the same side at 1 rank and parallel efficiency (speedup / r).

FLOP/s are computed from the shapes and the measured time, never assumed: a matmul
(m,k)@(k,n) is 2mkn FLOPs (a multiply and an add per term); an MLP layer (b,i)->(b,o) is
2bio + 2bo (matmul, bias add, ReLU); TFLOP/s = FLOPs / mean seconds / 1e12. (Seed 001's
TFLOPS column did not follow from its own times: 2 x 16384^3 / 11.23 s is 0.78 TFLOP/s, not
95.3; every row was off by about 100x.)

The summary prints, per rank count, the average / min / max speedup over the shapes, as seed
001 did. ``--json PATH`` writes every figure (``benchmarks/_results.py``'s layout; ``python -m
spmdgt.scripts.plot PATH`` draws it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _ranks import RankError, run_ranks
from _results import Progress, write

GROUPS = {
    "square": "Square matmuls",
    "batch": "Large-batch matmuls",
    "mlp": "MLP forwards",
}
SIDES = {"spmdgt": "spmdgt", "dtensor": "DTensor", "torch": "torch"}
_AUTO = {"auto": "GT_AUTO_SHARD=1", "plan": "GT_AUTO_SHARD=plan"}
MODES = ("compute", "read")


@dataclass(frozen=True)
class Shape:
    """One workload: a matmul ``(m, k) @ (k, n)`` (``dims = (m, k, n)``) or an MLP forward
    ``batch x w0 -> w1 -> w2`` (``dims = (batch, w0, w1, w2)``)."""

    group: str
    dims: tuple[int, ...]

    @property
    def name(self) -> str:
        if self.group == "mlp":
            b, *w = self.dims
            return f"batch {b}, {'-'.join(map(str, w))}"
        m, k, n = self.dims
        return f"({m},{k})@({k},{n})"

    @property
    def flops(self) -> int:
        """FLOPs of one run, from the shape (see the module docstring for the rule)."""
        if self.group == "mlp":
            b, *w = self.dims
            return sum(2 * b * i * o + 2 * b * o for i, o in itertools.pairwise(w))
        m, k, n = self.dims
        return 2 * m * k * n


SEED_SHAPES = [
    Shape("square", (4096, 4096, 4096)),
    Shape("square", (8192, 8192, 8192)),
    Shape("square", (16384, 16384, 16384)),
    Shape("batch", (8192, 4096, 4096)),
    Shape("batch", (16384, 4096, 4096)),
    Shape("batch", (32768, 2048, 2048)),
    Shape("mlp", (4096, 4096, 4096, 4096)),
    Shape("mlp", (8192, 4096, 8192, 4096)),
    Shape("mlp", (16384, 2048, 4096, 2048)),
]


def shapes_for(scale: int, groups: list[str]) -> list[Shape]:
    """Seed 001's shapes with every dimension divided by ``scale``."""
    out = []
    for s in SEED_SHAPES:
        if s.group in groups:
            out.append(Shape(s.group, tuple(max(d // scale, 1) for d in s.dims)))
    return out


# ----------------------------------------------------------------------------- the ranks


def _rows_of(m: int, world: int, rank: int) -> int:
    """This rank's rows of ``m`` under ``Shard(0)`` (torch.chunk's rule, as DTensor's)."""
    per = math.ceil(m / world)
    return max(0, min(per, m - rank * per))


class _Sides:
    """The three ways one shape is run on this rank: inputs, the op(s), the host read."""

    def __init__(self, shape: Shape, world: int, rank: int, cfg: dict[str, Any]) -> None:
        import torch
        from torch.distributed.tensor import DTensor, Replicate, Shard

        import spmdgt as gt

        self.gt, self.torch, self.shape = gt, torch, shape
        self.dev = gt.device()
        self.mesh = gt.device_mesh()
        self.world, self.rank = world, rank
        self.signal = cfg["placement"] == "signal"
        self.DTensor, self.Shard = DTensor, Shard
        self.layers = []
        if shape.group == "mlp":
            torch.manual_seed(0)
            w = shape.dims[1:]
            self.layers = [torch.nn.Linear(i, o).to(self.dev) for i, o in itertools.pairwise(w)]
            self.dt_layers = [
                tuple(
                    DTensor.from_local(p.detach(), self.mesh, [Replicate()], run_check=False)
                    for p in (layer.weight, layer.bias)
                )
                for layer in self.layers
            ]

    # inputs ----------------------------------------------------------------------------
    def _input_shapes(self) -> list[tuple[int, int]]:
        if self.shape.group == "mlp":
            return [(self.shape.dims[0], self.shape.dims[1])]
        m, k, n = self.shape.dims
        return [(m, k), (k, n)]

    def make(self, side: str) -> list:
        """New random inputs for ``side`` (placed as the side places them)."""
        torch, gt = self.torch, self.gt
        shapes = self._input_shapes()
        if side == "spmdgt":
            scope = gt.signal.context("rows") if self.signal else contextlib.nullcontext()
            with scope:
                return [gt.randn(*s) for s in shapes]
        if side == "dtensor":
            out = []
            for m, k in shapes:
                local = torch.randn(_rows_of(m, self.world, self.rank), k, device=self.dev)
                out.append(
                    self.DTensor.from_local(
                        local,
                        self.mesh,
                        [self.Shard(0)],
                        run_check=False,
                        shape=torch.Size((m, k)),
                        stride=(k, 1),
                    )
                )
            return out
        return [torch.randn(*s, device=self.dev) for s in shapes]

    # the ops -----------------------------------------------------------------------------
    def run(self, side: str, inputs: list):
        """The op(s) on ``inputs``: the matmul, or the MLP's layers (Linear + ReLU each)."""
        if self.shape.group != "mlp":
            return inputs[0] @ inputs[1]
        x = inputs[0]
        if side == "dtensor":
            f = self.torch.nn.functional
            for w, b in self.dt_layers:
                x = f.relu(f.linear(x, w, b))
            return x
        for layer in self.layers:
            x = layer(x).relu()
        return x

    def read(self, side: str, y) -> Any:
        """The result's global value on the host, as the side spells it."""
        if side == "dtensor":
            return y.full_tensor().cpu().numpy()
        if isinstance(y, self.gt.Tensor) or y.device.type == "cpu":
            return y.numpy()
        return y.cpu().numpy()  # a plain CUDA tensor (replicated, or a world of one)


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict | None:
    """One rank: every shape, every side and mode, interleaved; rank 0 returns the times."""
    import time

    import torch
    import torch.distributed as dist

    import spmdgt as gt

    if cfg["placement"] == "signal":
        gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    dev = gt.device()
    gt.device_mesh()  # makes the process group in a world of one too (the barriers need it)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # NCCL's barrier is told its device (else it guesses, and warns); gloo takes none
    barrier_kw = {"device_ids": [dev.index]} if cuda else {}
    sides = ["spmdgt", "dtensor"] + ([] if cuda else ["torch"])
    # every order of the sides in turn, so each side follows each other side as often: a
    # rotation put spmdgt after the 2-thread torch side twice as often as DTensor, and the
    # threads torch leaves spinning (OpenMP) slow whichever side comes next
    orders = list(itertools.permutations(sides))
    own_threads = torch.get_num_threads()
    torch_threads = world * cfg["threads_per_rank"]
    progress = Progress(f"scaling {world} rank{'s' if world > 1 else ''}") if rank == 0 else None
    out: dict[str, Any] = {}

    def timed(side: str, mode: str, sd: _Sides, inputs: list) -> float:
        """One run of ``side`` in ``mode`` on this rank, after a barrier; its seconds."""
        sync()
        dist.barrier(**barrier_kw)
        if side == "torch" and rank != 0:
            return 0.0  # rank 0 runs one process's worth; this rank waits in the next barrier
        if side == "torch":
            torch.set_num_threads(torch_threads)
        try:
            t0 = time.perf_counter()
            if mode == "compute":
                sd.run(side, inputs)
                sync()
            else:
                sd.read(side, sd.run(side, sd.make(side)))
            return time.perf_counter() - t0
        finally:
            if side == "torch":
                torch.set_num_threads(own_threads)

    with torch.no_grad():
        for i, shape in enumerate(cfg["shapes"]):
            sd = _Sides(shape, world, rank, cfg)
            inputs = {s: (sd.make(s) if s != "torch" or rank == 0 else None) for s in sides}
            times: dict[tuple[str, str], list[float]] = {(s, m): [] for s in sides for m in MODES}
            for rep in range(cfg["warmup"] + cfg["runs"]):
                order = orders[rep % len(orders)]
                for side in order:
                    for mode in MODES:
                        t = timed(side, mode, sd, inputs[side])
                        if rep >= cfg["warmup"]:
                            times[(side, mode)].append(t)
            keys = list(times)
            flat = torch.tensor([times[k] for k in keys], dtype=torch.float64, device=dev)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # a run's time: the slowest rank's
            slowest = flat.cpu().tolist()
            out[shape.name] = {f"{s}/{m}": slowest[j] for j, (s, m) in enumerate(keys)}
            if progress is not None:
                spm = statistics.fmean(out[shape.name]["spmdgt/compute"])
                progress(
                    f"{shape.name} done ({i + 1}/{len(cfg['shapes'])}; spmdgt compute "
                    f"{spm * 1e3:.2f} ms)"
                )
            del sd, inputs
    return out if rank == 0 else None


# ----------------------------------------------------------------------------- the figures


def figures(per_ranks: dict[int, dict], shapes: list[Shape], cfg: dict[str, Any]) -> list[dict]:
    """One row per shape, rank count, side and mode: times, mean +- std, TFLOP/s, speedup over
    the same side at 1 rank, efficiency = speedup / ranks."""
    rows = []
    for shape in shapes:
        for r in sorted(per_ranks):
            for key, times in per_ranks[r][shape.name].items():
                side, mode = key.split("/")
                base = statistics.fmean(per_ranks[1][shape.name][key])
                mean = statistics.fmean(times)
                speedup = base / mean
                threads = r * cfg["threads_per_rank"]
                rows.append(
                    {
                        "group": shape.group,
                        "shape": shape.name,
                        "dims": list(shape.dims),
                        "ranks": r,
                        "side": side,
                        "mode": mode,
                        "processes": 1 if side == "torch" else r,
                        "threads_total": threads if cfg["device"] == "cpu" else None,
                        "times_s": times,
                        "mean_s": mean,
                        "std_s": statistics.pstdev(times),
                        "flops": shape.flops,
                        "tflops": shape.flops / mean / 1e12,
                        "speedup": speedup,
                        "efficiency": speedup / r,
                    }
                )
    return rows


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per rank count > 1, side and mode: average / min / max speedup over the shapes."""
    out: dict[str, dict] = {}
    for r in sorted({row["ranks"] for row in rows if row["ranks"] > 1}):
        per: dict[str, dict] = {}
        for side in SIDES:
            for mode in MODES:
                s = [
                    row["speedup"]
                    for row in rows
                    if row["ranks"] == r and row["side"] == side and row["mode"] == mode
                ]
                if s:
                    per.setdefault(side, {})[mode] = {
                        "average": statistics.fmean(s),
                        "min": min(s),
                        "max": max(s),
                    }
        out[str(r)] = per
    return out


def _who(side: str, r: int, cfg: dict[str, Any]) -> str:
    k = cfg["threads_per_rank"]
    if cfg["device"] != "cpu":
        return f"{SIDES[side]} {r} GPU{'s' if r > 1 else ''}"
    if side == "torch":
        return f"torch 1 proc x{r * k}"
    return f"{SIDES[side]} {r}x{k} thr"


def report(rows: list[dict], shapes: list[Shape], cfg: dict[str, Any]) -> None:
    """The table, per workload group, then the summary as seed 001 printed it."""
    by = {(r["shape"], r["ranks"], r["side"], r["mode"]): r for r in rows}
    ranks = sorted({r["ranks"] for r in rows})
    sides = [s for s in SIDES if any(r["side"] == s for r in rows)]

    def cell(row: dict) -> str:
        return (
            f"{row['mean_s'] * 1e3:9.2f} +-{row['std_s'] * 1e3:7.2f}{row['tflops']:9.4f}"
            f"{row['speedup']:8.2f}x{row['efficiency']:6.2f}"
        )

    head = f"{'ms':>9}   {'+- std':>7}{'TFLOP/s':>9}{'speedup':>9}{'eff':>6}"
    for group, title in GROUPS.items():
        gshapes = [s for s in shapes if s.group == group]
        if not gshapes:
            continue
        print(f"\n--- {title} ---")
        print(f"{'shape':<28}{'side':<22}{'compute: ' + head:<60}  | +read: {head}")
        print("-" * 150)
        for shape in gshapes:
            for r in ranks:
                for j, side in enumerate(sides):
                    c, rd = by[(shape.name, r, side, "compute")], by[(shape.name, r, side, "read")]
                    label = shape.name if (r == ranks[0] and j == 0) else ""
                    print(f"{label:<28}{_who(side, r, cfg):<22}{cell(c)}         | {cell(rd)}")
                ratios = []
                for mode in MODES:
                    g = by[(shape.name, r, "spmdgt", mode)]["mean_s"]
                    d = by[(shape.name, r, "dtensor", mode)]["mean_s"]
                    part = f"{mode}: spmdgt/DTensor {g / d:.2f}x"
                    if "torch" in sides:
                        t = by[(shape.name, r, "torch", mode)]["mean_s"]
                        part += f", spmdgt/torch {g / t:.2f}x"
                    ratios.append(part)
                print(f"{'':<28}{'(time ratios)':<22}{'; '.join(ratios)}")
    print("\n" + "=" * 80 + "\nSUMMARY\n" + "=" * 80)
    placement = _AUTO.get(cfg["placement"], "`rows` signal")
    if len(ranks) == 1:
        print("\n(one rank count only: no speedup to summarise; give --ranks 1 2 ...)")
    for r, per in summary(rows).items():
        print(f"\n{r} ranks vs 1 rank (spmdgt, {placement}; compute / +read):")
        sp = per["spmdgt"]
        for stat, name in (("average", "Average"), ("min", "Min"), ("max", "Max")):
            print(f"  {name} speedup: {sp['compute'][stat]:.2f}x / {sp['read'][stat]:.2f}x")
        others = []
        for side in sides[1:]:
            o = per[side]
            who = "raw DTensor" if side == "dtensor" else f"torch, 1 process x {r} threads"
            others.append(
                f"{who}: average {o['compute']['average']:.2f}x / {o['read']['average']:.2f}x"
            )
        print("  (" + "; ".join(others) + f"; ideal {r}.00x)")


def _header(cfg: dict[str, Any], shapes: list[Shape]) -> None:
    dev = cfg["device"]
    placement = {
        "auto": "GT_AUTO_SHARD=1, no signal (axis 0 over every rank)",
        "plan": "GT_AUTO_SHARD=plan, no signal (placements priced from the first run's ops)",
    }.get(cfg["placement"], "a `rows` signal (axis 0 over every rank)")
    print(
        f"scaling: seed 001's workloads / {cfg['scale']} on {dev} "
        f"({'gloo' if dev == 'cpu' else 'nccl'}), ranks {cfg['ranks']}, inputs under "
        f"{placement}"
    )
    if dev == "cpu":
        k = cfg["threads_per_rank"]
        print(
            f"threads: every rank count r runs on the same r x {k} thread(s) in all, whichever "
            f"side: spmdgt and DTensor as r ranks x {k} thread(s) each, torch as 1 process x "
            f"{'r' if k == 1 else f'{k}r'} threads ({os.cpu_count()} CPUs here); the 1-rank "
            f"baseline has {k} thread(s), so the ideal speedup at r ranks is r"
        )
        worst = max(cfg["ranks"]) * k
        if worst > (os.cpu_count() or 1):
            print(
                f"  note: {worst} threads at {max(cfg['ranks'])} ranks is more than the "
                f"{os.cpu_count()} CPUs: those rows measure contention, not scaling"
            )
    print(
        f"timing: {cfg['warmup']} warm-up + {cfg['runs']} timed runs per side and mode, the "
        "sides alternating; a barrier before each run, a run's time = the slowest rank's; "
        "mean +- std (population)\n"
        "compute = inputs made before the timer, the ops only (result left sharded); +read = "
        "as GT timed it: make the inputs, the ops, .numpy() of the result on every rank\n"
        "TFLOP/s = FLOPs from the shape / mean time (matmul (m,k)@(k,n): 2mkn; MLP layer "
        "(b,i)->(b,o): 2bio + 2bo); speedup = the same side's 1-rank time / this time; "
        f"eff = speedup / ranks ({len(shapes)} shapes)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--quick", action="store_true", help="CPU sizes: every dimension / 8")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: / 64
    p.add_argument("--scale", type=int, default=None, help="divide every dimension by N")
    p.add_argument(
        "--auto-shard",
        nargs="?",
        const="1",
        choices=["1", "plan"],
        help="no signal: GT_AUTO_SHARD=1 (axis 0), or =plan (placements priced from the ops)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads-per-rank", type=int, default=1, help="CPU: torch threads a rank")
    p.add_argument("--groups", default="square,batch,mlp", help="comma-separated workloads")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (2; 3 with --quick)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (5; 20 with --quick)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per rank count")
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    args = p.parse_args(argv)
    scale = args.scale or (64 if args.tiny else 8 if args.quick else 1)
    ranks = sorted(set(args.ranks) | {1})  # speedups are over the 1-rank run
    groups = [g for g in args.groups.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"--groups: unknown {unknown}; choose from {sorted(GROUPS)}")
    # --quick's runs take milliseconds, and a 2-rank run's spread on a shared CPU is 10-40% of
    # its mean: 20 runs put a side's mean within a few percent, 5 could not tell two sides apart
    if args.runs is None:
        args.runs = 20 if args.quick else 5
    if args.warmup is None:
        args.warmup = 3 if args.quick else 2
    if args.runs < 1 or args.warmup < 0 or args.threads_per_rank < 1:
        p.error("--runs >= 1, --warmup >= 0 and --threads-per-rank >= 1")
    if args.device == "cuda":
        import torch  # the ranks are spawned: this process may touch CUDA

        gpus = torch.cuda.device_count()
        if max(ranks) > gpus:
            p.error(f"--device cuda runs one rank per GPU: {gpus} GPU(s) here, --ranks {ranks}")
    shapes = shapes_for(scale, groups)
    cfg = {
        "device": args.device,
        "ranks": ranks,
        "placement": {"1": "auto", "plan": "plan"}.get(args.auto_shard, "signal"),
        "threads_per_rank": args.threads_per_rank,
        "warmup": args.warmup,
        "runs": args.runs,
        "scale": scale,
        "shapes": shapes,
    }
    _header(cfg, shapes)
    if args.device == "cpu" and scale == 1:
        print("  note: seed 001's full sizes on a CPU take hours; --quick is the CPU size")
    progress = Progress("scaling")
    env = {"GT_AUTO_SHARD": args.auto_shard or "0"}
    per_ranks = {}
    for r in ranks:
        progress(f"starting {r} rank{'s' if r > 1 else ''}")
        try:
            res = run_ranks(
                _rank_main,
                r,
                cfg,
                device=args.device,
                threads=args.threads_per_rank,
                env=env,
                timeout=args.timeout,
            )
        except RankError as e:  # the failing rank's traceback, then a non-zero exit
            sys.exit(f"scaling: the run on {r} rank(s) failed\n{e}")
        per_ranks[r] = res[0]
    progress("done")
    rows = figures(per_ranks, shapes, cfg)
    report(rows, shapes, cfg)
    if args.json:
        _write_json(args, cfg, shapes, rows)


def _write_json(args: argparse.Namespace, cfg: dict[str, Any], shapes: list[Shape], rows: list):
    """Every figure, with the run's context, to ``--json`` (``_results.write``'s layout)."""
    ranks = cfg["ranks"]
    results = {
        "config": {k: v for k, v in cfg.items() if k != "shapes"},
        "shapes": [{**asdict(s), "name": s.name, "flops": s.flops} for s in shapes],
        "rows": rows,
        "summary": summary(rows),
        "notes": {
            "timing": "barrier before each run; a run's time is the slowest rank's "
            "(all-reduce MAX of each rank's own perf_counter time); mean and population "
            "std over the timed runs",
            "modes": "compute: inputs made before the timer, the ops only; read: make the "
            "inputs, the ops, .numpy() of the result on every rank (as GT timed it)",
            "flops": "matmul (m,k)@(k,n): 2mkn; MLP layer (b,i)->(b,o): 2bio + 2bo; "
            "tflops = flops / mean_s / 1e12",
            "speedup": "the same side's mean at 1 rank / its mean at r ranks; "
            "efficiency = speedup / ranks",
            "threads": "CPU: r ranks x threads_per_rank (spmdgt, dtensor) against one "
            "process with r x threads_per_rank threads (torch)",
        },
    }
    write(
        args.json,
        "scaling",
        results,
        device=args.device,
        world_size=ranks,
        threads={
            "per_rank": args.threads_per_rank,
            "total_at_ranks": {r: r * args.threads_per_rank for r in ranks},
        }
        if args.device == "cpu"
        else None,
    )


if __name__ == "__main__":
    main()
