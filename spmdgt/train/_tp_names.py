"""Module names in a placements table: which pattern a module matches, and a layer's name as
the every-layer glob a table keeps (read by ``_tp_plan``, ``_tp_sequence`` and the planner)."""

from __future__ import annotations

import fnmatch
import re

__all__ = ["style_of", "wild"]


def style_of(name: str, table: dict[str, str]) -> str | None:
    """The style of the first pattern in ``table`` that matches the module ``name``."""
    return next((s for p, s in table.items() if fnmatch.fnmatchcase(name, p)), None)


def wild(name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj`` (every layer)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
