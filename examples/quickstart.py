"""spmdgt quick start: GT's README example, a signal-sharded matmul, a few training steps.

    python examples/quickstart.py                                   # one process
    GT_CONFIG=examples/quickstart.yaml \\
        torchrun --nproc_per_node=2 examples/quickstart.py          # the same program, 2 ranks
    GT_AUTO_SHARD=1 torchrun --nproc_per_node=2 examples/quickstart.py
    GT_CONFIG=examples/quickstart_2d.yaml \\
        torchrun --nproc_per_node=4 examples/quickstart.py          # a 2 x 2 (dp, tp) mesh

Every rank runs this file; values printed are global and identical on every rank and in every
configuration (rank 0 prints them).
"""

from __future__ import annotations

import os

import torch

import spmdgt as gt

here = os.path.dirname(os.path.abspath(__file__))
if "GT_CONFIG" not in os.environ and os.environ.get("GT_AUTO_SHARD", "0") == "0":
    gt.print0("(no GT_CONFIG: every tensor replicated; try GT_CONFIG=examples/quickstart.yaml)")

# 1. GT's README example. GT wrote `c.data.numpy()`; on a GPU a replicated value is a plain
#    CUDA tensor, whose `.numpy()` raises as torch's does, so `.cpu()` first (works everywhere).
gt.manual_seed(0)
a = gt.tensor([[1.0, 2.0], [3.0, 4.0]])
b = gt.from_numpy(torch.ones(2, 2).numpy())
c = a @ b + 2.0
gt.print0("a @ b + 2 =\n", c.data.cpu().numpy())
gt.print0("sum:", c.sum().item(), " max over axis 1:", c.max(axis=1).values.cpu().numpy())

# 2. A signal-sharded matmul: x rows split ('data'), w columns split ('weights').
with gt.signal.context("data"):
    x = gt.randn(10, 16)
with gt.signal.context("weights"):
    w = gt.randn(16, 6, requires_grad=True)
y = x @ w
loss = (y * y).mean()
loss.backward()
gt.print0(
    f"world={gt.world_size()} x: {getattr(x, 'placements', 'replicated')}  "
    f"w: {getattr(w, 'placements', 'replicated')}  y: {getattr(y, 'placements', 'replicated')}"
)
gt.print0(f"loss={loss.item():.6f}  |grad w|={w.grad.norm().item():.6f}")

# 3. A few training steps of a plain torch.nn model on spmdgt inputs.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model.to(gt.device())  # where spmdgt's tensors live: this rank's GPU under torchrun, else the CPU
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
gt.manual_seed(1)
with gt.signal.context("data"):
    inputs = gt.randn(24, 16)
    targets = inputs.sum(axis=1, keepdims=True).sin()
for step in range(5):
    pred = model(inputs)
    loss = torch.nn.functional.mse_loss(pred, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    gt.print0(f"step {step}: loss {loss.item():.6f}")
