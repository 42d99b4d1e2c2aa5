"""``benchmarks/scaling.py`` at a tiny size on 1 and 2 forked CPU ranks: its JSON holds the
context and every figure, the figures follow from its own times, and the plot script draws
PNGs from it. One run of the script (~10 s) serves every test here."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks._paths import BENCHMARKS, ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    env = {**os.environ, "GT_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCHMARKS / "scaling.py"), "--tiny", "--ranks", "1", "2"]
    proc = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT
    )
    assert proc.returncode == 0, f"scaling.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    with open(out) as f:
        return json.load(f), proc.stdout


def test_json_holds_the_context_to_compare_runs(scaling_run):
    doc, _ = scaling_run
    assert doc["format"] == "spmdgt-benchmark/1" and doc["benchmark"] == "scaling"
    ctx = doc["context"]
    for key in ("date", "command", "machine", "torch", "spmdgt", "git", "device", "world_size"):
        assert key in ctx, key
    assert {"cpu_model", "cores", "gpu"} <= set(ctx["machine"])
    assert ctx["machine"]["cores"] == os.cpu_count()
    assert ctx["device"] == "cpu" and ctx["world_size"] == [1, 2]
    assert ctx["threads"]["per_rank"] == 1
    assert ctx["threads"]["total_at_ranks"] == {"1": 1, "2": 2}
    assert "revision" in ctx["git"] and ctx["spmdgt"]


def test_every_workload_side_and_mode_is_there(scaling_run):
    doc, _ = scaling_run
    res = doc["results"]
    groups = {s["group"] for s in res["shapes"]}
    assert groups == {"square", "batch", "mlp"}
    assert len(res["shapes"]) == 9
    rows = res["rows"]
    # 9 shapes x 2 rank counts x 3 sides (spmdgt, raw DTensor, one torch process) x 2 modes
    assert len(rows) == 9 * 2 * 3 * 2
    assert {r["side"] for r in rows} == {"spmdgt", "dtensor", "torch"}
    assert {r["mode"] for r in rows} == {"compute", "read"}
    for r in rows:
        assert len(r["times_s"]) == 5  # 2 warm-up runs are not kept, 5 timed ones are
        assert all(t > 0 for t in r["times_s"])
        # CPU: the same total threads whichever side (r ranks x 1, or 1 process x r)
        assert r["threads_total"] == r["ranks"]
        assert r["processes"] == (1 if r["side"] == "torch" else r["ranks"])


def test_figures_follow_from_its_own_times(scaling_run):
    doc, _ = scaling_run
    res = doc["results"]
    flops = {s["name"]: s["flops"] for s in res["shapes"]}
    for s in res["shapes"]:
        d = s["dims"]
        if s["group"] == "mlp":
            b, w = d[0], d[1:]
            want = sum(2 * b * i * o + 2 * b * o for i, o in itertools.pairwise(w))
        else:
            want = 2 * d[0] * d[1] * d[2]
        assert s["flops"] == want
    by = {(r["shape"], r["ranks"], r["side"], r["mode"]): r for r in res["rows"]}
    for r in res["rows"]:
        assert math.isclose(r["mean_s"], statistics.fmean(r["times_s"]), rel_tol=1e-12)
        assert math.isclose(r["std_s"], statistics.pstdev(r["times_s"]), rel_tol=1e-9, abs_tol=0)
        assert r["flops"] == flops[r["shape"]]
        assert math.isclose(r["tflops"], r["flops"] / r["mean_s"] / 1e12, rel_tol=1e-12)
        base = by[(r["shape"], 1, r["side"], r["mode"])]["mean_s"]
        assert math.isclose(r["speedup"], base / r["mean_s"], rel_tol=1e-12)
        assert math.isclose(r["efficiency"], r["speedup"] / r["ranks"], rel_tol=1e-12)
        if r["ranks"] == 1:
            assert r["speedup"] == 1.0
    summ = res["summary"]["2"]["spmdgt"]["compute"]
    two = [
        r["speedup"]
        for r in res["rows"]
        if (r["ranks"], r["side"], r["mode"]) == (2, "spmdgt", "compute")
    ]
    assert math.isclose(summ["average"], statistics.fmean(two), rel_tol=1e-12)
    assert summ["min"] == min(two) and summ["max"] == max(two)


def test_output_says_how_it_timed_and_threaded(scaling_run):
    _, out = scaling_run
    assert "r ranks x 1 thread(s) each, torch as 1 process x r threads" in out
    assert "slowest rank" in out
    assert "TFLOP/s = FLOPs from the shape / mean time" in out
    assert "Average speedup:" in out and "Min speedup:" in out and "Max speedup:" in out
    assert "[scaling" in out  # progress lines


def test_plot_draws_pngs_from_it(scaling_run, tmp_path, capsys):
    from spmdgt.scripts import plot

    doc, _ = scaling_run
    src = tmp_path / "run.json"
    src.write_text(json.dumps(doc))
    assert plot.main([str(src), "--out", str(tmp_path / "png")]) == 0
    drawn = [Path(p) for p in capsys.readouterr().out.split()]
    assert {p.name for p in drawn} == {"run-speedup.png", "run-overhead.png"}
    for p in drawn:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000
