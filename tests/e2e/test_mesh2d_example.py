"""The transformer example on a 2-D mesh as users start it: TP inside a node, FSDP across.

``torchrun --nproc_per_node=4 examples/train_transformer.py --strategy fsdp --tp 2`` on 4 CPU
ranks (2 data-parallel groups of 2 tensor-parallel ranks, 4 rows each) and the same on
2 "nodes" x 2 processes on loopback through ``launch/run.sh`` (``NNODES=2`` and a c10d
rendezvous on 127.0.0.1, the YAML's ``parallelism`` with ``--tp 2`` over it) must print, step
by step, the losses of one process reading the same global batch of 8 rows (the example
sizes its data by the global batch), within 1e-5: fp32 sums in another order (TP's partial
sums, FSDP's reduce-scatter, per-rank loss means) differ by a few ulps of the loss (~5, an ulp
~5e-7), and AdamW carries that into the next steps (measured here: <= 4.8e-7 over 4 steps).
Each run's log must say which ranks form each tp group and on which node: [0, 1] and
[2, 3], each group inside one node. The 2-node run also checkpoints at step 2, and one
process resumes that checkpoint (``--checkpoint-dir``) with the uninterrupted one-process
losses of steps 3 and 4 (1e-5; measured: equal).

The one-process reference runs in this process (the example's ``main``, the code ``python
examples/train_transformer.py`` runs), saving a start of ~8 s of imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spmdgt.scripts import compare_runs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_transformer.py"
YAML = str(ROOT / "examples" / "train_transformer.yaml")
TINY = ["--dim", "32", "--layers", "1", "--steps", "4", "--seq-len", "16", "--workers", "0"]
PER_RANK, TP = 4, 2  # 4 ranks / tp 2 = 2 data-parallel ranks: a global batch of 8


def _example():
    spec = importlib.util.spec_from_file_location("train_transformer_2d", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _one_process(tmp_path: Path, *extra: str) -> Path:
    """``python examples/train_transformer.py ... --batch-size 8`` (in this process)."""
    out = tmp_path / "one.json"
    _example().main([*TINY, *extra, "--batch-size", str(PER_RANK * 2), "--summary-json", str(out)])
    return out


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GT_DEVICE": "cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # torchrun
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_losses(one: Path, four: Path, log: str) -> str:
    """Check the 4-rank run's losses against one process (compare_runs, 1e-5); return both
    and their largest difference as lines to print."""
    ref, got = (json.loads(p.read_text())["losses"] for p in (one, four))
    assert len(got) == len(ref) == 4, log[-3000:]
    assert compare_runs.main([str(one), str(four), "--atol", "1e-5", "--rtol", "0"]) == 0
    return (
        f"one process: {' '.join(f'{x:.7f}' for x in ref)}\n"
        f"4 ranks 2x2: {' '.join(f'{x:.7f}' for x in got)}\n"
        f"max |diff|: {max(abs(a - b) for a, b in zip(ref, got)):.3g}"
    )


@pytest.mark.slow
def test_torchrun_4_ranks_fsdp_x_tp_equals_one_process(tmp_path):
    one = _one_process(tmp_path)
    four = tmp_path / "four.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    args = ["--strategy", "fsdp", "--tp", str(TP), "--batch-size", str(PER_RANK)]
    r = subprocess.run(
        [*cmd, str(EXAMPLE), *TINY, *args, "--summary-json", str(four)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tp groups: [0, 1] on node 0; [2, 3] on node 0" in r.stdout, r.stdout[-3000:]
    assert "world_size: 4" in r.stdout and "strategy: fsdp" in r.stdout
    print(_same_losses(one, four, r.stdout))


@pytest.mark.slow
def test_two_nodes_of_two_tp_inside_a_node_fsdp_across(tmp_path, capsys):
    """``NNODES=2 RDZV_ENDPOINT=127.0.0.1:PORT launch/run.sh 2 train_transformer.py --config
    train_transformer.yaml --tp 2 --checkpoint-dir ck``, started once per "node": the YAML's
    ``parallelism`` (``tp: 1``) overridden by the flag; node ranks come from the rendezvous.
    The run checkpoints every 2 steps (the YAML with ``every_steps: 2``); its step-2
    checkpoint then resumes in one process (``python ... --checkpoint-dir``), which must go on
    with the uninterrupted one-process losses of steps 3 and 4."""
    yaml = tmp_path / "train.yaml"  # the example's YAML, checkpointing every 2 steps
    text = Path(YAML).read_text()
    assert "  every_steps: 0\n" in text
    yaml.write_text(text.replace("  every_steps: 0\n", "  every_steps: 2\n  keep_last: 4\n"))
    one = _one_process(tmp_path, "--config", str(yaml))
    four = tmp_path / "four.json"
    endpoint = f"127.0.0.1:{_free_port()}"
    args = ["--config", str(yaml), "--tp", str(TP), "--batch-size", str(PER_RANK)]
    args += ["--summary-json", str(four), "--checkpoint-dir", str(tmp_path / "ck")]
    nodes = [
        subprocess.Popen(
            [str(ROOT / "launch" / "run.sh"), "2", str(EXAMPLE), *TINY, *args],
            env={**_env(), "NNODES": "2", "RDZV_ENDPOINT": endpoint, "RDZV_ID": "mesh2d"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for p in nodes:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    printed = [o for o in outs if "Training Summary" in o]
    assert len(printed) == 1  # rank 0 prints, on whichever node the rendezvous made node 0
    log = printed[0]
    assert "tp groups: [0, 1] on node 0; [2, 3] on node 1" in log, log[-3000:]
    assert "SPANS NODES" not in log and "strategy: fsdp" in log
    compared = _same_losses(one, four, log)

    # the 2x2 run's step-2 checkpoint, resumed by one process with the same global batch
    shutil.copytree(tmp_path / "ck" / "step_00000002", tmp_path / "ck_one" / "step_00000002")
    resumed = tmp_path / "resumed.json"
    capsys.readouterr()
    argv = [*TINY, "--config", str(yaml), "--batch-size", str(PER_RANK * 2)]
    argv += ["--checkpoint-dir", str(tmp_path / "ck_one"), "--summary-json", str(resumed)]
    _example().main(argv)
    said = capsys.readouterr().out
    assert "mesh dp_replicate x dp_shard x tp = 1x2x2 (4 rank(s)); resuming on 1x1x1" in said
    assert "data from global sample 16 of epoch 0" in said, said[-2000:]
    ref = json.loads(one.read_text())["losses"]
    got = json.loads(resumed.read_text())["losses"]
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, ref[2:])) <= 1e-5
    with capsys.disabled():  # the resume's output was captured to be read above
        print(f"\n{compared}\nresumed in one process, steps 3-4: {got}, uninterrupted: {ref[2:]}")


def test_example_flags_set_the_parallelism_block(tmp_path, monkeypatch, capsys):
    """--tp/--dp-shard/--dp-replicate go through the config's override (validated like the
    YAML), --tp takes the example plan when no --config gives one, and a bad mesh exits 2
    with one message naming the key, not a traceback."""
    ex = _example()
    cfg, strategy = ex._train_config(ex.parse_args(["--tp", "2", "--dp-shard", "-1"]))
    assert strategy == "fsdp" and (cfg.parallelism.tp, cfg.parallelism.dp_shard) == (2, -1)
    assert cfg.placements["layers.*.attn.[qk]_norm"] == "sharded_input"  # the example's plan
    cfg, _ = ex._train_config(ex.parse_args(["--config", YAML, "--dp-replicate", "2"]))
    assert cfg.parallelism.dp_replicate == 2 and cfg.strategy == "fsdp"
    with pytest.raises(SystemExit) as e:
        ex.main([*TINY, "--tp", "2"])  # one process: 1 x -1 x 2 cannot make a world of 1
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'parallelism'" in err and "world size 1" in err and "Traceback" not in err, err
    no_plan = tmp_path / "no_plan.yaml"
    no_plan.write_text("strategy: fsdp\n")
    with pytest.raises(SystemExit):
        ex.main([*TINY, "--tp", "2", "--config", str(no_plan)])
    assert "--tp 2 needs a placements table" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")  # 4 query / 2 kv heads do not split over tp 4
    with pytest.raises(SystemExit):
        ex.main([*TINY, "--tp", "4"])
    assert "--tp 4 splits the attention heads over 4 ranks" in capsys.readouterr().err
