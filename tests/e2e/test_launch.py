"""The launchers start a multi-node job as a cluster would: 2 "nodes" x 1 process on loopback.

``launch/run.sh`` with a c10d rendezvous (``NNODES``/``RDZV_ENDPOINT``), and
``launch/slurm.sbatch`` under stand-ins for ``srun``/``scontrol`` that start its per-node
command once per node on this machine, as SLURM would on each node. Both run the quick start
with its YAML and must print the numbers plain ``python`` prints, and leave a log file per rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_torchrun import EXAMPLE, ROOT, _numbers, _run

YAML = str(ROOT / "examples" / "quickstart.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GT_DEVICE": "cpu", "GT_CONFIG": YAML}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # torchrun
    return {**env, **extra}


def _strip(out: str) -> str:
    """torchrun's ``--tee`` prefixes each line with its rank (``[default0]:``)."""
    return "\n".join(ln.split("]:", 1)[-1] for ln in out.splitlines())


def _same_numbers(out: str, ref: list[float]) -> None:
    got = _numbers(out)
    assert len(got) == len(ref) >= 8, out
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * max(1.0, abs(r)), (g, r, out)


@pytest.mark.slow
def test_run_sh_two_nodes_with_c10d_rendezvous(tmp_path):
    ref = _numbers(_run([sys.executable, str(EXAMPLE)]))
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [str(ROOT / "launch" / "run.sh"), "1", str(EXAMPLE)],
            env=_env(
                NNODES="2",
                RDZV_ENDPOINT=endpoint,
                RDZV_ID="loopback",
                LOG_DIR=str(tmp_path / f"node{n}"),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outs = []
    for p in nodes:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(_strip(out))
    printed = [o for o in outs if "world=" in o]
    assert len(printed) == 1  # rank 0 prints, on whichever node the rendezvous made node 0
    assert "world=2 x: (Shard(dim=0),)" in printed[0]
    _same_numbers(printed[0], ref)
    logs = sorted(tmp_path.rglob("stdout.log"))
    assert len(logs) == 2  # one per rank


@pytest.mark.slow
def test_slurm_sbatch_starts_one_torchrun_per_node(tmp_path):
    ref = _numbers(_run([sys.executable, str(EXAMPLE)]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol's stand-in lists the head node first, then a long tail (a job of many nodes):
    # a script that reads only its first line closes the pipe early and dies of SIGPIPE
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\necho 127.0.0.1\nfor i in $(seq 20000); do echo 127.0.0.2; done\n"
    )
    # srun's stand-in: its per-node command, once per node, each with its SLURM_NODEID
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do SLURM_NODEID=$n "$@" & done\n'
        "status=0; for job in $(jobs -p); do wait $job || status=$?; done; exit $status\n"
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = _env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="1",
        RDZV_PORT=str(_free_port()),
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    r = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), str(EXAMPLE)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = _strip(r.stdout)
    assert "job 4242: 2 nodes x 1 GPUs, rendezvous 127.0.0.1:" in out
    _same_numbers("\n".join(ln for ln in out.splitlines() if not ln.startswith("job ")), ref)
    logs = sorted((tmp_path / "logs" / "4242").rglob("stdout.log"))
    assert len(logs) == 2 and {p.relative_to(tmp_path).parts[2] for p in logs} == {
        "node0",
        "node1",
    }
