"""End to end: the quick start under plain python and under torchrun (2 ranks), same numbers.

One torchrun start costs 5-8 s, so this file runs the example twice (with YAML and with
auto-shard) in one torchrun each and compares with the plain `python` run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def _run(cmd: list[str], **env: str) -> str:
    # CPU ranks everywhere (2 gloo ranks; on a GPU machine too, so all runs draw alike)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GT_DEVICE": "cpu", **env}
    full_env.pop("GT_CONFIG", None)
    full_env.update(env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _numbers(out: str) -> list[float]:
    lines = [ln for ln in out.splitlines() if not ln.startswith(("world=", "("))]
    return [float(x) for x in re.findall(r"-?\d+\.\d+", "\n".join(lines))]


def _torchrun(script: Path = EXAMPLE, **env: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    return _run([*cmd, str(script)], **env)


def _same_numbers(single: str, out: str) -> None:
    ref, got = _numbers(single), _numbers(out)
    assert len(ref) >= 8  # sum, loss, |grad w|, 5 training losses
    assert len(got) == len(ref), out
    for g, r in zip(got, ref, strict=True):
        # Sharded sums add in a different order: fp32 agreement to ~1e-6 relative.
        assert abs(g - r) <= 1e-5 * max(1.0, abs(r)), (g, r, out)


def test_quickstart_same_numbers_on_one_and_two_ranks():
    """README's first command: the quick start's YAML under torchrun, against plain python."""
    single = _run([sys.executable, str(EXAMPLE)])
    yaml_run = _torchrun(GT_CONFIG=str(ROOT / "examples" / "quickstart.yaml"))
    assert "world=1" in single and "world=2" in yaml_run
    assert "x: (Shard(dim=0),)  w: (Shard(dim=1),)" in yaml_run  # the YAML took effect
    _same_numbers(single, yaml_run)


@pytest.mark.slow  # auto-shard's numbers are proven in-process (tests/core/test_signals_dist)
def test_quickstart_auto_shard_same_numbers_on_one_and_two_ranks():
    single = _run([sys.executable, str(EXAMPLE)])
    auto_run = _torchrun(GT_AUTO_SHARD="1")
    assert "world=2" in auto_run
    assert "x: (Shard(dim=0),)  w: (Shard(dim=0),)" in auto_run  # 10 % 2 == 16 % 2 == 0
    _same_numbers(single, auto_run)


def test_ranks_agree_on_replicated_values_with_no_seed_call():
    script = Path(__file__).with_name("_no_seed.py")
    out = _torchrun(script)
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
    assert [ln.split(":")[0] for ln in lines] == ["rank 0", "rank 1"]
    assert lines[0].split(":")[1] == lines[1].split(":")[1], lines  # same weights, same draws
    # that another launch (torchrun's fresh run id) draws anew, as torch's own per-process
    # seeding does: test_gt_programs_dist's import-seeding test (a second torchrun, 7 s, here)
