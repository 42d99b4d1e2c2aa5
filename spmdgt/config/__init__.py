"""Configuration: typed dataclasses under a thin YAML layer; unknown keys are errors."""

from spmdgt.config._errors import ConfigError
from spmdgt.config._mesh import MeshConfig
from spmdgt.config._signals import (
    ShardConfig,
    SignalConfig,
    clear_config,
    get_config,
    get_mesh_config,
    load_config,
    parse_config,
    register_config,
    register_mesh,
)
from spmdgt.config._yaml import from_dict, load_mapping

__all__ = [
    "ConfigError",
    "MeshConfig",
    "ShardConfig",
    "SignalConfig",
    "clear_config",
    "from_dict",
    "get_config",
    "get_mesh_config",
    "load_config",
    "load_mapping",
    "parse_config",
    "register_config",
    "register_mesh",
]
