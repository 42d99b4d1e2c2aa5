"""The example transformer (``examples/train_transformer.py``), loaded as a module by the
trainer benchmarks (it is a script, not part of the package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example():
    """``examples/train_transformer.py`` as the module ``train_transformer``."""
    spec = importlib.util.spec_from_file_location(
        "train_transformer", ROOT / "examples" / "train_transformer.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod
