"""Typed signal configuration (gt-reference.md section 2) and the process-wide registry.

YAML::

    <signal>:
      shard: {axis: 0, workers: [0, 1], replicated: false}
      backward: <signal>   # placement the gradients of tensors made in this scope take
      compile: true        # the scope is a compile boundary

A config may also declare one named device mesh (``_mesh``) and place tensors on it::

    mesh: {dp: 2, tp: 2}
    grid:
      shard: {axis: [0, 1], over: [dp, tp]}   # tensor axis 0 over dp, axis 1 over tp

A signal without ``over`` keeps its 1-D meaning: the world, or its ``workers`` sub-mesh.

Every rank loads the same file, so every rank derives the same placements locally: there is
no dispatcher to ask.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from spmdgt._core import env as _env
from spmdgt._core.session import session
from spmdgt.config._errors import ConfigError
from spmdgt.config._mesh import MESH_KEY, MeshConfig, parse_mesh
from spmdgt.config._yaml import from_dict, line_of, load_mapping

__all__ = [
    "ShardConfig",
    "SignalConfig",
    "clear_config",
    "get_config",
    "get_mesh_config",
    "load_config",
    "lookup",
    "register_config",
    "register_mesh",
]


@dataclass(slots=True)
class ShardConfig:
    """Where a signal's tensors live."""

    axis: int | list[int] = 0
    """Tensor dim split across ``workers`` (torch.chunk rule for uneven sizes); with ``over``,
    one dim or a list of dims, one per mesh dim ``over`` names."""
    workers: list[int] | None = None
    """Ranks that hold the tensor; ``None`` means every rank."""
    replicated: bool = False
    """``True``: every listed rank holds a full copy instead of a slice."""
    over: str | list[str] | None = None
    """Mesh dim(s) of the config's ``mesh`` that ``axis`` is split over (replicated over the
    others); ``None``: the 1-D meaning (the world, or ``workers``)."""

    def __post_init__(self) -> None:
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, int):
                raise ConfigError(f"axis must be an int, got {a!r}", key="axis", value=self.axis)
            if a < 0:
                raise ConfigError(f"axis must be >= 0, got {a}", key="axis", value=self.axis)
        self._check_over()
        if self.workers is not None:
            if len(self.workers) == 0:
                raise ConfigError(
                    "workers is empty; omit it to use every rank", key="workers", value=[]
                )
            bad = [w for w in self.workers if isinstance(w, bool) or not isinstance(w, int)]
            bad += [w for w in self.workers if isinstance(w, int) and w < 0]
            if bad:
                raise ConfigError(
                    f"workers must be non-negative ranks, got {bad[0]!r}",
                    key="workers",
                    value=self.workers,
                )
            if len(set(self.workers)) != len(self.workers):
                raise ConfigError(
                    f"workers lists a rank twice: {self.workers}",
                    key="workers",
                    value=self.workers,
                )

    def _check_over(self) -> None:
        if self.over is None:
            if isinstance(self.axis, list):
                raise ConfigError(
                    f"a list of axes {self.axis} needs over: [...] naming one mesh dim per "
                    "axis (e.g. axis: [0, 1], over: [dp, tp])",
                    key="axis",
                    value=self.axis,
                )
            return
        over = self.over if isinstance(self.over, list) else [self.over]
        if not over or any(not isinstance(d, str) or not d for d in over):
            raise ConfigError(
                f"over must name mesh dims (a name or a list of names), got {self.over!r}",
                key="over",
                value=self.over,
            )
        if self.workers is not None:
            raise ConfigError(
                "over and workers cannot be combined: over places the tensor on the config's "
                "mesh (every rank), workers on a 1-D sub-mesh; keep one",
                key="over",
                value=self.over,
            )
        if self.replicated:
            raise ConfigError(
                "over and replicated: true cannot be combined: a replicated tensor is whole on "
                "every rank of the mesh; drop over",
                key="over",
                value=self.over,
            )
        twice = sorted({d for d in over if over.count(d) > 1})
        if twice:
            raise ConfigError(
                f"over names mesh dim {twice[0]!r} twice: a mesh dim splits one tensor axis",
                key="over",
                value=self.over,
            )
        if isinstance(self.axis, list):
            if not isinstance(self.over, list) or len(self.axis) != len(self.over):
                raise ConfigError(
                    f"axis {self.axis} and over {self.over!r} must be lists of the same length "
                    "(tensor axis i is split over mesh dim i)",
                    key="axis",
                    value=self.axis,
                )
            placed = sorted({a for a in self.axis if self.axis.count(a) > 1})
            if placed:
                a = placed[0]
                dims = [d for x, d in zip(self.axis, self.over, strict=True) if x == a]
                raise ConfigError(
                    f"tensor axis {a} is placed twice (over {dims}); to split one axis over "
                    f"several mesh dims write axis: {a}, over: {dims}",
                    key="axis",
                    value=self.axis,
                )

    def layout(self) -> list[tuple[str, int]]:
        """(mesh dim, tensor axis) pairs of a signal with ``over``, in the order written."""
        over = self.over if isinstance(self.over, list) else [self.over]
        if isinstance(self.axis, list):
            return list(zip(self.over, self.axis, strict=True))
        return [(d, self.axis) for d in over]


@dataclass(slots=True)
class SignalConfig:
    """One named signal: its placement, its gradients' placement, whether it compiles."""

    shard: ShardConfig | None = None
    """Placement of tensors made in the scope; ``None`` leaves placement to the default."""
    backward_signal: str | None = None
    """Signal whose placement the gradients of tensors made in this scope take."""
    compile: bool = False
    """The scope is a compile boundary for the compile-and-batch pass."""
    name: str = field(default="", compare=False, init=False)
    """The signal's name, set when it is registered (not a YAML key)."""
    file: str | None = field(default=None, compare=False, init=False)
    """The YAML file it came from, for errors found later (an axis out of range)."""


_registry: dict[str, SignalConfig] = {}
_mesh: MeshConfig | None = None
_env_loaded = False


def env_config_loaded() -> bool:
    """Whether ``GT_CONFIG`` was read (it is read once, at the first lookup)."""
    return _env_loaded


def _ensure_env_config() -> None:
    global _env_loaded
    if not _env_loaded:
        _env_loaded = True
        path = _env.text("GT_CONFIG")
        if path:
            load_config(path)


def parse_config(
    data: dict, file: str | None = None, mesh: MeshConfig | None = None
) -> dict[str, SignalConfig]:
    """Validate a mapping of signal name -> settings into ``SignalConfig`` objects.

    The reserved ``mesh`` entry is the config's device mesh, not a signal: it is validated
    here (``parse_mesh``) and checked against the dims each signal's ``over`` names; without
    one, ``mesh`` (else the registered mesh) is what ``over`` must name."""
    declared = parse_mesh(data, file)
    mesh = declared or mesh or _mesh
    out = {}
    for name, body in data.items():
        if name == MESH_KEY:
            continue
        if not isinstance(name, str):
            raise ConfigError(
                f"signal names must be strings, got {name!r}", file=file, line=line_of(data, name)
            )
        if body is None:
            body = {}
        try:
            cfg = from_dict(
                SignalConfig,
                body,
                file=file,
                section=name,
                aliases={"backward": "backward_signal"},
            )
            cfg.name = name
            cfg.file = file
            check_over(cfg, mesh, file)
        except ConfigError as e:
            raise e.located(line=line_of(body, e.key) or line_of(data, name)) from None
        out[name] = cfg
    for name, cfg in out.items():
        if cfg.backward_signal is not None and cfg.backward_signal not in out:
            # Allowed (annotations can be ignored), but almost always a typo: say so once.
            warnings.warn(
                f"{file or 'config'}: signal {name!r} names backward signal "
                f"{cfg.backward_signal!r}, which the config does not define; gradients keep "
                "their propagated placement",
                stacklevel=3,
            )
    return out


def check_over(cfg: SignalConfig, mesh: MeshConfig | None, file: str | None = None) -> None:
    """The mesh dims ``cfg``'s ``over`` names exist in ``mesh``, and one tensor axis split
    over several dims lists them in the mesh's order (DTensor splits in mesh-dim order, so
    ``over: [tp, dp]`` would lay the shards out as ``[dp, tp]`` does: said, not guessed)."""
    shard = cfg.shard
    if shard is None or shard.over is None:
        return
    where = {"file": file or cfg.file, "section": cfg.name or None, "key": "shard.over"}
    if mesh is None:
        raise ConfigError(
            f"over {shard.over!r} names mesh dims, but no mesh is declared: add a top-level "
            "mesh: {dp: 2, tp: 2} (dim name -> size) to the config",
            value=shard.over,
            **where,
        )
    for d, _ in shard.layout():
        if d not in mesh.dims:
            raise ConfigError(
                f"over names mesh dim {d!r}, which the mesh {{{mesh.describe()}}} does not "
                f"have; known dims: {', '.join(mesh.names)}",
                value=shard.over,
                **where,
            )
    if not isinstance(shard.axis, list) and isinstance(shard.over, list):
        order = [mesh.index(d) for d in shard.over]
        if order != sorted(order):
            want = sorted(shard.over, key=mesh.index)
            raise ConfigError(
                f"one axis split over several mesh dims is split in the mesh's order: write "
                f"over: {want} (the mesh is {{{mesh.describe()}}})",
                value=shard.over,
                **where,
            )


def _check_world(mesh: MeshConfig) -> None:
    # the sizes against the world, where the world is already known (a running process
    # group); else at the first placement on the mesh (``spmdgt.tensor._placement``)
    from spmdgt.runtime import _state

    rt = _state._runtime
    if rt is not None and rt.world_size > 1:
        mesh.sizes(rt.world_size)


def load_config(path: str | os.PathLike) -> dict[str, SignalConfig]:
    """Load a signal YAML file and register every signal in it (replacing same-named ones);
    a ``mesh:`` entry becomes the config's mesh (``get_mesh_config``)."""
    global _env_loaded, _mesh
    _env_loaded = True
    data, name = load_mapping(path, what="signal config")
    mesh = parse_mesh(data, file=name)
    parsed = parse_config(data, file=name)
    if mesh is not None:
        _check_world(mesh)
        _mesh = mesh
    _registry.update(parsed)
    return dict(parsed)


def register_config(name: str, config: SignalConfig) -> None:
    """Register (or replace) one signal from Python (its ``over`` must name the mesh's dims:
    ``register_mesh`` first)."""
    if not isinstance(config, SignalConfig):
        raise ConfigError(
            f"register_config expects a SignalConfig, got {type(config).__name__}", section=name
        )
    if name == MESH_KEY:
        raise ConfigError(
            f"{MESH_KEY!r} is reserved for the config's device mesh; use register_mesh",
            section=name,
        )
    _ensure_env_config()
    config.name = name
    check_over(config, _mesh)
    _registry[name] = config


def register_mesh(mesh: MeshConfig | dict[str, int] | None) -> MeshConfig | None:
    """Set (or, with None, forget) the config's device mesh from Python: a ``MeshConfig`` or
    a ``{dim name: size}`` mapping, as the YAML's ``mesh:`` entry."""
    global _mesh
    _ensure_env_config()
    if mesh is not None and not isinstance(mesh, MeshConfig):
        mesh = MeshConfig(dict(mesh) if isinstance(mesh, dict) else mesh)
    if mesh is not None:
        _check_world(mesh)
    _mesh = mesh
    return mesh


def get_mesh_config() -> MeshConfig | None:
    """The config's device mesh (the YAML's ``mesh:`` entry), or None when none is declared."""
    _ensure_env_config()
    return _mesh


def get_config(name: str | None = None) -> SignalConfig | dict[str, SignalConfig] | None:
    """All registered signals (a copy), or one by name (``None`` when unknown)."""
    _ensure_env_config()
    if name is not None:
        return _registry.get(name)
    return dict(_registry)


def lookup(name: str) -> SignalConfig | None:
    """The signal's config, or None: a signal missing from the config is ignored."""
    if not _env_loaded:
        _ensure_env_config()
    return _registry.get(name)


def clear_config() -> None:
    """Forget every registered signal and the mesh (tests; ``GT_CONFIG`` is read again)."""
    global _env_loaded, _mesh
    _registry.clear()
    _mesh = None
    _env_loaded = False


session.register("signals", clear_config)
