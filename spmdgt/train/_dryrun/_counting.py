"""What a dry run counts: the collectives of a step (``CollectiveCounter``, a dispatch mode on
the ``c10d`` and functional-collective ops: kind, count, bytes and the mesh dim whose group ran
it) and each rank's bytes of sharded tensors (``local_numel``: the rank's shard of a DTensor,
from its mesh coordinates).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmdgt.interceptor._groups import group_of_call

__all__ = ["CollectiveCounter", "collective_of", "local_numel"]

# --------------------------------------------------------------------------- collectives


# op base name (trailing "_" stripped) -> (kind, which argument holds the full buffer)
_OPS: dict[str, tuple[str, int]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "_allgather_base": ("all_gather", 0),  # (output, input): the gathered buffer
    "allgather": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", -1),  # functional: input x group size
    "all_gather_into_tensor_coalesced": ("all_gather", -1),
    "all_gather_into_tensor_out": ("all_gather", -1),
    "_reduce_scatter_base": ("reduce_scatter", 1),  # (output, input): the scattered buffer
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),  # functional: (input, op, size, group)
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "broadcast": ("broadcast", 0),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "reduce": ("reduce", 0),
    "gather": ("gather", 1),
    "scatter": ("scatter", 0),
    "send": ("send", 0),
    "recv": ("recv", 0),
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def collective_of(func: torch._ops.OpOverload, args: Sequence[object]) -> tuple[str, int] | None:
    """``(kind, bytes of the full buffer)`` of a collective op, ``None`` for anything else
    (barriers, waits, other ops). The full buffer, as ``CollectiveLog`` records it: the
    all-reduced tensors, the all-gather's output, the reduce-scatter's input."""
    if func.namespace not in _NAMESPACES:
        return None
    name = func._opname
    base = name[:-1] if name.endswith("_") and name[:-1] in _OPS else name
    if base not in _OPS:
        return None
    kind, where = _OPS[base]
    if where == -1:  # functional all-gather: (input(s), group_size, group)
        return kind, _nbytes(args[0]) * int(args[1])
    return kind, _nbytes(args[where]) if len(args) > where else 0


class CollectiveCounter(TorchDispatchMode):
    """Every collective dispatched while active: ``(step, kind, bytes, dim)`` in ``records``.

    It sees the ``c10d`` ops (what ``torch.distributed`` calls, DDP's C++ reducer and FSDP2
    issue) and the functional collectives (DTensor's), real or fake, so a real run and a dry
    run are counted by the same code. ``dim`` names the mesh dim of the op's process group
    (``_groups.group_label``: ``tp``, ``dp_shard``, ``world``). Set ``step`` to tag the
    records that follow."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str, int, str]] = []
        self.step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor desugar its op into local ops and collectives first (a mode runs
            # before a subclass, and what runs inside a mode's handler skips that mode):
            # they come back here as plain ops, as CommDebugMode and FSDPMemTracker do it.
            return NotImplemented
        found = collective_of(func, args)
        if found is not None:
            self.records.append((self.step, *found, group_of_call(func, args, kwargs)))
        return func(*args, **(kwargs or {}))

    def totals(self, step: int | None = None) -> dict[str, dict[str, int]]:
        """Per kind: ``count`` and ``bytes`` (of ``step``'s records; all when ``None``)."""
        out: dict[str, dict[str, int]] = {}
        for s, kind, nbytes, _ in self.records:
            if step is None or s == step:
                t = out.setdefault(kind, {"count": 0, "bytes": 0})
                t["count"] += 1
                t["bytes"] += nbytes
        return out

    def totals_by_dim(self, step: int | None = None) -> dict[str, dict[str, dict[str, int]]]:
        """``totals`` per mesh dim: ``{dim: {kind: {count, bytes}}}``."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for s, kind, nbytes, dim in self.records:
            if step is None or s == step:
                t = out.setdefault(dim, {}).setdefault(kind, {"count": 0, "bytes": 0})
                t["count"] += 1
                t["bytes"] += nbytes
        return out


# --------------------------------------------------------------------------- per-rank bytes


def _coordinates(mesh: object) -> dict[int, list[int]]:
    """rank -> its coordinate on ``mesh`` (read from the mesh's real rank tensor, outside
    any fake or tracking mode). On a sub-mesh of an N-D mesh (FSDP's ``dp_shard`` mesh of a
    2-D run) every rank of the world has one: its coordinates along those dims of the root
    mesh, on the sibling sub-mesh that holds its copy of the tensor (rank 0 sees only its
    own sub-mesh, ``[0, 2]`` of a 2 x 2 mesh; rank 1's shard lives on ``[1, 3]``)."""
    out = _own_coordinates(mesh)
    root = getattr(mesh, "_get_root_mesh", lambda: None)()
    names = getattr(mesh, "mesh_dim_names", None)
    root_names = getattr(root, "mesh_dim_names", None)
    if root is None or root is mesh or not names or not root_names:
        return out
    if not all(n in root_names for n in names):  # a flattened dim: not a slice of the root
        return out
    picks = [root_names.index(n) for n in names]
    for rank, coord in _own_coordinates(root).items():
        out.setdefault(rank, [coord[i] for i in picks])
    return out


def _own_coordinates(mesh: object) -> dict[int, list[int]]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        ranks = mesh.mesh.tolist()  # type: ignore[attr-defined]
    out: dict[int, list[int]] = {}

    def walk(x: object, coord: list[int]) -> None:
        if isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, [*coord, i])
        else:
            out[int(x)] = coord

    walk(ranks, [])
    return out


@functools.lru_cache(maxsize=65536)
def _local_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple
) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, _ = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    return tuple(local)


def local_numel(t: torch.Tensor, rank: int, coords: dict[int, list[int]] | None = None) -> int:
    """Elements of ``t`` that ``rank`` holds: a DTensor's local shard on that rank (from its
    placements; 0 off its mesh), a plain tensor whole (every rank has its own copy)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.numel()
    mesh = t.device_mesh
    coords = coords if coords is not None else _coordinates(mesh)
    if rank not in coords:
        return 0
    shape = _local_shape(
        tuple(t.shape), tuple(mesh.shape), tuple(coords[rank]), tuple(t.placements)
    )
    return math.prod(shape)


def _bytes_per_rank(tensors: list[torch.Tensor], world: int) -> list[int]:
    """Bytes of ``tensors`` on each of ``world`` ranks (from metadata only, outside any fake
    or tracking mode)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _bytes_per_rank_here(tensors, world, DTensor)


def _bytes_per_rank_here(tensors: list[torch.Tensor], world: int, DTensor: type) -> list[int]:
    out = [0] * world
    meshes: dict[int, dict[int, list[int]]] = {}
    for t in tensors:
        size = t.element_size()
        if not isinstance(t, DTensor):
            for r in range(world):
                out[r] += t.numel() * size
            continue
        coords = meshes.setdefault(id(t.device_mesh), _coordinates(t.device_mesh))
        for r in range(world):
            out[r] += local_numel(t, r, coords) * size
    return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
