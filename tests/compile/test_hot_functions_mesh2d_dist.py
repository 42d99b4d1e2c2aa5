"""Hot functions (``GT_AUTO_COMPILE=1``) on a signal of the config's 2-D mesh.

Four forked gloo ranks load ``mesh: {dp: 2, tp: 2}``; a GT-style training loop keeps its data
``shard: {axis: 0, over: dp}`` (7 rows: 4 + 3) and its weights ``shard: {axis: 1, over: tp}``
(6 and 3 columns: 3 + 3, 2 + 1) and steps a ``torch.optim.SGD`` with no host read inside the
loop, so the optimizer steps (``compile/_steps.py``) are the only agreement points. The pass
must turn the step's forward hot, compile it on every rank at the same call (or run it
eagerly, saying why in ``spmdgt.compile.status()``), and every step's loss and gradients
must equal one-process torch within 1e-5 on every rank. Three runs in one fork: the
environment's pass (``aot_eager``: dynamo's graphs without a C++ build; inductor, run by hand,
gives the same numbers after a ~40 s cold compile), a backend that fails on rank 3 only (eager
everywhere, each status saying why), and the model as an ``nn.Module`` with AdamW and a host
read of each loss (its ``forward`` turns hot, as a HF model's does).
"""

from __future__ import annotations

import textwrap

import numpy as np
import torch
import torch.nn.functional as F

from tests._dist import run_ranks

YAML = textwrap.dedent(
    """
    mesh: {dp: 2, tp: 2}
    data:
      shard: {axis: 0, over: dp}
    weights:
      shard: {axis: 1, over: tp}
    """
)
ENV = {
    "GT_AUTO_COMPILE": "1",
    "GT_COMPILE_BACKEND": "aot_eager",  # dynamo's graphs, no C++ build: seconds, not minutes
    "GT_COMPILE_SAMPLE_EVERY": "2",
    "GT_COMPILE_HOT_SAMPLES": "4",
}
STEPS, LR = 12, 0.1


def _forward(x, y, w1, w2):
    """The model: (7, 5) @ (5, 6) -> tanh -> @ (6, 3), mean-squared error against ``y``."""
    h = torch.tanh(x @ w1)
    out = h @ w2
    return F.mse_loss(out, y) + 0.01 * (w1 * w1).sum()


def _forward_again(x, y, w1, w2):
    """``_forward`` under another code object: the second phase's function, fresh to the pass."""
    h = torch.tanh(x @ w1)
    out = h @ w2
    return F.mse_loss(out, y) + 0.01 * (w1 * w1).sum()


class _MLP(torch.nn.Module):
    """The model as a module with the weights as its parameters, stepped by AdamW with a host
    read of each loss: the module's forward turns hot (as a HF model's does)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)

    def forward(self, x, y):
        h = torch.tanh(x @ self.w1)
        return F.mse_loss(h @ self.w2, y) + 0.01 * (self.w1 * self.w1).sum()


def _module_losses(make, lr=0.05):
    """AdamW on ``_MLP``, reading each step's loss on the host; ``make(name, value)`` lays a
    value out (a signal's tensor, or the plain tensor for the reference)."""
    x, y, w1, w2 = _data()
    x, y = make("data", x), make("data", y)
    model = _MLP(make("weights", w1), make("weights", w2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a host read: an agreement point every step
    return losses, model.w1.grad.numpy()


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 3, generator=g)
    w1, w2 = torch.randn(5, 6, generator=g) * 0.5, torch.randn(6, 3, generator=g) * 0.5
    return x, y, w1, w2


def _reference():
    x, y, w1, w2 = _data()
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    opt = torch.optim.SGD([w1, w2], lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _forward(x, y, w1, w2)
        loss.backward()
        losses.append(loss.item())
        grads.append((w1.grad.clone(), w2.grad.clone()))
        opt.step()
    return losses, grads


def _loop(gt, gt_compile, path, forward):
    """The GT training loop on the 2x2 mesh: this rank's losses, gradients, placements and
    the compile count after each step."""
    gt.load_config(path)
    x, y, w1, w2 = _data()
    with gt.signal.context("data"):
        x, y = gt.tensor(x), gt.tensor(y)
    with gt.signal.context("weights"):
        w1, w2 = gt.tensor(w1, requires_grad=True), gt.tensor(w2, requires_grad=True)
    placements = (tuple(x.placements), tuple(w1.placements), tuple(w2.to_local().shape))
    opt = torch.optim.SGD([w1, w2], lr=LR)
    losses, grads, compiled_at = [], [], []
    for _ in range(STEPS):  # no host read here: the optimizer steps are the agreement points
        opt.zero_grad()
        loss = forward(x, y, w1, w2)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append((w1.grad.detach().clone(), w2.grad.detach().clone()))
        opt.step()
        compiled_at.append(gt_compile.stats()["compiled"])
    st = gt_compile.stats()
    return {
        "losses": [float(v.item()) for v in losses],
        "grads": [(a.numpy(), b.numpy()) for a, b in grads],
        "placements": placements,
        "compiled_at": compiled_at,
        "status": gt_compile.status(),
        "stats": {k: st[k] for k in ("compiled", "graph_runs", "fallbacks", "training_steps")},
    }


def _train(rank, world, path):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    torch.set_num_threads(1)
    # A user's (or a test's) reset clears dynamo's compile callbacks, spmdgt's included: they
    # must come back, or dynamo traces gt.Tensor's own hook and every compiled loss doubled.
    import spmdgt.tensor._tensor  # installs them

    torch._dynamo.reset()
    # the parent imported spmdgt without the variable: turn the pass on as a rank's import does
    assert gt_compile.maybe_enable_from_env(), gt_compile.status()
    compiled = _loop(gt, gt_compile, path, _forward)
    gt_compile.disable()

    def fails_on_rank_3(gm, example_inputs):  # the compile fails on one rank of the four
        if rank == 3:
            raise RuntimeError("only rank 3 fails")
        return gm.forward

    gt_compile.enable(backend=fails_on_rank_3, every=2, hot_at=4)
    try:
        eager = _loop(gt, gt_compile, path, _forward_again)
    finally:
        gt_compile.disable()

    def make(name, value):
        with gt.signal.context(name):
            return gt.tensor(value)

    gt_compile.enable(backend="aot_eager", every=2, hot_at=4)
    try:
        module = (*_module_losses(make), gt_compile.status())
    finally:
        gt_compile.disable()
    return compiled, eager, module


def _check_values(rank, r, ref_losses, ref_grads):
    from torch.distributed.tensor import Replicate, Shard

    x_p, w_p, w2_local = r["placements"]
    assert x_p == (Shard(0), Replicate()) and w_p == (Replicate(), Shard(1)), rank
    assert w2_local == ((6, 2), (6, 1), (6, 2), (6, 1))[rank]  # 3 columns over tp: uneven
    np.testing.assert_allclose(r["losses"], ref_losses, rtol=0, atol=1e-5)
    for step, ((g1, g2), (r1, r2)) in enumerate(zip(r["grads"], ref_grads, strict=True)):
        np.testing.assert_allclose(g1, r1.numpy(), rtol=0, atol=1e-5, err_msg=f"{step}")
        np.testing.assert_allclose(g2, r2.numpy(), rtol=0, atol=1e-5, err_msg=f"{step}")
    assert r["stats"]["training_steps"] == STEPS, r["stats"]


def test_hot_function_on_the_2d_mesh_compiles_and_matches_one_process(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(YAML)
    ref_losses, ref_grads = _reference()
    results = run_ranks(_train, 4, tmp_path, str(path), env=ENV, timeout=240)
    module_ref = _module_losses(lambda name, value: value)
    for rank, (compiled, eager, module) in enumerate(results):
        _check_values(rank, compiled, ref_losses, ref_grads)
        st = compiled["stats"]
        assert st["compiled"] == 1 and st["graph_runs"] == STEPS - 1, compiled["status"]
        assert compiled["status"].startswith("compiled: _forward ("), compiled["status"]
        assert not st["fallbacks"], compiled["status"]
        # hot during step 1, agreed at its optimizer step, compiled at step 2 on every rank
        assert compiled["compiled_at"] == [0] + [1] * (STEPS - 1), (rank, compiled)
        # a compile that fails on rank 3: eager on every rank, exact, and the status says why
        _check_values(rank, eager, ref_losses, ref_grads)
        st = eager["stats"]
        assert st["compiled"] == 0 and st["graph_runs"] == 0, eager["status"]
        if rank == 3:
            assert "only rank 3 fails" in eager["status"], eager["status"]
        else:
            assert eager["status"] == "nothing compiled: another rank's compile failed (x1)"
        # the module with AdamW and host reads: its forward compiled, the same numbers
        losses, w1_grad, status = module
        np.testing.assert_allclose(losses, module_ref[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(w1_grad, module_ref[1], rtol=0, atol=1e-5)
        assert status.startswith("compiled: _MLP.forward ("), status
