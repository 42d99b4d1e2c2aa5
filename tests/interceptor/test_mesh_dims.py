"""The mesh dim of each collective, in one process: the log's column 15 and its readers, top's
column, the comm sink's filter and the per-dim cost model. The 4-rank 2 x 2 run that checks
these against real collectives is ``tests/train/test_comm2d_dist.py``."""

from __future__ import annotations

import math

import pytest
import torch

from spmdgt.interceptor._events import COLUMNS, COLUMNS_V1, OpEvent
from spmdgt.interceptor._groups import group_label
from spmdgt.interceptor._instruction_log import format_events
from spmdgt.interceptor._logreader import MalformedLine, check_status, parse_line
from spmdgt.scripts import top
from spmdgt.train import CommunicationProfiler
from spmdgt.train._comm import CollectiveLog, InterceptorCollectiveSink, _collective_kind

OLD = "0.127753s r0 #00000025 COMM fwd comm all_reduce 2048B 293.8us 1 - 32x16:f32 32x16:f32 -"


def _event(op: str, group: str | None, kind: str = "comm", t0: int = 10, nbytes: int = 64):
    spec = ((torch.Size([4, 4]), torch.float32, None),)
    return OpEvent(1, t0, 5, op, kind, 1, "fwd", None, spec, spec, nbytes, group)


def test_log_names_the_dim_and_old_logs_still_read():
    assert COLUMNS[-1] == "group" and COLUMNS[:14] == COLUMNS_V1
    line = format_events([_event("_c10d_functional.all_reduce.default", "tp")])
    assert line.split()[14] == "tp" and len(line.split()) == 15
    rec = parse_line(line)
    assert (rec.group, rec.placements, rec.nbytes) == ("tp", "-", 64)
    other = format_events([_event("mul", None, kind="elementwise", nbytes=0)])
    assert parse_line(other).group == "-"
    old = parse_line(OLD)  # a log from before column 15: same fields, no dim
    assert (old.group, old.op, old.nbytes) == ("-", "all_reduce", 2048)
    with pytest.raises(MalformedLine, match="16 columns, expected 15"):
        parse_line(OLD + " tp extra")


def test_group_label_without_a_process_group():
    assert group_label(None) == "world"  # the default group: what a 1-D run prints


def _status(rank: int, groups: dict[str, int] | None) -> dict:
    s = {"rank": rank, "world": 2, "updated_unix": 0.0, "collectives_total": 9}
    if groups is not None:
        s["collectives_by_group"] = groups
    return s


def test_top_adds_a_mesh_dim_column_only_on_a_mesh():
    one_d = top.render([_status(0, {"world": 9}), _status(1, None)], now=0.0)
    assert "by mesh dim" not in one_d
    frame = top.render([_status(0, {"tp": 6, "dp_shard": 3}), _status(1, {"tp": 6})], now=0.0)
    head, row0, row1 = frame.splitlines()[1:4]
    assert head.endswith("by mesh dim")
    assert row0.endswith("dp_shard:3 tp:6") and row1.endswith("tp:6")
    assert check_status(_status(0, {"tp": float("nan")})) is not None
    assert check_status(_status(0, ["tp"])) is not None  # type: ignore[arg-type]


def test_collective_kinds_of_every_spelling():
    for op, kind in {
        "_c10d_functional.all_gather_into_tensor.default": "all_gather",
        "c10d._allgather_base_.default": "all_gather",
        "c10d._reduce_scatter_base_.default": "reduce_scatter",
        "dist.all_gather_single": "all_gather",
        "c10d.allreduce_.default": "all_reduce",
        "all_reduce": "all_reduce",
    }.items():
        assert _collective_kind(op) == kind, op


def test_sink_beside_hooks_keeps_what_the_hooks_cannot_see():
    events = [
        _event("_c10d_functional.all_reduce.default", "tp", t0=10),  # TP: kept
        _event("dist.all_reduce", "world", t0=11),  # the trainer's loss flush: dropped
        _event("c10d.allreduce_.default", "dp_replicate", t0=12),  # HSDP's: kept
        _event("c10d._allgather_base_.default", "dp_shard", t0=13),  # the hooks': dropped
        _event("c10d.allreduce_.default", "dp_shard", t0=14),  # not in api_dims: dropped
    ]
    sink = InterceptorCollectiveSink({"tp", "dp_replicate"})
    sink.on_events(events)
    log = CollectiveLog()
    sink.fill(log, [(0, 0.0, 1.0)])
    got = {d: {k: t["count"] for k, t in v.items()} for d, v in log.totals_by_dim().items()}
    assert got == {"tp": {"all_reduce": 1}, "dp_replicate": {"all_reduce": 1}}
    plain = InterceptorCollectiveSink()  # placements alone: DTensor's collectives only
    plain.on_events(events)
    assert [e[4] for e in plain.events] == ["tp"] and not plain.hooked


def test_estimate_per_dim_uses_each_dims_link_and_ring():
    counted = {
        "tp": {"all_reduce": {"count": 4, "bytes": 4_000_000}},
        "dp_shard": {"all_gather": {"count": 2, "bytes": 8_000_000}},
    }
    prof = CommunicationProfiler(by_dim={"tp": (400e9, 5e-6), "dp_shard": (40e9, 20e-6)})
    est = prof.estimate_counted_by_dim(counted, {"tp": 4, "dp_shard": 2})
    # tp: 4 x 5 us + 2(4-1)/4 x 4 MB / 400 GB/s; dp_shard: 2 x 20 us + (2-1)/2 x 8 MB / 40 GB/s
    assert est["tp"]["estimated_sec"] == pytest.approx(4 * 5e-6 + 1.5 * 4e6 / 400e9)
    assert est["dp_shard"]["estimated_sec"] == pytest.approx(2 * 20e-6 + 0.5 * 8e6 / 40e9)
    total = est["total"]
    assert total["collectives"] == 6
    assert total["estimated_sec"] == est["tp"]["estimated_sec"] + est["dp_shard"]["estimated_sec"]
    same = CommunicationProfiler(bandwidth=40e9, latency=20e-6)  # one link for every dim
    both = same.estimate_counted_by_dim(counted, {"tp": 4, "dp_shard": 2})
    assert both["dp_shard"]["estimated_sec"] == est["dp_shard"]["estimated_sec"]
    assert both["tp"]["estimated_sec"] > est["tp"]["estimated_sec"]  # the slower link
    assert all(math.isfinite(v["estimated_sec"]) for v in both.values())
    with pytest.raises(ValueError, match="mesh dim 'tp', whose size is not known"):
        same.estimate_counted_by_dim(counted, {"dp_shard": 2})
