"""The shared result file (``benchmarks/_results.py``) from another benchmark than scaling,
and what the plot script does with files it cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.benchmarks._paths import BENCHMARKS, ROOT, bench_module


def test_bench_interceptor_writes_its_figures_with_the_context(tmp_path):
    out = tmp_path / "ic.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_interceptor.py"), "--iters", "200"]
    proc = subprocess.run(
        [*cmd, "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "GT_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "interceptor"
    assert {"machine", "torch", "spmdgt", "git", "date", "threads"} <= set(doc["context"])
    cases = {c["name"]: c for c in doc["results"]["cases"]}
    assert cases["plain torch"]["ratio_to_plain"] == 1.0
    from spmdgt.scripts import plot

    assert plot.main([str(out)]) == 0
    assert (tmp_path / "ic-overhead.png").read_bytes()[:4] == b"\x89PNG"


def test_write_is_strict_json_and_keeps_the_layout(tmp_path):
    results = bench_module("_results")
    path = results.write(
        tmp_path / "sub" / "x.json", "demo", {1: float("nan"), "t": (1, 2)}, device="cpu"
    )
    doc = json.loads(path.read_text())  # NaN became null: strict JSON readers accept it
    assert doc["results"] == {"1": None, "t": [1, 2]}
    assert doc["format"] == results.FORMAT and doc["context"]["device"] == "cpu"


def test_plot_skips_what_is_not_a_result_file(tmp_path, capsys):
    from spmdgt.scripts import plot

    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert plot.main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert "not a benchmark result file" in err and "nothing drawn" in err


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    from spmdgt.scripts import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="needs matplotlib"):
        plot.main(["whatever.json"])
