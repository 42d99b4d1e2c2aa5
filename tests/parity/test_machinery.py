"""The sweep's own machinery on made-up ops that misbehave on purpose: each outcome is called
what it is, and a hang or a crash costs one case, not the run. ~10 s on 2 ranks."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch

from tests.parity import runner
from tests.parity.observe import Job
from tests.parity.prepare import Case, RowKey, reference
from tests.parity.verdict import judge


def _rank() -> int | None:
    """This process's rank; None in the parent, which computes the reference."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def _sin(x):
    return torch.sin(x)


def _wrong_on_ranks(x):
    return x + (1 if _rank() is not None else 0)


def _raises_on_ranks(x):
    if _rank() is not None:
        raise ValueError("not on a rank")
    return x * 2


def _raises_on_rank_1(x):
    if _rank() == 1:
        raise ValueError("rank 1 says no")
    return x * 2


def _hangs_on_rank_1(x):
    if _rank() == 1:
        time.sleep(60)
    return x * 2


def _slow_on_rank_1(x):
    # Computing (CPU time moving) for longer than the case's timeout: slow, not hung.
    if _rank() == 1:
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            sum(range(1000))
    return x * 2


def _dies_on_rank_0(x):
    if _rank() == 0:
        os._exit(7)
    return x * 2


def _dropped_inplace(x):
    # The bug the sweep exists for: an in-place op that hands back a new value and leaves
    # its input alone (on the ranks only).
    return x.mul(2) if _rank() is not None else x.mul_(2)


def _case(name: str, fn, placement: str = "plain", variant: str = "fn") -> Case:
    op = SimpleNamespace(op=fn, inplace_variant=fn, supports_autograd=False)
    torch.manual_seed(0)
    sample = SimpleNamespace(input=torch.randn(5, 3), args=(), kwargs={})
    job = Job(op, variant, sample, grad_seed=1, backward=False)
    return Case(RowKey(name, variant, placement, 2), 0, 1, job, reference(job, 1))


def test_each_outcome_is_named_and_the_run_survives_hangs_and_crashes():
    cases = [
        _case("sin", _sin, "shard0"),
        _case("wrong", _wrong_on_ranks),
        _case("raises", _raises_on_ranks),
        _case("one_raises", _raises_on_rank_1),
        _case("dropped", _dropped_inplace, "shard1", variant="inplace"),
        _case("hangs", _hangs_on_rank_1),
        _case("after_hang", _sin, "subrep"),
        _case("slow", _slow_on_rank_1),
        _case("dies", _dies_on_rank_0),
        _case("after_crash", _sin, "shard0_empty"),
    ]
    runs = runner.run_cases(cases, 2, timeout=4.0)
    got = {
        c.key.op: judge(c.reference, r.status, r.observations, r.note) for c, r in zip(cases, runs)
    }
    assert {k: v[0] for k, v in got.items()} == {
        "sin": "equal",
        "wrong": "differs",
        "raises": "raises",
        "one_raises": "disagree",
        "dropped": "differs",
        "hangs": "hang",
        "after_hang": "equal",
        "slow": "equal",
        "dies": "crash",
        "after_crash": "equal",
    }, got
    assert "rank 1 silent in forward" in got["hangs"][1]
    assert "_hangs_on_rank_1" in got["hangs"][1]  # the stack of the silent rank
    assert "rank 0 went on" in got["hangs"][1]
    assert "rank 0 died (exit code 7)" in got["dies"][1]
    assert "self" in got["dropped"][1]
