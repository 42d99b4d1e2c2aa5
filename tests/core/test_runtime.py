"""The runtime: environment parsing, GT's worker knob, fork hygiene, tensor re-placement."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import spmdgt as gt
import spmdgt.runtime._state as state
from tests._dist import run_ranks


def test_bad_torchrun_environment_names_the_variable(monkeypatch):
    monkeypatch.setattr(state, "_runtime", None)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        gt.init()
    monkeypatch.setattr(state, "_runtime", None)


def test_gt_device_picks_or_refuses_a_device(monkeypatch):
    monkeypatch.setattr(state, "_runtime", None)
    monkeypatch.setenv("GT_DEVICE", "cpu")
    assert gt.init().device.type == "cpu"  # CPU even where a GPU is visible
    monkeypatch.setattr(state, "_runtime", None)
    monkeypatch.setenv("GT_DEVICE", "tpu")
    with pytest.raises(ValueError, match="GT_DEVICE='tpu'"):
        gt.init()
    if not torch.cuda.is_available():
        monkeypatch.setattr(state, "_runtime", None)
        monkeypatch.setenv("GT_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="GT_DEVICE=cuda, but torch sees no CUDA"):
            gt.init()
    monkeypatch.setattr(state, "_runtime", None)


def test_gpu_workers_reports_the_real_world():
    assert gt.gpu_workers(1) == 1
    with pytest.warns(UserWarning, match=r"torchrun --nproc_per_node=4"):
        assert gt.gpu_workers(4) == 1


def test_connect_has_no_dispatcher_but_runs():
    assert gt.connect() is gt.init()  # GT's attach call: the rank as gt.init() sets it up
    with pytest.warns(UserWarning, match=r"no dispatcher.*torchrun"):
        assert gt.connect("localhost:9000").world_size == 1


def _child_world(conn) -> None:
    conn.send((state._runtime is None, gt.world_size()))


def test_forked_child_forgets_the_parents_runtime(monkeypatch):
    gt.init()
    assert state._runtime is not None
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    p = ctx.Process(target=_child_world, args=(child,))
    p.start()
    assert parent.poll(60)
    fresh, world = parent.recv()
    p.join(10)
    assert fresh and world == 1


def _retensor(rank, world):
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gt.manual_seed(3)
    with gt.signal.context("rows"):
        a = gt.randn(5, 4)
    with gt.signal.context("cols"):
        b = gt.tensor(a)  # a sharded input: its global value, re-placed
    return b.placements, b.numpy(), a.numpy()


def test_tensor_of_a_sharded_tensor_uses_its_global_value(tmp_path):
    for placements, b, a in run_ranks(_retensor, 2, tmp_path):
        assert str(placements) == "(Shard(dim=1),)"
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a))


def test_session_reset_forgets_every_part():
    # the one object that owns process-wide state: a test or a forked child calls reset()
    # instead of poking private globals
    import spmdgt as gt
    import spmdgt.compile  # registers its part
    from spmdgt import interceptor
    from spmdgt._core import scope
    from spmdgt.config import get_config

    parts = ["compile", "interceptor", "autoplan", "meshes", "runtime", "signals", "scopes"]
    # upper layers forgotten first; a part loaded on first use (the fast path's cache, once a
    # sharded tensor exists in this process) may sit among them
    assert [p for p in gt.session.parts() if p in parts] == parts
    assert set(gt.session.parts()) <= {*parts, "fastpath"}
    gt.register_config("s", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.signal.enter("s")
    interceptor.enable(stats=True)
    gt.device_mesh()
    assert get_config("s") is not None and scope.current() == "s" and interceptor.is_enabled()
    gt.session.reset()
    import spmdgt.runtime._state as state

    assert scope.current() is None and not interceptor.is_enabled()
    assert get_config("s") is None
    assert state._runtime is None and state._world_mesh is None
