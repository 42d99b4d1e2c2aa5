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

Everything here that touches spmdgt runs on a rank only: the parent never builds a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PLACEMENTS", "Layout", "min_dim", "narrowed_rows", "rank_layout"]

PLACEMENTS: tuple[str, ...] = ("plain", "shard0", "shard1", "subrep", "shard0_empty")

# The tensor dims a placement needs on the sample's first input.
_MIN_DIM = {"plain": 1, "shard0": 1, "shard1": 2, "subrep": 1, "shard0_empty": 1}


def min_dim(placement: str) -> int:
    """The fewest dims the first input must have for ``placement`` to apply."""
    return _MIN_DIM[placement]


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

    if placement == "subrep":
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
