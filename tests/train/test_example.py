"""The transformer example runs tiny: in-process (trainer and --pytorch) and once under torchrun."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--layers", "1", "--steps", "3", "--seq-len", "16", "--batch-size", "4"]


def _example():
    spec = importlib.util.spec_from_file_location(
        "train_transformer", ROOT / "examples" / "train_transformer.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_example_trainer_and_pytorch_agree_in_process():
    ex = _example()
    ours = ex.main([*TINY, "--strategy", "ddp"])
    plain = ex.main([*TINY, "--pytorch"])
    assert ours["num_steps"] == plain["num_steps"] == 3
    # Same model, data order, optimizer and clipping in a world of one: same losses (1e-5:
    # the trainer's clip sums the norm in another order).
    assert ours["final_loss"] == pytest.approx(plain["final_loss"], abs=1e-5)


def test_example_placements_without_config_takes_the_example_plan(capsys):
    ex = _example()
    out = ex.main([*TINY, "--strategy", "placements"])  # failed with a traceback before
    assert out["num_steps"] == 3 and out["strategy"] == "placements"
    yaml = ROOT / "examples" / "train_transformer.yaml"
    assert f"using the placements table of {yaml}" in capsys.readouterr().out


def test_example_placements_with_a_config_lacking_a_plan_names_flag_and_file(tmp_path, capsys):
    ex = _example()
    cfg = tmp_path / "no_plan.yaml"
    cfg.write_text("strategy: fsdp\n")
    with pytest.raises(SystemExit) as e:
        ex.main([*TINY, "--strategy", "placements", "--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--strategy placements needs a placements table" in err and str(cfg) in err
    assert "Traceback" not in err and "train_transformer.yaml has one" in err


def test_example_help_shows_defaults(capsys):
    ex = _example()
    with pytest.raises(SystemExit):
        ex.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for line in [
        "--dim DIM model width (default: 128)",
        "--steps STEPS optimizer steps (default: 30)",
        "--lr LR AdamW learning rate (default: 0.003)",
    ]:
        assert line in out
    assert "None: the config's training.batch_size, else 8 (default: None)" in out


@pytest.mark.slow
def test_example_under_torchrun_fsdp():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GT_DEVICE="cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "train_transformer.py"),
        *TINY,
        "--config",
        str(ROOT / "examples" / "train_transformer.yaml"),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Training Summary") == 1  # rank 0 only
    assert "strategy: fsdp" in r.stdout and "world_size: 2" in r.stdout


def test_placements_with_heads_that_do_not_split_is_a_clear_error(monkeypatch, capsys):
    # 4 query / 2 key-value heads cannot split over 3 ranks: before, torch's reshape failed
    # deep in the attention ("shape '[32, 16, -1, 12]' is invalid") on every rank
    ex = _example()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e:
        ex.main([*TINY, "--strategy", "placements"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--heads (4) and --kv-heads (2) must both divide by 3" in err, err
