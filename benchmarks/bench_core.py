"""Core overhead: spmdgt vs plain torch (1 rank) and gt.Tensor vs raw DTensor (2 ranks).

    python benchmarks/bench_core.py            # all four, side by side, ratios printed
    python benchmarks/bench_core.py --quick    # fewer iterations (CI smoke)
    python benchmarks/bench_core.py --json results/core.json   # the figures as a file too

Each pair runs interleaved in one process (A, B, A, B ... best of rounds), so machine noise
hits both sides alike. Targets: small-op loop <= 1.3x torch, seed 000's baseline
<= 1.05x, MLP step <= 1.05x, 2-rank sharded per-op cost no worse than DTensor's own.
Rank agreement: one agreement point against the smallest all-reduce its side group runs
(<= 1.2x), a 1000x1000 ``.numpy()`` at 2 ranks, header included, against DTensor's read
(<= 1.1x), and what ``GT_CHECK_RANKS=1`` costs a read, a redistributing matmul and a local op.
Errors on one rank: what the watchdog costs an op, and what an error every rank raises costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_ranks
from _results import Progress, write

PAIRS: list[dict] = []
"""Every pair timed in this run, for ``--json``: name, baseline (what spmdgt is set against),
both times, unit, ratio (spmdgt / baseline) and the target where there is one."""


def record(
    name: str, baseline: str, base: float, ours: float, unit: str, target: float | None = None
) -> None:
    """Keep one pair's figures for ``--json`` (``ratio`` = ours / base: above 1 is slower)."""
    PAIRS.append(
        {
            "name": name,
            "baseline": baseline,
            "baseline_value": base,
            "value": ours,
            "unit": unit,
            "ratio": ours / base,
            "target_max_ratio": target,
        }
    )


def best_of(fn: Callable[[], None], iters: int, rounds: int) -> float:
    """Seconds per iteration: the best of ``rounds`` timings of ``iters`` calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()  # CUDA work is asynchronous: time it to completion
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def pair(
    name: str,
    base: Callable,
    ours: Callable,
    iters: int,
    rounds: int,
    unit: float = 1e6,
    target: float | None = None,
) -> float:
    """Time ``base`` (plain torch) and ``ours`` in alternating rounds; print best-of times and
    the ratio; record them for ``--json``."""
    base(), ours()  # warm
    tb, to = float("inf"), float("inf")
    for _ in range(rounds):  # interleave the two sides
        tb = min(tb, best_of(base, iters, 1))
        to = min(to, best_of(ours, iters, 1))
    label = "ms" if unit == 1e3 else "us"
    print(
        f"{name:<44} baseline {tb * unit:9.2f} {label}   spmdgt {to * unit:9.2f} {label}"
        f"   ratio {to / tb:5.2f}x",
        flush=True,
    )
    record(name, "torch", tb * unit, to * unit, label + (" per op" if unit > 1e6 else ""), target)
    return to / tb


def small_op_loop(q: bool) -> None:
    import spmdgt as gt

    torch.manual_seed(0)
    a, b, c0 = (torch.randn(64, 64, device=gt.device()) for _ in range(3))
    gt.manual_seed(0)
    ga, gb, gc0 = (gt.randn(64, 64) for _ in range(3))
    n = 200

    def torch_loop():
        c = c0
        for _ in range(n):
            c = c * b + a

    def gt_loop():
        c = gc0
        for _ in range(n):
            c = c * gb + ga

    r = pair(
        "small-op loop c=c*b+a 64x64 (per op)",
        torch_loop,
        gt_loop,
        1,
        30 if q else 200,
        unit=1e6 / (2 * n),
        target=1.3,
    )
    print(f"{'':<44} target <= 1.30x: {'OK' if r <= 1.3 else 'MISSED'}")


def seed000_baseline(q: bool) -> None:
    import spmdgt as gt

    dev = gt.device()
    # On CUDA a world of one's tensors are plain CUDA tensors and .numpy() is torch's (it
    # raises for device memory): both sides copy to the host first there.
    host = (lambda t: t) if dev.type == "cpu" else (lambda t: t.cpu())

    def torch_iter():
        x = torch.randn(1000, 1000, device=dev)
        y = x @ x
        host(y.data).numpy()

    def gt_iter():
        x = gt.randn(1000, 1000)
        y = x @ x
        host(y.data).numpy()

    r = pair(
        "seed 000: randn(1000,1000) @, .data.numpy()",
        torch_iter,
        gt_iter,
        5 if q else 20,
        3 if q else 10,
        unit=1e3,
        target=1.05,
    )
    print(f"{'':<44} target <= 1.05x: {'OK' if r <= 1.05 else 'MISSED'}")


def mlp_step(q: bool) -> None:
    import spmdgt as gt

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
        m = m.to(gt.device())
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    tm, topt = build()
    gm, gopt = build()
    tx = torch.randn(64, 256, device=gt.device())
    ty = torch.randint(0, 10, (64,), device=gt.device())
    gx, gy = gt.tensor(tx), gt.tensor(ty)

    def step(m, opt, x, y):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    r = pair(
        "3-layer MLP step (AdamW, batch 64, width 256)",
        lambda: step(tm, topt, tx, ty),
        lambda: step(gm, gopt, gx, gy),
        10 if q else 40,
        3 if q else 10,
        unit=1e3,
        target=1.05,
    )
    print(f"{'':<44} target <= 1.05x: {'OK' if r <= 1.05 else 'MISSED'}")


def _two_rank(rank: int, world: int, q: bool) -> list | None:
    """One of 2 forked gloo CPU ranks (``_ranks.run_ranks``: 1 thread, on a GPU machine too);
    rank 0 returns ``(name, baseline us, spmdgt us)`` per row."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    mesh = gt.device_mesh()
    torch.manual_seed(0)
    full = [torch.randn(64, 64) for _ in range(3)]
    da, db, dc = (distribute_tensor(t, mesh, [Shard(0)]) for t in full)
    with gt.signal.context("rows"):
        ga, gb, gc = (gt.tensor(t) for t in full)
    assert type(ga) is gt.Tensor and type(da) is DTensor, (type(ga), type(da))
    # DTensor caches sharding decisions by spec; a lookup with an equal but different spec
    # object pays an __eq__ (~2 us) that an identical one skips. Share the specs so neither
    # side is charged for coming second.
    ga, gb, gc = (_share_spec(g, d) for g, d in ((ga, da), (gb, db), (gc, dc)))
    w = torch.randn(64, 64)
    dw = distribute_tensor(w, mesh, [Shard(0)])
    gw = _share_spec(gt.signal.tensor(w, "rows"), dw)
    n = 50
    results = []

    def run(name, f_dt, f_gt, iters, unit):
        f_dt(), f_gt()
        tb = to = float("inf")
        for _ in range(5 if q else 20):
            dist.barrier()
            tb = min(tb, best_of(f_dt, iters, 1))
            dist.barrier()
            to = min(to, best_of(f_gt, iters, 1))
        results.append((name, tb * unit, to * unit))

    def loop(a, b, c):
        def f():
            x = c
            for _ in range(n):
                x = x * b + a

        return f

    run(
        "2 ranks: c=c*b+a on Shard(0) 64x64 (per op)",
        loop(da, db, dc),
        loop(ga, gb, gc),
        1,
        1e6 / (2 * n),
    )
    run("2 ranks: Shard(0) @ Shard(0) -> redistribute", lambda: da @ dw, lambda: ga @ gw, 20, 1e6)
    run(
        "2 ranks: sum() -> Partial -> .full_tensor()",
        lambda: da.sum().full_tensor(),
        lambda: gc.sum().full_tensor(),
        20,
        1e6,
    )
    # Rank agreement (spmdgt.runtime._agree). A host read carries a header exchange; the
    # baseline is the same read without it (DTensor's full_tensor().numpy()).
    from spmdgt.runtime import _agree

    big = torch.randn(1000, 1000)
    dbig = distribute_tensor(big, mesh, [Shard(0)])
    gbig = _share_spec(gt.signal.tensor(big, "rows"), dbig)
    run(
        "2 ranks: .numpy() 1000x1000 Shard(0), header",
        lambda: dbig.full_tensor().numpy(),
        lambda: gbig.numpy(),
        5,
        1e6,
    )
    # a Partial sum read on the host (a loss summed over sharded rows): DTensor all-reduces
    # it; spmdgt, on one host, reduces it through shared memory after the read's header
    dsum, gsum = dc.sum(), gc.sum()
    run(
        "2 ranks: .item() of a Partial sum, header",
        lambda: dsum.full_tensor().item(),
        lambda: gsum.item(),
        20,
        1e6,
    )
    # the header alone (one agreement point) against the smallest all-reduce its side group
    # runs: one int64, on the group's gloo backend as the agreement calls it (two or more
    # elements take gloo's ring 1.5-2x as long; dist.all_reduce adds its Python on top)
    one = torch.zeros(1, dtype=torch.int64)
    run(
        "2 ranks: one agreement point vs 8 B all-reduce",
        lambda: _agree._backend.allreduce([one]).wait(),
        lambda: _agree.agree("bench", site="bench"),
        50,
        1e6,
    )
    # the same pair timed call by call, alternating, medians: on a loaded box a best-of-rounds
    # row swings with the scheduler more than the point's own microseconds move it
    base_us, ours_us = paired(
        lambda: _agree._backend.allreduce([one]).wait(),
        lambda: _agree.agree("bench", site="bench"),
        2000 if q else 10000,
    )
    results.append(("2 ranks: one agreement point vs 8 B all-reduce, median", base_us, ours_us))
    base_us, ours_us = paired(
        lambda: dbig.full_tensor().numpy(), lambda: gbig.numpy(), 100 if q else 400
    )
    results.append(("2 ranks: .numpy() 1000x1000, header, median", base_us, ours_us))
    # GT_CHECK_RANKS=1: the same calls with the check on (baseline: spmdgt, check off)
    _agree._install_redistribute_check()

    def checked(f):
        def g():
            _agree._check = True
            try:
                f()
            finally:
                _agree._check = False

        return g

    run(
        "2 ranks: GT_CHECK_RANKS=1, .numpy() 1000x1000",
        lambda: gbig.numpy(),
        checked(lambda: gbig.numpy()),
        5,
        1e6,
    )
    run(
        "2 ranks: GT_CHECK_RANKS=1, Shard(0) @ Shard(0)",
        lambda: ga @ gw,
        checked(lambda: ga @ gw),
        20,
        1e6,
    )
    run(
        "2 ranks: GT_CHECK_RANKS=1, c=c*b+a (per op)",
        loop(ga, gb, gc),
        checked(loop(ga, gb, gc)),
        1,
        1e6 / (2 * n),
    )
    _rank_error_rows(rank, q, loop(ga, gb, gc), n, results)
    return results if rank == 0 else None


def paired(base: Callable[[], object], ours: Callable[[], object], calls: int) -> tuple:
    """Median microseconds of ``base`` and of ``ours``, timed call by call in alternation
    (which of the two goes first alternates too): both see the same moments of a shared
    machine. Every rank makes the same calls in the same order."""
    import numpy

    times = numpy.zeros((2, calls))
    clock = time.perf_counter
    fns = (base, ours)
    base(), ours()  # warm
    for i in range(calls):
        for j in (0, 1) if i % 2 else (1, 0):
            t0 = clock()
            fns[j]()
            times[j, i] = clock() - t0
    med = numpy.median(times, axis=1) * 1e6
    return float(med[0]), float(med[1])


def _rank_error_rows(rank: int, q: bool, ops, n: int, results: list) -> None:
    """What spmdgt's answer to an error on one rank costs (``runtime._failed``): on the happy
    path only its watchdog thread (one store look a second), timed per op with the watchdog
    stopped (baseline) and running; and an error every rank raises, which now also posts to
    the store and waits for every rank's post (baseline: ``GT_RANK_ERROR_WAIT=0``, off)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import spmdgt as gt
    from spmdgt.runtime import _failed

    with gt.signal.context("rows"):
        bad = gt.tensor(torch.full((8,), 9))  # out of range on every rank: a uniform error
    w = torch.randn(5, 3)

    def uniform_error():
        try:
            F.embedding(bad, w)
        except IndexError:
            pass

    def timed(name, f, iters, unit, off, on):
        f()
        tb = to = float("inf")
        for _ in range(5 if q else 20):
            off()
            dist.barrier()
            tb = min(tb, best_of(f, iters, 1))
            on()
            dist.barrier()
            to = min(to, best_of(f, iters, 1))
        results.append((name, tb * unit, to * unit))

    def env(value):
        return lambda: os.environ.__setitem__("GT_RANK_ERROR_WAIT", value)

    timed(
        "2 ranks: rank-error watchdog, c=c*b+a (per op)",
        ops,
        1,
        1e6 / (2 * n),
        _failed.stop,
        _failed._start_watchdog,
    )
    timed("2 ranks: an error every rank raises", uniform_error, 5, 1e6, env("0"), env("5"))
    os.environ.pop("GT_RANK_ERROR_WAIT")


def _share_spec(g, d):
    from torch.distributed.tensor import DTensor

    import spmdgt as gt

    assert torch.equal(g.to_local(), d.to_local())
    out = DTensor(g.to_local(), d._spec, requires_grad=False)
    out.__class__ = gt.Tensor
    return out


def two_rank_vs_dtensor(q: bool) -> None:
    # a rank that fails fails the run with its traceback; a hang is killed at the timeout
    results = run_ranks(_two_rank, 2, q, device="cpu", threads=1, timeout=900)[0]
    for name, tb, to in results:
        base = "DTensor"
        if "GT_CHECK_RANKS" in name or "agreement" in name:
            base = "spmdgt" if "GT_CHECK_RANKS" in name else "gloo"
        elif "rank-error" in name or "every rank raises" in name:
            base = "off"
        print(f"{name:<46} {base:<7} {tb:9.2f} us   spmdgt {to:9.2f} us   ratio {to / tb:5.2f}x")
        target = 1.0 if base == "DTensor" else None  # no worse than DTensor's own
        if "agreement point" in name or "header" in name:  # issue 25: 1.2x and 1.1x
            target = 1.2 if "agreement point" in name else 1.1
        record(name, base if base != "spmdgt" else "spmdgt, check off", tb, to, "us", target)
        if name.startswith("2 ranks: sum()"):
            print(f"{'':<46} target: no worse than DTensor (ratio ~1.0 within noise)")
    print(f"{'':<46} (GT_CHECK_RANKS rows: baseline is spmdgt with the check off)")
    print(
        f"{'':<46} (rank-error rows: baseline is spmdgt without the watchdog / with "
        "GT_RANK_ERROR_WAIT=0)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import spmdgt as gt

    where = torch.cuda.get_device_name() if gt.device().type == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, 1 thread per rank, {os.cpu_count()} CPUs, "
        f"1-rank cases on {where}"
    )
    print("(1 rank, no config: spmdgt tensors are plain torch tensors; 1-rank ratios are noise)\n")
    progress = Progress("bench_core")
    small_op_loop(args.quick)
    seed000_baseline(args.quick)
    mlp_step(args.quick)
    progress("1-rank parts done; starting 2 forked ranks (spmdgt against DTensor)")
    two_rank_vs_dtensor(args.quick)
    if args.json:
        write(
            args.json,
            "core",
            {"pairs": PAIRS, "quick": args.quick},
            device=gt.device().type,
            world_size=[1, 2],
            threads={"per_rank": 1},
        )


if __name__ == "__main__":
    main()
