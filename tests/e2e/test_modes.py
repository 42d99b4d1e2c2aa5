"""A chosen subset of the suite, run again with the compile pass on (``GT_AUTO_COMPILE=1``).

Every test that passes eager must pass with the pass on: the exactness and signal tests on 2,
3 and 4 ranks (sub-meshes, empty shards, fallbacks, where ranks run different numbers of ops).
A fresh pytest process, so the pass is on from ``import spmdgt`` as a user's run has it;
``GT_DEBUG_COMPILE=1`` shows that functions did get compiled there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ["tests/core/test_exactness_dist.py", "tests/core/test_signals_dist.py"]


def test_subset_passes_with_auto_compile():
    env = {**os.environ, "GT_AUTO_COMPILE": "1", "GT_DEBUG_COMPILE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *SUBSET]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " compiled " in out, out[-3000:]  # the pass did compile functions in the subset
