"""CUDA paths, run where torch sees a GPU (skipped on CPU-only machines such as CI): a world of
one on the GPU, the trainer on CUDA (fp32 against the one-process reference, fp16 AMP with a
GradScaler, bf16 AMP, CUDA memory in the summary) and bitwise checkpoint resume on the GPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import spmdgt as gt
import spmdgt.runtime._state as state
from spmdgt.train import DistributedTrainer, OptimizedDataLoader
from tests.train._models import make_dataset, make_model, make_optimizer, reference_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _on_the_gpu(monkeypatch):
    monkeypatch.delenv("GT_DEVICE", raising=False)
    monkeypatch.setattr(state, "_runtime", None)
    yield
    monkeypatch.setattr(state, "_runtime", None)


def _loader(bs: int = 8):
    return OptimizedDataLoader.create(make_dataset(), bs, shuffle=False)


def test_world_of_one_runs_on_the_gpu():
    gt.manual_seed(0)
    x = gt.randn(257, 129)
    torch.manual_seed(0)
    ref = torch.randn(257, 129, device="cuda")
    assert gt.device().type == "cuda" and type(x) is torch.Tensor and x.device.type == "cuda"
    assert torch.equal(x, ref)  # same seed, same generator: torch's numbers
    y = (x @ x.T).relu().sum(axis=0, keepdims=True)
    torch.testing.assert_close(y, (ref @ ref.T).relu().sum(0, keepdim=True))
    assert y.cpu().numpy().shape == (1, 257) and y.sum().item() > 0
    with pytest.raises(TypeError):
        y.numpy()  # torch's rule for device memory (README: torch wins); .cpu().numpy() works


def test_trainer_fp32_on_cuda_matches_the_reference():
    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, max_grad_norm=0.5)
    s = t.train(_loader(), epochs=1)
    ref, ref_losses = reference_train(make_dataset(), 8, 6, max_grad_norm=0.5)
    assert next(t.model.parameters()).device.type == "cuda"
    for k, v in ref.items():  # CPU reference; CUDA kernels sum in another order
        torch.testing.assert_close(t.model.state_dict()[k].cpu(), v, atol=1e-5, rtol=1e-5)
    assert s["final_loss"] == pytest.approx(ref_losses[-1], abs=1e-5)
    assert s["memory_kind"] == "cuda_allocated" and s["peak_memory_allocated_gb"] > 0


def _linear_dtypes(model) -> list:
    # A Linear's output: autocast's lower precision on CUDA (LayerNorm, the model's last op,
    # autocasts to fp32 on CUDA, unlike on the CPU).
    seen = []
    model.down.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    return seen


def test_fp16_amp_uses_a_grad_scaler():
    def loss_fn(out, y):
        return F.mse_loss(out.float(), y)

    model = make_model()
    seen = _linear_dtypes(model)
    before = [p.detach().clone() for p in model.parameters()]
    t = DistributedTrainer(
        model, make_optimizer(model), loss_fn=loss_fn, use_amp=True, amp_dtype=torch.float16
    )
    s = t.train(_loader(), epochs=1)
    assert isinstance(t.scaler, torch.amp.GradScaler) and t.scaler.is_enabled()
    assert t.scaler.get_scale() > 0 and math.isfinite(s["final_loss"])
    assert set(seen) == {torch.float16}
    after = list(t.model.parameters())
    assert all(p.dtype == torch.float32 for p in after)  # fp32 master weights
    assert any(not torch.equal(a.cpu(), b) for a, b in zip(after, before))  # steps applied


def test_bf16_amp_on_cuda_needs_no_scaler():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")

    def loss_fn(out, y):
        return F.mse_loss(out.float(), y)

    model = make_model()
    seen = _linear_dtypes(model)
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=loss_fn, use_amp=True)
    s = t.train(_loader(), epochs=1, max_steps=3)
    assert seen == [torch.bfloat16] * 3 and t.scaler is None and math.isfinite(s["final_loss"])


def test_checkpoint_resume_is_bitwise_on_cuda(tmp_path):
    from tests.train.test_checkpoint import _resume_run

    ref_losses, ref_state, first, second, second_state = _resume_run(0, 1, str(tmp_path), "ddp")
    assert first == ref_losses[:8] and second.last_stats.global_losses == ref_losses[8:]
    for k, v in ref_state.items():
        assert torch.equal(second_state[k], v), k
