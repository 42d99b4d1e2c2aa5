"""Where a new tensor lives: from the active signal's YAML, else auto-shard, else replicated.

A signal with ``over`` places on the config's named n-D mesh (``mesh: {dp: 2, tp: 2}``): each
tensor axis it names is split over its mesh dims, the other dims replicate. Without ``over`` a
signal is 1-D: the world or its ``workers`` sub-mesh.

``None`` means "replicated on every rank", which spmdgt represents as a plain torch tensor:
the cheapest form there is, and exactly what a world of one uses. ``torch.distributed.tensor``
(~2 s to import) is loaded only when a placement is actually made: a world of one never pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmdgt._core import env as _env
from spmdgt._core import scope as _scope
from spmdgt.config._errors import ConfigError
from spmdgt.config._signals import SignalConfig, check_over, get_mesh_config, lookup
from spmdgt.runtime._state import get_runtime, world_mesh
from spmdgt.tensor._meshes import mesh_for, named_mesh

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = [
    "Target",
    "auto_shard_enabled",
    "creation_target",
    "describe",
    "intent",
    "signal_mesh_of",
    "signal_target",
]


@dataclass(frozen=True, slots=True)
class Target:
    mesh: object
    placements: tuple[Placement, ...]
    signal: str | None = None


def auto_shard_enabled() -> bool | str:
    """``GT_AUTO_SHARD``: False, True (axis 0) or ``"plan"`` (``tensor/_autoplan``); read at
    each creation (so a forked test rank's env is seen)."""
    return _env.flag("GT_AUTO_SHARD")


def _config_mesh(cfg: SignalConfig):
    """The config's n-D mesh for a signal with ``over``: its dims checked against the mesh
    registered now, its sizes against the world (the same file and world on every rank: the
    same ``ConfigError`` on every rank, before any collective)."""
    mc = get_mesh_config()
    check_over(cfg, mc)
    return mc, named_mesh(mc.sizes(get_runtime().world_size))


def signal_mesh_of(cfg: SignalConfig):
    """The mesh signal ``cfg`` places on: the config's mesh (``over``), else its 1-D one."""
    if cfg.shard.over is not None:
        return _config_mesh(cfg)[1]
    return mesh_for(cfg.shard.workers, cfg.name)


def _axis_error(cfg: SignalConfig, axis: int, shape: Sequence[int]) -> ConfigError:
    return ConfigError(
        f"axis {axis} is out of range for a tensor of shape {tuple(shape)} "
        f"({len(shape)} dims); use an axis below {len(shape)} or replicated: true",
        file=cfg.file,
        section=cfg.name,
        key="shard.axis",
        value=cfg.shard.axis,
    )


def _mesh_target(cfg: SignalConfig, shape: Sequence[int]) -> Target | None:
    from torch.distributed.tensor import Replicate, Shard

    mc, mesh = _config_mesh(cfg)
    if len(shape) == 0:
        return None  # a 0-d tensor has no axis to split: replicated everywhere, plain
    placements: list = [Replicate()] * mesh.ndim
    for dim, axis in cfg.shard.layout():
        if axis >= len(shape):
            raise _axis_error(cfg, axis, shape)
        placements[mc.index(dim)] = Shard(axis)
    return Target(mesh, tuple(placements), cfg.name)


def signal_target(cfg: SignalConfig, shape: Sequence[int]) -> Target | None:
    """The placement signal ``cfg`` gives a tensor of ``shape``; None for world-replicated."""
    shard = cfg.shard
    if shard is None:
        return None
    if shard.over is not None:
        return _mesh_target(cfg, shape)
    from torch.distributed.tensor import Replicate, Shard

    mesh = mesh_for(shard.workers, cfg.name)
    if shard.replicated or len(shape) == 0:
        if mesh is world_mesh():
            return None
        return Target(mesh, (Replicate(),), cfg.name)
    if shard.axis >= len(shape):
        raise _axis_error(cfg, shard.axis, shape)
    if mesh.size() == 1 and mesh is world_mesh():
        return None
    return Target(mesh, (Shard(shard.axis),), cfg.name)


def _signals_loaded() -> bool:
    from spmdgt.config import _signals

    return _signals.env_config_loaded()


def intent(shape: Sequence[int]) -> str:
    """Where a tensor created now is meant to live, in words that are the same on every rank
    running the same program (no mesh is built: ranks compare this *before* they make one)."""
    name = _scope.current()
    if name is not None:
        cfg = lookup(name)
        if cfg is not None and cfg.shard is not None:
            return f"signal {name!r} ({describe(cfg, shape)})"
    auto = auto_shard_enabled()
    if auto == "plan" and len(shape) > 0:
        return "auto-shard plan (placement chosen from the ops that use it)"
    if auto and len(shape) > 0 and shape[0] % get_runtime().world_size == 0:
        return "auto-shard (shard axis 0 over every rank)"
    if name is None:
        return "replicated on every rank (no signal)"
    return f"signal {name!r} (replicated)"


def will_shard(shape: Sequence[int]) -> bool:
    """Whether a tensor created now gets a sharded placement (a ``gt.Tensor``), as ``intent``
    words it: a signal that shards, or auto-shard's axis 0 (not its ``plan``, which records).
    Read from the scope and config only, so alike on every rank running the same program."""
    if not shape:
        return False
    name = _scope.current()
    if name is not None:
        cfg = lookup(name)
        if cfg is not None and cfg.shard is not None:
            return not cfg.shard.replicated
    auto = auto_shard_enabled()
    return auto is True and shape[0] % get_runtime().world_size == 0


def describe(cfg: SignalConfig, shape: Sequence[int] = (0,)) -> str:
    """Signal ``cfg``'s placement in words, the mesh included (``shard axis 0 over dp of
    mesh (dp=2, tp=2)``): what ranks compare at an agreement point, before any mesh exists."""
    shard = cfg.shard
    if shard.over is not None:
        mc = get_mesh_config()
        mesh = f"mesh ({mc.describe()})" if mc is not None else "no mesh"
        if not shape:
            return f"replicated on {mesh}"
        parts = ", ".join(f"axis {a} over {d}" for d, a in shard.layout())
        return f"shard {parts} of {mesh}"
    how = "replicated" if shard.replicated or not shape else f"shard axis {shard.axis}"
    over = "every rank" if shard.workers is None else f"workers {list(shard.workers)}"
    return f"{how} over {over}"


def creation_target(shape: Sequence[int], dtype=None) -> Target | None:
    """Placement for a tensor being created now, on this rank, in the current scope."""
    world = get_runtime().world_size
    if world == 1:
        if not _signals_loaded():  # the first creation only: GT_CONFIG and GT_AUTO_SHARD are
            lookup("")  # read and validated in a world of one too (a typo fails here, not
            auto_shard_enabled()  # later under torchrun)
        return None
    name = _scope.current()
    if name is not None:
        cfg = lookup(name)
        if cfg is not None and cfg.shard is not None:
            return signal_target(cfg, shape)
    auto = auto_shard_enabled()
    if auto == "plan" and len(shape) > 0:
        from spmdgt.runtime._agree import call_site
        from spmdgt.tensor import _autoplan

        planned = _autoplan.placement_for(call_site(), shape, dtype, world)
        if planned == _autoplan.R:
            return None
        if planned is not None:
            from torch.distributed.tensor import Shard

            return Target(world_mesh(), (Shard(planned),), None)
    if auto and len(shape) > 0 and shape[0] % world == 0:
        from torch.distributed.tensor import Shard

        return Target(world_mesh(), (Shard(0),), None)
    return None
