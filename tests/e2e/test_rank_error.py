"""An op that fails on one rank only, under torchrun: every rank ends within seconds with
spmdgt's RankFailedError naming rank 0, the op and torch's message (GT_TIMEOUT at its default
of 30 min: without spmdgt's mechanism rank 1 would name only a lost connection, or wait)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parent / "_rank_error.py"


@pytest.mark.slow
def test_torchrun_every_rank_names_the_failed_rank_and_op():
    with pytest.raises(IndexError) as info:  # torch's message for the op, in one process
        F.embedding(torch.tensor([9]), torch.ones(5, 3))
    expected = f"IndexError: {info.value}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "GT_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "GT_RANK_ERROR_WAIT": "3"}
    env.pop("GT_TIMEOUT", None)
    proc = subprocess.run(
        [*cmd, "--monitor-interval=1", str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0 and "VALUE" not in proc.stdout, proc.stdout
    for rank in (0, 1):
        line = (
            f"[rank {rank}] spmdgt: RankFailedError: rank 0 failed in torch.nn.functional.embedding"
        )
        assert line in proc.stderr, proc.stderr
    assert proc.stderr.count(expected) >= 2, proc.stderr
    # two ranks' prints share one pipe and may interleave: read each "ELAPSED rank s" anywhere
    elapsed = [float(s) for _, s in re.findall(r"ELAPSED (\d+) (\d+\.\d)", proc.stdout)]
    assert len(elapsed) == 2 and max(elapsed) < 30, proc.stdout
