"""The planner against real runs: every candidate it lists for 4 CPU gloo ranks, trained.

    PYTHONPATH=. python benchmarks/plan.py [--models decoder,gpt2-s,gpt2-m,llama-s,llama-m]
        [--steps 6] [--passes 2] [--micro-batches 4] [--json out.json]

1. The 4 ranks measure this machine's ``cpu`` profile at once (``_plan._cpuprobe.probe_cpu``:
   collective latency and bandwidth per group size, per-op, FSDP-unit, TP-module and
   checkpointed-block costs), and the 4-rank all-reduce the model before it priced with.
2. For each of ``--models`` (``benchmarks/_plan_models.py``: the example decoder, HF GPT-2
   and Llama at two sizes each, built from configs), ``spmdgt.train.plan`` plans it for
   world 4 and global batch 16 on that profile, with a memory budget set at the 75th
   percentile of the candidates' predicted peaks, so some do not fit; the same candidates
   are priced by the model before the profile (one link, one latency whatever the group, no
   per-unit costs) for comparison.
3. Every candidate that fits is written as its YAML and trained for real on 4 forked gloo
   ranks by the model's example script (``--config`` that YAML, nothing else changed),
   ``--passes`` times in alternating order (the planner's, then reversed): its least step
   after the 2 warm-up steps (load only adds time), its mean, and each rank's tensor peak
   as the trainer reports it (``peak_memory_allocated_gb``: on a CPU its tensor meter over
   the first 2 steps, which the timings leave out).
4. Reported per model, for both models against the least and the mean step: the pick against
   the fastest measured (within 10%?) and Spearman's rank correlation of predicted and
   measured step times; and whether any candidate said to fit measured over its budget. The
   load average is printed as each model starts and ends.

The machine is shared: step times carry the load of whatever else runs. Results go to
``--json`` with the machine's context.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._plan_models import MODELS, BenchModel  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402

GLOBAL_BATCH = 16
WORLD = 4


def _profile(rank: int, world: int) -> dict:
    """The ``cpu`` device profile, measured by the 4 ranks at once (``probe_cpu``), and the
    old model's one link: the 4-rank all-reduce's latency and bandwidth."""
    from spmdgt.train import measure_bandwidth
    from spmdgt.train._comm_cost import measure_latency
    from spmdgt.train._plan._cpuprobe import probe_cpu

    lat = measure_latency()["all_reduce"]
    bw = measure_bandwidth(kind="all_reduce", latency=lat)
    return {"profile": probe_cpu(), "latency": lat, "bandwidth": bw}


def _train(rank: int, world: int, name: str, yaml_path: str, steps: int) -> dict:
    """One rank's run: its least and mean step, and its tensor peak as the trainer measures
    it on a CPU (its meter over the first 2 steps, left out of the timings; the meter
    ``tests/train/test_dryrun_peak.py`` checks the dry run against)."""
    got = MODELS[name].train(yaml_path, steps, GLOBAL_BATCH)
    tensors = str(got.get("memory_kind", "")).startswith("tensors")
    peak = round(got["peak_memory_allocated_gb"] * 1e9) if tensors else None
    return {"step": got["min_step_time"], "mean": got["avg_step_time"], "peak": peak}


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def _mib(peaks: list) -> list:
    return [q if isinstance(q, str) or q is None else round(q / 2**20, 3) for q in peaks]


def _ranking(pred: list[float], meas: list[float]) -> tuple[float, float]:
    """(the pick's measured time over the fastest measured, Spearman) of a ranking."""
    pick = meas[min(range(len(pred)), key=pred.__getitem__)]
    return pick / min(meas), _spearman(pred, meas)


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _plans(bm: BenchModel, dev, old, micro_batches: list[int]):
    """The model's plan on the measured profile with a budget some candidates miss, and the
    same candidates priced by the model before the profile."""
    import torch

    from spmdgt.train._plan import plan

    torch.manual_seed(0)
    model = bm.build()
    batch = bm.batch(4)
    common = dict(
        world=WORLD,
        global_batch=GLOBAL_BATCH,
        loss_fn=bm.loss_fn(),
        micro_batches=micro_batches,
        amp=(False,),  # bf16 matmuls run ~20x slower than fp32 on this CPU: never picked
        base=_base(),
        progress=print,
    )
    first = plan(model, batch, device=dev, **common)
    mems = sorted(e.memory for e in first.ranked)
    budget = mems[(3 * len(mems)) // 4]  # a quarter of the candidates do not fit
    mm = first.memory_model
    result = plan(model, batch, device=dev, memory=budget, memory_model=mm, **common)
    before = plan(model, batch, device=old, memory=budget, memory_model=mm, **common)
    return result, {e.candidate: e.step for e in before.ranked}, budget


def _measure(bm: BenchModel, result, old_step: dict, budget: float, args) -> list[tuple]:
    """Every fitting candidate trained: (estimate, least step, mean step, per-rank peaks)."""
    from spmdgt.train._plan import config_yaml

    n = len(result.ranked)
    least, means = [float("inf")] * n, [float("inf")] * n
    peaks: list[list] = [[None] * WORLD for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, e in enumerate(result.ranked):
            paths.append(os.path.join(tmp, f"c{i}.yaml"))
            with open(paths[-1], "w") as f:
                f.write(config_yaml(e.candidate.config(_base())))
        # passes in alternating order (the planner's, then reversed): a load that drifts
        # over the run favours no end of the ranking; each candidate keeps its least
        for p in range(args.passes):
            order = range(n) if p % 2 == 0 else reversed(range(n))
            for i in order:
                e = result.ranked[i]
                got = run_ranks(_train, WORLD, bm.name, paths[i], args.steps, timeout=900)
                least[i] = min(least[i], max(g["step"] for g in got))  # the slowest rank's
                means[i] = min(means[i], max(g["mean"] for g in got))
                if p == 0:
                    peaks[i] = [g["peak"] for g in got]
                print(
                    f"[{bm.name} pass {p + 1}, {i + 1}/{n}] {e.candidate.label()}  predicted "
                    f"{e.step * 1e3:8.1f} ms (before {old_step[e.candidate] * 1e3:7.1f})  "
                    f"measured {least[i] * 1e3:8.1f} ms least, {means[i] * 1e3:8.1f} mean  peak "
                    f"{_mib(peaks[i])} MiB (predicted {e.memory / 2**20:.3f}, "
                    f"budget {budget / 2**20:.3f})",
                    flush=True,
                )
    return list(zip(result.ranked, least, means, peaks, strict=True))


def _bench(bm: BenchModel, dev, old, args) -> dict:
    """One model planned, every fitting candidate trained, and the ranking scored."""
    print(f"\n=== {bm.name}: {' '.join(bm.flags)} ({_load()})", flush=True)
    t0 = time.perf_counter()
    mbs = list(bm.micro_batches or (int(v) for v in args.micro_batches.split(",")))
    result, old_step, budget = _plans(bm, dev, old, mbs)
    print(result)
    rows = _measure(bm, result, old_step, budget, args)
    print(
        f"\n{bm.name}: candidate, in the planner's order | predicted ms | before ms | "
        "least ms | mean ms | peak MiB (max rank) | predicted MiB"
    )
    for e, s, m, pk in rows:
        top = max((q for q in pk if isinstance(q, int)), default=None)
        print(
            f"  {e.candidate.label():<40} {e.step * 1e3:8.1f} {old_step[e.candidate] * 1e3:8.1f} "
            f"{s * 1e3:8.1f} {m * 1e3:8.1f} "
            f"{'-' if top is None else f'{top / 2**20:8.3f}'} {e.memory / 2**20:8.3f}"
        )
    pred = [e.step for e, _, _, _ in rows]
    pred_old = [old_step[e.candidate] for e, _, _, _ in rows]
    summary = {}
    for model_name, pr in (("after", pred), ("before", pred_old)):
        for timing, col in (("least", 1), ("mean", 2)):
            meas = [r[col] for r in rows]
            ratio, rho = _ranking(pr, meas)
            summary[f"{model_name} {timing}"] = (ratio, rho)
            print(
                f"{bm.name}: {model_name:<6} model vs {timing:<5} step: pick "
                f"{(ratio - 1) * 100:+.1f}% over the fastest "
                f"({'within' if ratio <= 1.1 else 'NOT within'} 10%), Spearman "
                f"{rho:.3f} over {len(rows)} candidates"
            )
    over = [
        e.candidate.label()
        for e, _, _, pk in rows
        if any(isinstance(q, int) and q > budget for q in pk)
    ]
    print(
        f"{bm.name}: dropped for the budget: {len(result.dropped)}; said to fit but over "
        f"budget: {over or 'none'}; {time.perf_counter() - t0:.0f}s ({_load()})",
        flush=True,
    )
    return {
        "flags": list(bm.flags),
        "budget": budget,
        "dropped": len(result.dropped),
        "summary": {k: {"pick_over_fastest": r, "spearman": s} for k, (r, s) in summary.items()},
        "over_budget": over,
        "rows": [
            {
                "candidate": e.candidate.label(),
                "predicted_s": e.step,
                "predicted_before_s": old_step[e.candidate],
                "measured_least_s": s,
                "measured_mean_s": m,
                "predicted_peak": e.memory,
                "measured_peaks": pk,
            }
            for e, s, m, pk in rows
        ],
    }


def _final(results: dict) -> None:
    """One line per model: the targets, on the new model against the least and mean step."""
    print("\nmodel     n  dropped  pick/least  rho/least  pick/mean  rho/mean  over budget")
    for name, r in results.items():
        least, mean = r["summary"]["after least"], r["summary"]["after mean"]
        print(
            f"{name:<8} {len(r['rows']):2d} {r['dropped']:8d}  "
            f"{(least['pick_over_fastest'] - 1) * 100:+9.1f}%  {least['spearman']:9.3f}  "
            f"{(mean['pick_over_fastest'] - 1) * 100:+8.1f}%  {mean['spearman']:8.3f}  "
            f"{r['over_budget'] or 'none'}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (2 warm-up)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--micro-batches", default="4", help="to search (GPT-2's are 2,4: it has no TP)")
    p.add_argument("--passes", type=int, default=2, help="timing passes (alternating order)")
    args = p.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    import torch

    from spmdgt.train._plan import device_spec
    from spmdgt.train._plan._cpuprobe import cpu_spec

    torch.set_num_threads(1)  # as each rank runs
    t0 = time.perf_counter()
    print(_load())
    probed = run_ranks(_profile, WORLD)[0]
    prof, lat, bw = probed["profile"], probed["latency"], probed["bandwidth"]
    print(f"cpu profile, measured by {WORLD} ranks at once: {prof}")
    dev = cpu_spec(prof)
    # the model before the profile: one latency for every group, no per-unit costs
    old = device_spec("cpu", bandwidth=bw, latency=lat)
    results = {name: _bench(MODELS[name], dev, old, args) for name in names}
    _final(results)
    print(f"total {time.perf_counter() - t0:.0f}s ({_load()})")
    if args.json:
        from benchmarks import _results

        _results.write(
            args.json,
            "plan",
            {"profile": prof, "latency": lat, "bandwidth": bw, "models": results},
        )
    return 0


def _base():
    from spmdgt.train import TrainConfig, TrainingConfig

    return TrainConfig(training=TrainingConfig(max_grad_norm=1.0), log_every=100)


if __name__ == "__main__":
    sys.exit(main())
