"""DeviceMeshes for signals: the world mesh, and one 1-D sub-mesh per distinct ``workers`` list.

Every rank runs the same program and so asks for the same meshes in the same order, which is
what ``new_group`` needs: a sub-mesh is built on first use on every rank, members or not.
"""

from __future__ import annotations

import os
import warnings

from spmdgt._core.session import session
from spmdgt.runtime._state import get_runtime, world_mesh

__all__ = ["clear", "mesh_for", "mesh_ranks"]

_cache: dict[tuple[int, ...], object] = {}
_warned: set[tuple[int, ...]] = set()


def _clamp(workers: list[int], signal: str | None) -> tuple[int, ...]:
    world = get_runtime().world_size
    ranks = tuple(w for w in workers if w < world)
    if len(ranks) != len(workers):
        key = tuple(workers)
        if key not in _warned:
            _warned.add(key)
            missing = [w for w in workers if w >= world]
            warnings.warn(
                f"signal {signal!r} lists workers {missing} but the world has {world} rank(s); "
                f"using ranks {list(ranks) or list(range(world))}",
                stacklevel=4,
            )
    return ranks or tuple(range(world))


def mesh_for(workers: list[int] | None, signal: str | None = None):
    """The 1-D mesh over ``workers`` (all ranks when None); ranks past the world are dropped.

    The mesh lists the workers in rank order, whatever order the YAML lists them in: c10d
    orders a group's members by rank, and DTensor's collectives lay shards out in group order,
    so a mesh ``[1, 0]`` would gather its shards swapped (a silent permutation of the value).
    Shard ``i`` lives on the ``i``-th smallest listed rank."""
    world = get_runtime().world_size
    ranks = tuple(range(world)) if workers is None else tuple(sorted(_clamp(workers, signal)))
    if ranks == tuple(range(world)):
        return world_mesh()
    mesh = _cache.get(ranks)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        world_mesh()  # the default group must exist first
        mesh = DeviceMesh(get_runtime().device_type, list(ranks))
        _cache[ranks] = mesh
    return mesh


def mesh_ranks(mesh) -> list[int]:
    """Global ranks of a 1-D (or flattened n-D) mesh, in mesh order.

    Kept on the mesh after the first call: a host read asks on every call, and reading the
    mesh tensor runs torch ops the instruction log would show as the program's."""
    ranks = mesh.__dict__.get("_gt_ranks")
    if ranks is None:
        ranks = mesh.mesh.flatten().tolist()
        mesh.__dict__["_gt_ranks"] = ranks
    return list(ranks)


def clear() -> None:
    """Forget cached sub-meshes (after the process group is destroyed)."""
    _cache.clear()
    _warned.clear()


session.register("meshes", clear)
# a forked child (a test rank, a DataLoader worker) owns none of its parent's process groups
os.register_at_fork(after_in_child=clear)
