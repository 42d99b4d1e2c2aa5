"""Tools that read outside input: trace requests, the instruction log, top and visualize.

Trace requests: anyone who can write the run folder can write one, so a request that escapes
the run folder / ``GT_TRACE_DIR``, names a bad id, or gives ``seconds`` that are not a finite
number in range is ignored and reported once (rank-prefixed, on stderr and in the status), the
job keeps running, and no file that is not the trace's own is ever written or replaced.
Readers: ``visualize``, ``trace`` and ``top`` skip what they cannot read, say how much in one
line on stderr, and show the rest. ``GT_RUN_DIR`` alone makes a plain ``python`` job publish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spmdgt.interceptor as interceptor
import spmdgt.interceptor._mode as mode
from spmdgt.interceptor._publish import write_json_atomic
from spmdgt.scripts import top, trace, visualize

HEADER = (
    "# spmdgt-instruction-log v1 rank=0 world=1 start_unix_ns=1700000000000000000 level=torch "
    "columns=elapsed,rank,seq,event,phase,kind,op,bytes,dur,level,signal,inputs,outputs,placements"
)


def _line(seq: int, kind: str = "elementwise", dur: str = "5.0us") -> str:
    return f"0.{seq:06d}s r0 #{seq:08d} OP fwd {kind} mul 0B {dur} 0 - 2x2:f32 2x2:f32 -"


# -- trace requests --------------------------------------------------------------------------


@pytest.fixture
def job(tmp_path, monkeypatch):
    """This process as a one-rank job publishing into ``tmp/run``, ticking on every op (a test
    cannot wait for 1 s ticks), with ``tmp/allowed`` as its GT_TRACE_DIR."""
    monkeypatch.setattr(mode, "_TICK_NS", 0)
    monkeypatch.setenv("GT_TRACE_DIR", str(tmp_path / "allowed"))  # read when publishing starts
    (tmp_path / "outside").mkdir()
    run = tmp_path / "run"
    interceptor.disable()
    interceptor.enable(run_dir=str(run), stats=False, level="torch")
    try:
        yield run
    finally:
        interceptor.disable()


def _request(run: Path, body: object) -> None:
    """Write a request as ``scripts.trace`` does (a new file each time); ``str`` is raw text."""
    if isinstance(body, str):
        tmp = run / "req.tmp"
        tmp.write_text(body)
        os.replace(tmp, run / "trace_request.json")
    else:
        write_json_atomic(str(run / "trace_request.json"), body)


def _ops(n: int) -> float:
    """Run ``n`` user ops (each one ticks) and return their value: the job is alive and right."""
    x = torch.zeros(3)
    for _ in range(n):
        x = x + 1
    return float(x.sum())


def _status(run: Path) -> dict:
    return json.loads((run / "rank0.json").read_text())


def _trace_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("trace_*.log*") if p.is_file())


BAD_REQUESTS = {
    "dir ../x": {"id": "t1", "seconds": 5, "dir": "../x"},
    "dir traces/../../x": {"id": "t1", "seconds": 5, "dir": "traces/../../outside"},
    "dir absolute outside": {"id": "t1", "seconds": 5, "dir": "<outside>"},
    "dir symlink out": {"id": "t1", "seconds": 5, "dir": "link"},
    "dir not text": {"id": "t1", "seconds": 5, "dir": ["traces"]},
    "id with slash": {"id": "a/b", "seconds": 5, "dir": "traces"},
    "id with ..": {"id": "../../evil", "seconds": 5, "dir": "traces"},
    "id empty": {"id": "", "seconds": 5, "dir": "traces"},
    "id a number": {"id": 7, "seconds": 5, "dir": "traces"},
    "id too long": {"id": "x" * 65, "seconds": 5, "dir": "traces"},
    "seconds Infinity": '{"id": "t1", "seconds": Infinity, "dir": "traces"}',
    "seconds NaN": '{"id": "t1", "seconds": NaN, "dir": "traces"}',
    "seconds negative": {"id": "t1", "seconds": -1, "dir": "traces"},
    "seconds zero": {"id": "t1", "seconds": 0, "dir": "traces"},
    "seconds a string": {"id": "t1", "seconds": "10", "dir": "traces"},
    "seconds a bool": {"id": "t1", "seconds": True, "dir": "traces"},
    "seconds over the cap": {"id": "t1", "seconds": 1e9, "dir": "traces"},
    "not an object": [1, 2, 3],
    "truncated JSON": '{"id": "t1", "seconds": 5, "di',
    "binary bytes": "\x00\xff\xfe garbage",
    "unknown key": {"id": "t1", "seconds": 5, "dir": "traces", "mode": "w"},
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_trace_request_is_reported_once_and_ignored(job, tmp_path, capsys, case):
    run = job
    (run / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    body = BAD_REQUESTS[case]
    if isinstance(body, dict) and body.get("dir") == "<outside>":
        body = {**body, "dir": str(tmp_path / "outside")}
    assert _ops(2) == 6.0
    capsys.readouterr()
    _request(run, body)
    assert _ops(5) == 15.0  # ticks on every op: the request is seen, the ops still run
    interceptor.disable()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[gt r0 trace]")]
    assert len(err) == 1 and "ignored the trace request" in err[0], err  # once, not per tick
    assert _status(run)["trace"]["state"] == "rejected"
    assert _trace_files(tmp_path) == []  # nothing written: not outside, not inside either
    assert list((tmp_path / "outside").iterdir()) == []


def test_existing_file_or_symlink_at_the_name_is_never_replaced(job, tmp_path, capsys):
    run = job
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "trace_keep.rank0.log").write_text("precious\n")
    secret = tmp_path / "outside" / "secret.txt"
    secret.write_text("secret\n")
    (run / "traces").mkdir()
    (run / "traces" / "trace_link.rank0.log").symlink_to(secret)
    _request(run, {"id": "keep", "seconds": 60, "dir": str(allowed)})
    _ops(2)
    _request(run, {"id": "link", "seconds": 60, "dir": "traces"})
    _ops(2)
    interceptor.disable()
    err = capsys.readouterr().err
    assert err.count("ignored the trace request") == 2, err
    assert (allowed / "trace_keep.rank0.log").read_text() == "precious\n"
    assert os.readlink(run / "traces" / "trace_link.rank0.log") == str(secret)
    assert secret.read_text() == "secret\n"
    assert sorted(os.listdir(allowed)) == ["trace_keep.rank0.log"]  # no .partial left either


def test_valid_requests_write_inside_the_run_dir_and_gt_trace_dir(job, tmp_path, capsys):
    run = job
    _request(run, {"id": "inside", "seconds": 60, "dir": "traces/sub"})
    _ops(3)
    assert _status(run)["trace"] == {
        "id": "inside",
        "state": "recording",
        "detail": str(run.resolve() / "traces" / "sub" / "trace_inside.rank0.log"),
    }
    _request(run, {"id": "there", "seconds": 60, "dir": str(tmp_path / "allowed")})
    _ops(3)  # the second request ends the first window and starts its own
    interceptor.disable()
    assert "[gt r0 trace]" not in capsys.readouterr().err
    for path in (run / "traces" / "sub" / "trace_inside.rank0.log",
                 tmp_path / "allowed" / "trace_there.rank0.log"):  # fmt: skip
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# spmdgt-instruction-log v1 rank=0")
        assert any(" add " in ln for ln in lines[1:]), lines
    assert _status(run)["trace"]["state"] == "written"
    assert _status(run)["trace_dirs"] == [str(run.resolve()), str((tmp_path / "allowed").resolve())]


def test_trace_command_asks_for_a_folder_the_ranks_accept(tmp_path):
    run, allowed = tmp_path / "run", tmp_path / "allowed"
    run.mkdir()
    statuses = [{"rank": 0, "trace_dirs": [str(run), str(allowed)]}]
    assert trace.writable_dir(str(run), str(tmp_path / "elsewhere"), statuses) == str(
        run / "traces"
    )
    assert trace.writable_dir(str(run), str(allowed / "x"), statuses) == str(allowed / "x")
    trace.request_trace(str(run), 2.0, str(run / "traces"), trace_id="abc")
    req = json.loads((run / "trace_request.json").read_text())
    assert req == {"id": "abc", "seconds": 2.0, "dir": "traces"}  # relative to the run dir
    with pytest.raises(ValueError, match="seconds"):
        trace.request_trace(str(run), float("inf"), str(run / "traces"))


# -- readers ---------------------------------------------------------------------------------

BAD_LINES: dict[str, bytes] = {
    "truncated line": _line(4)[:40].encode(),
    "binary bytes": b"\x00\xff\xfe\x80\x81 garbage \xc3\x28",
    "unknown kind": _line(4, kind="teleport").encode(),
    "nan duration": _line(4, dur="nanus").encode(),
}


def _log_with(tmp_path: Path, bad: bytes, name: str = "ops.log") -> Path:
    """A log of 4 good lines (seq 1, 2, 3, 5) with ``bad`` between the second and third."""
    good = [_line(i).encode() for i in (1, 2, 3, 5)]
    body = b"\n".join([HEADER.encode(), *good[:2], bad, *good[2:]]) + b"\n"
    path = tmp_path / name
    path.write_bytes(body)
    return path


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_visualize_skips_malformed_lines_and_draws_the_rest(tmp_path, capsys, case):
    log = _log_with(tmp_path, BAD_LINES[case])
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    assert visualize.main([str(log), str(tmp_path / "missing.log"), "-o", str(png),
                           "--chrome", str(js)]) == 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "visualize: skipped 1 malformed line(s) and 1 unreadable file(s)"
    ), err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ops = [e for e in json.loads(js.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["seq"] for e in ops) == [1, 2, 3, 5]


def _fake_rank_answer(tmp_path: Path, monkeypatch, bad: bytes, bad_status: bytes | None):
    """A run dir whose rank 0 already wrote trace ``fixed`` (with ``bad`` inside), so the trace
    command finds it at once; ``bad_status`` is a second ``rank1.json``."""
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    status = {"rank": 0, "world": 1, "trace_dirs": [str(run)]}
    (run / "rank0.json").write_text(json.dumps(status))
    if bad_status is not None:
        (run / "rank1.json").write_bytes(bad_status)
    _log_with(run / "traces", bad, "trace_fixed.rank0.log")
    monkeypatch.setattr(trace, "new_trace_id", lambda: "fixed")
    return run


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_trace_merge_skips_malformed_lines_and_keeps_the_rest(tmp_path, capsys, monkeypatch, case):
    run = _fake_rank_answer(tmp_path, monkeypatch, BAD_LINES[case], None)
    out = tmp_path / "out"
    assert trace.main(["-s", "1", "--dir", str(out), "--run-dir", str(run), "--timeout", "5"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trace: skipped 1 malformed line(s)"), err
    merged = interceptor.read_log(out / "trace_fixed.log")  # strict: everything kept parses
    assert [r.seq for r in merged] == [1, 2, 3, 5]
    assert not (run / "traces" / "trace_fixed.rank0.log").exists()


BAD_STATUSES: dict[str, bytes] = {
    "rank json holding a list": b"[1, 2, 3]",
    "truncated json": b'{"rank": 1, "world": 2, "ops_per_s": 12',
    "binary bytes": b"\x00\xff\xfe\x80",
    "nan count": b'{"rank": 1, "world": 2, "ops_per_s": NaN}',
    "rank not a number": b'{"rank": "1", "world": 2}',
}


@pytest.mark.parametrize("case", list(BAD_STATUSES))
def test_top_skips_bad_status_files_and_shows_the_rest(tmp_path, capsys, case):
    run = tmp_path / "run"
    run.mkdir()
    good = {"rank": 0, "world": 2, "ops_per_s": 123.0, "phase": "fwd", "updated_unix": 1.0}
    (run / "rank0.json").write_text(json.dumps(good))
    (run / "rank1.json").write_bytes(BAD_STATUSES[case])
    assert top.main(["--run-dir", str(run), "--once"]) == 0
    out, err = capsys.readouterr()
    rows = [ln.split() for ln in out.splitlines()[2:] if ln[:4].strip().isdigit()]
    assert [r[:2] for r in rows] == [["0", "123"]]
    err_lines = err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("top: skipped 1 unreadable file(s)"), (
        err_lines
    )


def test_trace_skips_a_rank_json_holding_a_list(tmp_path, capsys, monkeypatch):
    run = _fake_rank_answer(tmp_path, monkeypatch, _line(4).encode(), b"[1, 2, 3]")
    out = tmp_path / "out"
    assert trace.main(["-s", "1", "--dir", str(out), "--run-dir", str(run), "--timeout", "5"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trace: skipped 1 unreadable file(s)"), err
    assert sorted(r.seq for r in interceptor.read_log(out / "trace_fixed.log")) == [1, 2, 3, 4, 5]


def test_top_names_the_folder_it_waits_on(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert top.main(["--run-dir", "runs/job", "--once"]) == 0
    assert str(tmp_path / "runs" / "job") in capsys.readouterr().out


# -- GT_RUN_DIR alone ------------------------------------------------------------------------


def test_gt_run_dir_alone_publishes_a_status(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GT_")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["GT_RUN_DIR"] = str(run)
    code = (
        "import spmdgt, torch\n"
        "x = torch.ones(4)\n"
        "for _ in range(3):\n"
        "    x = x * 2 + 1\n"
        "print(float(x.sum()))\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "60.0"
    status = json.loads((run / "rank0.json").read_text())
    assert status["rank"] == 0 and status["world"] == 1
    assert status["ops_total"] >= 6  # 3 x (mul, add), counted by the attached stats
    assert status["trace_dirs"] == [str(run.resolve())]


def test_a_new_session_starts_at_the_default_level():
    """A forked test rank (or a later ``enable()``) must not inherit an earlier session's level:
    with ``aten`` left behind, the two-rank tools test recorded ATen ops at level 0."""
    interceptor.disable()
    interceptor.enable(stats=True, level="aten")
    interceptor.disable()
    try:
        interceptor.enable(stats=True)
        assert mode.get_interceptor().level == "torch"
    finally:
        interceptor.disable()
