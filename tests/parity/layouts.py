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
| `partial`      | Partial(sum) on the world mesh: each rank holds a part (an audit layout) |
| `mesh_ps0`     | 2x2 mesh, world 4: (Partial(), Shard(0)) (an audit layout), uncut        |
| `mesh_s0p`     | 2x2 mesh, world 4: (Shard(0), Partial()) (an audit layout), uncut        |

``partial`` and its 2-D forms are not among the default placements (the ledger does not
hold their rows): they audit DTensor's rules that keep a ``Partial`` placement through an
op, which are right only where the op is linear in its input (``op(sum of parts) == sum of
op(parts)``). Asked for by name: ``--placements partial`` (2 and 3 ranks), ``--placements
mesh_ps0,mesh_s0p --worlds 4``. The parts have mixed signs (a rule that keeps ``Partial``
through ``relu`` or ``abs`` is caught) and add up to the value exactly in any order (a
reduction that is right gives one process's bits): see ``partial_parts``.

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
    "PLACEMENTS_AUDIT",
    "Layout",
    "fits",
    "min_dim",
    "narrowed_rows",
    "partial_parts",
    "rank_layout",
    "soft_cut",
]

PLACEMENTS_1D: tuple[str, ...] = ("plain", "shard0", "shard1", "subrep", "shard0_empty")
PLACEMENTS_2D: tuple[str, ...] = ("mesh_s0s1", "mesh_s0r", "mesh_rs1", "mesh_s0s0")
PLACEMENTS: tuple[str, ...] = PLACEMENTS_1D + PLACEMENTS_2D
PLACEMENTS_AUDIT: tuple[str, ...] = ("partial", "mesh_ps0", "mesh_s0p")  # asked for by name
MESH_2D: tuple[tuple[str, int], ...] = (("dp", 2), ("tp", 2))
WORLD_2D = 4  # the ranks of MESH_2D

# The tensor dims a placement needs on the sample's first input.
_MIN_DIM = {"plain": 1, "shard0": 1, "shard1": 2, "subrep": 1, "shard0_empty": 1}
_MIN_DIM.update(mesh_s0s1=2, mesh_s0r=1, mesh_rs1=2, mesh_s0s0=1)
_MIN_DIM.update(partial=0, mesh_ps0=1, mesh_s0p=1)
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
    return world == WORLD_2D if placement.startswith("mesh_") else True


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
    if placement in PLACEMENTS_AUDIT:
        return _partial_layout(placement, world)
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
    from torch.distributed.tensor import Partial, Replicate, Shard

    out, i = [], 0
    while i < len(kinds):
        if kinds[i] in "rp":
            out.append(Replicate() if kinds[i] == "r" else Partial())
            i += 1
        else:
            out.append(Shard(int(kinds[i + 1])))
            i += 2
    return tuple(out)


# a float dtype's integer of the same width, and its mantissa's stored bits
_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16}
_INT_OF.update({torch.float32: torch.int32, torch.float64: torch.int64})
_MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}


def _truncate(v: torch.Tensor, keep: int) -> torch.Tensor:
    """``v`` with only the top ``keep`` bits of its mantissa (towards zero; sign, exponent
    kept): a float with few bits, of ``v``'s sign and binade."""
    itype = _INT_OF[v.dtype]
    width = torch.finfo(v.dtype).bits
    drop = _MANTISSA[v.dtype] - keep
    mask = ~((1 << drop) - 1) & ((1 << width) - 1)
    if mask >= 1 << (width - 1):
        mask -= 1 << width  # as the signed integer of the same bits
    return (v.view(itype) & mask).view(v.dtype)


def partial_parts(v: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``world`` parts whose sum is ``v`` exactly, in any order of addition.

    Floats: ``q`` is ``v`` cut to its top 4 mantissa bits (so ``v/2 < q <= v``); part 0 is
    ``v - 2q`` (exact by Sterbenz's lemma, of the other sign) and the others split ``2q``'s
    few bits between them. Any subset's sum is a multiple of ``v``'s last place below twice its
    binade, so representable: a reduction adds to ``v``'s own bits whatever its order.
    Non-finite values, and those so large that ``2q`` would overflow, stay whole on part 0.
    Integers: random parts (wrapping arithmetic is exact); booleans stay whole on part 0."""
    zeros = [torch.zeros_like(v) for _ in range(world - 1)]
    if world == 1 or v.dtype == torch.bool:
        return [v.clone(), *zeros]
    if v.is_complex():
        real = partial_parts(torch.view_as_real(v), world)
        return [torch.view_as_complex(p.contiguous()) for p in real]
    if not v.is_floating_point():
        g = torch.Generator().manual_seed(1234 + v.numel())
        low = 0 if v.dtype == torch.uint8 else -3
        rest = [torch.randint(low, 4, v.shape, generator=g).to(v.dtype) for _ in zeros]
        first = v.clone()
        for r in rest:
            first -= r
        return [first, *rest]
    v = v.contiguous()
    keep = 4
    two_q = _truncate(v, keep) * 2
    ok = torch.isfinite(v) & torch.isfinite(two_q) & (v.abs() < torch.finfo(v.dtype).max / 4)
    fields = []
    for k in range(1, world):  # 2q's bits, top first, in world - 1 fields
        upto = _truncate(two_q, keep * k // (world - 1)) if k < world - 1 else two_q
        fields.append(upto - sum(fields, torch.zeros_like(v)))
    first = torch.where(ok, v - two_q, v)
    return [first, *(torch.where(ok, f, 0.0) for f in fields)]


def _partial_layout(placement: str, world: int) -> Layout:
    """``partial``: each rank holds its part of the value as ``Partial(sum)`` on the world;
    ``mesh_ps0`` / ``mesh_s0p``: on the 2x2 mesh, the value split in parts over one mesh dim
    and each part's rows sharded over the other (DTensor's rules across mesh dims)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from spmdgt.tensor._meshes import mesh_for, named_mesh
    from spmdgt.tensor._moves import _cls, _DisableSubclass

    if placement == "partial":
        mesh, pls = mesh_for(None), (Partial(),)
    else:
        mesh, pls = named_mesh(MESH_2D), _two(placement.removeprefix("mesh_"))
    coord = mesh.get_coordinate()
    pdim = next(i for i, p in enumerate(pls) if isinstance(p, Partial))
    held = tuple(Replicate() if isinstance(p, Partial) else p for p in pls)

    def put(t: torch.Tensor) -> torch.Tensor:
        whole = partial_parts(t.detach(), mesh.size(pdim))[coord[pdim]].contiguous()
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, held)
        # a fresh part at storage offset 0, as spmdgt's own layouts (a view of ``whole`` would
        # keep a storage offset that differs by rank, which as_strided reads)
        part = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()
        stride = whole.stride() if whole.dim() else ()
        with _DisableSubclass():
            out = DTensor.from_local(part, mesh, pls, run_check=False, shape=t.shape, stride=stride)
        out.__class__ = _cls[0]
        return out

    return Layout(put, _identity)
