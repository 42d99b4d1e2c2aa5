"""Training with sharded spmdgt parameters and torch.optim: equal to one-process torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests._dist import run_ranks

B, D, H, C = 9, 6, 10, 5  # uneven over 2 ranks on purpose


def _train(rank, world, optimizer_name):
    import spmdgt as gt

    gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config(
        "cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1), backward_signal="cols")
    )
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))

    def params(sharded: bool):
        gen = torch.Generator().manual_seed(0)
        w1 = torch.randn(D, H, generator=gen) * 0.3
        w2 = torch.randn(H, C, generator=gen) * 0.3
        b1 = torch.zeros(H)
        if not sharded:
            return [t.requires_grad_() for t in (w1, w2, b1)]
        with gt.signal.context("cols"):
            gw1 = gt.tensor(w1, requires_grad=True)  # column parallel
        with gt.signal.context("rows"):
            gw2 = gt.tensor(w2, requires_grad=True)  # row parallel: contraction sharded
        return [gw1, gw2, b1.requires_grad_()]

    def make_opt(ps):
        if optimizer_name == "adamw":
            return torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    ours, ref = params(True), params(False)
    opt, ropt = make_opt(ours), make_opt(ref)
    losses = []
    for step in range(4):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(B, D, generator=gen)
        y = torch.randint(0, C, (B,), generator=gen)
        with gt.signal.context("data"):
            gx = gt.tensor(x)
        for (w1, w2, b1), inp, o in ((ours, gx, opt), (ref, x, ropt)):
            h = torch.tanh(inp @ w1 + b1)
            loss = F.cross_entropy(torch.softmax(h @ w2, dim=-1).log(), y)
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.item())
    return (
        losses,
        [(p.numpy() if hasattr(p, "placements") else p.detach().numpy()) for p in ours],
        [p.detach().numpy() for p in ref],
        [str(getattr(p, "placements", "plain")) for p in ours],
        str(ours[0].grad.placements),
    )


def _check(results):
    for losses, got, ref, placements, grad_place in results:
        for i in range(0, len(losses), 2):
            assert abs(losses[i] - losses[i + 1]) < 1e-5, losses
        for g, r in zip(got, ref):
            # AdamW normalises by sqrt(v): fp32 reduction-order noise stays ~1e-6.
            torch.testing.assert_close(torch.tensor(g), torch.tensor(r), rtol=1e-5, atol=1e-5)
        assert placements == ["(Shard(dim=1),)", "(Shard(dim=0),)", "plain"]
        assert grad_place == "(Shard(dim=1),)"


def test_sharded_parameters_train_like_torch_sgd(tmp_path):
    _check(run_ranks(_train, 2, tmp_path, "sgd"))


def test_sharded_parameters_train_like_torch_adamw(tmp_path):
    _check(run_ranks(_train, 2, tmp_path, "adamw"))
