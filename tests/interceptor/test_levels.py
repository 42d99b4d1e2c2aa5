"""One program, three interception levels (torch, aten, native): one classification.

Every level classifies with ``_events``' table (the C++ observer is handed it at load), so the
same program must give the same op kinds and the same collectives at each level, with
communication time (collectives and the waits on them) counted everywhere, and no dispatcher
bookkeeping (``PythonSubclass``, ``PythonDispatchMode``) among the ops.
"""

from __future__ import annotations

import pytest
import torch

from spmdgt.interceptor import _events, _native
from spmdgt.interceptor._logreader import read_log
from tests._dist import run_ranks

needs_native = pytest.mark.skipif(
    not _native.available(), reason=f"native observer unavailable: {_native.error()}"
)
_LEVELS = ("torch", "aten", "native")


def _program(mesh, a_full, b_full):
    """A sharded matmul (an all-gather of ``b``), a pointwise op and a redistribute."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])
    c = torch.relu(torch.mm(a, b))
    return c.redistribute(mesh, [Replicate()]).to_local()


def _three_levels_job(rank: int, world: int, logdir: str):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt.interceptor as interceptor
    from spmdgt import debug
    from spmdgt.interceptor._mode import get_interceptor

    if not _native.available():  # the parent built it; a child that cannot load it fails
        raise RuntimeError(f"native observer unavailable on rank {rank}: {_native.error()}")
    mesh = DeviceMesh("cpu", list(range(world)))
    torch.manual_seed(0)
    a_full, b_full = torch.randn(world * 3 + 1, 5), torch.randn(5, 4)  # uneven shards
    with CommDebugMode() as comm_mode:  # torch's count of the program's collectives
        _program(mesh, a_full, b_full)
    stats = {}
    for level in _LEVELS:
        interceptor.enable(instruction_log=f"{logdir}/{level}.log", stats=True, level=level)
        try:
            assert get_interceptor().level == level
            out = _program(mesh, a_full, b_full)
            stats[level] = debug.get_worker_stats()[rank]
        finally:
            interceptor.disable()
            get_interceptor().level = "torch"
        torch.testing.assert_close(out, torch.relu(a_full @ b_full))
    return stats, comm_mode.get_total_counts()


@needs_native
def test_one_program_same_kinds_collectives_and_comm_time_at_every_level(tmp_path):
    results = run_ranks(_three_levels_job, 2, tmp_path, str(tmp_path))
    for rank, (stats, expected) in enumerate(results):
        kinds = {level: set(stats[level]["by_kind"]) for level in _LEVELS}
        # the same kinds at every level, none of them bookkeeping
        assert kinds["torch"] == kinds["aten"] == kinds["native"], kinds
        assert {"matmul", "elementwise", "comm", "wait"} <= kinds["native"]
        assert _events.OVERHEAD not in kinds["native"]
        for level in _LEVELS:
            coll = stats[level]["collectives"]
            # torch's own count (2 scatters in distribute_tensor, 2 all-gathers), exactly
            assert expected > 0 and coll["total"] == expected, (level, coll)
            recs = read_log(tmp_path / f"{level}.rank{rank}.log")
            assert not any(r.op.startswith(("PythonSubclass", "PythonDispatchMode")) for r in recs)
            assert {r.kind for r in recs} == kinds[level]
            # communication time: every collective and every wait on one, at every level
            # (waits were 'elementwise' at the Python levels before the shared table)
            waits = [r for r in recs if r.kind == "wait"]
            assert waits and all(r.event == "WAIT" for r in waits), level
            comm_us = sum(r.dur_us for r in recs if r.kind in _events.COLLECTIVE_KINDS)
            # the log rounds each duration down to 0.1 us
            assert coll["time_s"] * 1e6 == pytest.approx(comm_us, abs=0.1 * len(recs) + 1e-3)
            assert coll["time_s"] > 0 and coll["time_s"] * 1e6 > sum(r.dur_us for r in waits)


@needs_native
def test_native_observer_classifies_with_the_python_table():
    """The C++ observer's kind for an op name is ``_events.classify``'s, name by name."""
    ext = _native.load()
    names = [f"aten.{n}.default" for n in _events.kind_table()]
    names += [f"{n}_" for n in _events.kind_table()]  # in-place spellings, no namespace
    names += [
        "_c10d_functional.wait_tensor.default",
        "_c10d_functional.all_gather_into_tensor.default",
        "c10d.allreduce_.default",
        "autograd.MulBackward0",
        "profiler._record_function_enter_new.default",
        "PythonSubclass.default",
        "PythonDispatchMode.default",
        "aten.relu.default",
        "Redistribute.default",
        "dist.all_reduce",
    ]
    got = {n: ext.classify(n) for n in names}
    assert got == {n: _events.classify(n) for n in names}
    assert got["_c10d_functional.wait_tensor.default"] == "wait"
    assert got["PythonSubclass.default"] == got["PythonDispatchMode.default"] == "overhead"


@pytest.mark.parametrize(
    "level,mul",
    [
        ("torch", "mul"),
        ("aten", "aten.mul.Tensor"),
        pytest.param("native", "aten.mul.Tensor", marks=needs_native),
    ],
)
def test_record_function_is_no_op_at_any_level(level, mul):
    # record_function's own ops are 'overhead': the aten level recorded them as elementwise ops
    import spmdgt.interceptor as interceptor
    from spmdgt import debug
    from spmdgt.interceptor._mode import get_interceptor

    a = torch.ones(3)
    interceptor.enable(stats=True, level=level)
    try:
        with torch.profiler.record_function("region"):
            a * a
        stats = debug.get_worker_stats()[0]
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    assert dict(stats["top_ops"]) == {mul: 1} and stats["by_kind"] == {"elementwise": 1}


@needs_native
def test_a_switch_from_native_to_torch_counts_with_the_new_level():
    # the native session's C++ counters were kept as the stats after a switch to the torch
    # level (they count nothing there): the operation totals then read 0
    import spmdgt.interceptor as interceptor
    from spmdgt import debug

    interceptor.enable(stats=True, level="native")
    try:
        c = torch.ones(4, 4)
        for _ in range(10):
            c = c * 2.0
        interceptor.enable(stats=True, level="torch")
        for _ in range(25):
            c = c + 1.0
        total = debug.get_worker_stats()[0]["operations"]["total"]
    finally:
        interceptor.disable()
    assert total >= 25, total
