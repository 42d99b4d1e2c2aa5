"""The run's layout, built once: which ranks share data, which split each layer.

``Layout`` is torchtitan's ``ParallelDims`` for this trainer: the world, this rank, the
``(dp_replicate, dp_shard, tp)`` sizes, the mesh and its named sub-meshes, the data-parallel
size and rank (which rows this rank reads) and the dims a batch is split over. Every reader
takes its numbers from it: ``wrap_model`` (which engine over which mesh), the loop (the loss's
data-parallel scaling, HF's label-token count), the loader (``_data.shard_loader``), the
checkpoint (the mesh it was written on) and the dry run (the same object on a fake world).

``TrainConfig.parallelism`` (torchtitan's names) lays the world out on one
``(dp_replicate, dp_shard, tp)`` ``DeviceMesh``, row-major, so the TP ranks of a data group
are neighbours (inside a node, where the links are fast). The default (``dp_replicate`` and
``tp`` of 1) builds no N-D mesh: the strategy spans the 1-D world mesh, bit for bit as before
(``placements``: the world is the ``tp`` dim; ``ddp``/``fsdp``: the world is ``dp_shard``).
A bad block is a ``ConfigError`` on every rank, before any collective.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from spmdgt.config import ConfigError
from spmdgt.train._config import ParallelismConfig

__all__ = ["Layout", "build_layout", "describe_groups", "tp_group"]

DIMS = ("dp_replicate", "dp_shard", "tp")
FLAT_DP_TP = "dp_shard_tp"
"""``dp_shard`` and ``tp`` flattened into one dim (FSDP x TP): a value partial over both
reduces in one collective there (the clip's norm); where it spans the world it reads
``world``."""


@dataclass
class Layout:
    """Where this rank sits in the run (built once by ``build_layout``; read, never changed).

    ``shape`` is ``(dp_replicate, dp_shard, tp)`` as run, also on the 1-D world. ``mesh`` is
    the N-D mesh (``None`` on the 1-D world, where ``world_mesh`` is the strategy's mesh);
    ``tp_mesh`` and ``dp_mesh`` the sub-meshes ``wrap_model`` applies TP and FSDP/DDP on."""

    strategy: str
    world: int
    rank: int
    device: torch.device
    backend: str | None
    shape: tuple[int, int, int] = (1, 1, 1)
    mesh: object | None = None
    world_mesh: object | None = None
    tp_mesh: object | None = None
    dp_mesh: object | None = None

    @property
    def dp_replicate(self) -> int:
        return self.shape[0]

    @property
    def dp_shard(self) -> int:
        return self.shape[1]

    @property
    def tp(self) -> int:
        """Ranks that split each layer (the world for ``placements`` on the 1-D world)."""
        return self.shape[2]

    @property
    def dp_size(self) -> int:
        """Ranks that read different rows (1 for ``placements``: every rank the same batch)."""
        return self.shape[0] * self.shape[1]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: the TP ranks of a data group are neighbours
        (row-major), so they share ``rank // tp``."""
        return self.rank // self.tp

    @property
    def batch_replicas(self) -> int:
        """Ranks that read the same batch (the TP ranks of one data group)."""
        return self.world // self.dp_size

    @property
    def batch_dims(self) -> tuple[str, ...]:
        """The mesh dims a batch is split over (size > 1): ``("dp_replicate", "dp_shard")``,
        one of them, or ``()`` when every rank reads the same batch."""
        return tuple(d for d, n in zip(DIMS[:2], self.shape[:2]) if n > 1)

    @property
    def two_d(self) -> bool:
        """Whether the run is on the ``parallelism`` block's N-D mesh (not the 1-D world)."""
        return self.mesh is not None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def data_parallel(self) -> bool:
        """Whether DDP/FSDP wrap the model (more than one data-parallel rank)."""
        return self.dp_mesh is not None and self.dp_size > 1 and self.strategy != "placements"

    @property
    def tensor_parallel(self) -> bool:
        """Whether TP applies: ``placements`` (checked in a world of one too), or a ``tp`` dim."""
        return self.strategy == "placements" or self.tp_mesh is not None

    def dim_sizes(self) -> dict[str, int]:
        """Each mesh dim's size, as collectives are labelled (``world`` included)."""
        sizes = {"world": self.world}
        if self.mesh is not None:
            sizes.update(zip(DIMS, self.shape))
            if self.shape[1] > 1 and self.shape[2] > 1:  # flattened by build_layout
                sizes[FLAT_DP_TP] = self.shape[1] * self.shape[2]
        return sizes

    def describe(self) -> str:
        """``dp_replicate x dp_shard x tp`` sizes, e.g. ``1x2x2``."""
        return "x".join(map(str, self.shape))


def build_layout(
    parallelism: ParallelismConfig,
    strategy: str,
    world: int,
    rank: int,
    device: torch.device,
    backend: str | None = None,
) -> Layout:
    """This rank's ``Layout`` for ``parallelism`` on ``world`` ranks: an ``init_device_mesh`` of
    shape ``(dp_replicate, dp_shard, tp)`` unless the block is the default (then the 1-D world
    mesh in a world of more than one). Collective when it makes a mesh (every rank builds the
    same layout from the same config)."""
    from spmdgt.interceptor._groups import register_mesh

    rep, shard, tp = parallelism.resolve(world)
    common = {"strategy": strategy, "world": world, "rank": rank, "device": device}
    common["backend"] = backend
    if rep == 1 and tp == 1:  # the 1-D world, bit for bit
        shape = (1, 1, world) if strategy == "placements" else (1, world, 1)
        world_mesh = None
        if world > 1:
            from spmdgt import runtime

            world_mesh = runtime.device_mesh()
        layout = Layout(**common, shape=shape, world_mesh=world_mesh)
        if strategy == "placements":
            layout.tp_mesh = world_mesh
        else:
            layout.dp_mesh = world_mesh
        return layout
    if strategy == "placements" and rep * shard > 1:
        raise ConfigError(
            f"strategy 'placements' is tensor parallelism alone, but parallelism gives "
            f"dp_replicate={rep} x dp_shard={shard} data-parallel ranks; use strategy "
            "'fsdp' (or 'ddp' without tp) for the data dims, or tp = the world size",
            key="parallelism",
            value={"dp_replicate": rep, "dp_shard": shard, "tp": tp},
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (rep, shard, tp), mesh_dim_names=DIMS)
    register_mesh(mesh)  # collectives are labelled with the dim whose group ran them
    if shard > 1 and tp > 1:
        # a value partial over both (the clip's norm of FSDP x TP gradients): DTensor reduces
        # it in one all-reduce over this flattened dim where it exists, else one per dim, one
        # after the other (and warns that it does)
        register_mesh(mesh["dp_shard", "tp"]._flatten(FLAT_DP_TP))
    from spmdgt.tensor import _dynamo_guards

    _dynamo_guards.hold("sharded meshes")  # compile=True over DTensors: exact shape guards
    dp_mesh = None
    if rep * shard > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if rep > 1 else mesh["dp_shard"]
    tp_mesh = mesh["tp"] if tp > 1 else None
    return Layout(**common, shape=(rep, shard, tp), mesh=mesh, tp_mesh=tp_mesh, dp_mesh=dp_mesh)


def tp_group(layout: Layout) -> object | None:
    """The tensor-parallel process group of an N-D layout whose ``tp`` dim is > 1, else None
    (on the 1-D world, ``placements``' group is the world: ``None`` too)."""
    if layout.mesh is None or layout.tp == 1:
        return None
    return layout.mesh["tp"].get_group()


def _node() -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` (the node rank its rendezvous assigned;
    also right for several "nodes" on one host), else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group not in (None, "") else socket.gethostname()


def describe_groups(layout: Layout) -> str | None:
    """One line naming each tensor-parallel group's ranks and the node(s) they run on, so a
    log shows whether TP stayed inside a node (``None`` on the 1-D world: nothing to say;
    the mesh alone, no collective, when ``tp`` is 1: one-rank groups say nothing).

    Collective on an N-D layout (an all-gather of each rank's node, once, at setup; every
    rank builds the same layout, so every rank calls it). A group spanning nodes is flagged:
    its per-layer collectives would cross the slow link (put ``tp`` at most the GPUs per
    node, as ``(dp_replicate, dp_shard, tp)`` row-major keeps a node's ranks in one group).
    On the fake backend (a dry run) there are no other nodes to ask: none are named."""
    if layout.mesh is None:
        return None
    tp = layout.tp
    if tp == 1:  # HSDP: no tp group to place (the same layout, so the same skip, everywhere)
        return f"mesh dp_replicate x dp_shard x tp = {layout.describe()} (no tensor parallelism)"
    if layout.backend == "fake":
        return f"mesh dp_replicate x dp_shard x tp = {layout.describe()}"
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
