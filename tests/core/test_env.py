"""``spmdgt.env``: every GT_* variable declared once and read by one rule; the docs' table is
the declarations' table; a bad value stops every rank with one line naming the variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmdgt import env
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "environment.md"
FLAG_SPELLINGS = "expected one of 1, true, on, yes (on) or 0, false, off, no, '' (off)"


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", "TRUE", " On ", "Yes\n"])
def test_flag_on_spellings(value):
    assert env.flag("GT_AUTO_SHARD", {"GT_AUTO_SHARD": value}) is True
    assert env.flag("GT_COMPILE", {"GT_COMPILE": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "off", "no", "", "  ", "OFF", " No ", "False"])
def test_flag_off_spellings(value):
    # off means off for flags on by default too (GT_COMPILE, GT_CHECK_SHAPES, GT_NATIVE)
    assert env.flag("GT_AUTO_SHARD", {"GT_AUTO_SHARD": value}) is False
    assert env.flag("GT_COMPILE", {"GT_COMPILE": value}) is False


def test_unset_flags_take_their_defaults(monkeypatch):
    for name in ("GT_AUTO_SHARD", "GT_COMPILE", "GT_CHECK_SHAPES", "GT_NATIVE", "GT_VERBOSE"):
        monkeypatch.delenv(name, raising=False)
    assert not env.flag("GT_AUTO_SHARD") and not env.flag("GT_VERBOSE")
    assert env.flag("GT_COMPILE") and env.flag("GT_CHECK_SHAPES") and env.flag("GT_NATIVE")


def test_flag_reads_os_environ(monkeypatch):
    monkeypatch.setenv("GT_AUTO_SHARD", "off")
    assert env.flag("GT_AUTO_SHARD") is False
    monkeypatch.setenv("GT_AUTO_SHARD", "yes")
    assert env.flag("GT_AUTO_SHARD") is True


@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "o n"])
def test_bad_flag_names_variable_value_and_spellings(value):
    with pytest.raises(env.EnvError) as err:
        env.flag("GT_VERBOSE", {"GT_VERBOSE": value})
    assert isinstance(err.value, ValueError)
    assert str(err.value) == f"GT_VERBOSE={value!r}: {FLAG_SPELLINGS}"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GT_TAPE_SIZE", "lots", "GT_TAPE_SIZE='lots' is not an integer: expected an integer >= 0"),
        ("GT_TAPE_SIZE", "1.5", "GT_TAPE_SIZE='1.5' is not an integer: expected an integer >= 0"),
        ("GT_TAPE_SIZE", "-1", "GT_TAPE_SIZE='-1' is out of range: expected an integer >= 0"),
        ("GT_LAZY_CACHE", "0", "GT_LAZY_CACHE='0' is out of range: expected an integer >= 1"),
        ("GT_HOTPATH_WINDOW", "x", "GT_HOTPATH_WINDOW='x' is not an integer"),
        ("GT_TIMEOUT", "0", "GT_TIMEOUT='0' is out of range: expected a number > 0"),
        ("GT_TIMEOUT", "inf", "GT_TIMEOUT='inf' is not finite: expected a number > 0"),
        ("GT_TIMEOUT", "nan", "GT_TIMEOUT='nan' is not finite"),
        (
            "GT_PROFILE_MAX_MB",
            "-1",
            "GT_PROFILE_MAX_MB='-1' is out of range: expected a number >= 0",
        ),
        ("GT_DEVICE", "tpu", "GT_DEVICE='tpu': expected one of cpu, cuda"),
        ("GT_INTERCEPT", "fast", "GT_INTERCEPT='fast': expected one of torch, aten, native"),
    ],
)
def test_bad_numbers_and_choices_name_variable_value_and_bounds(name, value, message):
    with pytest.raises(env.EnvError, match=re.escape(message)):
        env.get(name, {name: value})


def test_numbers_choices_and_text_parse():
    assert env.integer("GT_TAPE_SIZE", {}) == 1000  # the default, now documented
    assert env.integer("GT_TAPE_SIZE", {"GT_TAPE_SIZE": " 0 "}) == 0
    assert env.integer("GT_WORKER_BATCH_SIZE", {}) is None
    assert env.integer("GT_WORKER_BATCH_SIZE", {"GT_WORKER_BATCH_SIZE": ""}) is None
    assert env.number("GT_TIMEOUT", {"GT_TIMEOUT": "2.5"}) == 2.5
    assert env.number("GT_INSTRUCTION_LOG_MAX_MB", {}) == 256.0
    assert env.text("GT_DEVICE", {"GT_DEVICE": " CPU "}) == "cpu"
    assert env.text("GT_COMPILE_BACKEND", {}) == "inductor"
    assert env.text("GT_CONFIG", {"GT_CONFIG": ""}) is None
    assert env.is_set("GT_CONFIG", {"GT_CONFIG": "a.yaml"})
    assert not env.is_set("GT_CONFIG", {"GT_CONFIG": " "})


def test_undeclared_names_and_wrong_kinds_are_programming_errors():
    with pytest.raises(KeyError, match="GT_NOT_A_VARIABLE is not a declared variable"):
        env.flag("GT_NOT_A_VARIABLE")
    with pytest.raises(KeyError):
        env.raw("GT_TEST_START")  # the test harness's own switch, not spmdgt's
    with pytest.raises(TypeError, match="GT_TAPE_SIZE is a int, not a flag"):
        env.flag("GT_TAPE_SIZE")


def test_launcher_ints(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(env.EnvError, match="WORLD_SIZE='two' is not an integer"):
        env.launcher_int("WORLD_SIZE", 1)
    monkeypatch.setenv("WORLD_SIZE", "")
    assert env.launcher_int("WORLD_SIZE", 1) == 1
    with pytest.raises(KeyError):
        env.launcher_int("GT_TAPE_SIZE", 0)


def test_every_variable_declared_once_with_a_meaning():
    names = [v.name for v in env.VARIABLES]
    assert len(names) == len(set(names))
    for v in env.VARIABLES:
        assert v.name.startswith("GT_") and v.kind in (
            "flag",
            "int",
            "float",
            "str",
            "path",
            "choice",
        )
        assert v.meaning and "\n" not in v.meaning and "|" not in v.meaning
        # words: a choice's own; a flag may add some beside on/off (GT_AUTO_SHARD=plan)
        assert v.kind in ("choice", "flag") or not v.choices
        assert v.kind != "choice" or v.choices


def test_readers_share_the_declared_defaults():
    from spmdgt.compile import _lazy_regions as _lazy
    from spmdgt.interceptor import _instruction_log, _profile

    assert env.integer("GT_LAZY_MIN_NUMEL", {}) == _lazy.MIN_NUMEL
    assert env.number("GT_INSTRUCTION_LOG_MAX_MB", {}) == _instruction_log.DEFAULT_MAX_MB
    assert env.number("GT_PROFILE_MAX_MB", {}) == _profile.DEFAULT_MAX_MB


@pytest.mark.parametrize(("value", "off"), [("0", True), ("off", True), ("no", True), ("1", False)])
def test_gt_compile_one_answer(monkeypatch, value, off):
    from spmdgt import compile as gt_compile
    from spmdgt.train._compile import compile_disabled_by_env

    monkeypatch.setenv("GT_COMPILE", value)
    assert gt_compile.compile_disabled() is off and compile_disabled_by_env() is off


def test_debug_flags_off_means_off():
    from spmdgt._core import debuglog

    try:
        debuglog.configure({"GT_VERBOSE": "0", "GT_DEBUG_DISPATCHER": "off"})
        assert not debuglog.VERBOSE and not debuglog.SHARDING
        debuglog.configure({"GT_VERBOSE": "yes"})
        assert debuglog.VERBOSE
    finally:
        debuglog.configure({})


def test_module_imports_nothing_heavy():
    # import spmdgt reads it first; loaded on its own it must not pull torch in
    path = str(ROOT / "spmdgt" / "_core" / "env.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('e', {path!r})\n"
        "m = sys.modules['e'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_python_m_prints_the_table():
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("GT_")}
    run_env.update(GT_AUTO_SHARD="off", GT_TAPE_SIZE="lots")
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "spmdgt.env"],
        env=run_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["variable", "type", "default", "value", "meaning"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [v.name for v in env.VARIABLES]
    assert re.search(
        r"GT_AUTO_SHARD\s+flag or plan\s+off\s+'off'\s+shard new tensors", rows["GT_AUTO_SHARD"]
    )
    assert re.search(r"GT_TAPE_SIZE\s+int >= 0\s+1000\s+'lots' INVALID\s", rows["GT_TAPE_SIZE"])
    assert re.search(r"GT_CONFIG\s+path\s+-\s+-\s", rows["GT_CONFIG"])
    assert out.stderr == ""


def _generated(text: str) -> str:
    m = re.search(
        r"<!-- generated by: [^\n]*-->\n(.*?)\n<!-- end of generated table -->", text, re.S
    )
    assert m, "docs/environment.md lost its generated-table markers"
    return m.group(1)


def test_doc_table_is_the_declarations():
    table = _generated(DOC.read_text())
    listed = re.findall(r"^\| `(GT_[A-Z0-9_]+)` \|", table, re.M)
    declared = [v.name for v in env.VARIABLES]
    assert set(declared) - set(listed) == set(), "declared but not in docs/environment.md"
    assert set(listed) - set(declared) == set(), "in docs/environment.md but not declared"
    assert table == env.markdown(), "regenerate: python -m spmdgt.env --markdown"
    assert all(row.count("|") == 5 for row in table.splitlines()), "a cell holds a '|'"


def test_readme_and_docs_name_only_declared_variables():
    declared = {v.name for v in env.VARIABLES}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        # `GT_DEBUG_CLIENT/DISPATCHER` names its first variable; `GT_DEBUG_*` a family (a
        # prefix, ending in "_"), which must be the prefix of a declared name
        named = set(re.findall(r"\bGT_[A-Z0-9_]+", page.read_text()))
        unknown = {
            n
            for n in named
            if n not in declared
            and not (n.endswith("_") and any(d.startswith(n) for d in declared))
        }
        assert not unknown, f"{page.name} names undeclared variables {sorted(unknown)}"
    assert "docs/environment.md" in (ROOT / "README.md").read_text()


def _auto_shard_state(rank, world):
    import torch

    import spmdgt as gt

    x = gt.randn(8, 4)  # outside any signal: only auto-shard could shard it
    return type(x) is torch.Tensor, type(x).__name__, str(getattr(x, "placements", None))


@pytest.mark.parametrize(
    ("value", "on"), [("off", False), ("0", False), ("false", False), ("no", False), ("on", True)]
)
def test_auto_shard_off_spellings_on_two_ranks(tmp_path, value, on):
    for plain, kind, placements in run_ranks(
        _auto_shard_state, 2, tmp_path, env={"GT_AUTO_SHARD": value}, timeout=90
    ):
        if on:
            assert kind == "Tensor" and placements == "(Shard(dim=0),)"
        else:
            assert plain, f"GT_AUTO_SHARD={value} sharded a creation: {kind} {placements}"


def test_bad_auto_shard_stops_every_rank(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_ranks(_auto_shard_state, 2, tmp_path, env={"GT_AUTO_SHARD": "maybe"}, timeout=90)
    text = str(err.value)
    assert "timed out" not in text
    line = f"EnvError: GT_AUTO_SHARD='maybe': {FLAG_SPELLINGS}"
    for rank in (0, 1):
        section = text.split(f"--- rank {rank} ---", 1)[1].split("--- rank", 1)[0]
        assert line in section, section
