"""``level="kineto"``: the same OpEvent stream from torch's C++ profiler, delivered at flushes."""

from __future__ import annotations

import pytest
import torch

import spmdgt.interceptor as interceptor
from spmdgt import debug
from spmdgt.interceptor import _kineto
from spmdgt.interceptor._instruction_log import COLUMNS
from spmdgt.interceptor._logreader import read_log
from spmdgt.interceptor._mode import get_interceptor
from tests._dist import run_ranks


class _Collect:
    def __init__(self) -> None:
        self.events: list = []

    def on_events(self, events: list) -> None:
        self.events.extend(events)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_kineto_counts_exactly_the_ops_run_and_pushes_no_mode():
    n = 30
    a, b = torch.full((5, 7), 0.5), torch.full((5, 7), 2.0)
    c = torch.zeros(5, 7)
    interceptor.enable(stats=True, level="kineto")
    try:
        assert interceptor.is_enabled()
        assert torch._C._len_torch_function_stack() == 0
        assert torch._C._autograd._profiler_enabled()
        for _ in range(n):
            c = c * b + a
        (s,) = debug.get_worker_stats()
    finally:
        interceptor.disable()
    assert not torch._C._autograd._profiler_enabled() and not interceptor.is_enabled()
    assert torch.allclose(c, torch.full((5, 7), 0.5 * (2.0**n - 1)))
    assert s["operations"]["total"] == 2 * n
    assert dict(s["top_ops"]) == {"aten.mul": n, "aten.add": n}
    assert s["hotpath"]["top_sequences"][0]["ops"] == ["aten.mul", "aten.add"] * 2


def test_kineto_log_parses_back_with_signals(tmp_path):
    from spmdgt import signal

    path = str(tmp_path / "ops.log")
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    interceptor.enable(instruction_log=path, stats=False, level="kineto")
    try:
        with signal.context("layer one"):
            c = a * b
            with signal.context("inner"):
                c = c + a
        d = c.sum()
    finally:
        interceptor.disable()
    assert d.dtype == torch.float64
    with open(path) as f:
        lines = f.read().splitlines()
    assert "level=kineto" in lines[0]
    assert all(len(line.split()) == len(COLUMNS) for line in lines[1:])
    recs = [r for r in read_log(path) if r.level == 0]
    assert [(r.op, r.signal) for r in recs] == [
        ("aten.mul", "layer_one"),
        ("aten.add", "inner"),
        ("aten.sum", None),
    ]
    assert recs[0].inputs == "3x4:f64,3x4:f64" and recs[2].kind == "reduce"
    assert [r.seq for r in read_log(path)] == list(range(1, len(lines)))


def test_kineto_backward_and_optimizer_phases():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    opt = torch.optim.SGD([w], lr=0.1)
    interceptor.enable(stats=True, level="kineto")
    try:
        loss = (x @ w).sum()
        loss.backward()
        opt.step()
        tape = debug.get_tape()
    finally:
        interceptor.disable()
    ops = {(e.op, e.phase, e.level) for e in tape}
    assert ("aten.matmul", "fwd", 0) in ops
    assert ("aten.mm", "bwd", 0) in ops  # the grad of x @ w, run by the autograd engine
    assert any(p == "opt" and op.startswith("aten.add") for op, p, _ in ops), ops


def test_kineto_flushes_on_optimizer_step_after_the_interval(monkeypatch):
    monkeypatch.setattr(_kineto, "_FLUSH_NS", 0)  # every flush point is due: no waiting
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.SGD([w], lr=0.1)
    sink = _Collect()
    interceptor.enable(stats=False, level="kineto")
    try:
        interceptor.add_sink(sink)
        windows = get_interceptor()._kineto.windows
        (w * 2).sum().backward()
        opt.step()  # the post-hook flushes: the sink has the step's events before any drain
        seen = [(e.op, e.phase) for e in sink.events]
        assert get_interceptor()._kineto.windows == windows + 1
    finally:
        interceptor.disable()
    assert ("aten.mul", "fwd") in seen and any(p == "opt" for _, p in seen)


def test_kineto_refuses_to_share_the_profiler():
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu), pytest.raises(RuntimeError, match="already"):
        interceptor.enable(stats=True, level="kineto")
    interceptor.disable()
    assert not torch._C._autograd._profiler_enabled()


def _allreduce_job(rank: int, world: int, log: str):
    import torch.distributed as dist

    import spmdgt.interceptor as interceptor
    from spmdgt import debug

    interceptor.enable(instruction_log=log, stats=True, level="kineto")
    t = torch.full((16, 4), float(rank + 1))
    dist.all_reduce(t)
    stats = debug.get_worker_stats()  # gathers every rank's entry (a collective)
    interceptor.disable()
    assert torch.equal(t, torch.full((16, 4), float(sum(range(1, world + 1)))))
    return stats


def test_kineto_two_ranks_see_collectives(tmp_path):
    log = str(tmp_path / "ops.log")
    results = run_ranks(_allreduce_job, 2, tmp_path, log)
    for rank, stats in enumerate(results):
        mine = stats[rank]
        assert mine["collectives"]["by_op"].get("c10d.allreduce_", 0) >= 1, mine
        assert mine["collectives"]["bytes"] >= 16 * 4 * 4
        recs = read_log(str(tmp_path / f"ops.rank{rank}.log"))
        comm = [r for r in recs if r.event == "COMM" and r.op == "c10d.allreduce_"]
        assert comm and comm[0].nbytes == 16 * 4 * 4 and comm[0].rank == rank
