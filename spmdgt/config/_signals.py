"""Typed signal configuration (gt-reference.md section 2) and the process-wide registry.

YAML::

    <signal>:
      shard: {axis: 0, workers: [0, 1], replicated: false}
      backward: <signal>   # placement the gradients of tensors made in this scope take
      compile: true        # the scope is a compile boundary

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
from spmdgt.config._yaml import from_dict, load_mapping

__all__ = [
    "ShardConfig",
    "SignalConfig",
    "clear_config",
    "get_config",
    "load_config",
    "lookup",
    "register_config",
]


@dataclass(slots=True)
class ShardConfig:
    """Where a signal's tensors live."""

    axis: int = 0
    """Tensor dim split across ``workers`` (torch.chunk rule for uneven sizes)."""
    workers: list[int] | None = None
    """Ranks that hold the tensor; ``None`` means every rank."""
    replicated: bool = False
    """``True``: every listed rank holds a full copy instead of a slice."""

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ConfigError(f"axis must be an int, got {self.axis!r}", key="axis")
        if self.axis < 0:
            raise ConfigError(f"axis must be >= 0, got {self.axis}", key="axis", value=self.axis)
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


def parse_config(data: dict, file: str | None = None) -> dict[str, SignalConfig]:
    """Validate a mapping of signal name -> settings into ``SignalConfig`` objects."""
    out = {}
    for name, body in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"signal names must be strings, got {name!r}", file=file)
        if body is None:
            body = {}
        cfg = from_dict(
            SignalConfig, body, file=file, section=name, aliases={"backward": "backward_signal"}
        )
        cfg.name = name
        cfg.file = file
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


def load_config(path: str | os.PathLike) -> dict[str, SignalConfig]:
    """Load a signal YAML file and register every signal in it (replacing same-named ones)."""
    global _env_loaded
    _env_loaded = True
    data, name = load_mapping(path, what="signal config")
    parsed = parse_config(data, file=name)
    _registry.update(parsed)
    return dict(parsed)


def register_config(name: str, config: SignalConfig) -> None:
    """Register (or replace) one signal from Python."""
    if not isinstance(config, SignalConfig):
        raise ConfigError(
            f"register_config expects a SignalConfig, got {type(config).__name__}", section=name
        )
    _ensure_env_config()
    config.name = name
    _registry[name] = config


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
    """Forget every registered signal (tests; a fresh ``GT_CONFIG`` is read again)."""
    global _env_loaded
    _registry.clear()
    _env_loaded = False


session.register("signals", clear_config)
