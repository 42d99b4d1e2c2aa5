"""The YAML signal schema: what it accepts, and the exact errors for what it does not."""

from __future__ import annotations

import re
import textwrap

import pytest

import spmdgt as gt
from spmdgt.config import ConfigError, clear_config


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv("GT_CONFIG", raising=False)
    clear_config()
    yield
    clear_config()


def _write(tmp_path, text, name="signals.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_full_schema_loads_into_typed_dataclasses(tmp_path):
    path = _write(
        tmp_path,
        """
        data_parallel:
          shard: {axis: 0, workers: [0, 1, 2, 3]}
        model_parallel:
          shard:
            axis: 1
            workers: [0, 1]
        hot_path:
          shard: {axis: 0}
          compile: true
        stage_1:
          shard: {axis: 0, workers: [0, 1], replicated: false}
          backward: stage_1_backward
        stage_1_backward:
          shard: {replicated: true}
        """,
    )
    loaded = gt.load_config(path)
    assert set(loaded) == set(gt.get_config())
    cfg = gt.get_config("stage_1")
    assert cfg == gt.SignalConfig(
        shard=gt.ShardConfig(axis=0, workers=[0, 1]), backward_signal="stage_1_backward"
    )
    assert gt.get_config("hot_path").compile is True
    assert gt.get_config("model_parallel").shard.axis == 1
    assert gt.get_config("stage_1_backward").shard.replicated is True
    assert gt.get_config("missing") is None


def test_register_config_from_python():
    gt.register_config("x", gt.SignalConfig(shard=gt.ShardConfig(axis=1), compile=True))
    assert gt.get_config("x").shard.axis == 1 and gt.get_config("x").name == "x"


def test_gt_config_env_var_is_read(tmp_path, monkeypatch):
    path = _write(tmp_path, "env_sig:\n  shard: {axis: 1}\n")
    monkeypatch.setenv("GT_CONFIG", path)
    clear_config()
    assert gt.get_config("env_sig").shard.axis == 1


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        (
            "sig:\n  shard: {axis: 0, wrkers: [0]}\n",
            "signals.yaml:2, signal 'sig', key 'shard.wrkers': unknown key(s) 'wrkers'",
        ),
        ("sig:\n  shrad: {axis: 0}\n", "signal 'sig', key 'shrad': unknown key(s) 'shrad'"),
        (
            "sig:\n  shard: {axis: first}\n",
            "signals.yaml:2, signal 'sig', key 'shard.axis': expected int | list, got str 'first'",
        ),
        ("sig:\n  shard: {axis: -1}\n", "signal 'sig', key 'shard.axis': axis must be >= 0"),
        (
            "sig:\n  shard: {axis: 0, workers: [0, -2]}\n",
            "signal 'sig', key 'shard.workers': workers must be non-negative ranks, got -2",
        ),
        (
            "sig:\n  shard: {axis: 0, workers: 3}\n",
            "signal 'sig', key 'shard.workers': expected list, got int 3",
        ),
        (
            "sig:\n  shard: {replicated: 'yes'}\n",
            "signal 'sig', key 'shard.replicated': expected bool, got str 'yes'",
        ),
        ("sig:\n  compile: 1\n", "signal 'sig', key 'compile': expected bool, got int 1"),
        ("sig:\n  backward: [a]\n", "signal 'sig', key 'backward': expected str, got list"),
        ("sig: [1, 2]\n", "signal 'sig': expected a mapping, got list [1, 2]"),
        ("- a\n- b\n", "signals.yaml: top level must be a mapping of names, got list"),
        ("sig:\n  shard: {axis: 0\n", "signals.yaml:3: malformed YAML"),
        (
            "a:\n  shard: {axis: 0}\nb: {}\na:\n  shard: {axis: 1}\n",
            "signals.yaml:4: malformed YAML: duplicate key 'a' (first on line 1)",
        ),
        ("sig:\n  name: x\n", "signal 'sig', key 'name': unknown key(s) 'name'; known keys: "),
    ],
)
def test_bad_yaml_names_file_signal_key_and_value(tmp_path, yaml_text, expected):
    path = _write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        gt.load_config(path)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)
    assert gt.get_config() == {}  # a bad file registers nothing


def test_unknown_key_message_lists_only_yaml_keys(tmp_path):
    with pytest.raises(ConfigError) as info:
        gt.load_config(_write(tmp_path, "sig:\n  nam: x\n"))
    assert str(info.value).endswith("known keys: backward, compile, shard")


def test_non_utf8_file_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("sig:\n  shard: {axis: 0}  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: signal config file is not UTF-8"):
        gt.load_config(path)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("sig:\n  shard: {axis: 0\n", "malformed YAML"),
        ("sig:\n  shard: {axs: 0}\n", "unknown key(s) 'axs'"),
        (None, "cannot read signal config file"),
    ],
)
def test_gt_config_is_validated_in_a_world_of_one(tmp_path, monkeypatch, text, expected):
    # "try it with python first" must show the mistakes torchrun would
    path = _write(tmp_path, text) if text is not None else tmp_path / "missing.yaml"
    monkeypatch.setenv("GT_CONFIG", str(path))
    clear_config()
    with pytest.raises(ConfigError, match=re.escape(expected)):
        gt.randn(3)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read signal config file"):
        gt.load_config(tmp_path / "nope.yaml")


def test_unknown_backward_signal_warns(tmp_path):
    path = _write(tmp_path, "a:\n  shard: {axis: 0}\n  backward: b_typo\n")
    with pytest.warns(UserWarning, match="backward signal 'b_typo'"):
        gt.load_config(path)


def test_register_config_rejects_wrong_type():
    with pytest.raises(ConfigError, match="expects a SignalConfig"):
        gt.register_config("x", {"shard": {"axis": 0}})
