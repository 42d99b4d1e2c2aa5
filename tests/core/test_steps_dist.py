"""Whole training steps on a sharded batch equal one process: forward, backward, gradient
clipping, accumulation over uneven micro-batches and 3 optimizer steps, for the layers users
train (Linear, Embedding, LayerNorm, BatchNorm1d, Conv1d, MultiheadAttention, scaled dot
product attention, dropout, a transformer block).

Each rank computes the one-process reference itself (plain tensors, the same seeds) and the
sharded run, then compares: every step's loss, every parameter's gradient before each step,
and the weights after the last one. The batch is created under a data-parallel signal
(``rows``), or under one with a ``backward:`` signal (``rows_bwd``: the input itself needs
grad, and its gradient is laid out as the backward signal says). No seed call in the program
but the dropout's (the ranks' generators agree with none).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks

MICRO = (7, 6)  # uneven, then even, on 2 and 3 ranks: two micro-batches accumulate a step
STEPS = 3  # the 2nd and 3rd steps run on optimizer state (momentum, Adam's moments)
D = 6  # features in


class _Attention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention`` (causal), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2)).mean(1)


class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        y, _ = self.mha(h, h, h, need_weights=False)
        return self.out(y).mean(1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 8)
        self.block = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.block(self.inp(x))).mean(1)


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.out = nn.Linear(4 * D, 3)

    def forward(self, x):
        return self.out(self.emb(x).flatten(1))


def _model(name: str) -> nn.Module:
    if name == "linear":
        return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3))
    if name == "layernorm":
        return nn.Sequential(nn.Linear(D, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    if name == "batchnorm":
        return nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    if name == "conv1d":
        return nn.Sequential(nn.Conv1d(D, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3, 3))
    if name == "dropout":
        return nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.3), nn.Linear(8, 3))
    if name == "embedding":
        return _Embed()
    if name == "mha":
        return _MHA()
    if name == "sdpa":
        return _Attention()
    if name == "transformer":
        return _Block()
    raise KeyError(name)


MODELS = (
    "linear",
    "embedding",
    "layernorm",
    "batchnorm",
    "conv1d",
    "mha",
    "sdpa",
    "dropout",
    "transformer",
)


def _batch(name: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if name == "embedding":
        return torch.randint(0, 11, (n, D), generator=gen)
    if name == "conv1d":
        return torch.randn(n, D, 5, generator=gen)
    if name in ("mha", "sdpa", "transformer"):
        return torch.randn(n, 4, D, generator=gen)
    return torch.randn(n, D, generator=gen)


def _train(model_name, optimizer, signal, put, seed):
    """5 steps of 2 accumulated micro-batches; ``put`` lays a batch out (identity: the
    reference). Returns the losses, the gradients before each step, the final weights and the
    input gradients (``rows_bwd``)."""
    gen = torch.Generator().manual_seed(seed)
    model = _model(model_name)
    with torch.no_grad():  # the same weights everywhere, whatever the model's init draws
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if optimizer == "adamw":
        # eps 1e-4: a parameter whose true gradient is 0 (a key bias, a bias before
        # BatchNorm) gets fp32 rounding noise (~1e-9) that Adam would divide by its own size
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, eps=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads, input_grads = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        for i, n in enumerate(MICRO):
            x = _batch(model_name, n, gen)
            y = torch.randn(n, 3, generator=gen)
            needs_grad = signal == "rows_bwd" and x.is_floating_point()
            gx, gy = put(x, needs_grad), put(y, False)
            torch.manual_seed(1000 * seed + 10 * step + i)  # dropout: the same masks
            loss = F.mse_loss(model(gx), gy) / len(MICRO)
            loss.backward()
            losses.append(float(loss))
            if needs_grad:
                input_grads.append(_value(gx.grad))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        grads.append([_value(p.grad) for p in model.parameters()])
        opt.step()
    return losses, grads, [_value(p) for p in model.parameters()], input_grads


def _value(t: torch.Tensor) -> torch.Tensor:
    from spmdgt.tensor._tensor import global_value

    return global_value(t).clone()


def _run(rank, world, cases):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("rep", gt.SignalConfig(shard=gt.ShardConfig(axis=0, replicated=True)))
    gt.register_config(
        "rows_bwd", gt.SignalConfig(shard=gt.ShardConfig(axis=0), backward_signal="rep")
    )
    failures = []
    for k, (model_name, optimizer, signal) in enumerate(cases):

        def reference(x, needs_grad):
            return x.clone().requires_grad_(needs_grad)

        def sharded(x, needs_grad, signal=signal):
            with gt.signal.context(signal):
                return gt.tensor(x, requires_grad=needs_grad)

        want = _train(model_name, optimizer, signal, reference, k)
        try:
            got = _train(model_name, optimizer, signal, sharded, k)
        except Exception as e:
            failures.append(f"{model_name}/{optimizer}/{signal}: raised {type(e).__name__}: {e}")
            continue
        try:
            _compare(got, want)
        except AssertionError as e:
            failures.append(f"{model_name}/{optimizer}/{signal}: {str(e).splitlines()[:3]}")
    return failures


def _compare(got, want) -> None:
    # fp32: a sharded reduction sums in another order (~1e-7 relative); AdamW's division by
    # sqrt(v) can lift that to ~1e-6 on tiny gradients. 1e-5 keeps room and catches any
    # real error (a factor of the world size, a dropped shard).
    tol = {"rtol": 1e-5, "atol": 1e-5}
    g_losses, g_grads, g_weights, g_inputs = got
    w_losses, w_grads, w_weights, w_inputs = want
    torch.testing.assert_close(torch.tensor(g_losses), torch.tensor(w_losses), **tol)
    for step, (gs, ws) in enumerate(zip(g_grads, w_grads)):
        for i, (g, w) in enumerate(zip(gs, ws)):
            torch.testing.assert_close(
                g, w, **tol, msg=lambda m, s=step, i=i: f"grad {i} step {s}: {m}"
            )
    for i, (g, w) in enumerate(zip(g_weights, w_weights)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"weight {i}: {m}")
    assert len(g_inputs) == len(w_inputs)
    for g, w in zip(g_inputs, w_inputs):
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"input grad: {m}")


def _cases(optimizers: tuple[str, ...]) -> list[tuple[str, str, str]]:
    return [(m, o, s) for m in MODELS for o in optimizers for s in ("rows", "rows_bwd")]


# 2 ranks: slow (3 ranks, uneven and a sub-mesh, stands for it; tests/train trains on 2 ranks).
# SGD is slow too: AdamW's steps read the same gradients and carry state (the optimizer
# scenarios of tests/parity sweep every torch.optim on sharded parameters)
@pytest.mark.parametrize(
    "world, optimizers",
    [
        pytest.param(2, ("sgd", "adamw"), marks=pytest.mark.slow),
        pytest.param(3, ("sgd",), marks=pytest.mark.slow),
        (3, ("adamw",)),
    ],
)
def test_whole_steps_equal_one_process(tmp_path, world, optimizers):
    results = run_ranks(_run, world, tmp_path, _cases(optimizers), timeout=600)
    assert results == [[]] * world, "\n".join(f for r in results for f in r)
