"""The examples (``examples/train_transformer.py``, ``train_hf.py``), loaded as modules by the
trainer benchmarks (they are scripts, not part of the package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(stem: str):
    """``examples/<stem>.py`` as the module ``stem``, loaded afresh."""
    spec = importlib.util.spec_from_file_location(stem, ROOT / "examples" / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


def load_example():
    """``examples/train_transformer.py`` as the module ``train_transformer``."""
    return load_script("train_transformer")
