"""A world of one: plain `python`, no launcher, no config: spmdgt is torch, at torch's speed."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import spmdgt as gt


def test_no_setup_and_no_process_group():
    x = gt.randn(2, 2)
    assert gt.rank() == 0 and gt.world_size() == 1 and gt.device().type in ("cpu", "cuda")
    assert type(x) is torch.Tensor  # replicated on a world of one: a plain tensor, no wrapper
    assert not dist.is_initialized()


def test_world_of_one_never_loads_dtensor():
    # Pay only for what is used: torch.distributed.tensor costs ~2 s to import, and a world of
    # one (all tensors plain) must not load it, YAML signals and all; gt.Tensor still resolves.
    code = (
        "import sys, spmdgt as gt\n"
        "gt.register_config('d', gt.SignalConfig(shard=gt.ShardConfig(axis=0)))\n"
        "with gt.signal.context('d'):\n"
        "    x = gt.randn(4, 3, requires_grad=True)\n"
        "(x @ gt.signal.tensor(gt.ones(3, 2), 'd')).sum().backward()\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'loaded'\n"
        "assert gt.Tensor.__name__ == 'Tensor' and 'torch.distributed.tensor' in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GT_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_creation_api_dtypes_and_grad():
    assert gt.zeros(2, 3).shape == (2, 3) and gt.ones((4,)).sum().item() == 4
    assert gt.randn(3, dtype="float64").dtype == torch.float64
    assert gt.zeros(2, dtype=gt.float16).dtype == torch.float16
    assert gt.tensor([1, 2, 3], dtype="int64").tolist() == [1, 2, 3]
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = gt.from_numpy(a)
    assert np.array_equal(t.numpy(), a)
    w = gt.randn(3, 2, requires_grad=True)
    y = (gt.tensor(a) @ w).sum()
    y.backward()
    np.testing.assert_allclose(w.grad.numpy(), a.sum(0)[:, None].repeat(2, 1))
    y2 = (gt.tensor(a) @ w).sum()
    y2.backward()  # torch semantics: gradients accumulate (GT overwrote them: a bug)
    np.testing.assert_allclose(w.grad.numpy(), 2 * a.sum(0)[:, None].repeat(2, 1))
    with gt.no_grad():
        assert not (w * 2).requires_grad
    assert gt.cat([gt.ones(1, 2), gt.zeros(2, 2)], axis=0).shape == (3, 2)
    assert gt.full((2,), 7.0).tolist() == [7.0, 7.0]
    assert gt.arange(5).tolist() == [0, 1, 2, 3, 4]
    assert gt.eye(2).trace().item() == 2


def test_gt_reduction_spellings_and_torch_semantics():
    x = gt.tensor([[1.0, 5.0], [3.0, 2.0]])
    assert x.sum(axis=0).tolist() == [4.0, 7.0]
    assert x.mean(axis=1, keepdims=True).shape == (2, 1)
    # torch wins where GT differs: max(axis) returns (values, indices)
    values, indices = x.max(axis=1)
    assert values.tolist() == [5.0, 3.0] and indices.tolist() == [1, 0]
    assert (x.data.numpy() == np.array([[1, 5], [3, 2]])).all()
    assert x.sum().item() == 11.0


def test_same_seed_same_values():
    gt.manual_seed(7)
    a = gt.randn(4, 4)
    torch.manual_seed(7)
    assert torch.equal(a, torch.randn(4, 4))


def test_signals_are_tracked_but_placement_is_ignored_on_one_rank():
    gt.register_config("s", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1, 2])))
    try:
        with gt.signal.context("s"):
            assert gt.signal.current_signal() == "s"
            x = gt.randn(5, 3)
            assert gt.signal.tensor(x, "s") is x
        assert gt.signal.current_signal() is None
        assert type(x) is torch.Tensor
        gt.signal.enter("a")
        gt.signal.enter("b")
        with pytest.raises(RuntimeError, match="does not match the innermost scope 'b'"):
            gt.signal.exit("a")
        gt.signal.exit("b")
        gt.signal.exit("a")
        with pytest.raises(RuntimeError, match="without a matching"):
            gt.signal.exit()
    finally:
        gt.config.clear_config()


def test_bad_creation_input():
    with pytest.raises(ValueError, match="shape must be non-negative ints"):
        gt.randn(2, -1)
    with pytest.raises(TypeError, match="unknown dtype 'flaot32'"):
        gt.zeros(2, dtype="flaot32")
    with pytest.raises(TypeError, match=r"expects a numpy\.ndarray"):
        gt.from_numpy([1, 2])


def test_device_mesh_on_one_rank_needs_no_network():
    mesh = gt.device_mesh()
    assert mesh.size() == 1
    gt.shutdown()
    assert not dist.is_initialized()
