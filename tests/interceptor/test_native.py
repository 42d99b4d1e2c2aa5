"""level="native": the compiled RecordFunction observer (built on first use, ~1 min once)."""

from __future__ import annotations

import pytest
import torch

import spmdgt.interceptor as interceptor
from spmdgt import debug
from spmdgt._core import debuglog as _debuglog
from spmdgt.interceptor import _control, _native
from spmdgt.interceptor._instruction_log import COLUMNS
from spmdgt.interceptor._logreader import read_log
from spmdgt.interceptor._mode import get_interceptor
from spmdgt.interceptor._stats import NativeCounters

needs_native = pytest.mark.skipif(
    not _native.available(), reason=f"native observer unavailable: {_native.error()}"
)


def _loop(n: int) -> torch.Tensor:
    a, b = torch.full((5, 7), 0.5), torch.full((5, 7), 2.0)
    c = torch.zeros(5, 7)
    for _ in range(n):
        c = c * b + a
    return c, a, b


@needs_native
def test_log_lines_parse_back_and_count_exactly(tmp_path):
    path = str(tmp_path / "ops.log")
    n = 5000  # more than one 4096-record batch
    a, b = torch.full((5, 7), 0.5), torch.full((5, 7), 2.0)
    c = torch.zeros(5, 7)
    interceptor.enable(instruction_log=path, stats=True, level="native")
    try:
        assert torch._C._len_torch_function_stack() == 0  # no Python mode on the op path
        for _ in range(n):
            c = c * b + a
        stats = debug.get_worker_stats()[0]
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    assert stats["operations"]["total"] == 2 * n
    assert dict(stats["top_ops"]) == {"aten.mul.Tensor": n, "aten.add.Tensor": n}
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("# spmdgt-instruction-log v1 rank=0 world=1")
    assert "level=native" in lines[0]
    assert all(len(line.split()) == len(COLUMNS) for line in lines[1:])
    recs = read_log(path)
    assert [r.seq for r in recs] == list(range(1, 2 * n + 1))
    assert [r.op for r in recs[:2]] == ["aten.mul.Tensor", "aten.add.Tensor"]
    r = recs[0]
    assert (r.event, r.phase, r.kind, r.level, r.nbytes) == ("OP", "fwd", "elementwise", 0, 0)
    assert r.inputs == "5x7:f32,5x7:f32" and r.outputs == "5x7:f32" and r.placements == "-"
    assert all(x.dur_us >= 0 and x.rank == 0 for x in recs)
    assert recs[0].start_unix_ns > 0 and recs[-1].t_unix >= recs[0].t_unix


@needs_native
def test_phases_levels_and_dtypes(tmp_path):
    path = str(tmp_path / "ops.log")
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    interceptor.enable(instruction_log=path, stats=True, level="native")
    try:
        loss = (w * 2).sum()
        loss.backward()
        opt.step()
        tape = debug.get_tape()
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    recs = read_log(path)
    assert len(recs) == len(tape)
    by_phase = {p: [r for r in recs if r.phase == p] for p in ("fwd", "bwd", "opt")}
    assert [r.op for r in by_phase["fwd"] if r.level == 0][:2] == [
        "aten.mul.Tensor",
        "aten.sum.default",
    ]
    assert any(r.op == "autograd.MulBackward0" and r.kind == "backward" for r in by_phase["bwd"])
    assert any(r.op.startswith("aten.mul") for r in by_phase["bwd"])
    assert any(r.op == "aten.add_.Tensor" and r.level == 0 for r in by_phase["opt"])
    sums = [r for r in recs if r.op == "aten.sum.default"]
    assert sums[0].kind == "reduce" and sums[0].outputs == "scalar:f64"
    mul = next(e for e in tape if e.op == "aten.mul.Tensor")
    assert mul.inputs[0][:2] == ((4, 4), torch.float64)  # Python sinks get torch dtypes


@needs_native
def test_collective_has_bytes(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    path = str(tmp_path / "ops.log")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(8, 16)
        interceptor.enable(instruction_log=path, stats=True, level="native")
        try:
            dist.all_reduce(t)
            stats = debug.get_worker_stats()[0]
        finally:
            interceptor.disable()
            get_interceptor().level = "torch"
    finally:
        dist.destroy_process_group()
    comm = [r for r in read_log(path) if r.event == "COMM"]
    assert [r.op for r in comm] == ["c10d.allreduce_.default"]
    assert comm[0].nbytes == 8 * 16 * 4 and comm[0].kind == "comm"
    assert stats["collectives"]["total"] == 1 and stats["collectives"]["bytes"] == 512


def test_fallback_when_disabled(tmp_path, monkeypatch, capsys):
    saved = (_native._ext, _native._tried, _native._error)
    monkeypatch.setenv("GT_NATIVE", "0")
    monkeypatch.setattr(_debuglog, "VERBOSE", True, raising=False)
    _native._ext, _native._tried, _native._error = None, False, None
    path = str(tmp_path / "ops.log")
    try:
        assert not _native.available() and "GT_NATIVE" in (_native.error() or "")
        interceptor.enable(instruction_log=path, stats=False, level="native")
        try:
            assert get_interceptor().level == "torch"
            assert torch._C._len_torch_function_stack() == 1
            _loop(3)
        finally:
            interceptor.disable()
            get_interceptor().level = "torch"
    finally:
        _native._ext, _native._tried, _native._error = saved
    assert [r.op for r in read_log(path)][-6:] == ["mul", "add"] * 3  # torch-level names
    assert "native interceptor unavailable" in capsys.readouterr().err


@needs_native
def test_instruction_log_env_uses_native(tmp_path, monkeypatch):
    path = str(tmp_path / "env.log")
    monkeypatch.setenv("GT_INSTRUCTION_LOG", path)
    monkeypatch.delenv("GT_INTERCEPT", raising=False)
    monkeypatch.delenv("GT_NATIVE", raising=False)
    try:
        assert _control.maybe_enable_from_env()
        assert get_interceptor().level == "native"
        counters = _control.tool("stats")
        # the log alone: counters kept in C++, no Python events to pay for
        assert isinstance(counters, NativeCounters) and counters.events is None
        _loop(2)
        entry = debug.get_worker_stats()[0]
        assert debug.get_tape() == []
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    recs = read_log(path)
    ops = [r.op for r in recs]
    assert ops.count("aten.mul.Tensor") == 2 and ops.count("aten.add.Tensor") == 2
    assert entry["stats_enabled"] is True and entry["hotpath_enabled"] is False
    assert entry["operations"]["total"] == len(ops)  # the counters agree with the log
    top = dict(entry["top_ops"])
    assert top["aten.mul.Tensor"] == 2 and top["aten.add.Tensor"] == 2
    # GT's "instructions": the top-level ops (torch.full's empty + fill_ are level 1)
    assert entry["hotpath"]["total_instructions"] == sum(r.level == 0 for r in recs)


@needs_native
def test_signal_scopes_reach_the_native_log(tmp_path):
    import spmdgt as gt

    path = str(tmp_path / "sig.log")
    x = torch.ones(3, 3)
    interceptor.enable(instruction_log=path, stats=False, level="native")
    try:
        with gt.signal.context("outer"):
            y = x * 2
            with gt.signal.context("inner"):
                y = y + 1
            y = y - 3
        y = y / 4
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    from spmdgt._core import scope as _scope

    assert _scope.listeners == []  # off again: scopes cost one empty loop
    arith = ("aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.div.Tensor")
    ops = [(r.op, r.signal) for r in read_log(path) if r.op in arith]
    assert ops == [
        ("aten.mul.Tensor", "outer"),
        ("aten.add.Tensor", "inner"),
        ("aten.sub.Tensor", "outer"),
        ("aten.div.Tensor", None),
    ]


@needs_native
def test_gt_stats_env_adds_counters_to_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GT_INSTRUCTION_LOG", str(tmp_path / "env.log"))
    monkeypatch.setenv("GT_STATS", "1")
    monkeypatch.delenv("GT_INTERCEPT", raising=False)
    try:
        assert _control.maybe_enable_from_env()
        _loop(3)
        stats = debug.get_worker_stats()[0]
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    assert stats["stats_enabled"] is True and stats["hotpath_enabled"] is True
    top = dict(stats["top_ops"])
    assert top["aten.mul.Tensor"] == 3 and top["aten.add.Tensor"] == 3


def _two_rank_program(world: int):
    """A signal-sharded matmul, its backward, and the values read back (gathers)."""
    import spmdgt as gt

    gt.manual_seed(0)
    with gt.signal.context("rows"):
        a = gt.randn(2 * world + 1, 6, requires_grad=True)  # uneven rows
    w = torch.ones(6, 3, requires_grad=True)  # a plain parameter: replicated
    with gt.signal.context("loss"):
        loss = (a @ w).relu().sum()
    loss.backward()
    return loss.item(), a.grad.numpy(), w.grad.numpy()


def _native_two_rank_job(rank: int, world: int, log: str):
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt
    from spmdgt.interceptor import _native as native

    if not native.available():  # the parent built it; a child that cannot load it fails
        raise RuntimeError(f"native observer unavailable on rank {rank}: {native.error()}")
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    _two_rank_program(world)  # once untraced: one-time setup (meshes) is not in the counts
    with CommDebugMode() as comm_mode:  # torch's own count of the program's collectives
        _two_rank_program(world)
    expected = comm_mode.get_total_counts()
    interceptor.enable(instruction_log=log, stats=True, level="native")
    try:
        value, grad_a, grad_w = _two_rank_program(world)
        stats = debug.get_worker_stats()
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    return value, grad_a, grad_w, stats, expected


@needs_native
def test_two_ranks_native_logs(tmp_path):
    from tests._dist import run_ranks

    log = str(tmp_path / "ops.log")
    results = run_ranks(_native_two_rank_job, 2, tmp_path, log)

    torch.manual_seed(0)  # the same program in one process, no interceptor
    a = torch.randn(5, 6, requires_grad=True)
    w = torch.ones(6, 3, requires_grad=True)
    loss = (a @ w).relu().sum()
    loss.backward()
    for rank, (value, grad_a, grad_w, stats, expected) in enumerate(results):
        assert value == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(grad_a), a.grad)
        torch.testing.assert_close(torch.from_numpy(grad_w), w.grad)
        assert [s["rank"] for s in stats.values()] == [0, 1]  # gathered from both ranks
        mine = stats[rank]
        # exactly the collectives CommDebugMode counts for the same program (one per
        # transfer: the c10d call inside a functional collective is not counted twice)
        assert expected > 0 and mine["collectives"]["total"] == expected
        assert mine["collectives"]["bytes"] > 0

    for rank in (0, 1):
        lines = (tmp_path / f"ops.rank{rank}.log").read_text().splitlines()
        assert lines[0].startswith(f"# spmdgt-instruction-log v1 rank={rank} world=2")
        recs = read_log(str(tmp_path / f"ops.rank{rank}.log"))
        assert {r.rank for r in recs} == {rank}
        # get_worker_stats pauses the observer for its gather; numbering continues after it
        assert sorted(r.seq for r in recs) == list(range(1, len(recs) + 1))
        assert results[rank][3][rank]["operations"]["total"] == len(recs)
        comm = [r for r in recs if r.event == "COMM"]
        assert comm and all(r.nbytes > 0 and "c10d" in r.op for r in comm), comm
        # one record per collective: DTensor's functional collective, not also the c10d call
        # it runs (the same bytes, counted twice before)
        assert not any(r.op.startswith("c10d.allreduce") for r in comm), comm
        assert results[rank][3][rank]["collectives"]["total"] == len(comm) == results[rank][4]
        assert results[rank][3][rank]["collectives"]["bytes"] == sum(r.nbytes for r in comm)
        assert any(r.op == "aten.mm.default" and r.signal == "loss" for r in recs)
        assert {r.phase for r in recs} >= {"fwd", "bwd"}
    # Same program on both ranks: the same collectives, in the same order.
    ops = [
        [r.op for r in read_log(str(tmp_path / f"ops.rank{k}.log")) if r.event == "COMM"]
        for k in (0, 1)
    ]
    assert ops[0] == ops[1]


@needs_native
def test_python_sinks_keep_up_in_a_long_loop(tmp_path):
    # torch releases the GIL around each op; the observer takes it back on the rank's thread to
    # hand records to Python every 4096 of them, so nothing is dropped past its 65536 buffer.
    from spmdgt.interceptor import _native as native

    n = 36_000  # 72,000 records
    interceptor.enable(instruction_log=str(tmp_path / "long.log"), stats=True, level="native")
    try:
        _loop(n)
        stats = debug.get_worker_stats()[0]
        dropped = native.load().counts()[1]
        top_level = _control.tool("stats").top_level  # level-0 records, counted in C++
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    assert dropped == 0
    # every top-level record reached the Python hot-path detector
    assert stats["hotpath"]["total_instructions"] == top_level == 2 * n + 3
    assert dict(stats["top_ops"])["aten.mul.Tensor"] == n
    assert stats["hotpath"]["hot_instructions"] > 2 * n - 100  # the loop is one hot sequence


def test_cache_key_follows_source_torch_and_flags():
    with open(_native._SRC, "rb") as f:
        src = f.read()
    key = _native.cache_key(src)
    assert key == _native.cache_key()  # this checkout's source
    assert _native.cache_key(src + b"\n// one more line") != key
    assert _native.cache_key(src, torch_version="0.0.0") != key
    assert _native.cache_key(src, cflags=("-O0",)) != key
    assert _native.build_dir(key).endswith(f"spmdgt_observer_{key}")


def test_a_build_announces_itself_once_with_its_folder(tmp_path, monkeypatch, capsys):
    # The compile itself (~45 s) is replaced; everything around it is the real path: the
    # folder from the source's key, the source copied into it, the line on stderr.
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        return "the module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    assert _native._load_or_build() == "the module"
    build = tmp_path / f"spmdgt_observer_{_native.cache_key()}"
    (call,) = calls
    assert call["build_directory"] == str(build) and call["name"] == "spmdgt_observer"
    assert call["sources"] == [str(build / "observer.cpp")]  # a copy: no other checkout's file
    with open(_native._SRC, "rb") as f:
        assert (build / "observer.cpp").read_bytes() == f.read()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[gt r{_debuglog._rank()} native +")
    assert f"compiling the native op observer into {build} " in lines[0]


@needs_native
def test_a_cached_build_is_imported_without_a_word(tmp_path, monkeypatch, capsys):
    import shutil

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / f"spmdgt_observer_{_native.cache_key()}"
    build.mkdir()
    shutil.copy(_native.load().__file__, build / "spmdgt_observer.so")

    def no_build(**kwargs):
        raise AssertionError("a cached build was rebuilt")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    module = _native._load_or_build()  # (Python hands back the module already loaded)
    assert callable(module.set_table) and callable(module.classify)
    assert capsys.readouterr().err == ""  # no build, no line
