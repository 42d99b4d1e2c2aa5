"""A chosen subset of the suite, run again with each half of the compile pass on.

Every test that passes eager must pass with the pass on: the exactness and signal tests on 2,
3 and 4 ranks (sub-meshes, empty shards, fallbacks, where ranks run different numbers of ops),
and whole training steps on 2 ranks. All of it is in the ``slow`` part (``-m ""``); the default
suite proves each half on its own tests (``tests/compile/``).
A fresh pytest process each, so the pass is on from ``import spmdgt`` as a user's run has it;
``GT_DEBUG_COMPILE=1`` shows that functions or regions did get compiled there.

- hot functions: ``GT_AUTO_COMPILE=1`` (inductor);
- lazy regions: ``GT_WORKER_BATCH_SIZE=16`` with ``GT_LAZY_MIN_NUMEL=1``, so the tests' small
tensors
  are recorded too, plain and sharded (hundreds of regions: ``aot_eager`` keeps the compiles
  short);
- both halves at once (lazy regions as above, hot functions with ``aot_eager``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBSET = [
    "tests/core/test_exactness_dist.py",
    "tests/core/test_signals_dist.py",
    # whole training steps (losses' backward, clipping, accumulation, optimizers): 2 ranks
    "tests/core/test_steps_dist.py::test_whole_steps_equal_one_process[2]",
]
# Each mode runs the exactness cases at 3 ranks (uneven shards 2+2+1, an empty shard, a true
# sub-mesh) by default; their 2-rank twins, the signal file and the whole training steps run
# in the ``slow`` part (the default suite trains with both halves on in
# tests/compile/test_both_halves_dist.py).
PARTS = {
    # slow since 2026-11-28 (55 s, the suite's longest test, with the suite at 15 min): the
    # default suite proves lazy regions on sharded values at 3 ranks in
    # tests/compile/test_lazy_regions_sharded.py and in a training loop with both halves
    "3 ranks": (["--world-only", "3", SUBSET[0]], [pytest.mark.slow]),
    "2 ranks": (["--world-only", "2", SUBSET[0]], [pytest.mark.slow]),
    "signals": ([SUBSET[1]], [pytest.mark.slow]),
    "steps": ([SUBSET[2]], [pytest.mark.slow]),
}
# Hot functions compile with inductor (seconds a function on this box): all of their runs are
# in the slow part. The default suite proves them on functions, models, 2 and 3 ranks and a
# 2-D mesh (tests/compile/test_hot_functions*.py) and together with lazy regions on a
# training loop (tests/compile/test_both_halves_dist.py).
HOT_PARTS = {
    "3 ranks": (["--world-only", "3", *SUBSET[1:]], [pytest.mark.slow]),
    "3 ranks, exactness": (["--world-only", "3", SUBSET[0]], [pytest.mark.slow]),
    "2 ranks": PARTS["2 ranks"],
}


_LAZY_REGIONS = {
    "GT_WORKER_BATCH_SIZE": "16",
    "GT_LAZY_MIN_NUMEL": "1",
    "GT_COMPILE_BACKEND": "aot_eager",
}
MODES = {  # the environment, and what GT_DEBUG_COMPILE prints when that half did compile
    "hot_functions": ({"GT_AUTO_COMPILE": "1"}, ["] compiled "]),
    "lazy_regions": (_LAZY_REGIONS, ["region batch: compiled", "(sharded)"]),
    "both_halves": ({**_LAZY_REGIONS, "GT_AUTO_COMPILE": "1"}, ["] compiled ", "(sharded)"]),
}

# both halves at once run in the slow part only; the default suite proves them on a training
# loop (tests/compile/test_both_halves_dist.py)
SLOW_MODES = {"both_halves": [pytest.mark.slow]}


def _parts(mode: str) -> dict:
    return HOT_PARTS if mode == "hot_functions" else PARTS


@pytest.mark.parametrize(
    "mode,part",
    [
        pytest.param(
            m,
            p,
            marks=_parts(m)[p][1] + SLOW_MODES.get(m, []),
            id=f"{m}-{p.split()[0]}" + ("x" if p.endswith("exactness") else ""),
        )
        for m in MODES
        for p in _parts(m)
    ],
)
def test_subset_passes_with_the_pass_on(mode, part):
    extra, proofs = MODES[mode]
    env = {**os.environ, **extra, "GT_DEBUG_COMPILE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", ""]
    cmd += ["-p", "tests.e2e._world_only", *_parts(mode)[part][0]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:  # name the failing tests and their errors, not only the tail
        keep = [
            ln
            for ln in out.splitlines()
            if ln.startswith(("FAILED", "ERROR")) or "Error:" in ln or "timed out" in ln
        ]
        raise AssertionError("\n".join(keep[-60:]) + "\n...\n" + out[-3000:])
    for proof in proofs:
        assert proof in out, (proof, out[-3000:])  # the pass did compile in the forked ranks
