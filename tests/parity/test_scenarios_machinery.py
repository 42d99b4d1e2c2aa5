"""The scenario harness's check of itself: a right scenario is ``equal``, one that raises
everywhere is ``raises``, one wrong by the world size is ``differs``, one whose ranks hold
different values is ``disagree``, and a group goes on after each (scenarios.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests.parity import scenarios as S
from tests.parity.verdict import DIFFERS, DISAGREE, EQUAL, RAISES


def _right(case):
    x = case.put(torch.randn(case.rows(7), 3), requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    loss = (x @ w).pow(2).sum()
    loss.backward()
    return {"loss": loss, "gx": x.grad, "gw": w.grad, "rng": torch.get_rng_state()}


def _raises(case):
    return {"v": case.put(torch.randn(7, 3)) @ torch.randn(4, 2)}


def _world_times(case):
    return {"s": case.value(case.put(torch.randn(7, 3)).sum()) * case.world}


def _per_rank(case):
    import torch.distributed as dist

    rank = dist.get_rank() if case.layout is not None else 0
    return {"s": case.value(case.put(torch.randn(7, 3)).sum()) + rank}


_TABLE = {
    sc.name: sc
    for sc in (
        S.Scenario("t.right", _right, ("shard0", "shard0_empty", "subrep"), worlds=(3,)),
        S.Scenario("t.raises", _raises, layouts=("shard0",)),
        S.Scenario("t.world_times", _world_times, layouts=("shard0",)),
        S.Scenario("t.per_rank", _per_rank, layouts=("shard0",)),
    )
}


def test_outcomes_are_told_apart():
    rows = S.run_rows(S.family_rows(worlds=(2, 3), table=_TABLE), table=_TABLE).rows
    outcome = {(k.op, k.placement, k.world): o for k, (o, _) in rows.items()}
    for layout in ("shard0", "shard0_empty", "subrep"):  # uneven 3/3/1, empty 1/1/0, off rank 0
        assert outcome["t.right", layout, 3] == EQUAL, rows
    for w in (2, 3):
        assert outcome["t.raises", "shard0", w] == RAISES
        assert outcome["t.world_times", "shard0", w] == DIFFERS
        assert outcome["t.per_rank", "shard0", w] == DISAGREE


def test_rows_and_samples():
    rows = S.family_rows(worlds=(2, 3, 4), table=_TABLE)
    assert len(rows) == 3 + 3 * 2  # no 2-D layout in the table: world 4 adds nothing
    mesh = {"t.m": S.Scenario("t.m", _right, layouts=("shard0", "mesh_s0s1"))}
    assert {(k.placement, k.world) for k in S.family_rows(table=mesh)} == {
        ("shard0", 2),
        ("shard0", 3),
        ("mesh_s0s1", 4),
    }
    sample = S.family_rows(worlds=(2, 3), table=_TABLE, sample=4, seed=1)
    assert len(sample) == 4 and sample == S.family_rows(
        worlds=(2, 3), table=_TABLE, sample=4, seed=1
    )


def test_the_reference_and_the_judge_are_plain_torch_under_the_compile_tools(monkeypatch):
    """A sweep run with both compile halves (``GT_WORKER_BATCH_SIZE``, ``GT_AUTO_COMPILE``) turns
    them on in its own process too, where the scenario rows' references are computed after the
    first fork: they ran recorded and compiled, with a defect of the pass on both sides of the
    comparison. ``plain_torch`` runs them eagerly: nothing recorded, no frame hook."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    import spmdgt
    import spmdgt.compile as gt_compile
    from spmdgt.interceptor import _control
    from tests.parity.prepare import plain_torch

    assert plain_torch(lambda: 7) == 7  # no tool on: called as is
    monkeypatch.setenv("GT_LAZY_MIN_NUMEL", "1")  # the sweeps' setting: every op is recorded
    sc = _TABLE["t.right"]
    try:
        assert gt_compile.enable_regions(batch=16, backend="eager")  # cheapest to compile
        gt_compile.enable(backend="eager")
        hook = gt_compile._hot.hook

        def turns_hot() -> Any:  # a code turns hot inside: the hook goes in after, not here
            hook.install()
            return hook.installed, get_eval_frame_callback()

        assert plain_torch(turns_hot) == (False, None) and hook.installed
        captured = lambda: gt_compile.stats()["regions"]["ops_captured"]  # noqa: E731
        before = captured()
        S._reference(sc, None, 1)  # as before: the reference's ops went into regions
        assert captured() > before
        before = captured()
        got = plain_torch(S._reference, sc, None, 1)
        assert captured() == before and got[0] == "ok"
        assert get_eval_frame_callback() is hook.callback
        assert plain_torch(get_eval_frame_callback) is None
        assert get_eval_frame_callback() is hook.callback  # and back after
    finally:
        spmdgt.session.reset("compile")
        _control.disable()  # the pass turned the interceptor on: later tests count with it off
    assert not gt_compile.regions_enabled() and not gt_compile.is_enabled()
