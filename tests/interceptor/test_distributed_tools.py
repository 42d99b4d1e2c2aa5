"""Two real gloo ranks: DTensor collectives in the stream, per-rank logs, stats gathered across
ranks, a trace captured through the run folder, the timeline PNG + Chrome JSON, and top."""

from __future__ import annotations

import json
import os
from collections import Counter

from spmdgt.interceptor._events import base_name
from tests._dist import run_ranks


def _program(mesh, a_full, b_full):
    """The DTensor program: two distribute_tensor scatters, mm's all-gather, a redistribute."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])  # mm needs it replicated: an all-gather
    c = torch.mm(a, b)
    c = torch.relu(c)
    return c.redistribute(mesh, [Replicate()]).to_local()


def _sharded_matmul_job(rank: int, world: int, log: str, run_dir: str, trace_dir: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt.interceptor as interceptor
    import spmdgt.interceptor._mode as mode
    from spmdgt import debug
    from spmdgt.scripts.trace import request_trace

    mode._TICK_NS = 0  # publish on every op: the test cannot wait for 1 s ticks
    mesh = DeviceMesh("cpu", list(range(world)))
    torch.manual_seed(0)  # same global values on every rank
    n = world * 3 + 1  # uneven shards
    a_full, b_full = torch.randn(n, 5), torch.randn(5, 4)
    with CommDebugMode() as comm_mode:  # torch's own count of the same program's collectives
        _program(mesh, a_full, b_full)
    expected = {str(op): k for op, k in comm_mode.get_comm_counts().items()}
    interceptor.enable(instruction_log=log, run_dir=run_dir)
    if rank == 0:
        request_trace(run_dir, 60.0, trace_dir)  # ranks pick it up on their next tick
    dist.barrier()  # no tensor argument: no __torch_function__, not in the stream
    full = _program(mesh, a_full, b_full)
    stats = debug.get_worker_stats()  # a collective: both ranks call it
    tape = [(e.op, e.kind, e.level, e.nbytes) for e in debug.get_tape()]
    interceptor.disable()
    ref = torch.relu(a_full @ b_full)
    torch.testing.assert_close(full, ref)  # same numbers as one process
    return stats, tape, expected


def test_two_ranks_collectives_logs_trace_timeline_top(tmp_path, capsys):
    from spmdgt.interceptor._logreader import read_log, read_logs
    from spmdgt.scripts import top, trace, visualize

    log = str(tmp_path / "ops.log")
    # ranks write traces only inside the run folder (or GT_TRACE_DIR): see _publish
    run_dir = str(tmp_path / "run")
    trace_dir = os.path.join(run_dir, "traces")
    os.makedirs(run_dir)
    results = run_ranks(_sharded_matmul_job, 2, tmp_path, log, run_dir, trace_dir)

    for rank, (stats, tape, expected) in enumerate(results):
        assert [s["rank"] for s in stats.values()] == [0, 1]  # every rank sees every rank's entry
        mine = stats[rank]
        # exactly CommDebugMode's collectives, by type: 2 scatters (distribute_tensor), 2
        # all-gathers (mm's operand, the redistribute)
        assert expected == {"c10d.scatter_": 2, "c10d_functional.all_gather_into_tensor": 2}
        by_type = Counter()
        for op, k in mine["collectives"]["by_op"].items():
            by_type[base_name(op)] += k
        assert by_type == Counter({base_name(op): k for op, k in expected.items()})
        assert mine["collectives"]["total"] == sum(expected.values())
        assert mine["collectives"]["bytes"] > 0
        comm = [t for t in tape if t[1] == "comm"]
        assert any("all_gather" in op and level == 1 for op, _, level, _ in comm), tape
        assert ("mm", "matmul", 0, 0) in tape  # the DTensor call itself, level 0
        assert ("aten.mm.default", "matmul", 1, 0) in tape  # its local matmul

    # per-rank instruction logs, collectives visible to grep/awk
    for rank in (0, 1):
        recs = read_log(str(tmp_path / f"ops.rank{rank}.log"))
        assert {r.rank for r in recs} == {rank}
        comm = [r for r in recs if r.event == "COMM"]  # one line per collective
        assert len(comm) == sum(results[rank][2].values()) and all(r.nbytes > 0 for r in comm)
        # a 1-D mesh's collectives run on the default group: the log's mesh dim says world
        assert {r.group for r in comm} == {"world"}
        assert {r.group for r in recs if r.event == "OP"} == {"-"}
        assert any(r.op == "mm" and r.placements.startswith("S(0),S(0)->") for r in recs)

    # the trace both ranks wrote on request, merged, drawn, exported
    parts = sorted(os.listdir(trace_dir))
    assert len(parts) == 2 and all(".rank" in p for p in parts), parts
    merged = trace.merge([os.path.join(trace_dir, p) for p in parts], str(tmp_path / "t.log"))
    recs = read_logs([merged])
    assert {r.rank for r in recs} == {0, 1}
    # `visualize traces/trace_*.log` matches the per-rank files and the merged one: once each
    assert len(read_logs([trace_dir, merged])) == len(recs)
    png, js = str(tmp_path / "timeline.png"), str(tmp_path / "timeline.json")
    assert visualize.main([merged, "--output", png, "--chrome", js]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(js) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert any(e["cat"] == "comm" for e in events if e["ph"] == "X")
    assert {e["args"].get("group") for e in events if e.get("cat") == "comm"} == {"world"}

    # top renders one frame from what the ranks published
    assert top.main(["--run-dir", run_dir, "--once"]) == 0
    frame = capsys.readouterr().out
    rows = [line.split() for line in frame.splitlines()[2:] if line[:4].strip().isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]
    assert "total" in frame
    assert "by mesh dim" not in frame  # a 1-D run's frame is what it was
