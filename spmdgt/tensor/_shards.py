"""The shape of every rank's piece of a DTensor, from global metadata alone.

DTensor cuts a tensor mesh dim by mesh dim, left to right, each ``Shard(d)`` cutting what dim
``d`` has so far with torch.chunk's rule. The op table (empty and uneven shards) and the
strategy checks of ``_hook`` (nested uneven shards DTensor's view rules get wrong) both read
these shapes; every rank computes the same answer without a collective.
"""

from __future__ import annotations

import itertools

__all__ = ["nested_uneven", "shard_shapes"]

_shard_shapes: dict[tuple, tuple[tuple[int, ...], ...] | None] = {}
_SHAPES_KEPT = 4096


def shard_shapes(spec) -> tuple[tuple[int, ...], ...] | None:
    """The local shape every mesh coordinate holds of a DTensor with ``spec``, in mesh order,
    by DTensor's rule: mesh dims left to right, each ``Shard(d)`` cutting the part dim ``d``
    has so far with torch.chunk's rule (so nested shards of one dim, ``(Shard(0), Shard(0))``,
    cut the first cut's pieces). None for a placement whose split this does not know
    (``_StridedShard``): callers treat that as irregular. Global metadata only; cached."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh_shape = tuple(spec.mesh.shape)
    key = (tuple(spec.shape), mesh_shape, tuple(spec.placements))
    if key in _shard_shapes:
        return _shard_shapes[key]
    out: list[tuple[int, ...]] | None = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape = list(spec.shape)
        for i, p in enumerate(spec.placements):
            if isinstance(p, Shard):
                shape[p.dim] = Shard.local_shard_size_and_offset(
                    shape[p.dim], mesh_shape[i], coord[i]
                )[0]
            elif not isinstance(p, (Replicate, Partial)):
                out = None
                break
        if out is None:
            break
        out.append(tuple(shape))
    if len(_shard_shapes) >= _SHAPES_KEPT:  # a program of ever new shapes: start over
        _shard_shapes.clear()
    _shard_shapes[key] = found = None if out is None else tuple(out)
    return found


def nested_uneven(spec) -> bool:
    """True when one tensor dim of ``spec`` is sharded over two or more mesh dims
    (``(Shard(0), Shard(0))``) and the ranks' pieces differ in size. DTensor's view rules
    check a flattened or split dim's evenness against the first of those mesh dims only, and
    then view each rank's piece at a size it does not have (2 rows over 2x2: pieces 1, 0, 1,
    0; a flatten asks each for a quarter): errors on some ranks, or wrong values."""
    from torch.distributed.tensor import Shard

    dims = [p.dim for p in spec.placements if isinstance(p, Shard)]
    if len(dims) == len(set(dims)):
        return False
    shapes = shard_shapes(spec)
    return shapes is None or len(set(shapes)) > 1
