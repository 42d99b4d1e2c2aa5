"""The ``parallelism`` block as meshes: which ranks share data, which split each layer.

``TrainConfig.parallelism`` (``dp_replicate``, ``dp_shard``, ``tp``, torchtitan's names) lays
the world out on one ``(dp_replicate, dp_shard, tp)`` ``DeviceMesh``, row-major, so the TP
ranks of a data group are neighbours (inside a node, where the links are fast). The default
(``dp_replicate`` and ``tp`` of 1) builds nothing: the trainer keeps today's 1-D world mesh,
bit for bit. A bad block is a ``ConfigError`` on every rank, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmdgt.config import ConfigError
from spmdgt.train._config import ParallelismConfig

__all__ = ["Layout", "build_layout", "tp_group"]


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

    def wrap_kwargs(self) -> dict[str, object]:
        """``wrap_model``'s mesh arguments: none on the 1-D world."""
        if self.mesh is None:
            return {}
        return {"tp_mesh": self.tp_mesh, "dp_mesh": self.dp_mesh}


def build_layout(
    parallelism: ParallelismConfig, strategy: str, world: int, rank: int, device: torch.device
) -> Layout:
    """This rank's ``Layout`` for ``parallelism`` on ``world`` ranks (``init_device_mesh`` of
    shape ``(dp_replicate, dp_shard, tp)`` unless the block is the default)."""
    rep, shard, tp = parallelism.resolve(world)
    if rep == 1 and tp == 1:  # today's path, bit for bit
        data = 1 if strategy == "placements" else world
        return Layout(None, data, rank if data > 1 else 0)
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
    # row-major: (dp_replicate, dp_shard) then tp, so a rank's data rank is rank // tp
    return Layout(mesh, rep * shard, rank // tp, mesh["tp"] if tp > 1 else None, dp_mesh)


def tp_group(mesh: object | None) -> object | None:
    """The tensor-parallel process group of ``mesh`` when its ``tp`` dim is > 1, else None."""
    if mesh is None or mesh["tp"].size() == 1:
        return None
    return mesh["tp"].get_group()
