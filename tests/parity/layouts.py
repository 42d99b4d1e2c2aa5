"""The placements a sweep case lays its inputs out in, and how a rank lays a tensor out.

A case places the sample's first tensor input, and every other tensor argument of the same
shape (the second operand of a binary op, say), as one of:

| name           | layout                                                                   |
|----------------|--------------------------------------------------------------------------|
| `plain`        | Replicate on the world: in spmdgt a plain torch tensor (the control)     |
| `shard0`       | Shard(0) on the world mesh (OpInfo's sizes 5/10/20 are mostly uneven)    |
| `shard1`       | Shard(1) on the world mesh (inputs with 2 or more dims)                  |
| `subrep`       | Replicate on the sub-mesh of ranks 1..N-1 (rank 0 holds nothing)         |
| `shard0_empty` | Shard(0) after cutting dim 0 to N-1 rows: the last rank's shard is empty |
| `mesh_s0s1`    | 2x2 mesh (dp, tp), world 4: (Shard(0), Shard(1)), cut to <= 7 x 5        |
| `mesh_s0r`     | 2x2 mesh, world 4: (Shard(0), Replicate()), dim 0 cut to <= 7 rows       |
| `mesh_rs1`     | 2x2 mesh, world 4: (Replicate(), Shard(1)), dim 1 cut to <= 5 cols       |
| `mesh_s0s0`    | 2x2 mesh, world 4: (Shard(0), Shard(0)): dim 0 over all 4, cut to <= 7   |

The 2-D layouts (``mesh_*``) run at world 4 only, on ``named_mesh(MESH_2D)``. Their cut is
soft: a dim longer than 7 rows / 5 cols is cut to that (7 rows split 4/3 over dp, and 2/2/2/1
over dp x tp; 5 cols split 3/2 over tp), a shorter one is kept (OpInfo's 5 rows split 3/2 and
2/1/1/1). A sample whose cut torch itself refuses (a matmul whose inner dims no longer match)
is run uncut, so the cut never costs a sample.

Everything here that touches spmdgt runs on a rank only: the parent never builds a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "WORLD_2D",
    "MESH_2D",
    "PLACEMENTS",
    "PLACEMENTS_1D",
    "PLACEMENTS_2D",
    "Layout",
    "fits",
    "min_dim",
    "narrowed_rows",
    "rank_layout",
    "soft_cut",
]

PLACEMENTS_1D: tuple[str, ...] = ("plain", "shard0", "shard1", "subrep", "shard0_empty")
PLACEMENTS_2D: tuple[str, ...] = ("mesh_s0s1", "mesh_s0r", "mesh_rs1", "mesh_s0s0")
PLACEMENTS: tuple[str, ...] = PLACEMENTS_1D + PLACEMENTS_2D
MESH_2D: tuple[tuple[str, int], ...] = (("dp", 2), ("tp", 2))
WORLD_2D = 4  # the ranks of MESH_2D

# The tensor dims a placement needs on the sample's first input.
_MIN_DIM = {"plain": 1, "shard0": 1, "shard1": 2, "subrep": 1, "shard0_empty": 1}
_MIN_DIM.update(mesh_s0s1=2, mesh_s0r=1, mesh_rs1=2, mesh_s0s0=1)
# (tensor dim, length) cuts of a 2-D layout, applied where the dim is longer (see above)
_SOFT_CUT: dict[str, tuple[tuple[int, int], ...]] = {
    "mesh_s0s1": ((0, 7), (1, 5)),
    "mesh_s0r": ((0, 7),),
    "mesh_rs1": ((1, 5),),
    "mesh_s0s0": ((0, 7),),
}


def min_dim(placement: str) -> int:
    """The fewest dims the first input must have for ``placement`` to apply."""
    return _MIN_DIM[placement]


def fits(placement: str, world: int) -> bool:
    """Does ``placement`` run at ``world`` ranks? (The 2-D layouts need exactly 2x2 = 4.)"""
    return world == WORLD_2D if placement in PLACEMENTS_2D else True


def soft_cut(placement: str) -> tuple[tuple[int, int], ...]:
    """(dim, length) pairs a 2-D layout cuts its samples to where they are longer; () else."""
    return _SOFT_CUT.get(placement, ())


def narrowed_rows(placement: str, world: int) -> int | None:
    """Rows of dim 0 to keep for ``placement`` (None: keep the sample as it is).

    ``shard0_empty`` keeps ``world - 1`` rows: torch.chunk's rule (DTensor's) then gives the
    first ``world - 1`` ranks one row each and the last rank none (1 row on 2 ranks: [1, 0];
    2 rows on 3 ranks: [1, 1, 0]).
    """
    return world - 1 if placement == "shard0_empty" else None


@dataclass(frozen=True)
class Layout:
    """How one rank lays out a case's tensors: ``put`` for inputs, ``put_out`` for ``out=``."""

    put: Callable[[torch.Tensor], torch.Tensor]
    put_out: Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


IDENTITY = Layout(_identity, _identity)


def sub_mesh_ranks(world: int) -> list[int]:
    """Ranks of the ``subrep`` sub-mesh: all but rank 0 (so the value lives off rank 0)."""
    return list(range(1, world))


def rank_layout(placement: str, world: int) -> Layout:
    """The layout of ``placement`` on this rank (spmdgt initialised, meshes built)."""
    if placement == "plain":
        return IDENTITY
    from torch.distributed.tensor import Replicate, Shard

    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._placement import Target
    from spmdgt.tensor._tensor import place

    if placement in PLACEMENTS_2D:
        from spmdgt.tensor._meshes import named_mesh

        pls = _two(placement.removeprefix("mesh_"))
        target = Target(named_mesh(MESH_2D), pls)
        dim = max((p.dim for p in pls if isinstance(p, Shard)), default=-1)
    elif placement == "subrep":
        target = Target(mesh_for(sub_mesh_ranks(world)), (Replicate(),))
        dim = -1
    else:
        dim = 1 if placement == "shard1" else 0
        target = Target(mesh_for(None), (Shard(dim),))

    def put(t: torch.Tensor) -> torch.Tensor:
        return place(t, target)

    def put_out(t: torch.Tensor) -> torch.Tensor:
        # An out= tensor takes the input's layout where it has the sharded dim, else stays
        # plain (a 0-d result of a reduction over a sharded input, say).
        return place(t, target) if t.dim() > dim else t

    return Layout(put, put_out)


def _two(kinds: str) -> tuple:
    """``s0s1`` -> (Shard(0), Shard(1)); ``s0r`` -> (Shard(0), Replicate()); and so on."""
    from torch.distributed.tensor import Replicate, Shard

    out, i = [], 0
    while i < len(kinds):
        if kinds[i] == "r":
            out.append(Replicate())
            i += 1
        else:
            out.append(Shard(int(kinds[i + 1])))
            i += 2
    return tuple(out)
