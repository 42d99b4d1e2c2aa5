"""Where the benchmark scripts live, and a way to import their helper modules in a test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (the folder is not a package)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
