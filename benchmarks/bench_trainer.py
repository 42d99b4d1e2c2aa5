"""Trainer benchmark: DDP vs FSDP2 vs TP placements, each beside the same loop in raw torch.

Runs the Qwen3-like transformer of examples/train_transformer.py on 2 CPU ranks (forked here
by ``_ranks.run_ranks``, gloo over a rendezvous on 127.0.0.1; no torchrun needed; a failing
rank fails the run with its traceback, a hang is killed at ``--timeout``) and prints, per
strategy: step time, throughput, max RSS, communication share and collectives per step for
the trainer, the step time of a hand-written torch loop doing the same work (DDP /
fully_shard / parallelize_module, clip, AdamW, ``loss.item()``), and the trainer's added step
time; then that added time again on the same model at a tiny width (``_overhead_floor``),
where compute noise is gone. Then gradient accumulation 1 vs 4 (same micro-batch):
collectives per optimizer step and step time. Then the communication cost model against
measurement, per strategy and collective kind, side by side: ``CommunicationProfiler``'s
estimate (latency per collective from a small-message probe + ring bytes / bus bandwidth from
a large all-reduce probe) beside what the run's collectives counted and took (DDP comm hook
and FSDP2 collective hooks: issue to completion; placements: a run with the interceptor on,
whose times are issue times, a lower bound). Then the mesh section (``_mesh4``): the same
model on 4 ranks as fsdp 4x1, tp 1x4 and fsdp x tp 2x2 (``parallelism``), step times side by
side, and the 2x2 layout's collectives per mesh dim beside the per-dim cost model.

    python benchmarks/bench_trainer.py                 # default size, ~2-3 minutes on 2 cores
    python benchmarks/bench_trainer.py --mesh-only --no-compile --json results/mesh4.json
    python benchmarks/bench_trainer.py --steps 5 --rounds 1 --dim 64   # quick look
    python benchmarks/bench_trainer.py --compile-only  # just the compile section
    python benchmarks/bench_trainer.py --rank-errors-only  # the rank-error watchdog's cost
    python benchmarks/bench_trainer.py --json results/trainer.json   # the figures as a file
    python benchmarks/bench_trainer.py --compile-only --dim 1024 --layers 8 --seq-len 512 \
        --batch-size 16 --heads 16 --kv-heads 4        # the issue's GPU size (bf16 on CUDA)

Compile section (world of one, this process; on CUDA with bf16 autocast): one training step of
the example transformer four ways, side by side: a hand-written eager loop, the same loop with
each block ``torch.compile``-d by hand (torchtitan's way), the trainer eager, and
``TrainConfig(compile=True)``. Each compiled side is first compiled cold (in
a fresh process with an empty inductor cache) to report its compile time; then ``--compile-rounds``
rounds alternate the sides (order rotated each round), each side running ``--warmup`` untimed
steps then ``--steps`` timed ones; the median per side is reported. Loss sequences are compared
with the eager loop's (same data order). With CUDA, MFU = (6 N + 12 L d s) tokens / step time /
peak, N the non-embedding parameters (the issue's 10-11% eager / 28% compiled on an H200 comes
out of the same formula).

Noise: trainer and raw runs alternate for ``--rounds`` rounds (the order flips every round, so
neither side always runs first), each round gives one mean step time per side, and the table
reports the median over rounds per side, the overhead of those medians, and the spread of the
per-round paired overheads (min .. max), which says how far a single pair can be off on this
machine. The placements trainer runs with no tracing (comm "n/a": nothing measured it; pass
``profile=True`` or turn the interceptor on to measure it, which costs interception time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _compile_step import compile_section, report_compile
from _example import ROOT
from _example import load_example as _example
from _mesh4 import mesh_main, report_mesh
from _ranks import run_ranks
from _results import Progress, write

TP_PLAN = {
    "layers.*.attn.[qkv]_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "layers.*.attn.[qk]_norm": "sharded_input",  # per-head norms over this rank's heads
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _setup(args, ex):
    import torch

    torch.manual_seed(0)
    margs = ex.ModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=2 * args.dim,
        max_seq_len=args.seq_len,
    )
    model = ex.Transformer(margs)
    n_tok = (args.steps + args.warmup + 2) * args.batch_size * 8 * args.seq_len + 1
    ds = ex.TokenDataset(ex.load_tokens(None, n_tok, 256, 0), args.seq_len)
    return model, ds


def _trainer_case(args, ex, strategy, accum=1, trace_collectives=False):
    import torch

    from spmdgt import interceptor
    from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig, TrainingConfig

    model, ds = _setup(args, ex)
    cfg = TrainConfig(
        strategy=strategy,
        placements=TP_PLAN if strategy == "placements" else {},
        training=TrainingConfig(warmup_steps=args.warmup),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = DistributedTrainer(
        model,
        opt,
        loss_fn=ex.lm_loss,
        max_grad_norm=1.0,
        config=cfg,
        gradient_accumulation_steps=accum,
    )
    loader = OptimizedDataLoader.create(
        ds, args.batch_size, shard=strategy != "placements", num_workers=0
    )
    import contextlib
    import io

    own = trace_collectives and not interceptor.is_enabled()
    if own:  # placements: DTensor's collectives are seen only in the interceptor's op stream
        interceptor.enable(stats=False, hotpath=False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the summary is re-printed below
            s = t.train(loader, max_steps=args.warmup + args.steps)
    finally:
        if own:
            interceptor.disable()
    s["max_rss_gb"] = max(t.last_stats.rss) / 1e9  # sampled RSS, as the plain loop's
    # Per kind over the timed steps (the warm-up left out, as in the summary's averages).
    timed_from = t.last_stats.first_step + s["warmup_steps_excluded"]
    timed = [r for r in t.wrapped.log.records if r.step >= timed_from]
    s["comm_totals"] = t.wrapped.log.totals(timed)
    s["comm_step"] = [(r.kind, r.nbytes) for r in timed if r.step == timed_from]  # one step
    s["comm_steps"] = s["num_steps"] - s["warmup_steps_excluded"]
    return s


def _raw_case(args, ex, strategy):
    """The loop a user would write by hand on the same engines."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    model, ds = _setup(args, ex)
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = strategy != "placements"
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        for m in (model.embed, model.norm, model.lm_head):
            fully_shard(m)
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        plan = {}
        for i in range(len(model.layers)):
            for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"layers.{i}.{n}"] = ColwiseParallel()
            for n in ("attn.o_proj", "mlp.down_proj"):
                plan[f"layers.{i}.{n}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        # the per-head q/k norms read this rank's heads only: their whole, plain parameters
        # get a partial gradient, summed over the ranks (the trainer's sharded_input style)
        for block in model.layers:
            for norm in (block.attn.q_norm, block.attn.k_norm):
                for param in norm.parameters():
                    param.register_hook(_all_reduce_sum)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(
        ds, num_replicas=world if shard else 1, rank=rank if shard else 0, shuffle=True, seed=0
    )
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    times, mem = [], []
    t0 = time.perf_counter()
    for x, y in loader:
        loss = ex.lm_loss(model(x), y)
        loss.backward()
        if strategy == "placements":  # mixed DTensor / plain grads: the trainer's clip
            from spmdgt.train._strategies import clip_grad_norm

            clip_grad_norm(list(model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        mem.append(_rss())
        t0 = t1
        if len(times) == args.warmup + args.steps:
            break
    return {"avg_step_time": statistics.fmean(times[args.warmup :]), "max_rss_gb": max(mem) / 1e9}


def _all_reduce_sum(grad):
    """A gradient summed over the ranks (a new tensor: a hook must not change its input)."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def _replay(collectives: list[tuple[str, int]], iters: int = 5) -> dict[str, float]:
    """Seconds per kind to run one step's collectives back to back on the idle group (no
    compute, no overlap, no rank skew: what the cost model describes), the slowest rank's
    median over ``iters``. Every rank replays its own log of the same step: the same
    sequence, or the run would have hung."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    # torch 2.13 renamed the flat-tensor collectives (the old names warn)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = {}
    for kind in sorted({k for k, _ in collectives}):
        bufs = []
        for k, nbytes in collectives:
            if k != kind:
                continue
            numel = max(nbytes // 4, world) // world * world
            bufs.append((torch.ones(numel), torch.ones(numel // world)))

        def run(kind=kind, bufs=bufs):
            for full, part in bufs:
                if kind == "all_reduce":
                    dist.all_reduce(full)
                elif kind == "all_gather":
                    all_gather(full, part)
                else:
                    reduce_scatter(part, full)

        run()  # warm-up
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[kind] = float(t.item())
    return out


def _spread(values: list[float]) -> float:
    """(max - min) / median of per-round step times: how noisy one side was."""
    return (max(values) - min(values)) / statistics.median(values)


def _overhead_floor(args, ex) -> dict[str, dict[str, float]]:
    """The trainer's added time per step, measured where it can be resolved.

    On the full-size model a few percent drowns in this machine's noise (rounds differ by
    10-40%). The trainer's cost does not grow with width: it is per step, per collective and
    per parameter tensor. So the same model (same modules, parameters and collectives) also
    runs at a tiny width, where the compute, and the noise it brings, is gone; the
    trainer-minus-raw difference there, in ms, is the added cost, which the report divides by
    the full-size raw step time. On 2 CPU ranks the fixed costs (dispatch, gloo collectives)
    dominate even the tiny step, so the interquartile range is printed beside the median.
    """
    tiny = argparse.Namespace(**vars(args))
    tiny.dim, tiny.seq_len, tiny.batch_size = 16, 8, 2
    tiny.steps, tiny.warmup = args.floor_steps, 5
    out = {}
    for strategy in ("ddp", "fsdp", "placements"):
        diffs, raws = [], []
        for i in range(args.floor_rounds):
            first, second = (_trainer_case, _raw_case) if i % 2 == 0 else (_raw_case, _trainer_case)
            a = first(tiny, ex, strategy)["avg_step_time"]
            b = second(tiny, ex, strategy)["avg_step_time"]
            tr, raw = (a, b) if i % 2 == 0 else (b, a)
            diffs.append(tr - raw)
            raws.append(raw)
        diffs.sort()
        out[strategy] = {
            "added": statistics.median(diffs),
            "added_lo": diffs[len(diffs) // 4],
            "added_hi": diffs[-1 - len(diffs) // 4],
            "raw": statistics.median(raws),
        }
    return out


def _rank_error_cost(args, ex) -> dict[str, dict[str, float]]:
    """What spmdgt's answer to an error on one rank (``runtime._failed``) costs a training
    step: on the happy path, its watchdog thread alone (the error path never runs). Each
    strategy's trainer runs with the watchdog running and stopped, ``--rank-error-rounds``
    alternating rounds, in this one run; per side the median of the rounds' mean step times."""
    from spmdgt.runtime import _failed

    out = {}
    for strategy in ("ddp", "placements"):
        on, off = [], []
        for i in range(args.rank_error_rounds):
            for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
                if side == "on":
                    _failed._start_watchdog()
                else:
                    _failed.stop()
                t = _trainer_case(args, ex, strategy)["avg_step_time"]
                (on if side == "on" else off).append(t)
        _failed._start_watchdog()  # as gt.init left it
        paired = [a / b - 1 for a, b in zip(on, off)]
        out[strategy] = {
            "with": statistics.median(on),
            "without": statistics.median(off),
            "paired_min": min(paired),
            "paired_max": max(paired),
        }
    # the watchdog's whole work: one store look per _POLL seconds; its time bounds the cost
    key = [_failed._prefix + _failed._TEXT]
    t0 = time.perf_counter()
    for _ in range(200):
        _failed._store.check(key)
    out["poll_s"] = {"look": (time.perf_counter() - t0) / 200, "every": _failed._POLL}
    return out


def report_rank_errors(cost: dict, args) -> None:
    print(
        "\nerrors on one rank (GT_RANK_ERROR_WAIT): cost per step, with and without the "
        f"watchdog, {args.rank_error_rounds} alternating rounds of {args.steps} steps, this run:"
    )
    cost = dict(cost)
    poll = cost.pop("poll_s")
    for s, c in cost.items():
        added = c["with"] / c["without"] - 1
        print(
            f"  {s:<11} with {c['with'] * 1e3:8.2f} ms   without {c['without'] * 1e3:8.2f} ms"
            f"   added {added * 100:+5.2f}% (paired {c['paired_min'] * 100:+.1f}.."
            f"{c['paired_max'] * 100:+.1f}%; target <= +2%)"
        )
    print(
        f"  the watchdog's work: one store look ({poll['look'] * 1e6:.0f} us) every "
        f"{poll['every']:g} s = {poll['look'] / poll['every'] * 100:.3f}% of any step's time "
        "at most (a bound that the rounds' noise above cannot resolve)"
    )


def _rank_main(rank: int, world: int, args) -> dict | None:
    """One of the 2 CPU ranks (started by ``_ranks.run_ranks``: gloo, 1 thread, the process
    group joined by ``spmdgt.init()`` as under torchrun); rank 0 returns the figures."""
    import torch

    from spmdgt.train import CommunicationProfiler, DDPConfig

    ex = _example()
    out = {}
    say = Progress("bench_trainer") if rank == 0 else (lambda msg: None)
    say("errors on one rank: the watchdog's cost per step")
    out["rank_errors"] = _rank_error_cost(args, ex)
    if args.rank_errors_only:
        return out if rank == 0 else None
    for strategy in ("ddp", "fsdp", "placements"):
        tr, raw = [], []
        for i in range(args.rounds):  # alternate, flipping the order, so drift hits both sides
            say(f"{strategy}: round {i + 1}/{args.rounds} (trainer and raw loop)")
            if i % 2 == 0:
                tr.append(_trainer_case(args, ex, strategy))
                raw.append(_raw_case(args, ex, strategy))
            else:
                raw.append(_raw_case(args, ex, strategy))
                tr.append(_trainer_case(args, ex, strategy))
        best = sorted(tr, key=lambda s: s["avg_step_time"])[len(tr) // 2]
        best["raw_step_time"] = statistics.median(r["avg_step_time"] for r in raw)
        best["raw_max_rss_gb"] = statistics.median(r["max_rss_gb"] for r in raw)
        best["trainer_step_time"] = statistics.median(s["avg_step_time"] for s in tr)
        paired = [t["avg_step_time"] / r["avg_step_time"] - 1 for t, r in zip(tr, raw)]
        best["paired_min"], best["paired_max"] = min(paired), max(paired)
        best["paired_median"] = statistics.median(paired)
        best["trainer_spread"] = _spread([s["avg_step_time"] for s in tr])
        best["raw_spread"] = _spread([r["avg_step_time"] for r in raw])
        out[strategy] = best
    say("overhead floor (tiny width)")
    out["floor"] = _overhead_floor(args, ex)
    say("gradient accumulation, collectives, cost model")
    out["accum"] = {a: _trainer_case(args, ex, "ddp", accum=a) for a in (1, 4)}
    out["placements_traced"] = _trainer_case(args, ex, "placements", trace_collectives=True)
    out["replay"] = {
        s: _replay((out["placements_traced"] if s == "placements" else out[s])["comm_step"])
        for s in ("ddp", "fsdp", "placements")
    }
    model, _ = _setup(args, ex)
    prof = CommunicationProfiler()  # probes latency and bandwidth on first use (collective)
    batch = torch.randint(0, 256, (args.batch_size, args.seq_len))  # one rank's micro-batch
    out["estimate"] = {
        "ddp": prof.estimate_ddp_comm_cost(model, world, bucket_cap_mb=DDPConfig().bucket_cap_mb),
        "fsdp": prof.estimate_fsdp_comm_cost(model, world),
        "placements": prof.estimate_placements_comm_cost(model, world, TP_PLAN, batch),
    }
    return out if rank == 0 else None


def report(out: dict, args) -> None:
    world = 2
    if args.rank_errors_only:
        report_rank_errors(out["rank_errors"], args)
        return
    print(
        f"bench_trainer: Qwen3-like transformer dim={args.dim} layers={args.layers} "
        f"seq={args.seq_len} batch/rank={args.batch_size}, {world} CPU ranks (gloo, 1 thread "
        f"each), {args.steps} timed steps after {args.warmup} warm-up, median of "
        f"{args.rounds} alternating rounds"
    )
    hdr = (
        f"{'strategy':<11}{'step ms':>9}{'raw ms':>9}{'overhead':>10}{'paired min..max':>17}"
        f"{'spread tr/raw':>15}{'samples/s':>11}{'tokens/s':>10}{'RSS GB':>8}{'comm %':>8}"
        f"{'coll/step':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for s in ("ddp", "fsdp", "placements"):
        r = out[s]
        over = (r["trainer_step_time"] / r["raw_step_time"] - 1) * 100
        paired = f"{r['paired_min'] * 100:+.1f}..{r['paired_max'] * 100:+.1f}%"
        spread = f"{r['trainer_spread'] * 100:.0f}%/{r['raw_spread'] * 100:.0f}%"
        share, coll = r["comm_time_share"], r["collectives_per_step"]
        share_s = f"{share * 100:>7.1f}%" if share is not None else f"{'n/a':>8}"
        coll_s = f"{coll:>10.1f}" if coll is not None else f"{'n/a':>10}"
        print(
            f"{s:<11}{r['trainer_step_time'] * 1e3:>9.1f}{r['raw_step_time'] * 1e3:>9.1f}"
            f"{over:>+9.1f}%{paired:>17}{spread:>15}"
            f"{r['throughput_samples_per_sec']:>11.1f}"
            f"{r['throughput_tokens_per_sec']:>10.0f}{r['max_rss_gb']:>8.3f}{share_s}{coll_s}"
        )
    print(
        "(step/raw ms: median over rounds of each round's mean step time; overhead = their "
        "ratio - 1, target <= +3%;\n paired min..max: per-round trainer/raw - 1; spread: "
        "(max - min) / median of the rounds per side;\n comm % = collective issue-to-completion"
        " time / step time, overlap counted in full; n/a = not measured)"
    )
    _report_comm(out)
    print(
        f"\ntrainer overhead floor: the same model at dim=16 seq=8 batch=2 (same modules and "
        f"collectives), {args.floor_steps} steps x {args.floor_rounds} alternating rounds; "
        "added ms/step = median of per-round trainer - raw (interquartile range), "
        "as a share of the full-size raw step:"
    )
    for s in ("ddp", "fsdp", "placements"):
        f = out["floor"][s]
        full = out[s]["raw_step_time"]
        print(
            f"  {s:<11} tiny raw {f['raw'] * 1e3:6.2f} ms   added {f['added'] * 1e3:+6.3f} ms"
            f" ({f['added_lo'] * 1e3:+.3f}..{f['added_hi'] * 1e3:+.3f})   = "
            f"{f['added'] / full * 100:+5.2f}% of {full * 1e3:.1f} ms (target <= +3%)"
        )
    print("\ngradient accumulation (DDP, same micro-batch):")
    for a, r in out["accum"].items():
        print(
            f"  accum={a}: {r['collectives_per_step']:.1f} collectives/optimizer step, "
            f"{r['avg_step_time'] * 1e3:.1f} ms/optimizer step, "
            f"{r['avg_step_time'] / a * 1e3:.1f} ms/micro-step"
        )
    report_rank_errors(out["rank_errors"], args)


def _report_comm(out: dict) -> None:
    """Estimate vs measurement of the collectives per optimizer step, side by side."""
    est = out["estimate"]
    probes = {}  # kind -> (latency, bus bandwidth), as the estimates carry them
    for e in est.values():
        for k in ("all_reduce", "all_gather", "reduce_scatter"):
            if f"{k}_latency_per_collective_sec" in e:
                probes[k] = (
                    e[f"{k}_latency_per_collective_sec"],
                    e[f"{k}_bandwidth_bytes_per_sec"],
                )
    print(
        "\ncommunication per optimizer step: estimate vs measured. Model: each collective costs "
        "latency + ring bytes / bus bandwidth,\nboth probed per kind on this group as nccl-tests"
        " does (8-byte message; 8 MiB message, latency removed; slowest rank's median):\n  "
        + "; ".join(
            f"{k} {lat * 1e6:.0f} us + bytes / {bw / 1e9:.2f} GB/s"
            for k, (lat, bw) in probes.items()
        )
    )
    hdr = (
        f"  {'strategy':<11}{'collective':<15}{'est n':>6}{'meas n':>7}{'est MB':>7}{'meas MB':>8}"
        f"{'lat ms':>7}{'xfer ms':>8}{'est ms':>7}{'replay ms':>10}{'in-run ms':>10}"
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    measured = {s: out[s] for s in ("ddp", "fsdp")}
    measured["placements"] = out["placements_traced"]
    for s in ("ddp", "fsdp", "placements"):
        e, m = est[s], measured[s]
        steps = max(m["comm_steps"], 1)
        kinds = sorted({k[: -len("_count")] for k in e if k.endswith("_count")})
        rows = []
        for k in kinds:
            t = m["comm_totals"].get(k, {"count": 0, "bytes": 0, "sec": 0.0})
            ring = 2 * (2 - 1) / 2 if k == "all_reduce" else (2 - 1) / 2  # 2 ranks
            lat_ms = e[f"{k}_count"] * e[f"{k}_latency_per_collective_sec"] * 1e3
            rows.append(
                (
                    k,
                    e[f"{k}_count"],
                    t["count"] / steps,
                    e[f"{k}_bytes"] / 1e6,
                    ring * t["bytes"] / steps / 1e6,
                    lat_ms,
                    e[f"{k}_sec"] * 1e3 - lat_ms,
                    e[f"{k}_sec"] * 1e3,
                    out["replay"][s].get(k, 0.0) * 1e3,
                    t["sec"] / steps * 1e3,
                )
            )
        if len(rows) > 1:
            rows.append(("(all)", *(sum(r[i] for r in rows) for i in range(1, 10))))
        for k, en, mn, emb, mmb, lat_ms, xfer, ems, rms, mms in rows:
            print(
                f"  {s:<11}{k:<15}{en:>6.0f}{mn:>7.1f}{emb:>7.3f}{mmb:>8.3f}{lat_ms:>7.2f}"
                f"{xfer:>8.2f}{ems:>7.2f}{rms:>10.2f}{mms:>10.2f}"
            )
    print(
        "  (est n / MB: the model's collectives and ring bytes per rank; meas n / MB: what the run"
        " issued per timed step;\n   lat / xfer ms: the estimate's latency and transfer terms, "
        "est ms their sum; replay ms: one step's logged\n   collectives run back to back on the "
        "idle group (no compute, overlap or rank skew: what the model describes);\n   in-run "
        "ms: ddp/fsdp issue-to-completion from the DDP comm hook and FSDP2 collective hooks, "
        "overlap,\n   queueing behind earlier collectives and waiting for the slower rank "
        "counted in full (an upper bound on exposed\n   communication); placements: a run with "
        "the interceptor on, which times the issuing call only, not the\n   later wait "
        "(a lower bound))"
    )


# ----------------------------------------------------------------------------- compile


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--floor-steps", type=int, default=30)
    p.add_argument("--floor-rounds", type=int, default=6)
    p.add_argument("--heads", type=int, default=4, help="compile section: attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="compile section: key/value heads")
    p.add_argument("--compile-rounds", type=int, default=5)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--threads", type=int, default=1, help="compile section: torch threads")
    p.add_argument("--compile-only", action="store_true", help="only the compile section")
    p.add_argument("--mesh-only", action="store_true", help="only the 4-rank mesh section")
    p.add_argument("--no-mesh", action="store_true", help="skip the 4-rank mesh section")
    p.add_argument("--mesh-rounds", type=int, default=3, help="mesh section: rotated rounds")
    p.add_argument("--no-compile", action="store_true", help="skip the compile section")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the 2 ranks")
    p.add_argument("--rank-error-rounds", type=int, default=4, help="watchdog on/off rounds")
    p.add_argument(
        "--rank-errors-only", action="store_true", help="only the errors-on-one-rank section"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    out, comp, mesh = None, None, None
    if not args.compile_only and not args.mesh_only:
        # forked gloo ranks; a failing rank fails the run with its traceback, a hang is killed
        out = run_ranks(_rank_main, 2, args, device="cpu", threads=1, timeout=args.timeout)[0]
        report(out, args)
    if not args.compile_only and not args.no_mesh and not args.rank_errors_only:
        mesh = run_ranks(_mesh_rank, 4, args, device="cpu", threads=1, timeout=args.timeout)[0]
        report_mesh(mesh, args)
    # after the forked ranks: they never compile
    if not args.no_compile and not args.mesh_only and not args.rank_errors_only:
        comp = compile_section(args)
        report_compile(comp, args)
    if args.json:
        write(
            args.json,
            "trainer",
            figures(out, comp, args, mesh),
            device="cuda" if comp and comp["cuda"] else "cpu",
            world_size={"strategies": 2, "compile": 1, "mesh": 4},
            threads={"per_rank": 1, "compile": args.threads},
        )


def _mesh_rank(rank: int, world: int, args) -> dict | None:
    return mesh_main(rank, world, args, _example(), TP_PLAN)


def figures(out: dict | None, comp: dict | None, args, mesh: dict | None = None) -> dict:
    """What ``--json`` keeps: per strategy the step times of trainer and raw loop (medians over
    rounds), overhead, spread, throughput, memory and communication; the overhead floor,
    gradient accumulation and the cost model against measurement; the compile section's step
    time, compile time and loss difference per side; the mesh section's step time per layout
    and the 2x2 layout's collectives per mesh dim (``mesh``)."""
    res: dict = {"config": vars(args)}
    if mesh is not None:
        res["mesh"] = mesh
    if out is not None:
        keep = (
            "trainer_step_time",
            "raw_step_time",
            "paired_min",
            "paired_median",
            "paired_max",
            "trainer_spread",
            "raw_spread",
            "throughput_samples_per_sec",
            "throughput_tokens_per_sec",
            "max_rss_gb",
            "raw_max_rss_gb",
            "comm_time_share",
            "collectives_per_step",
            "comm_measured_by",
        )
        res["strategies"] = {
            s: {
                **{k: out[s].get(k) for k in keep},
                "overhead": out[s]["trainer_step_time"] / out[s]["raw_step_time"] - 1,
            }
            for s in ("ddp", "fsdp", "placements")
        }
        res["floor"] = out["floor"]
        res["rank_errors"] = out["rank_errors"]
        res["accum"] = {
            a: {k: r.get(k) for k in ("avg_step_time", "collectives_per_step")}
            for a, r in out["accum"].items()
        }
        measured = {s: out[s] for s in ("ddp", "fsdp")}
        measured["placements"] = out["placements_traced"]
        res["communication"] = {
            "estimate": out["estimate"],
            "replay_s": out["replay"],
            "measured": {
                s: {"totals": m["comm_totals"], "steps": m["comm_steps"]}
                for s, m in measured.items()
            },
        }
    if comp is not None:
        ref = comp["runs"]["eager (hand loop)"][0]["losses"]
        sides = {}
        for name, runs in comp["runs"].items():
            steps = [r["step"] for r in runs]
            cold = comp["cold"].get(name)
            sides[name] = {
                "step_s_median": statistics.median(steps),
                "step_s_rounds": steps,
                "compile_s_cold": cold["compile_sec"] if cold else None,
                "max_abs_loss_diff": max(
                    abs(a - b) for r in runs for a, b in zip(r["losses"], ref)
                ),
            }
        res["compile"] = {
            "sides": sides,
            "device": comp["device"],
            "flops_per_step": comp["flops"],
            "peak_flops": comp["peak"],
        }
    return res


if __name__ == "__main__":
    main()
