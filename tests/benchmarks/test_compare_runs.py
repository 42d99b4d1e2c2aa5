"""``python -m spmdgt.scripts.compare_runs A B``: equal runs pass (exit 0), a loss planted past
``--atol`` fails (exit 1) naming the step and both values, from summary JSONs and from
TensorBoard logdirs written with the trainer's tag names; unreadable input exits 2."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spmdgt.scripts import compare_runs
from tests.benchmarks._paths import ROOT

LOSSES = [2.5 - 0.125 * i for i in range(12)]  # exact in fp32: TensorBoard stores fp32
PLANTED_STEP = 7  # 1-based, as the trainer counts steps
PLANTED = [*LOSSES]
PLANTED[PLANTED_STEP - 1] += 2**-7  # 0.0078125, exact in fp32 too


def _summary(path: Path, losses: list[float]) -> Path:
    """What ``json.dump(trainer.train(...))`` writes (the keys that matter here)."""
    path.write_text(
        json.dumps({"num_steps": len(losses), "final_loss": losses[-1], "losses": losses})
    )
    return path


def _logdir(path: Path, losses: list[float]) -> Path:
    """A logdir as ``DistributedTrainer(logdir=...)``'s ``MetricsLogger`` writes it."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(path))
    for i, loss in enumerate(losses):
        step = i + 1
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", 1e-3, step)
        w.add_scalar("perf/step_time_sec", 0.1, step)
    w.close()
    return path


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run(*args: str) -> _Result:
    """``compare_runs.main`` in this process (a fresh ``python -m`` costs ~2 s of imports;
    ``test_the_command_line`` runs it once that way)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = compare_runs.main(list(args))
    return _Result(code, out.getvalue(), err.getvalue())


def test_the_command_line(tmp_path):
    a = _summary(tmp_path / "a.json", LOSSES)
    c = _summary(tmp_path / "c.json", PLANTED)
    cmd = [sys.executable, "-m", "spmdgt.scripts.compare_runs", str(a), str(c), "--atol", "1e-3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and f"first at step {PLANTED_STEP}" in r.stdout, r.stderr


@pytest.mark.parametrize("kind", ["json", "tensorboard"])
def test_equal_runs_pass_and_a_planted_difference_fails(tmp_path, kind):
    make = _summary if kind == "json" else _logdir
    suffix = ".json" if kind == "json" else ""
    a = make(tmp_path / f"a{suffix}", LOSSES)
    b = make(tmp_path / f"b{suffix}", LOSSES)
    c = make(tmp_path / f"c{suffix}", PLANTED)
    same = _run(str(a), str(b), "--atol", "1e-3", "--rtol", "0")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "largest difference: 0.000e+00" in same.stdout and "OK" in same.stdout
    diff = _run(str(a), str(c), "--atol", "1e-3", "--rtol", "0")
    assert diff.returncode == 1, diff.stdout + diff.stderr
    out = diff.stdout
    a_val, c_val = LOSSES[PLANTED_STEP - 1], PLANTED[PLANTED_STEP - 1]
    assert f"largest difference: 7.812e-03 at step {PLANTED_STEP}" in out
    assert f"first at step {PLANTED_STEP}: A {a_val:.9g}, B {c_val:.9g}" in out
    assert "FAILED: 1 of 12 steps past the tolerance" in out
    # the same difference inside a looser tolerance passes
    assert _run(str(a), str(c), "--atol", "0.02").returncode == 0


def test_a_logdir_against_a_summary_json(tmp_path):
    tb = _logdir(tmp_path / "run", LOSSES)
    js = _summary(tmp_path / "run.json", PLANTED)
    r = _run(str(tb), str(js), "--atol", "1e-3")
    assert r.returncode == 1 and f"at step {PLANTED_STEP}" in r.stdout
    s = compare_runs.read_series(tb)
    assert s.values == dict(enumerate(LOSSES, start=1)) and "train/loss" in s.source


def test_steps_only_one_run_logged_fail_unless_common_only(tmp_path):
    a = _summary(tmp_path / "a.json", LOSSES)
    b = _summary(tmp_path / "b.json", LOSSES[:8])
    r = _run(str(a), str(b))
    assert r.returncode == 1 and "steps only in A: 4 (9..12)" in r.stdout
    assert _run(str(a), str(b), "--common-only").returncode == 0


def test_what_it_cannot_read_exits_2_with_the_reason(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"final_loss": 1.0, "avg_loss": 1.2}))
    r = _run(str(old), str(old))
    assert r.returncode == 2 and "no 'losses'" in r.stderr and "TensorBoard" in r.stderr
    tb = _logdir(tmp_path / "tb", LOSSES)
    r = _run(str(tb), str(tb), "--tag", "val/loss")
    assert r.returncode == 2 and "no scalar tag 'val/loss'" in r.stderr
    assert "train/loss" in r.stderr  # the tags it has
    r = _run(str(tmp_path / "missing"), str(old))
    assert r.returncode == 2 and "no such file" in r.stderr


def test_without_tensorboard_the_error_says_what_to_install(tmp_path, monkeypatch):
    tb = _logdir(tmp_path / "tb", LOSSES)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(compare_runs.ReadError, match="needs the tensorboard package"):
        compare_runs.read_series(tb)


def test_nan_matches_only_nan():
    nan = float("nan")
    a = compare_runs.Series("a", "list", {1: 1.0, 2: nan, 3: nan})
    b = compare_runs.Series("b", "list", {1: 1.0, 2: nan, 3: 3.0})
    c = compare_runs.compare(a, b, atol=1.0, rtol=1.0)
    assert [f[0] for f in c.failures] == [3]
