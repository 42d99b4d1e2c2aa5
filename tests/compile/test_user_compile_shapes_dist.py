"""Your own ``torch.compile`` of a function over ``gt.Tensor``s whose row count changes from call
to call, on 2 and 3 ranks, the compile pass off: every call equals one process.

torch 2.13's dynamo guards a DTensor input by its local shape and its spec without the global
shape: a graph compiled for 5 rows (3+2 over 2 ranks) passed rank 0's guards for 6 rows (3+3)
and returned a result of global shape 5 there, while rank 1 recompiled; the host read after it
raised a ``RankDivergenceError`` in a correct program. spmdgt's meshes hold the exact guard on
(``tensor/_dynamo_guards``), installed when dynamo is imported, after the first mesh.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS = [5, 6, 7, 5]  # 5 -> 6 leaves rank 0's shard at 3 rows on 2 ranks, 2 rows on 3


def head(x):
    return x.amax(1) * 2


def _inputs():
    return [torch.arange(n * 3.0).reshape(n, 3).sin() for n in ROWS]


def _ranked(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    with gt.signal.context("rows"):
        xs = [gt.tensor(x) for x in _inputs()]
    compiled = torch.compile(head, backend="aot_eager")
    return [compiled(x).numpy() for x in xs]


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_own_compile_on_changing_rows_equals_one_process(tmp_path, world):
    ref = [head(x).numpy() for x in _inputs()]
    for rank, got in enumerate(run_ranks(_ranked, world, tmp_path, timeout=120)):
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            np.testing.assert_allclose(g, r, rtol=1e-6, err_msg=f"call {i}, rank {rank}")


def test_guard_waits_for_dynamos_import():
    """Held before dynamo is loaded, the guard goes in when dynamo's guards module runs (a
    fresh process: importing dynamo costs seconds, which spmdgt does not pay for you)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from spmdgt.tensor import _dynamo_guards as g\n"
        "assert 'torch._dynamo.guards' not in sys.modules\n"
        "g.hold('test')\n"
        "import torch._dynamo.guards as guards\n"
        "assert guards.check_dtensor_spec is g._check_dtensor_spec\n"
        "assert not any(isinstance(f, g._AfterImport) for f in sys.meta_path)\n"
        "g.let_go('test')\n"
        "assert guards.check_dtensor_spec is not g._check_dtensor_spec\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
