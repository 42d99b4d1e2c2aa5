"""bench_trainer's 4-rank mesh section: its table and its ``--json`` figures from a result of
the shape ``_mesh4.mesh_main`` returns (the ranks themselves run in the benchmark, not here:
the 2 x 2 collectives it reports are checked against real runs in
``tests/train/test_comm2d_dist.py``)."""

from __future__ import annotations

import argparse

from tests.benchmarks._paths import bench_module


def _result() -> dict:
    per_dim = {
        "tp": {"all_reduce": {"count": 19.0, "bytes": 115_000.0, "sec": 0.0158}},
        "dp_shard": {"all_gather": {"count": 6.0, "bytes": 215_000.0, "sec": 0.0139}},
    }
    est = {
        "tp": {"all_reduce_sec": 0.0246},
        "dp_shard": {"all_gather_sec": 0.0011},
        "total": {"estimated_sec": 0.0257, "latency_sec": 0.025, "transfer_sec": 0.0007},
    }
    out = {
        name: {
            "step_time": t,
            "step_time_rounds": [t, t * 1.1],
            "samples_per_sec": 32 / t,
            "tokens_per_sec": 32 * 64 / t,
            "collectives_per_step": None if name.startswith("tp") else 9.0,
            "comm_measured_by": "x",
            "max_rss_gb": 0.3,
        }
        for name, t in (("fsdp 4x1", 0.2), ("tp 1x4", 0.31), ("fsdp x tp 2x2", 0.16))
    }
    out["fsdp x tp 2x2 traced"] = {
        "per_dim": per_dim,
        "estimate": est,
        "probes": {
            "latency": {"tp": {"all_reduce": 1.3e-3}, "dp_shard": {"all_gather": 1.4e-4}},
            "bandwidth": {"tp": {"all_reduce": 6.7e8}, "dp_shard": {"all_gather": 4.7e8}},
        },
        "step_time": 0.13,
    }
    out["load_average"] = (7.5, 7.2, 5.1)
    return out


def test_mesh_table_and_figures(capsys):
    mesh4 = bench_module("_mesh4")
    bench = bench_module("bench_trainer")
    args = argparse.Namespace(
        dim=128, layers=2, seq_len=64, batch_size=8, steps=10, warmup=3, mesh_rounds=2
    )
    mesh4.report_mesh(_result(), args)
    text = capsys.readouterr().out
    assert "load average 7.50, 7.20, 5.10" in text and "only rank the" in text
    lines = [line.split() for line in text.splitlines() if len(line.split()) > 2]
    rows = {f[0] + f[1]: " ".join(f) for f in lines}
    assert "200.0" in rows["fsdp4x1"] and "310.0" in rows["tp1x4"] and "n/a" in rows["tp1x4"]
    assert rows["tpall_reduce"].split()[2:6] == ["19.0", "0.115", "15.80", "24.60"]
    assert "estimated total 25.70 ms/step" in text
    figs = bench.figures(None, None, args, _result())
    assert figs["mesh"]["fsdp x tp 2x2"]["step_time"] == 0.16
    assert set(mesh4.LAYOUTS) == {"fsdp 4x1", "tp 1x4", "fsdp x tp 2x2"}
