"""bench_trainer's mesh section: one model on 4 CPU ranks laid out three ways, side by side.

* ``fsdp 4x1``: FSDP2 over all 4 ranks (``strategy: fsdp``, the default 1-D world);
* ``tp 1x4``: tensor parallelism over all 4 ranks (``strategy: placements``, the TP table);
* ``fsdp x tp 2x2``: ``parallelism: {dp_shard: 2, tp: 2}``, TP inside pairs of ranks, FSDP2
  across them.

The same Qwen3-like model (4 query and 4 key/value heads, so TP over 4 ranks gets one head
each) and the same global batch: 4 x ``--batch-size`` sequences per optimizer step, split over
the data-parallel ranks (4, 1 and 2 of them). Layouts alternate for ``--mesh-rounds`` rounds,
the order rotated each round; each round gives one mean step time per layout (after
``--warmup`` steps), the table the median. Then one more run of the 2x2 layout with the
interceptor on gives its collectives per mesh dim and step, beside
``CommunicationProfiler(mesh=...)``'s estimate of them (latency and bandwidth probed on each
dim's own group). On 2 shared CPU cores these figures only rank the layouts: 4 ranks
oversubscribe the cores, gloo on loopback is no interconnect, and the load of the machine
moves every number; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics

__all__ = ["LAYOUTS", "mesh_main", "report_mesh"]

# name -> (strategy, parallelism, data-parallel ranks)
LAYOUTS = {
    "fsdp 4x1": ("fsdp", {}, 4),
    "tp 1x4": ("placements", {}, 1),
    "fsdp x tp 2x2": ("fsdp", {"dp_shard": 2, "tp": 2}, 2),
}


def _case(args, ex, plan: dict[str, str], name: str, traced: bool = False) -> dict:
    import torch

    from spmdgt import interceptor
    from spmdgt.train import (
        DistributedTrainer,
        OptimizedDataLoader,
        ParallelismConfig,
        TrainConfig,
        TrainingConfig,
    )

    strategy, parallelism, dp = LAYOUTS[name]
    torch.manual_seed(0)
    margs = ex.ModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=2 * args.dim,
        max_seq_len=args.seq_len,
    )
    model = ex.Transformer(margs)
    per_rank = 4 * args.batch_size // dp  # the same global batch for every layout
    steps = args.warmup + args.steps
    n_tok = (steps + 2) * 4 * args.batch_size * args.seq_len + 1
    ds = ex.TokenDataset(ex.load_tokens(None, n_tok, 256, 0), args.seq_len)
    cfg = TrainConfig(
        strategy=strategy,
        placements=plan if strategy == "placements" or parallelism.get("tp", 1) > 1 else {},
        parallelism=ParallelismConfig(**parallelism),
        training=TrainingConfig(warmup_steps=args.warmup),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = DistributedTrainer(model, opt, loss_fn=ex.lm_loss, max_grad_norm=1.0, config=cfg)
    loader = OptimizedDataLoader.create(
        ds,
        per_rank,
        shuffle=False,
        num_workers=0,
        num_replicas=t.data_parallel_size,
        rank=t.data_parallel_rank,
    )
    own = traced and not interceptor.is_enabled()
    if own:  # TP's collectives are seen only in the interceptor's op stream
        interceptor.enable(stats=False, hotpath=False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the summary is re-printed below
            s = t.train(loader, max_steps=steps)
    finally:
        if own:
            interceptor.disable()
    s["global_batch"] = per_rank * dp
    if traced:
        timed_from = t.last_stats.first_step + s["warmup_steps_excluded"]
        timed = [r for r in t.wrapped.log.records if r.step >= timed_from]
        n = max(s["num_steps"] - s["warmup_steps_excluded"], 1)
        per_dim = t.wrapped.log.totals_by_dim(timed)
        s["per_dim"] = {
            dim: {k: {f: v[f] / n for f in ("count", "bytes", "sec")} for k, v in kinds.items()}
            for dim, kinds in per_dim.items()
        }
        from spmdgt.train import CommunicationProfiler

        prof = CommunicationProfiler(mesh=t.device_mesh)  # per-dim probes: collective
        s["estimate"] = prof.estimate_counted_by_dim(s["per_dim"])
        s["probes"] = {"latency": prof.latency_by_dim, "bandwidth": prof.bandwidths_by_dim}
    return s


def mesh_main(
    rank: int, world: int, args: argparse.Namespace, ex, plan: dict[str, str]
) -> dict | None:
    """One of the 4 ranks: every layout for ``--mesh-rounds`` rounds, then the traced 2x2.
    ``ex`` is the example module, ``plan`` bench_trainer's TP table."""
    import logging

    # DTensor warns on every clip that a 2-D norm reduces one dim at a time: said in the docs
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    names = list(LAYOUTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, dict] = {}
    for i in range(args.mesh_rounds):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate: no fixed first
        for name in order:
            s = _case(args, ex, plan, name)
            times[name].append(s["avg_step_time"])
            last[name] = s
    traced = _case(args, ex, plan, "fsdp x tp 2x2", traced=True)
    if rank != 0:
        return None
    out = {}
    for name in names:
        s = last[name]
        med = statistics.median(times[name])
        out[name] = {
            "step_time": med,
            "step_time_rounds": times[name],
            "samples_per_sec": s["global_batch"] / med,
            "tokens_per_sec": s["global_batch"] * args.seq_len / med,
            "collectives_per_step": s["collectives_per_step"],
            "comm_measured_by": s["comm_measured_by"],
            "max_rss_gb": s["peak_rss_gb"],
            "tensor_peak_gb": s["peak_memory_allocated_gb"],
        }
    out["fsdp x tp 2x2 traced"] = {
        "per_dim": traced["per_dim"],
        "estimate": traced["estimate"],
        "probes": traced["probes"],
        "step_time": traced["avg_step_time"],
    }
    out["load_average"] = os.getloadavg()
    return out


def report_mesh(out: dict, args: argparse.Namespace) -> None:
    """Print the side-by-side table and the 2x2 layout's collectives per mesh dim."""
    load = ", ".join(f"{v:.2f}" for v in out["load_average"])
    print(
        f"\nmesh layouts on 4 CPU ranks (gloo, 1 thread each, {os.cpu_count()} cores; load "
        f"average {load} at the end): dim={args.dim} layers={args.layers} seq={args.seq_len}, "
        f"global batch {4 * args.batch_size}, {args.steps} timed steps after {args.warmup} "
        f"warm-up, median of {args.mesh_rounds} rotated rounds. CPU figures only rank the "
        "layouts."
    )
    hdr = (
        f"  {'layout':<15}{'step ms':>9}{'rounds ms':>24}{'samples/s':>11}{'tokens/s':>10}"
        f"{'coll/step':>10}  measured by"
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for name in LAYOUTS:
        r = out[name]
        rounds = "/".join(f"{t * 1e3:.0f}" for t in r["step_time_rounds"])
        coll = r["collectives_per_step"]
        coll_s = f"{coll:>10.1f}" if coll is not None else f"{'n/a':>10}"
        print(
            f"  {name:<15}{r['step_time'] * 1e3:>9.1f}{rounds:>24}{r['samples_per_sec']:>11.1f}"
            f"{r['tokens_per_sec']:>10.0f}{coll_s}  {r['comm_measured_by']}"
        )
    t = out["fsdp x tp 2x2 traced"]
    print(
        "\n  fsdp x tp 2x2, collectives per step and mesh dim (a run with the interceptor on, "
        f"{t['step_time'] * 1e3:.1f} ms/step): measured\n  vs CommunicationProfiler(mesh=...)'s "
        "estimate of them (latency + ring bytes / bandwidth, both probed on the dim's group)"
    )
    print(
        f"  {'mesh dim':<10}{'collective':<16}{'n':>6}{'MB':>9}{'meas ms':>9}{'est ms':>8}"
        f"{'lat us':>8}{'GB/s':>7}"
    )
    lat, bw = t["probes"]["latency"], t["probes"]["bandwidth"]
    for dim, kinds in sorted(t["per_dim"].items()):
        est = t["estimate"].get(dim, {})
        for kind, v in sorted(kinds.items()):
            lat_us = lat.get(dim, {}).get(kind, float("nan")) * 1e6
            gbs = bw.get(dim, {}).get(kind, float("nan")) / 1e9
            print(
                f"  {dim:<10}{kind:<16}{v['count']:>6.1f}{v['bytes'] / 1e6:>9.3f}"
                f"{v['sec'] * 1e3:>9.2f}{est.get(f'{kind}_sec', float('nan')) * 1e3:>8.2f}"
                f"{lat_us:>8.0f}{gbs:>7.2f}"
            )
    total = t["estimate"]["total"]
    print(
        f"  estimated total {total['estimated_sec'] * 1e3:.2f} ms/step = "
        f"{total['latency_sec'] * 1e3:.2f} latency + {total['transfer_sec'] * 1e3:.2f} transfer;"
        " meas ms: hooks' issue-to-completion (dp_shard), the interceptor's issue time (tp)"
    )
