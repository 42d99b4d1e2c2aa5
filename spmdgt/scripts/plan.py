"""Plan a training run before launch: which mesh, micro-batch, activation checkpointing and AMP.

    python -m spmdgt.scripts.plan --world 64 --device h100 --interconnect ib-ndr \\
        --global-batch 512 --output plan.yaml examples/train_transformer.py --dim 4096 \\
        --layers 32 --heads 32 --kv-heads 8 --seq-len 4096 --batch-size 1
    torchrun --nproc_per_node=8 examples/train_transformer.py --config plan.yaml ...

The script runs until its trainer first calls the model (a dry run of a world of one: nothing
is allocated); the planner reads that model and micro-batch, calibrates memory with a few dry
runs of a two-block copy, prices every config the trainer can run on ``--world`` devices
(memory per rank, compute over the device's peak, each collective on its mesh dim's link,
FSDP2's overlap), drops what does not fit ``--memory`` (default: the device's, less
``--headroom``), prints the ranked table and writes the winner as the trainer's YAML.
``--device cpu`` prices against this machine's measured peak; ``--cpu-profile PATH`` against
the profile ``--world`` ranks measure at once (collectives per group size, per-op, per-unit
costs), measured and saved the first time, read from PATH after. See ``docs/planner.md``.
Exit 0 with a plan, 1 when nothing fits, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "parse_args"]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _onoff(text: str) -> tuple[bool, ...]:
    return {"on": (True,), "off": (False,), "both": (False, True)}[text]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from spmdgt.train._dryrun import INTERCONNECTS
    from spmdgt.train._plan._device import DEVICE_NAMES

    p = argparse.ArgumentParser(
        prog="python -m spmdgt.scripts.plan",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="devices: "
        + ", ".join(DEVICE_NAMES)
        + "\ninterconnects: "
        + ", ".join(INTERCONNECTS),
    )
    p.add_argument("--world", type=int, required=True, help="devices to plan for")
    p.add_argument("--device", help="h100 (default), h200, a100 or cpu (measured here)")
    p.add_argument(
        "--cpu-profile",
        metavar="PATH",
        help="the cpu profile measured by --world ranks (implies --device cpu): read from "
        "PATH when it exists, else measured once by --world gloo ranks forked here and "
        "saved to PATH for later plans",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help="rows per optimizer step (default: the script's micro-batch x world)",
    )
    p.add_argument("--memory", help="budget per device, e.g. 40GB (default: the device's)")
    p.add_argument(
        "--headroom", type=float, default=0.1, help="share of the device's memory kept back"
    )
    p.add_argument("--margin", type=float, default=0.05, help="share added to each predicted peak")
    p.add_argument("--interconnect", help="the link across nodes (default ib-ndr)")
    p.add_argument("--intra", help="the link inside a node (default the device's NVLink)")
    p.add_argument("--bandwidth", help="one bandwidth for every link, e.g. 1GB/s")
    p.add_argument("--latency", help="one latency per collective for every link, e.g. 300us")
    p.add_argument("--per-node", type=int, help="devices per node (default 8 for GPUs)")
    p.add_argument("--micro-batches", type=_ints, help="micro-batch sizes to try, e.g. 1,2,4")
    p.add_argument(
        "--ac", type=_onoff, default=(False, True), help="activation checkpointing: on, off, both"
    )
    p.add_argument("--amp", type=_onoff, default=(False, True), help="AMP: on, off, both")
    p.add_argument("--strategies", default="ddp,fsdp,placements", help="strategies to try")
    p.add_argument("--config", help="a training YAML whose other settings the plan keeps")
    p.add_argument("--top", type=int, default=20, help="rows of the table")
    p.add_argument("--output", help="write the winner here as the trainer's YAML")
    p.add_argument("script", help="the training script (runs until its model's first call)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p.parse_args(argv)


def _cpu_profile(args: argparse.Namespace, say) -> dict:
    """``--cpu-profile``: the profile saved at the path, or measured now by ``--world``
    forked ranks and saved there (before the script runs: a fork copies one thread)."""
    import os

    from spmdgt.train._plan._cpuprofile import load_profile, measure_profile, save_profile

    if args.device not in (None, "cpu"):
        raise ValueError(f"--cpu-profile prices --device cpu, not --device {args.device}")
    if os.path.exists(args.cpu_profile):
        prof = load_profile(args.cpu_profile)
        say(f"plan: cpu profile read from {args.cpu_profile} (measured by {prof['ranks']} ranks)")
        return prof
    say(f"plan: measuring the cpu profile on {args.world} forked gloo ranks (seconds)")
    prof = measure_profile(args.world)
    save_profile(prof, args.cpu_profile)
    say(f"plan: cpu profile saved to {args.cpu_profile}; later plans read it")
    return prof


def main(argv: Sequence[str] | None = None) -> int:
    """Plan; print the table; write the winner; return the exit status."""
    from spmdgt.config import ConfigError
    from spmdgt.train._config import load_train_config
    from spmdgt.train._dryrun import DryRunError
    from spmdgt.train._plan import plan
    from spmdgt.train._plan._capture import capture_script

    args = parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        profile = _cpu_profile(args, say) if args.cpu_profile else None
        base = load_train_config(args.config) if args.config else None
        say(f"plan: running {args.script} to its model's first call")
        model, batch = capture_script(args.script, args.args)
        result = plan(
            model,
            batch,
            world=args.world,
            device="cpu" if profile is not None else (args.device or "h100"),
            device_profile=profile,
            global_batch=args.global_batch,
            memory=args.memory,
            headroom=args.headroom,
            margin=args.margin,
            interconnect=args.interconnect,
            intra=args.intra,
            bandwidth=args.bandwidth,
            latency=args.latency,
            per_node=args.per_node,
            micro_batches=args.micro_batches,
            ac=args.ac,
            amp=args.amp,
            strategies=tuple(args.strategies.split(",")),
            base=base,
            progress=say,
        )
    except (DryRunError, ConfigError, ValueError) as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    print(result.table(limit=args.top))
    if result.best is None:
        return 1
    if args.output:
        result.write(args.output)
        print(f"wrote {args.output}: torchrun ... {args.script} --config {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
