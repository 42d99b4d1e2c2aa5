"""Command-line flags a training script shares with every other: the ``parallelism`` block.

torchtitan's launch flags (``--parallelism.tensor_parallel_degree`` and friends) in the
spelling of this project's examples; each maps to one ``TrainConfig.parallelism`` field and
goes through ``override()``, so an absent flag keeps the config's value.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parallelism_args"]


def add_parallelism_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp``, ``--dp-shard`` and ``--dp-replicate`` (all default ``None``: the config's
    value) to ``parser``; pass them on as ``override(cfg, tp=args.tp, dp_shard=args.dp_shard,
    dp_replicate=args.dp_replicate)``."""
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
