"""The ``parallelism`` block as meshes: which ranks share data, which split each layer.

``TrainConfig.parallelism`` (``dp_replicate``, ``dp_shard``, ``tp``, torchtitan's names) lays
the world out on one ``(dp_replicate, dp_shard, tp)`` ``DeviceMesh``, row-major, so the TP
ranks of a data group are neighbours (inside a node, where the links are fast). The default
(``dp_replicate`` and ``tp`` of 1) builds nothing: the trainer keeps today's 1-D world mesh,
bit for bit. A bad block is a ``ConfigError`` on every rank, before any collective.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from spmdgt.config import ConfigError
from spmdgt.train._config import ParallelismConfig

__all__ = ["Layout", "build_layout", "data_parallel", "describe_groups", "tp_group"]


@dataclass
class Layout:
    """Where this rank sits: the 2-D (3-dim) mesh or ``None``, its data-parallel rank and the
    data-parallel size (the TP ranks of a data group share the rank, and the batch), and the
    sub-meshes ``wrap_model`` takes."""

    mesh: object | None
    dp_size: int
    dp_rank: int
    tp_mesh: object | None = None
    dp_mesh: object | None = None
    shape: tuple[int, int, int] = (1, 1, 1)
    """``(dp_replicate, dp_shard, tp)`` as run, also on the 1-D world (``placements``: the
    world is the ``tp`` dim); written into checkpoints, so a resume can say what changed."""

    def describe(self) -> str:
        """``dp_replicate x dp_shard x tp`` sizes, e.g. ``1x2x2``."""
        return "x".join(map(str, self.shape))

    def wrap_kwargs(self) -> dict[str, object]:
        """``wrap_model``'s mesh arguments: none on the 1-D world."""
        if self.mesh is None:
            return {}
        return {"tp_mesh": self.tp_mesh, "dp_mesh": self.dp_mesh}


def data_parallel(
    parallelism: ParallelismConfig, strategy: str, world: int, rank: int
) -> tuple[int, int]:
    """``(data-parallel size, this rank's data-parallel rank)`` for ``parallelism``, by
    arithmetic alone (no mesh, no collective): what the loader shards over. The TP ranks of
    a data group are neighbours (row-major), so the data rank is ``rank // tp``; on the 1-D
    world it is the world (``placements``: one group, every rank reads the same batch)."""
    rep, shard, tp = parallelism.resolve(world)
    if rep == 1 and tp == 1:
        return (1, 0) if strategy == "placements" else (world, rank)
    return rep * shard, rank // tp


def build_layout(
    parallelism: ParallelismConfig, strategy: str, world: int, rank: int, device: torch.device
) -> Layout:
    """This rank's ``Layout`` for ``parallelism`` on ``world`` ranks (``init_device_mesh`` of
    shape ``(dp_replicate, dp_shard, tp)`` unless the block is the default)."""
    rep, shard, tp = parallelism.resolve(world)
    dp_size, dp_rank = data_parallel(parallelism, strategy, world, rank)
    if rep == 1 and tp == 1:  # today's path, bit for bit
        shape = (1, 1, world) if strategy == "placements" else (1, world, 1)
        return Layout(None, dp_size, dp_rank, shape=shape)
    if strategy == "placements" and rep * shard > 1:
        raise ConfigError(
            f"strategy 'placements' is tensor parallelism alone, but parallelism gives "
            f"dp_replicate={rep} x dp_shard={shard} data-parallel ranks; use strategy "
            "'fsdp' (or 'ddp' without tp) for the data dims, or tp = the world size",
            key="parallelism",
            value={"dp_replicate": rep, "dp_shard": shard, "tp": tp},
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device.type, (rep, shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    dp_mesh = None
    if rep * shard > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if rep > 1 else mesh["dp_shard"]
    tp_mesh = mesh["tp"] if tp > 1 else None
    return Layout(mesh, dp_size, dp_rank, tp_mesh, dp_mesh, (rep, shard, tp))


def tp_group(mesh: object | None) -> object | None:
    """The tensor-parallel process group of ``mesh`` when its ``tp`` dim is > 1, else None."""
    if mesh is None or mesh["tp"].size() == 1:
        return None
    return mesh["tp"].get_group()


def _node() -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` (the node rank its rendezvous assigned;
    also right for several "nodes" on one host), else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group not in (None, "") else socket.gethostname()


def describe_groups(layout: Layout) -> str | None:
    """One line naming each tensor-parallel group's ranks and the node(s) they run on, so a
    log shows whether TP stayed inside a node (``None`` on the 1-D world: nothing to say;
    the mesh alone, no collective, when ``tp`` is 1: one-rank groups say nothing).

    Collective on a 2-D/3-D layout (an all-gather of each rank's node, once, at setup; every
    rank builds the same layout, so every rank calls it). A group spanning nodes is flagged:
    its per-layer collectives would cross the slow link (put ``tp`` at most the GPUs per
    node, as ``(dp_replicate, dp_shard, tp)`` row-major keeps a node's ranks in one group)."""
    if layout.mesh is None:
        return None
    tp = layout.shape[2]
    if tp == 1:  # HSDP: no tp group to place (the same layout, so the same skip, everywhere)
        return f"mesh dp_replicate x dp_shard x tp = {layout.describe()} (no tensor parallelism)"
    import torch.distributed as dist

    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, _node())
    ranks = layout.mesh.mesh.flatten().tolist()
    parts = []
    for g in range(0, len(ranks), tp):
        group = ranks[g : g + tp]
        where = sorted({nodes[r] for r in group})
        span = " SPANS NODES" if len(where) > 1 else ""
        parts.append(f"{group} on {', '.join(where)}{span}")
    return f"mesh dp_replicate x dp_shard x tp = {layout.describe()}; tp groups: " + "; ".join(
        parts
    )
