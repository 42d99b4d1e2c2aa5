"""Which mesh dim a collective runs on: a process group -> its mesh dim's name.

A 2-D run issues each collective on one dim's process group (TP's inside ``tp``, FSDP's on
``dp_shard``, HSDP's replica all-reduce on ``dp_replicate``). The instruction log, ``top``, the
trainer's communication log and the dry run all name that dim with ``group_label``, one rule:

1. a group a mesh was registered for (``register_mesh``, what the trainer and the dry run do
   with their mesh) -> that dim's name (a group ``DeviceMesh`` made for it, or one a user
   made with ``new_group``); never the default group: a dim that spans the whole world
   reuses it, and naming it would rename every later world collective of the process;
2. a group ``DeviceMesh`` created -> its dim's name (torch describes it ``mesh_<dim>``; a
   flattened dim ``mesh_dp_replicate_dp_shard`` keeps its joined name);
3. the default group (and ``None``, which means it) -> ``world``: what a 1-D run prints;
4. any other group -> ``pg<name>`` (torch's group name), never a guessed dim.

Cheap enough for the op stream: only collectives ask, and each answer is a dictionary lookup
plus one attribute read. Works without ``torch.distributed`` initialised (``world``).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch._ops import OpOverload

__all__ = ["WORLD", "group_label", "group_of_call", "register_mesh", "registered"]

WORLD = "world"
_REGISTERED: dict[str, tuple[Any, str]] = {}  # group name -> (weak ref to the group, dim name)


def register_mesh(mesh: object) -> dict[str, str]:
    """Name the groups of ``mesh``'s dims (size > 1) after the dims; returns group name -> dim.
    Local: no collective (the groups exist already). A dim on the default group (one that
    spans the world) stays ``world``."""
    import torch.distributed as dist

    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        return {}
    out = {}
    for dim in names:
        sub = mesh[dim]  # type: ignore[index]
        if sub.size() <= 1:
            continue
        pg = sub.get_group()
        if pg is dist.distributed_c10d._get_default_group():
            continue
        _REGISTERED[pg.group_name] = (weakref.ref(pg), dim)
        out[pg.group_name] = dim
    return out


def registered() -> dict[str, str]:
    """Group name -> dim name of the meshes registered so far (live groups only)."""
    return {k: dim for k, (ref, dim) in _REGISTERED.items() if ref() is not None}


def group_label(group: Any) -> str:
    """The mesh dim name of ``group`` (a ``ProcessGroup``, a group name as functional
    collectives pass it, or ``None`` for the default group): module docstring's rule."""
    import torch.distributed as dist

    if group is None:
        return WORLD
    if not (dist.is_available() and dist.is_initialized()):
        return WORLD if group is None else f"pg{getattr(group, 'group_name', group)}"
    pg = group
    if isinstance(group, str):
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(group)
        except Exception:  # a name no live group has (a destroyed world's)
            return f"pg{group}"
    elif not isinstance(group, dist.ProcessGroup):
        unbox = getattr(dist.ProcessGroup, "unbox", None)
        try:
            pg = unbox(group) if unbox is not None else group
        except Exception:
            return "-"
    name = getattr(pg, "group_name", None)
    got = _REGISTERED.get(name) if name is not None else None
    if got is not None and got[0]() is pg:
        return got[1]
    if pg is dist.GroupMember.WORLD or pg is dist.distributed_c10d._get_default_group():
        return WORLD
    desc = getattr(pg, "group_desc", "") or ""
    if desc.startswith("mesh_") and desc not in ("mesh_default",):
        return desc[len("mesh_") :]
    return f"pg{name}"


# func -> index of its group argument in positional args (or -1) and its keyword name
_WHERE: dict[Any, tuple[int, str | None]] = {}


def _where(func: Any) -> tuple[int, str | None]:
    got = _WHERE.get(func)
    if got is not None:
        return got
    schema = getattr(func, "_schema", None)
    if schema is None and isinstance(getattr(func, "default", None), OpOverload):
        schema = func.default._schema  # an op packet (torch.ops._c10d_functional.all_reduce)
    got = (-1, None)
    if schema is not None:  # an ATen/c10d/functional op: group_name (str) or process_group
        for i, arg in enumerate(schema.arguments):
            if arg.name in ("group_name", "process_group", "group"):
                got = (i, arg.name)
                break
    else:  # torch.distributed's Python API: a ``group`` parameter
        try:
            params = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            params = []
        for name in ("group", "group_name", "process_group"):
            if name in params:
                got = (params.index(name), name)
                break
    _WHERE[func] = got
    return got


def group_of_call(func: Any, args: tuple, kwargs: dict | None) -> str:
    """The mesh dim name of the group a collective call ``func(*args, **kwargs)`` runs on
    (``-`` when the call names no group argument this can find)."""
    index, key = _where(func)
    if key is None:
        return "-"
    if kwargs and key in kwargs:
        group = kwargs[key]
    elif 0 <= index < len(args):
        group = args[index]
    else:
        group = None  # the default: the world
    try:
        return group_label(group)
    except Exception:  # never let naming break the op
        return "-"
