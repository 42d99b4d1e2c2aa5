"""What recording one op in a lazy region costs, in microseconds, for one or more source trees.

    python benchmarks/bench_record.py [--tree PATH ...] [--rounds 5] [--ops 200] [--json PATH]

A lazy region (``GT_WORKER_BATCH_SIZE``, ``compile: true`` scopes) records each capturable op
and hands back a placeholder; this times that recording alone, the region's run (the flush,
a cached graph) outside the timed part:

- ``plain``: a chain of ``--ops`` elementwise ops (``c = c * b + a``, then ``c * 1.5``) on
  64x64 plain tensors, one process;
- ``sharded``: the same chain on ``gt.Tensor``s of 64x64 sharded by rows over 2 forked gloo
  ranks (rank 0's figure).

``GT_LAZY_MIN_NUMEL=1`` so that 64x64 tensors open a region; the graph backend is ``eager``.
Each figure is the best of ``--rounds`` runs of 20 chains, wall (``perf_counter``) and process
CPU time, and beside it the same process's bare eager op on 4x4 tensors (the machine's own
speed right then: a loaded machine inflates both alike).

With several ``--tree``s, each round runs one child process per tree, alternating, with
``PYTHONPATH`` set to that tree, so that load drift hits every tree alike (main against a
branch: ``--tree /work/main --tree .``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

N = 64


def _chain(a: Any, b: Any, ops: int) -> Any:
    """``ops`` elementwise ops: pairs of ``c * b + a``, then ``* 1.5`` if ``ops`` is odd."""
    c = a
    for _ in range(ops // 2):
        c = c * b + a
    if ops % 2:
        c = c * 1.5
    return c


def _measure(a: Any, b: Any, ops: int, rounds: int, regions: Any) -> dict[str, float]:
    """Best-of-``rounds`` recording time per op (wall and CPU), the flush untimed; and the
    bare eager 4x4 op of this process."""
    import torch

    for _ in range(3):  # warm-up: metadata caches, the graph compiled
        _chain(a, b, ops)
        regions.flush("bench")
    wall = cpu = float("inf")
    for _ in range(rounds):
        w = c = 0.0
        for _ in range(20):
            t0, p0 = time.perf_counter(), time.process_time()
            _chain(a, b, ops)
            w += time.perf_counter() - t0
            c += time.process_time() - p0
            regions.flush("bench")
        wall, cpu = min(wall, w / (20 * ops)), min(cpu, c / (20 * ops))
    regions._hook(False)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    bare = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(2000):
            x * y
        bare = min(bare, (time.perf_counter() - t0) / 2000)
    regions._hook(True)
    return {"wall_us": wall * 1e6, "cpu_us": cpu * 1e6, "bare_us": bare * 1e6}


def _regions() -> Any:
    import spmdgt.compile as gt_compile

    assert gt_compile.enable_regions(batch=1_000_000, backend="eager")
    return gt_compile._regions


def child_plain(ops: int, rounds: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    regions = _regions()
    got = _measure(torch.randn(N, N), torch.randn(N, N), ops, rounds, regions)
    assert regions.snapshot()["ops_captured"] >= ops, "the chain was not recorded"
    return got


def _sharded_rank(rank: int, world: int, ops: int, rounds: int) -> dict[str, float]:
    import torch

    import spmdgt as gt

    torch.set_num_threads(1)
    regions = _regions()
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    with gt.signal.context("rows"):
        a, b = gt.tensor(torch.randn(N, N).numpy()), gt.tensor(torch.randn(N, N).numpy())
    got = _measure(a, b, ops, rounds, regions)
    assert regions.snapshot()["ops_captured"] >= ops, "the chain was not recorded"
    return got


def child_sharded(ops: int, rounds: int) -> dict[str, float]:
    import tempfile
    from pathlib import Path

    from tests._dist import run_ranks

    env = {"GT_LAZY_MIN_NUMEL": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(_sharded_rank, 2, Path(tmp), ops, rounds, env=env, timeout=300)
    return got[0]


def _run_child(tree: str, case: str, ops: int, rounds: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, GT_LAZY_MIN_NUMEL="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case]
    cmd += ["--ops", str(ops), "--rounds", str(rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} on {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="a source tree (repeat to compare)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--cases", default="plain,sharded")
    ap.add_argument("--repeat", type=int, default=3, help="child runs per tree and case")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = child_plain if args.child == "plain" else child_sharded
        print(json.dumps(fn(args.ops, args.rounds)))
        return
    from _results import Progress, write

    trees = args.tree or [os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))]
    results: dict[str, dict[str, list]] = {}
    progress = Progress("bench_record")
    for case in args.cases.split(","):
        for i in range(args.repeat):
            for tree in trees:  # alternating: load drift hits every tree alike
                progress(f"{case} {i + 1}/{args.repeat} {tree}")
                got = _run_child(tree, case, args.ops, args.rounds)
                results.setdefault(case, {}).setdefault(tree, []).append(got)
    print(f"recording {args.ops} elementwise ops on 64x64 (us per op; best of runs)")
    for case, per_tree in results.items():
        for tree, runs in per_tree.items():
            wall = [r["wall_us"] for r in runs]
            cpu = [r["cpu_us"] for r in runs]
            rel = [r["cpu_us"] / r["bare_us"] for r in runs]
            print(
                f"{case:8s} {tree:28s} wall {min(wall):6.2f}-{max(wall):6.2f}  "
                f"cpu {min(cpu):6.2f}-{max(cpu):6.2f}  "
                f"x bare 4x4 op {min(rel):5.2f}-{max(rel):5.2f}"
            )
    if args.json:
        write(
            args.json,
            "record",
            {"ops": args.ops, "rounds": args.rounds, "results": results},
            device="cpu",
            threads={"per_rank": 1},
        )


if __name__ == "__main__":
    main()
