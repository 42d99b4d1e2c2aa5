"""``benchmarks/_ranks.py``: a rank that fails, dies or hangs fails the run, with what
happened to it, and no rank is left running (``scaling.py`` and ``bench_trainer.py`` start
their ranks with it)."""

from __future__ import annotations

import os
import time

import pytest

from tests.benchmarks._paths import bench_module

_ranks = bench_module("_ranks")


def _start() -> str:
    """Fork here, as the benchmarks do; spawn where CUDA is (this test process may have
    touched it, as tests/_dist.py says)."""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def _ok(rank: int, world: int) -> tuple[int, int, str]:
    import torch.distributed as dist

    import spmdgt as gt

    dist.barrier()  # the ranks really are one group
    return rank, gt.world_size(), os.environ["MASTER_ADDR"]


def _rank1_raises(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()  # rank 0 waits for a rank that will never come


def _rank0_hangs(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(600)


def _rank1_exits(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_join_one_group_and_return():
    assert _ranks.run_ranks(_ok, 2, timeout=120, start=_start()) == [
        (0, 2, "127.0.0.1"),
        (1, 2, "127.0.0.1"),
    ]


def test_a_failing_rank_fails_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(_ranks.RankError) as err:
        _ranks.run_ranks(_rank1_raises, 2, timeout=120, grace=2, start=_start())
    msg = str(err.value)
    assert "--- rank 1 ---" in msg and "ValueError: planted failure on rank 1" in msg
    assert "_rank1_raises" in msg  # the traceback, not only the message
    # rank 0, waiting in a barrier for rank 1, fails there too (gloo sees the peer go) or is
    # killed after the grace: either way it is named and the run ends
    assert "--- rank 0 ---" in msg
    assert time.monotonic() - t0 < 60


def test_a_hang_is_killed_at_the_timeout():
    with pytest.raises(_ranks.RankError, match="rank 0 timed out after 3 s"):
        _ranks.run_ranks(_rank0_hangs, 2, timeout=3, start=_start())


def test_a_rank_that_dies_is_named():
    with pytest.raises(_ranks.RankError, match=r"rank 1 died without a result \(exit code 3\)"):
        _ranks.run_ranks(_rank1_exits, 2, timeout=60, grace=2, start=_start())
