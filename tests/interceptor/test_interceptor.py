"""The interceptor and its tools: off means absent, exact op counts, log round trip, hot paths."""

from __future__ import annotations

import torch

import spmdgt.interceptor as interceptor
from spmdgt import debug
from spmdgt._core import debuglog as _debuglog
from spmdgt.interceptor._instruction_log import COLUMNS, rank_path
from spmdgt.interceptor._logreader import parse_line, read_log
from spmdgt.interceptor._stats import HotPathDetector


def _stacks() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _loop(n: int) -> torch.Tensor:
    a, b = torch.full((5, 7), 0.5), torch.full((5, 7), 2.0)
    c = torch.zeros(5, 7)
    interceptor.enable(stats=True)
    for _ in range(n):
        c = c * b + a
    return c


def test_off_means_no_mode_pushed():
    interceptor.disable()
    assert _stacks() == (0, 0)
    assert not interceptor.is_enabled()
    interceptor.enable(stats=True)
    assert _stacks() == (1, 0) and interceptor.is_enabled()
    interceptor.disable()
    assert _stacks() == (0, 0) and not interceptor.is_enabled()


def test_stats_count_exactly_the_ops_run():
    n = 40
    try:
        c = _loop(n)
        stats = debug.get_worker_stats()
    finally:
        interceptor.disable()
    assert torch.allclose(c, torch.full((5, 7), 0.5 * (2.0**n - 1)))
    (s,) = stats.values()
    assert s["operations"] == {"total": 2 * n, "compiled": 0, "eager": 2 * n}
    assert s["by_kind"] == {"elementwise": 2 * n}
    assert dict(s["top_ops"]) == {"mul": n, "add": n}
    # mul add repeats with period 2 < min_seq 3, so the unit is "mul add mul add": n/2
    # occurrences, hot from the 10th on, 4 ops each
    hp = s["hotpath"]
    assert hp["unique_sequences"] == 1 and hp["hot_sequences"] == 1
    assert hp["top_sequences"] == [{"ops": ["mul", "add", "mul", "add"], "count": n // 2}]
    assert hp["hot_instructions"] == (n // 2 - 10 + 1) * 4
    assert s["collectives"]["total"] == 0


def test_log_lines_parse_back_with_stable_columns(tmp_path):
    path = str(tmp_path / "ops.log")
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    interceptor.enable(instruction_log=path, stats=False)
    try:
        c = a * b + a
        d = c.sum()
    finally:
        interceptor.disable()
    assert d.dtype == torch.float64
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("# spmdgt-instruction-log v1 rank=0 world=1")
    body = lines[1:]
    assert [line.split()[6] for line in body] == ["mul", "add", "sum"]  # awk $7 is the op
    assert all(len(line.split()) == len(COLUMNS) for line in body)
    recs = read_log(path)
    assert [r.seq for r in recs] == [1, 2, 3]
    assert recs[0].inputs == "3x4:f64,3x4:f64" and recs[0].outputs == "3x4:f64"
    assert recs[2].kind == "reduce" and recs[2].outputs == "scalar:f64"
    assert all(r.dur_us > 0 and r.rank == 0 and r.phase == "fwd" for r in recs)
    assert recs[0].start_unix_ns > 0 and recs[1].t_unix >= recs[0].t_unix


def test_backward_and_optimizer_are_seen():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    opt = torch.optim.SGD([w], lr=0.1)
    interceptor.enable(stats=True)
    try:
        loss = (x @ w).sum()
        loss.backward()
        opt.step()
        tape = debug.get_tape()
    finally:
        interceptor.disable()
    ops = [(e.op, e.phase, e.level) for e in tape]
    assert ("matmul", "fwd", 0) in ops
    assert ("backward", "bwd", 0) in ops
    assert ("aten.mm.default", "bwd", 1) in ops  # the grad of x @ w, inside the engine
    assert any(phase == "opt" for _, phase, _ in ops)


def test_aten_level_counts_aten_ops():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    interceptor.enable(stats=True, level="aten")
    try:
        c = a
        for _ in range(5):
            c = c * b + a
        s = debug.get_worker_stats()[0]
    finally:
        interceptor.disable()
    assert dict(s["top_ops"]) == {"aten.mul.Tensor": 5, "aten.add.Tensor": 5}
    assert _stacks() == (0, 0)


def test_parse_line_rejects_malformed():
    import pytest

    with pytest.raises(ValueError, match="columns"):
        parse_line("1.0s r0 #1 OP")


def test_hotpath_detector_rotations_and_threshold():
    det = HotPathDetector(window=20, min_seq=3, threshold=3)
    det.feed(["a", "b", "c"] * 5)
    summary = det.summary()
    assert summary["total_instructions"] == 15
    assert summary["hot_sequences"] == 1
    assert summary["top_sequences"][0]["count"] == 4  # first period completes at the 4th "a"


def test_rank_path_and_debuglog(capsys):
    assert rank_path("/tmp/x.log", 0, 1) == "/tmp/x.log"
    assert rank_path("/tmp/x.log", 3, 4) == "/tmp/x.rank3.log"
    _debuglog.configure({"GT_DEBUG_DISPATCHER": "1"})
    try:
        assert _debuglog.SHARDING and not _debuglog.INTERCEPTOR
        _debuglog.debug("dispatcher", "hello")  # GT's name maps to sharding
        _debuglog.debug("worker", "not printed")
    finally:
        _debuglog.configure({})
    err = capsys.readouterr().err
    assert "[gt r0 sharding +" in err and "hello" in err and "not printed" not in err
