"""The planner's predicted peak per rank against a dry run of the same candidate.

    PYTHONPATH=. python benchmarks/plan_memory.py [--models decoder,gpt2-s,...]
        [--strategies fsdp] [--backend nccl] [--world 4] [--amp]

For each of ``--models`` (``benchmarks/_plan_models.py``), ``spmdgt.train._plan.plan`` plans
it as ``benchmarks/plan.py`` does (world 4, global batch 16, the model's micro-batches, no
AMP unless ``--amp``); then every candidate of ``--strategies`` is dry-run as itself
(``spmdgt.train._dryrun.dry_run`` of its YAML's config at the world, on the model's batch
at its micro-batch: the reference the planner's calibration is made of, exact against real
runs, ``tests/train/test_dryrun_peak.py``) and its predicted peak is printed beside the dry
run's, with the error. The planner itself runs no dry run per candidate: its calibration's
few runs are composed and scaled (``_plan/_calibrate.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._plan_models import MODELS  # noqa: E402

GLOBAL_BATCH = 16


def compare(
    name: str, world: int, strategies: tuple[str, ...], backend: str, amp: bool = False
) -> list[tuple]:
    """(candidate label, predicted bytes, dry-run bytes) of every listed candidate."""
    import torch

    from spmdgt.train import TrainConfig, TrainingConfig
    from spmdgt.train._plan import plan
    from spmdgt.train._plan._calibrate import dry_run_peak

    bm = MODELS[name]
    torch.manual_seed(0)
    model = bm.build()
    base = TrainConfig(training=TrainingConfig(max_grad_norm=1.0), log_every=100)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the trainers' mesh and table lines
        p = plan(
            model,
            bm.batch(4),
            world=world,
            device="h100",
            global_batch=GLOBAL_BATCH,
            loss_fn=bm.loss_fn(),
            micro_batches=list(bm.micro_batches or (4,)),
            amp=(False, True) if amp else (False,),
            base=base,
            jobs=1,
        )
    print(f"{name}: planned in {time.perf_counter() - t0:.1f}s ({'; '.join(p.memory_model.runs)})")
    rows = []
    for e in sorted(p.ranked + p.dropped, key=lambda e: e.candidate.label()):
        c = e.candidate
        if c.strategy not in strategies:
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            peak = dry_run_peak(
                model, bm.batch(4), c, loss_fn=bm.loss_fn(), base=base, backend=backend
            )
        err = (e.memory - peak) / peak * 100
        rows.append((c.label(), e.memory, peak))
        print(
            f"  {name:<8} {c.label():<40} predicted {e.memory / 2**20:8.3f} MiB  dry run "
            f"{peak / 2**20:8.3f} MiB  {err:+6.1f}%",
            flush=True,
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default="fsdp", help="comma-separated: ddp,fsdp,placements")
    p.add_argument("--backend", default="nccl", help="the dry run's (the planner calibrates nccl)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--amp", action="store_true", help="AMP's candidates too")
    args = p.parse_args()
    worst = 0.0
    for name in args.models.split(","):
        for _, pred, ref in compare(
            name, args.world, tuple(args.strategies.split(",")), args.backend, args.amp
        ):
            worst = max(worst, abs(pred - ref) / ref)
    print(f"largest error: {worst * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
