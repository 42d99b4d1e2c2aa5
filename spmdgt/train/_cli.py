"""Command-line flags a training script shares with every other: the ``parallelism`` block
and the dry run.

torchtitan's launch flags (``--parallelism.tensor_parallel_degree`` and friends) in the
spelling of this project's examples; each maps to one ``TrainConfig.parallelism`` field and
goes through ``override()``, so an absent flag keeps the config's value. The dry-run flags
are ``dry_run_call``'s arguments (``docs/dryrun.md``).
"""

from __future__ import annotations

import argparse

__all__ = ["add_dry_run_args", "add_parallelism_args"]


def add_parallelism_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp``, ``--dp-shard``, ``--dp-replicate`` and ``--sequence-parallel`` (all
    default ``None``: the config's value) to ``parser``; pass them on as ``override(cfg,
    tp=args.tp, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate,
    sequence_parallel=args.sequence_parallel)``."""
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks (parallelism.tp; inside a node): the placements table is "
        "applied within each group of --tp neighbouring ranks, FSDP (or HSDP) across; None: "
        "the config's, else 1",
    )
    parser.add_argument(
        "--dp-shard",
        type=int,
        default=None,
        help="FSDP's shard dim (parallelism.dp_shard; -1: the ranks left); None: the config's",
    )
    parser.add_argument(
        "--dp-replicate",
        type=int,
        default=None,
        help="HSDP's replicate dim (parallelism.dp_replicate); None: the config's, else 1",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_const",
        const=True,
        default=None,
        help="split the residual stream between the tensor-parallel layers over the sequence "
        "(parallelism.sequence_parallel, with placements: auto): the same numbers, 1/tp of "
        "the stream's bytes",
    )


def add_dry_run_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--dry-run``, ``--world``, ``--device`` and ``--interconnect`` to ``parser``: one
    step for ``--world`` ranks in this process, whose per-rank memory and collectives say
    whether a config fits before the machines exist."""
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="one step for --world ranks in this process (fake process group, fake tensors): "
        "per-rank memory, collectives, whether it fits",
    )
    parser.add_argument("--world", type=int, default=64, help="--dry-run: ranks to simulate")
    parser.add_argument(
        "--device", default=None, help="--dry-run: h100, a100-40gb, ... (its memory)"
    )
    parser.add_argument("--interconnect", default=None, help="--dry-run: nvlink4, ib-ndr, ...")
