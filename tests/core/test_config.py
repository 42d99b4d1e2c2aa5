"""The YAML signal schema: what it accepts, and the exact errors for what it does not."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

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


# -- the config's device mesh (``mesh:``) and signals placed on it (``over``) --------------

MESH_OK = """\
mesh: {dp: 2, tp: 2}
rows:
  shard: {axis: 0, over: dp}
cols:
  shard: {axis: 1, over: tp}
grid:
  shard: {axis: [0, 1], over: [dp, tp]}
flat:
  shard: {axis: 0, over: [dp, tp]}
stage:
  shard: {axis: 0, workers: [2, 3]}
"""


def test_mesh_and_over_load_into_typed_dataclasses(tmp_path):
    loaded = gt.load_config(_write(tmp_path, MESH_OK))
    assert "mesh" not in loaded and set(loaded) == {"rows", "cols", "grid", "flat", "stage"}
    mesh = gt.get_mesh_config()
    assert mesh == gt.MeshConfig({"dp": 2, "tp": 2}) and mesh.names == ("dp", "tp")
    assert mesh.line == 1 and mesh.file.endswith("signals.yaml")
    assert gt.get_config("grid").shard == gt.ShardConfig(axis=[0, 1], over=["dp", "tp"])
    assert gt.get_config("grid").shard.layout() == [("dp", 0), ("tp", 1)]
    assert gt.get_config("flat").shard.layout() == [("dp", 0), ("tp", 0)]
    assert gt.get_config("cols").shard.layout() == [("tp", 1)]
    assert gt.get_config("stage").shard.over is None  # 1-D beside the mesh


def test_mesh_sizes_resolve_against_the_world():
    assert gt.MeshConfig({"dp": -1, "tp": 2}).sizes(8) == (("dp", 4), ("tp", 2))
    assert gt.MeshConfig({"dp": 2, "tp": 2}).sizes(4) == (("dp", 2), ("tp", 2))
    with pytest.raises(ConfigError, match=r"key 'mesh': mesh \{dp=-1, tp=3\}: the sizes tp=3 "):
        gt.MeshConfig({"dp": -1, "tp": 3}).sizes(4)
    with pytest.raises(ConfigError, match="multiply to 4, but the world has 2 rank"):
        gt.MeshConfig({"dp": 2, "tp": 2}).sizes(2)


def test_mesh_and_over_from_python():
    with pytest.raises(ConfigError, match="no mesh is declared"):
        gt.register_config("g", gt.SignalConfig(shard=gt.ShardConfig(axis=0, over="dp")))
    gt.register_mesh({"dp": 2, "tp": -1})
    gt.register_config("g", gt.SignalConfig(shard=gt.ShardConfig(axis=[1, 0], over=["dp", "tp"])))
    assert gt.get_mesh_config().dims == {"dp": 2, "tp": -1}
    with pytest.raises(ConfigError, match="mesh dim 'pp', which the mesh"):
        gt.register_config("h", gt.SignalConfig(shard=gt.ShardConfig(axis=0, over="pp")))
    with pytest.raises(ConfigError, match="reserved for the config's device mesh"):
        gt.register_config("mesh", gt.SignalConfig())
    with pytest.raises(ConfigError, match="only one mesh dim may be -1"):
        gt.register_mesh({"dp": -1, "tp": -1})
    gt.register_mesh(None)
    assert gt.get_mesh_config() is None


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        (
            "rows:\n  shard: {axis: 0}\nmesh:\n  dp: 2\n  tp: 0\n",
            "signals.yaml:5, key 'mesh.tp': mesh dim 'tp' must have a positive int size "
            "(or -1 for the rest of the world), got 0",
        ),
        ("mesh: {dp: two}\n", "signals.yaml:1, key 'mesh.dp': mesh dim 'dp' must have a posi"),
        ("mesh: {dp: 2.0}\n", "key 'mesh.dp': mesh dim 'dp' must have a positive int size"),
        (
            "mesh: {dp: -1, tp: -1}\n",
            "signals.yaml:1, key 'mesh.tp': only one mesh dim may be -1 (the rest of the "
            "world), got ['dp', 'tp']",
        ),
        (
            "mesh:\n  dp: 2\n  dp: 2\n",
            "signals.yaml:3: malformed YAML: duplicate key 'dp' (first on line 2)",
        ),
        ("mesh: [2, 2]\n", "signals.yaml:1, key 'mesh': mesh must map dim names to sizes"),
        ("mesh: {}\n", "key 'mesh': mesh must map dim names to sizes"),
        (
            "mesh:\n  shard: {axis: 0}\n",
            "signals.yaml:1, key 'mesh': 'mesh' is reserved for the config's device mesh (dim "
            "name -> size, e.g. mesh: {dp: 2, tp: 2}); a signal cannot be named 'mesh'",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard:\n    axis: 0\n    over: pp\n",
            "signals.yaml:5, signal 'sig', key 'shard.over': over names mesh dim 'pp', which "
            "the mesh {dp=2, tp=2} does not have; known dims: dp, tp",
        ),
        (
            "sig:\n  shard: {axis: 0, over: dp}\n",
            "signals.yaml:2, signal 'sig', key 'shard.over': over 'dp' names mesh dims, but "
            "no mesh is declared",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard:\n    axis: 0\n    workers: [0, 1]\n"
            "    over: dp\n",
            "signals.yaml:6, signal 'sig', key 'shard.over': over and workers cannot be combined",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {over: dp, replicated: true}\n",
            "signal 'sig', key 'shard.over': over and replicated: true cannot be combined",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard:\n    axis: [0, 1]\n    over: [dp]\n",
            "signals.yaml:4, signal 'sig', key 'shard.axis': axis [0, 1] and over ['dp'] must "
            "be lists of the same length",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {axis: [0, 1]}\n",
            "signal 'sig', key 'shard.axis': a list of axes [0, 1] needs over",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {axis: [0, 0], over: [dp, tp]}\n",
            "key 'shard.axis': tensor axis 0 is placed twice (over ['dp', 'tp']); to split one "
            "axis over several mesh dims write axis: 0, over: ['dp', 'tp']",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {axis: [0, 1], over: [dp, dp]}\n",
            "key 'shard.over': over names mesh dim 'dp' twice",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {axis: 0, over: [tp, dp]}\n",
            "key 'shard.over': one axis split over several mesh dims is split in the mesh's "
            "order: write over: ['dp', 'tp']",
        ),
        (
            "mesh: {dp: 2, tp: 2}\nsig:\n  shard: {axis: [0, -1], over: [dp, tp]}\n",
            "key 'shard.axis': axis must be >= 0, got -1",
        ),
        ("mesh: {dp: 2}\nsig:\n  shard: {axis: 0, over: 3}\n", "key 'shard.over': expected str"),
    ],
)
def test_bad_mesh_names_file_line_and_key(tmp_path, yaml_text, expected):
    path = _write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        gt.load_config(path)
    assert expected in str(info.value)
    assert gt.get_config() == {} and gt.get_mesh_config() is None  # nothing registered


def test_a_mesh_is_ignored_in_a_world_of_one(tmp_path, monkeypatch):
    # 2 x 2 cannot be a world of one: placements are ignored there, so the program runs as
    # plain torch; the sizes are checked when a world of 4 places on the mesh
    path = _write(tmp_path, MESH_OK)
    monkeypatch.setenv("GT_CONFIG", path)
    clear_config()
    gt.manual_seed(0)
    with gt.signal.context("grid"):
        x = gt.randn(7, 5)
    assert type(x) is torch.Tensor and gt.get_mesh_config().dims == {"dp": 2, "tp": 2}
    torch.manual_seed(0)
    assert torch.equal(x, torch.randn(7, 5))


def test_loaded_mappings_know_their_lines_and_dump_as_plain_yaml(tmp_path):
    import yaml

    from spmdgt.config import load_mapping

    data, _ = load_mapping(_write(tmp_path, MESH_OK))
    assert data.lines["mesh"] == 1 and data.lines["grid"] == 6
    assert data["grid"]["shard"].lines == {"axis": 7, "over": 7}
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # a dict to every other reader
