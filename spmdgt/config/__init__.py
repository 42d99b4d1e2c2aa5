"""Configuration: typed dataclasses under a thin YAML layer; unknown keys are errors."""

from spmdgt.config._errors import ConfigError
from spmdgt.config._signals import (
    ShardConfig,
    SignalConfig,
    clear_config,
    get_config,
    load_config,
    parse_config,
    register_config,
)
from spmdgt.config._yaml import from_dict, load_mapping

__all__ = [
    "ConfigError",
    "ShardConfig",
    "SignalConfig",
    "clear_config",
    "from_dict",
    "get_config",
    "load_config",
    "load_mapping",
    "parse_config",
    "register_config",
]
