"""Size bounds: the instruction log rotates at GT_INSTRUCTION_LOG_MAX_MB (both writers), the
profile stops recording at GT_PROFILE_MAX_MB; each says so once. Tiny caps, a few thousand ops."""

from __future__ import annotations

import json
import os

import pytest
import torch

import spmdgt.interceptor as interceptor
from spmdgt import debug
from spmdgt.interceptor import _native
from spmdgt.interceptor._logreader import read_log
from spmdgt.interceptor._mode import get_interceptor

_CAP_MB = 0.01  # 10 kB: ~100 lines a file
needs_native = pytest.mark.skipif(
    not _native.available(), reason=f"native observer unavailable: {_native.error()}"
)


def _loop(n: int) -> None:
    a, b = torch.full((5, 7), 0.5), torch.full((5, 7), 2.0)
    c = torch.zeros(5, 7)
    for _ in range(n):
        c = c * b + a


def _check_rotated(path: str, err: str, total: int) -> None:
    cap = int(_CAP_MB * 1_000_000)
    old = f"{path}.1"
    for p in (path, old):  # at most the cap on disk per file, both parseable
        assert os.path.getsize(p) <= cap, (p, os.path.getsize(p))
    with open(path) as f:
        head = [f.readline(), f.readline()]
    assert head[0].startswith("# spmdgt-instruction-log v1 rank=0")
    assert head[1] == f"# rotated: earlier lines are in {old}\n"
    recs = read_log(old) + read_log(path)
    seqs = [r.seq for r in recs]
    # the newest lines are kept, in order, none lost between the two files
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] == total
    assert seqs[0] > 1  # older ones were rotated away: the bound held
    notes = [line for line in err.splitlines() if "GT_INSTRUCTION_LOG_MAX_MB" in line]
    assert len(notes) == 1, err  # one line, however many rotations
    assert notes[0].startswith("[gt r0 log +") and f"{path}.1" in notes[0]


@pytest.mark.parametrize("level", ["torch", pytest.param("native", marks=needs_native)])
def test_instruction_log_rotates_at_its_cap(level, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GT_INSTRUCTION_LOG_MAX_MB", str(_CAP_MB))
    path = str(tmp_path / "ops.log")
    interceptor.enable(instruction_log=path, stats=True, level=level)
    try:
        assert get_interceptor().level == level
        _loop(3000)  # ~6000 lines, ~600 kB unbounded
        total = debug.get_worker_stats()[0]["operations"]["total"]
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    _check_rotated(path, capsys.readouterr().err, total)


def test_log_cap_must_be_a_size(monkeypatch, tmp_path):
    from spmdgt.interceptor._instruction_log import InstructionLogSink

    monkeypatch.setenv("GT_INSTRUCTION_LOG_MAX_MB", "lots")
    with pytest.raises(ValueError, match="GT_INSTRUCTION_LOG_MAX_MB='lots'"):
        InstructionLogSink(str(tmp_path / "x.log"), 0, 1, 0, 0, "torch")


@pytest.mark.parametrize("level", ["torch", pytest.param("native", marks=needs_native)])
def test_profile_stops_recording_at_its_cap(level, tmp_path, monkeypatch, capsys):
    from spmdgt.interceptor._profile import BYTES_PER_EVENT

    monkeypatch.setenv("GT_PROFILE_MAX_MB", "0.05")  # ~116 op events
    # the profile picks the native level when it builds; GT_INTERCEPT picks another
    if level == "native":
        monkeypatch.delenv("GT_INTERCEPT", raising=False)
    else:
        monkeypatch.setenv("GT_INTERCEPT", level)
    logdir = tmp_path / "prof"
    with debug.profile(str(logdir), scalars=False) as prof:
        assert get_interceptor().level == level
        _loop(1000)  # 2000 ops: ~860 kB of trace unbounded
        with torch.profiler.record_function("after_the_cap"):
            _loop(1)
        capped = prof.capped
    assert capped
    notes = [line for line in capsys.readouterr().err.splitlines() if "GT_PROFILE_MAX_MB" in line]
    assert len(notes) == 1 and notes[0].startswith("[gt r0 profile +"), notes
    (trace,) = [p for p in logdir.iterdir() if p.name.endswith(".pt.trace.json")]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    names = [e["name"] for e in events]
    cap_ops = 50_000 // BYTES_PER_EVENT
    # recording stopped at the cap: the ops up to it, nothing after (the marker is missing)
    assert 0 < names.count("aten::mul") + names.count("aten::add") <= cap_ops
    assert "after_the_cap" not in names
    assert trace.stat().st_size < 2 * 50_000
