"""Losses and means on uneven row shards: this checkout against another (main), interleaved.

    python benchmarks/bench_uneven_losses.py --against /work/main   # ratios printed
    python benchmarks/bench_uneven_losses.py --one                  # this checkout only

``cross_entropy`` of (1001, 50) logits sharded by rows over 2 ranks (501/500: uneven), and
``x.mean()`` of the same rows (read with ``.numpy()``, and unread): per-call time without and
with a backward, and the collectives ``CommDebugMode`` counts per call (all-gathers: the exact
fallback or DTensor's replication;
all-reduces: DTensor's partial sums). Each side runs in its own process with its checkout
first on ``sys.path``; rounds alternate the sides (A, B, A, B ...) and each figure is the best
round, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS, COLS, WORLD = 1001, 50, 2


def _time(fn, iters: int) -> float:
    fn()  # the first call learns caches
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _rank(rank: int, world: int, iters: int, rows: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, COLS, generator=g)
    target = torch.randint(0, COLS, (rows,), generator=g)
    with gt.signal.context("rows"):
        x, t = gt.tensor(logits), gt.tensor(target)
        xg = gt.tensor(logits, requires_grad=True)

    def ce():
        with torch.no_grad():
            F.cross_entropy(x, t).numpy()

    def ce_bwd():
        F.cross_entropy(xg, t).backward()

    def mean():
        with torch.no_grad():
            x.mean().numpy()

    def mean_unread():  # a Partial result stays unreduced until read (or used)
        with torch.no_grad():
            x.mean()

    out = {}
    for name, fn in (
        ("cross_entropy", ce),
        ("cross_entropy+backward", ce_bwd),
        ("mean", mean),
        ("mean unread", mean_unread),
    ):
        out[name] = _time(fn, iters)
        with CommDebugMode() as comms:
            fn()
        out[name + " comms"] = {
            str(k).split(".")[-1]: v for k, v in comms.get_comm_counts().items() if v
        }
    return out


def _one(iters: int, rows: int) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ranks import run_ranks

    return run_ranks(_rank, WORLD, iters, rows)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--against", help="the other checkout (its spmdgt is imported there)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rows", type=int, default=ROWS, help=f"rows (default {ROWS}: uneven)")
    p.add_argument("--one", action="store_true", help="this checkout only, as JSON")
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.iters, args.rows)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"this": here, "other": args.against}
    best: dict[str, dict] = {s: {} for s in sides}
    for _ in range(args.rounds):
        for side, root in sides.items():
            env = dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore")
            cmd = [sys.executable, os.path.abspath(__file__), "--one", "--iters", str(args.iters)]
            cmd += ["--rows", str(args.rows)]
            res = json.loads(
                subprocess.run(
                    cmd, env=env, capture_output=True, text=True, check=True
                ).stdout.splitlines()[-1]
            )
            for k, v in res.items():
                if isinstance(v, float):
                    best[side][k] = min(best[side].get(k, v), v)
                else:
                    best[side][k] = v
    print(f"{'':28} {'other ms':>9} {'this ms':>8} {'other/this':>10}  collectives other -> this")
    for k, v in best["this"].items():
        if isinstance(v, float):
            o = best["other"][k]
            comms = f"{best['other'][k + ' comms']} -> {best['this'][k + ' comms']}"
            print(f"{k:28} {o * 1e3:9.3f} {v * 1e3:8.3f} {o / v:10.2f}x  {comms}")


if __name__ == "__main__":
    main()
