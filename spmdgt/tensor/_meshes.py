"""DeviceMeshes for signals: the world mesh, one 1-D sub-mesh per distinct ``workers`` list,
and the config's named n-D mesh (``named_mesh``: ``mesh: {dp: 2, tp: 2}`` in the YAML).

Every rank runs the same program and so asks for the same meshes in the same order, which is
what ``new_group`` needs: a sub-mesh is built on first use on every rank, members or not.
"""

from __future__ import annotations

import os
import warnings

from spmdgt._core.session import session
from spmdgt.runtime import _agree
from spmdgt.runtime._state import get_runtime, world_mesh
from spmdgt.tensor import _dynamo_guards

__all__ = ["clear", "describe_mesh", "mesh_for", "mesh_ranks", "named_mesh", "spans_world"]

_cache: dict[tuple[int, ...], object] = {}
_named: dict[tuple[tuple[str, int], ...], object] = {}
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
    if world > 1:
        _dynamo_guards.hold("sharded meshes")  # your torch.compile over gt.Tensors: exact
    ranks = tuple(range(world)) if workers is None else tuple(sorted(_clamp(workers, signal)))
    if ranks == tuple(range(world)):
        return world_mesh()
    mesh = _cache.get(ranks)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        world_mesh()  # the default group must exist first
        _agree.settle()  # new_group is a collective: the points in flight are checked first
        mesh = DeviceMesh(get_runtime().device_type, list(ranks))
        _cache[ranks] = mesh
    return mesh


def named_mesh(dims: tuple[tuple[str, int], ...]):
    """The n-D mesh over every rank with ``dims`` (name, size) pairs, row-major, made once.

    Sizes must multiply to the world size (the config checks that, naming file and key,
    before any rank gets here). Every rank builds it in the same program order: each dim's
    process groups are made by ``init_device_mesh`` collectively."""
    key = tuple((str(n), int(s)) for n, s in dims)
    mesh = _named.get(key)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        world_mesh()  # the default group must exist first
        _agree.settle()  # new_group is a collective: the points in flight are checked first
        _dynamo_guards.hold("sharded meshes")
        names = tuple(n for n, _ in key)
        sizes = tuple(s for _, s in key)
        mesh = init_device_mesh(get_runtime().device_type, sizes, mesh_dim_names=names)
        _named[key] = mesh
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


def spans_world(mesh) -> bool:
    """Whether ``mesh`` holds every rank (kept on the mesh: asked on every op).

    A tensor on a sub-mesh is where ranks can part ways: a rank off the mesh holds an empty
    placeholder and runs no local op, so what a local result shows (a view's shared memory,
    a fast-path key's proof that the op is local) holds on some ranks only."""
    whole = mesh.__dict__.get("_gt_whole")
    if whole is None:
        whole = mesh.__dict__["_gt_whole"] = mesh.size() == get_runtime().world_size
    return whole


def describe_mesh(mesh) -> str:
    """A mesh in words that are the same on every rank: ``ranks [0, 1]`` for a 1-D mesh,
    ``mesh (dp=2, tp=2) over ranks [0, 1, 2, 3]`` for an n-D one (kept on the mesh)."""
    text = mesh.__dict__.get("_gt_text")
    if text is None:
        ranks = mesh_ranks(mesh)
        if mesh.ndim == 1:
            text = f"ranks {ranks}"
        else:
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
            text = f"mesh ({dims}) over ranks {ranks}"
        mesh.__dict__["_gt_text"] = text
    return text


def clear() -> None:
    """Forget cached sub-meshes (after the process group is destroyed)."""
    _cache.clear()
    _named.clear()
    _warned.clear()
    _dynamo_guards.let_go("sharded meshes")


session.register("meshes", clear)
# a forked child (a test rank, a DataLoader worker) owns none of its parent's process groups
os.register_at_fork(after_in_child=clear)
