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


def test_2d_layouts_run_at_world_4_only_and_cut_softly():
    """The ``mesh_*`` layouts are rows at world 4 only (the 1-D rows at 2 and 3 are the same
    as without them), and their cut keeps a sample whole where it is short or where torch
    refuses the cut (a matmul whose inner dims would no longer match)."""
    from torch.testing._internal.opinfo.core import SampleInput

    from tests.parity import sweep
    from tests.parity.layouts import PLACEMENTS_1D, PLACEMENTS_2D, fits, soft_cut
    from tests.parity.prepare import _soft_cut, build_cases

    assert [fits(p, 4) for p in PLACEMENTS_2D] == [True] * 4
    assert not any(fits(p, w) for p in PLACEMENTS_2D for w in (2, 3))
    ops = ["add", "mm"]
    rows = sweep.all_rows(ops, worlds=(2, 3, 4))
    assert {k.world for k in rows if k.placement in PLACEMENTS_2D} == {4}
    assert [k for k in rows if k.world < 4] == sweep.all_rows(ops, (2, 3), PLACEMENTS_1D)

    x = torch.randn(10, 20)
    cut = _soft_cut(SampleInput(x, args=(x.clone(), torch.randn(20))), soft_cut("mesh_s0s1"))
    assert cut.input.shape == (7, 5) and cut.args[0].shape == (7, 5)
    assert cut.args[1].shape == (20,)  # another shape: left alone
    assert _soft_cut(SampleInput(torch.randn(5, 4)), soft_cut("mesh_s0s1")) is None

    cases, _ = build_cases(
        [RowKey("mm", "fn", "mesh_s0s1", 4)], sweep.sweep_ops(), sweep.METADATA_ONLY
    )
    assert cases and all(c.reference["forward"].error is None for c in cases)


def test_partial_parts_add_up_exactly_in_any_order_with_mixed_signs():
    """The ``partial`` layout's parts: their sum is the value bit for bit whatever the order
    of addition (a right reduction gives one process's value), and a part has the other sign
    than the value (a rule that keeps ``Partial`` through ``abs`` or ``relu`` is caught);
    non-finite values stay whole on the first part."""
    import itertools

    from tests.parity.layouts import partial_parts

    g = torch.Generator().manual_seed(0)
    real = torch.randn(500, generator=g) * 10
    real[:4] = torch.tensor([float("inf"), float("nan"), 0.0, 3e38])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64):
        v = real.to(dtype) if not dtype.is_complex else torch.complex(real, real * 0.5)
        for world in (2, 3, 4):
            parts = partial_parts(v, world)
            for order in itertools.permutations(range(world)):
                total = parts[order[0]]
                for i in order[1:]:
                    total = total + parts[i]
                assert torch.equal(total[4:], v[4:]), (dtype, world, order)
            if not dtype.is_complex:
                assert (parts[0][4:] * v[4:] < 0).float().mean() > 0.9, (dtype, world)
                assert torch.equal(parts[0][:2], v[:2]) or parts[0][1].isnan(), dtype
    ints = torch.randint(-100, 100, (50,), generator=g)
    for dtype in (torch.int64, torch.int8, torch.uint8):
        parts = partial_parts(ints.to(dtype), 3)
        assert torch.equal(parts[0] + parts[1] + parts[2], ints.to(dtype))
