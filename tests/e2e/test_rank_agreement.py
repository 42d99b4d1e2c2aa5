"""Ranks that stop running the same program, as real processes: every rank exits non-zero
with one readable message and prints no value; GT_TIMEOUT and GT_CHECK_RANKS name a rank that
does not arrive; torchrun's summary shows the message.

Each case is two processes started as torchrun starts its workers (RANK, WORLD_SIZE,
MASTER_ADDR/PORT) but without torchrun's 5-8 s start; one runs under torchrun itself.
``_diverge.py`` holds the programs; ``tests/core/test_rank_agreement_dist.py`` runs every case
of the table in forked ranks, by default and with GT_CHECK_RANKS=1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_diverge.py"
CONFIG = HERE / "_diverge.yaml"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(case: str, **env: str) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(2):
        full = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GT_CONFIG": str(CONFIG),
            "GT_DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
            **env,
        }
        full.pop("TORCHELASTIC_ERROR_FILE", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), case],
                env=full,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            stdout, stderr = p.communicate()
            pytest.fail(f"a rank did not exit within 90 s:\n{stdout}\n{stderr[-3000:]}")
        out.append((p.returncode, stdout, stderr))
    return out


def _run_cases(cases: list[str], env: dict[str, str]) -> dict:
    """Start every case at once; each rank must end within 90 s of the start."""
    started = {name: _start(name, **env) for name in cases}
    deadline = time.monotonic() + 90
    return {name: _finish(procs, deadline) for name, procs in started.items()}


def test_real_processes_exit_nonzero_with_one_readable_message():
    results = _run_cases(["item", "dtype"], {})
    for case, ranks in results.items():
        for rank, (rc, out, err) in enumerate(ranks):
            assert rc != 0, (case, rank, out, err[-2000:])
            assert "VALUE" not in out, (case, rank, out)  # no rank printed a value
            line = f"[rank {rank}] spmdgt: RankDivergenceError: ranks stopped running"
            assert line in err, (case, rank, err[-2000:])
            assert "Traceback" not in err, (case, rank, err[-2000:])  # one message, no wall
    # rank 1 learns at its exit that rank 0 is still reading: the end is an agreement point
    assert "rank 1: the end of the program" in results["item"][1][2]


# together: slow (the late run makes the same assertions, with rank 1 joining late as well)
@pytest.mark.parametrize(
    "late",
    [pytest.param(None, marks=pytest.mark.slow), "6"],
    ids=["together", "rank1-joins-6s-late"],
)
def test_gt_timeout_names_the_op_that_waited(late):
    # rank 0 gathers inside a matmul while rank 1 waits in a read: by default nothing pairs
    # them, and GT_TIMEOUT turns the wait into an error on both ranks. GT_TIMEOUT bounds a
    # collective's wait, not the start: a rank that joins twice GT_TIMEOUT late is waited for
    # (before, rank 0's start failed after 3 s with gloo's connect timeout)
    env = {
        "GT_TIMEOUT": "3",
        **({"DIVERGE_LATE_RANK": "1", "DIVERGE_LATE_S": late} if late else {}),
    }
    (r0, r1) = _run_cases(["op"], env)["op"]
    assert r0[0] != 0 and r1[0] != 0
    assert "VALUE" not in r0[1] + r1[1]
    assert "RankTimeoutError: rank 0: a collective in Tensor.matmul" in r0[2], r0[2][-2000:]
    assert "got no answer within GT_TIMEOUT=3 s" in r0[2]
    # rank 1's exchange (shared memory, one host) names the rank it waited for: rank 0 did
    # not arrive within GT_TIMEOUT, or exited (after its own timeout) first
    assert "RankTimeoutError: rank 1: rank(s) [0] " in r1[2], r1[2][-2000:]
    assert "agreement point #2 (item() of float32[]" in r1[2]
    # the exchange keeps the last agreed point; the timeout's message reads it from there
    assert "last agreed point was #1: gt.randn of float32[6, 4]" in r1[2], r1[2][-2000:]


def test_check_ranks_names_a_rank_that_does_not_arrive():
    # rank 1 is busy for two minutes; rank 0 names it after GT_TIMEOUT, and (as torchrun
    # does once a rank fails) the test then stops rank 1
    procs = _start("stuck", GT_CHECK_RANKS="1", GT_TIMEOUT="3")
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode != 0 and "VALUE" not in out
    assert "RankTimeoutError: rank 0: rank(s) [1] did not arrive within GT_TIMEOUT=3 s" in err


@pytest.mark.slow  # a torchrun start: test_real_processes_exit_nonzero... reads the same run's end
def test_torchrun_summary_shows_each_ranks_message():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "GT_CONFIG": str(CONFIG), "GT_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(SCRIPT), "numpy"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.index("Root Cause") :]
    assert "traceback : [rank" in summary and "RankDivergenceError" in summary, summary
