"""Fused and foreach optimizers on sharded parameters: equal to one process.

torch's fused (``_fused_adam_``, ``_fused_sgd_``...) and foreach (``_foreach_add_``...) kernels
mutate lists of tensors: parameters, gradients and states. The exact fallback once wrote back
its first argument only when it was a tensor, so with ``fused=True`` a sharded weight never
moved and its state held garbage. Here each optimizer trains a 7-row weight sharded on rows
(4/3, 3/3/1) or on columns, beside a plain bias, for three steps, and the weights and the
state dict are compared with one process. Also here: the other ways a step reads its
tensors (a 0-d tensor on a sub-mesh as ``alpha=``; ``autograd.grad`` with respect to a
plain leaf beside a sharded one, as ``differentiable=True`` steps need).
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks

ROWS, COLS = 7, 5

_OPTIMIZERS = {
    "Adam.fused": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
    "Adam.fused.amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True, amsgrad=True),
    "AdamW.fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True, weight_decay=0.1),
    "SGD.fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "SGD.fused.nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, fused=True
    ),
    "Adam.foreach": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
}


def _global(x):
    """The global value of a sharded tensor, through state dicts; plain ones as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return torch.tensor(x.numpy())
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _global(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_global(v) for v in x)
    return x


def _train(make, w0, b0, put, steps=3):
    """``steps`` steps of ``make([w, b])``; ``put`` lays a tensor out (identity: plain)."""
    w, b = put(w0).requires_grad_(), b0.clone().requires_grad_()
    opt = make([w, b])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = put(torch.randn(ROWS, COLS, generator=g))
        opt.zero_grad()
        ((w * x).sum(1) @ torch.ones(ROWS) + (b * b).sum() + (w * w * x).sum()).backward()
        opt.step()
    return {"w": _global(w), "b": _global(b), "state": _global(opt.state_dict())}


def _optimizers(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gen = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(ROWS, COLS, generator=gen), torch.randn(COLS, generator=gen)
    out = {}
    for signal in ("rows", "cols"):

        def put(t, signal=signal):
            with gt.signal.context(signal):
                return gt.tensor(t)

        for name, make in _OPTIMIZERS.items():
            got = _train(make, w0, b0, put)
            want = _train(make, w0, b0, lambda t: t.clone())
            out[signal, name] = (got, want, str(put(w0).placements))
    return out


def _check_optimizers(results):
    for out in results:
        for (signal, name), (got, want, placements) in out.items():
            where = f"{name} on {signal} ({placements})"
            assert placements == ("(Shard(dim=0),)" if signal == "rows" else "(Shard(dim=1),)")
            assert not torch.equal(got["w"], _initial_w()), f"{where}: the weight never moved"
            torch.testing.assert_close(got["w"], want["w"], rtol=1e-5, atol=1e-5, msg=where)
            torch.testing.assert_close(got["b"], want["b"], rtol=1e-5, atol=1e-5, msg=where)
            assert set(got["state"]["state"]) == set(want["state"]["state"]), where
            for i, state in want["state"]["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(
                        got["state"]["state"][i][key],
                        value,
                        rtol=1e-5,
                        atol=1e-5,
                        msg=f"{where}: state[{i}][{key}]",
                    )
            assert got["state"]["param_groups"] == want["state"]["param_groups"], where


def _initial_w():
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def test_fused_and_foreach_optimizers_on_2_ranks(tmp_path):
    _check_optimizers(run_ranks(_optimizers, 2, tmp_path))


def test_fused_and_foreach_optimizers_on_3_ranks(tmp_path):
    _check_optimizers(run_ranks(_optimizers, 3, tmp_path))


def _reads(rank, world):
    """A 0-d value on a sub-mesh as ``alpha=`` (three times: DTensor caches its sharding
    decision after the first), and ``autograd.grad`` with respect to a plain leaf beside a
    sharded one."""
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("late", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[1])))
    gen = torch.Generator().manual_seed(0)
    w0, m0, s0 = torch.randn(ROWS, COLS, generator=gen), torch.randn(COLS, 3), torch.randn(4)
    with gt.signal.context("late"):  # on rank 1 only: rank 0 holds none of it
        s = gt.tensor(s0)
    p, ref = w0.clone(), w0.clone()
    for i in range(3):
        t = s.sum() * (i + 1)  # 0-d, on the sub-mesh
        p.add_(torch.ones(ROWS, COLS), alpha=t)
        ref.add_(torch.ones(ROWS, COLS), alpha=float(s0.sum() * (i + 1)))
    with gt.signal.context("rows"):
        w = gt.tensor(w0, requires_grad=True)
    m = m0.clone().requires_grad_()
    loss = ((w @ m).tanh() ** 2).sum() + (m * 3).sum()
    gw, gm = torch.autograd.grad(loss, [w, m])
    wr, mr = w0.clone().requires_grad_(), m0.clone().requires_grad_()
    rw, rm = torch.autograd.grad(((wr @ mr).tanh() ** 2).sum() + (mr * 3).sum(), [wr, mr])
    return p, ref, _global(gw), rw, _global(gm), rm


def _check_reads(results):
    for p, ref, gw, rw, gm, rm in results:
        torch.testing.assert_close(p, ref)
        torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gm, rm, rtol=1e-5, atol=1e-5)


def test_scalar_reads_and_plain_grads_on_2_ranks(tmp_path):
    _check_reads(run_ranks(_reads, 2, tmp_path))


def test_scalar_reads_and_plain_grads_on_3_ranks(tmp_path):
    _check_reads(run_ranks(_reads, 3, tmp_path))
