"""Dry-run a training script for a world you don't have: one step, one process, no memory.

    python -m spmdgt.scripts.dryrun --world 64 --device h100 --interconnect ib-ndr \\
        examples/train_transformer.py --strategy fsdp --dim 4096 --layers 32 --heads 32 \\
        --kv-heads 8 --seq-len 4096 --batch-size 1
    python -m spmdgt.scripts.dryrun --world 8 --strategy ddp --device-memory 40GB \\
        --bandwidth 300GB/s train.py --my-flag
    python -m spmdgt.scripts.dryrun --world 16 --config fsdp_tp.yaml --device h100 \\
        --link tp=nvlink4 --link dp_shard=ib-ndr train.py   # a parallelism block: per-dim links

The script runs as written, as rank 0 of ``--world`` ranks: torchrun's variables are set,
the process group is torch's fake one (collectives are issued, nothing moves) and every tensor
is fake (shapes without memory), so a model far larger than this machine is fine. Its
``DistributedTrainer(...)`` is built as written; its ``train(loader)`` runs one training step on
the loader's first batch (two in fact: the second is the one measured) and prints, instead of
training: per rank the bytes of parameters, gradients and optimizer state, rank 0's activation
and peak memory estimates, the step's collectives (kind, count, bytes) with their estimated
time, and whether the job fits (``--device`` or ``--device-memory``). See ``docs/dryrun.md``.

``--strategy`` and ``--config`` given here override the script's trainer (the script's own
flags after its path are its own). Exit 0 when it fits (or no memory was given), 1 when it
does not, 2 on bad input or a script that never trains. ``--json`` also writes the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The dry run's flags, then the script and its own arguments."""
    from spmdgt.train._dryrun import DEVICES, INTERCONNECTS

    p = argparse.ArgumentParser(
        prog="python -m spmdgt.scripts.dryrun",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="devices: "
        + ", ".join(DEVICES)
        + "\ninterconnects: "
        + "; ".join(f"{k}: {v[2]}" for k, v in INTERCONNECTS.items()),
    )
    p.add_argument("--world", type=int, required=True, help="ranks to simulate (>= 1)")
    p.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="whose collectives' memory to model (gloo copies a reduce-scatter's input)",
    )
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp", "placements"],
        help="override the trainer's strategy",
    )
    p.add_argument("--config", help="a training YAML that replaces the trainer's config")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--device-memory", help="memory per device, e.g. 80GB, 80GiB")
    mem.add_argument("--device", help="a known device (its memory), e.g. h100, a100-40gb")
    p.add_argument("--bandwidth", help="bus bandwidth per device, e.g. 50GB/s or 400Gb/s")
    p.add_argument(
        "--interconnect", help="a known interconnect (bandwidth and latency), e.g. nvlink4"
    )
    p.add_argument("--latency", help="per-collective latency, e.g. 20us (with --bandwidth)")
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="DIM=LINK",
        help="a mesh dim's own interconnect or bandwidth, e.g. tp=nvlink4 dp_shard=ib-ndr "
        "(repeat; dims: dp_replicate, dp_shard, tp, world)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="share of device memory kept back for the CUDA context, NCCL and fragmentation",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("script", help="the training script (runs as __main__)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the dry run; print the report; return the exit status."""
    from spmdgt.config import ConfigError
    from spmdgt.train._dryrun import DryRunError, dry_run_script

    args = parse_args(argv)
    links = {}
    for item in args.link:
        dim, sep, link = item.partition("=")
        if not sep or not dim or not link:
            print(
                f"dryrun: error: --link takes DIM=LINK (e.g. tp=nvlink4), got {item!r}",
                file=sys.stderr,
            )
            return 2
        links[dim] = link
    try:
        report = dry_run_script(
            args.script,
            args.args,
            args.world,
            config=args.config,
            strategy=args.strategy,
            device_memory=args.device_memory,
            device=args.device,
            bandwidth=args.bandwidth,
            latency=args.latency,
            interconnect=args.interconnect,
            headroom=args.headroom,
            links=links or None,
            backend=args.backend,
        )
    except (DryRunError, ConfigError) as e:
        print(f"dryrun: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
    return 1 if report.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
