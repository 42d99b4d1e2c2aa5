"""Trainer benchmark: DDP vs FSDP2 vs TP placements, each beside the same loop in raw torch.

Runs the Qwen3-like transformer of examples/train_transformer.py on 2 CPU ranks (forked here,
gloo over a file:// rendezvous; no torchrun needed) and prints, per strategy: step time,
throughput, max RSS, communication share and collectives per step for the trainer, the step
time of a hand-written torch loop doing the same work (DDP / fully_shard / parallelize_module,
clip, AdamW, ``loss.item()``), and the trainer's added step time; then that added time again on
the same model at a tiny width (``_overhead_floor``), where compute noise is gone. Then gradient
accumulation 1 vs 4 (same micro-batch): collectives per optimizer step and step time.

    python benchmarks/bench_trainer.py                 # default size, ~2-3 minutes on 2 cores
    python benchmarks/bench_trainer.py --steps 5 --rounds 1 --dim 64   # quick look

Noise: trainer and raw runs alternate for ``--rounds`` rounds (the order flips every round, so
neither side always runs first), each round gives one mean step time per side, and the table
reports the median over rounds per side, the overhead of those medians, and the spread of the
per-round paired overheads (min .. max), which says how far a single pair can be off on this
machine. The placements trainer runs with no tracing (comm "n/a": nothing measured it; pass
``profile=True`` or turn the interceptor on to measure it, which costs interception time).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TP_PLAN = {
    "layers.*.attn.[qkv]_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def _example():
    spec = importlib.util.spec_from_file_location(
        "train_transformer", ROOT / "examples" / "train_transformer.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


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


def _trainer_case(args, ex, strategy, accum=1):
    import torch

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

    with contextlib.redirect_stdout(io.StringIO()):  # the summary is re-printed below
        s = t.train(loader, max_steps=args.warmup + args.steps)
    s["max_rss_gb"] = max(t.last_stats.memory) / 1e9
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


def _rank_main(rank, world, init_file, args, conn):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GT_DEVICE="cpu",  # gloo CPU ranks, on a GPU machine too
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from spmdgt.train import CommunicationProfiler

    ex = _example()
    out = {}
    for strategy in ("ddp", "fsdp", "placements"):
        tr, raw = [], []
        for i in range(args.rounds):  # alternate, flipping the order, so drift hits both sides
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
    out["floor"] = _overhead_floor(args, ex)
    out["accum"] = {a: _trainer_case(args, ex, "ddp", accum=a) for a in (1, 4)}
    model, _ = _setup(args, ex)
    prof = CommunicationProfiler()
    out["estimate"] = {
        "ddp": prof.estimate_ddp_comm_cost(model, world),
        "fsdp": prof.estimate_fsdp_comm_cost(model, world),
    }
    dist.destroy_process_group()
    conn.send(out)
    conn.close()


def report(out: dict, args) -> None:
    world = 2
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
    bw = out["estimate"]["ddp"]["bandwidth_bytes_per_sec"]
    print(
        f"\ncomm estimate per step (ring algebra, bandwidth measured by probe: {bw / 1e9:.2f} "
        "GB/s):"
    )
    for s in ("ddp", "fsdp"):
        e = out["estimate"][s]
        meas = (out[s]["comm_time_share"] or 0.0) * out[s]["avg_step_time"]
        print(
            f"  {s:<5} {e['bytes_per_rank'] / 1e6:8.2f} MB/rank -> {e['estimated_sec'] * 1e3:6.2f}"
            f" ms estimated; measured comm {meas * 1e3:6.2f} ms/step"
        )
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
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rdzv")
        procs, conns = [], []
        for r in range(2):
            parent, child = ctx.Pipe(duplex=False)
            pr = ctx.Process(target=_rank_main, args=(r, 2, init, args, child))
            pr.start()
            procs.append(pr)
            conns.append(parent)
        out = conns[0].recv()
        for pr in procs:
            pr.join()
    report(out, args)


if __name__ == "__main__":
    main()
