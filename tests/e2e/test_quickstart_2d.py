"""End to end: the quick start on a 2 x 2 (dp, tp) mesh under torchrun (4 ranks) prints the
numbers plain ``python`` prints (``examples/quickstart_2d.yaml``). One torchrun start of 4
ranks (~25 s on 2 cores): ``slow``. The default suite stands for it with the same layouts
in-process (tests/core/test_mesh2d_signals_dist.py, each 2-D layout against one process) and
the 1-D quick start under torchrun (tests/e2e/test_torchrun.py)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.test_torchrun import EXAMPLE, ROOT, _numbers, _run


@pytest.mark.slow
def test_quickstart_on_a_2x2_mesh_prints_the_numbers_of_one_process():
    single = _run([sys.executable, str(EXAMPLE)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone"]
    out = _run([*cmd, str(EXAMPLE)], GT_CONFIG=str(ROOT / "examples" / "quickstart_2d.yaml"))
    assert "world=1" in single and "world=4" in out
    # the YAML took effect: rows over dp, columns over tp, the product on both
    assert (
        "x: (Shard(dim=0), Replicate())  w: (Replicate(), Shard(dim=1))  "
        "y: (Shard(dim=0), Shard(dim=1))" in out
    ), out
    ref, got = _numbers(single), _numbers(out)
    assert len(ref) >= 8 and len(got) == len(ref), out  # sum, loss, |grad w|, 5 losses
    for g, r in zip(got, ref, strict=True):
        # sharded sums add in another order: fp32 agreement to ~1e-6 relative
        assert abs(g - r) <= 1e-5 * max(1.0, abs(r)), (g, r, out)
