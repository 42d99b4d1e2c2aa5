"""The planner against real runs: every candidate it lists for 4 CPU gloo ranks, trained.

    PYTHONPATH=. python benchmarks/plan.py [--steps 6] [--json out.json]

1. Four ranks measure this machine's gloo all-reduce (latency and bus bandwidth,
   ``measure_latency``/``measure_bandwidth``): the links the planner prices with.
2. ``spmdgt.train.plan`` plans the example decoder (``examples/train_transformer.py``) for
   world 4 on ``--device cpu`` with one torch thread (as each rank has), with a memory budget
   set between the candidates' predicted peaks, so some do not fit.
3. Every candidate that fits is written as its YAML and trained for real on 4 forked gloo
   ranks by the example's own ``run_trainer`` (``--config`` that YAML, nothing else changed):
   the mean step time after the warm-up steps; then again for 2 steps under torch's
   ``MemTracker`` for each rank's tensor peak (live tensor storage, what the plan predicts;
   apart, as the tracker's dispatch mode slows every op).
4. Reported: the pick against the fastest measured (within 10%?), Spearman's rank correlation
   of predicted and measured step times, and whether any candidate said to fit measured over
   its budget.

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

from benchmarks._example import load_example  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402

MODEL_FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "32"]
GLOBAL_BATCH = 16
WORLD = 4


def _links(rank: int, world: int) -> tuple[float, float]:
    from spmdgt.train import measure_bandwidth
    from spmdgt.train._comm_cost import measure_latency

    lat = measure_latency()["all_reduce"]
    bw = measure_bandwidth(kind="all_reduce", latency=lat)
    return lat, bw


def _train(rank: int, world: int, yaml_path: str, steps: int, track: bool) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    ex = load_example()
    args = ex.parse_args(
        [*MODEL_FLAGS, "--config", yaml_path, "--steps", str(steps), "--workers", "0"]
    )
    import torch

    if not track:  # the timing run: no tracker (its dispatch mode slows every op)
        return {"step": ex.run_trainer(args)["avg_step_time"], "peak": None}
    tracker = MemTracker()
    # MemTracker refuses a second top-level forward (the next micro-step) unless its
    # per-module stats are reset (the peak is kept): reset them as the root module's forward
    # starts outside a backward (a global hook, registered before the tracker's own; the
    # root is the first module called)
    root: list = []

    def pre(module, args):
        if not root:
            root.append(module)
        if module is root[0] and torch._C._current_graph_task_id() == -1:
            tracker.reset_mod_stats()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre)]
    peak = None
    try:
        with tracker:
            summary = ex.run_trainer(args)
        snap = tracker.get_tracker_snapshot("peak")
        peak = max(int(v.get("Total", 0)) for v in snap.values()) if snap else None
    except Exception as e:  # the tracker on a real FSDP run: report, do not hide
        if "summary" not in locals():
            raise
        peak = f"tracker failed: {type(e).__name__}: {e}"
    finally:
        for h in hooks:
            h.remove()
    return {"step": summary["avg_step_time"], "peak": peak}


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (2 warm-up)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--micro-batches", default="4")
    args = p.parse_args()
    import torch

    from spmdgt.train._plan import plan

    torch.set_num_threads(1)  # as each rank runs
    t0 = time.perf_counter()
    lat, bw = run_ranks(_links, WORLD)[0]
    print(f"gloo all-reduce on this machine: latency {lat * 1e6:.0f} us, bus {bw / 1e9:.2f} GB/s")
    ex = load_example()
    margs = ex.parse_args(MODEL_FLAGS)
    model = ex.build_model(margs)
    x = torch.zeros(4, margs.seq_len, dtype=torch.long)
    common = dict(
        world=WORLD,
        device="cpu",
        global_batch=GLOBAL_BATCH,
        bandwidth=bw,
        latency=lat,
        loss_fn=ex.lm_loss,
        micro_batches=[int(v) for v in args.micro_batches.split(",")],
        amp=(False,),  # bf16 matmuls run ~20x slower than fp32 on this CPU: never picked
        base=_base(),
        progress=print,
    )
    first = plan(model, (x, x), **common)
    mems = sorted(e.memory for e in first.ranked)
    budget = mems[(3 * len(mems)) // 4]  # a quarter of the candidates do not fit
    result = plan(model, (x, x), memory=budget, memory_model=first.memory_model, **common)
    print(result)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, e in enumerate(result.ranked):
            path = os.path.join(tmp, f"c{i}.yaml")
            from spmdgt.train._plan import config_yaml

            with open(path, "w") as f:
                f.write(config_yaml(e.candidate.config(_base())))
            got = run_ranks(_train, WORLD, path, args.steps, False, timeout=900)
            step = max(g["step"] for g in got)
            # the memory run: 2 steps (the second holds the optimizer state) under MemTracker
            peaks = [g["peak"] for g in run_ranks(_train, WORLD, path, 2, True, timeout=900)]
            rows.append((e, step, peaks))
            print(
                f"[{i + 1}/{len(result.ranked)}] {e.candidate.label()}  predicted "
                f"{e.step * 1e3:8.1f} ms  measured {step * 1e3:8.1f} ms  peak "
                f"{[p if isinstance(p, str) else round(p / 2**20, 3) for p in peaks]} MiB "
                f"(predicted {e.memory / 2**20:.3f}, budget {budget / 2**20:.3f})",
                flush=True,
            )
    pred = [e.step for e, _, _ in rows]
    meas = [s for _, s, _ in rows]
    fastest = min(meas)
    pick = meas[0]
    rho = _spearman(pred, meas)
    over = [
        e.candidate.label()
        for e, _, peaks in rows
        if any(isinstance(p, int) and p > budget for p in peaks)
    ]
    print(
        f"\npick {rows[0][0].candidate.label()}: {pick * 1e3:.1f} ms, fastest measured "
        f"{fastest * 1e3:.1f} ms ({(pick / fastest - 1) * 100:+.1f}%: "
        f"{'within' if pick <= 1.1 * fastest else 'NOT within'} 10%)"
    )
    print(f"Spearman(predicted, measured) = {rho:.3f} over {len(rows)} candidates")
    print(
        f"dropped for the budget: {len(result.dropped)}; said to fit but over budget: "
        f"{over or 'none'}"
    )
    print(f"total {time.perf_counter() - t0:.0f}s")
    if args.json:
        from benchmarks import _results

        _results.write(
            args.json,
            "plan",
            {
                "latency": lat,
                "bandwidth": bw,
                "budget": budget,
                "spearman": rho,
                "pick_over_fastest": pick / fastest,
                "over_budget": over,
                "rows": [
                    {
                        "candidate": e.candidate.label(),
                        "predicted_s": e.step,
                        "measured_s": s,
                        "predicted_peak": e.memory,
                        "measured_peaks": pk,
                    }
                    for e, s, pk in rows
                ],
            },
        )
    return 0


def _base():
    from spmdgt.train import TrainConfig, TrainingConfig

    return TrainConfig(training=TrainingConfig(max_grad_norm=1.0), log_every=100)


if __name__ == "__main__":
    sys.exit(main())
