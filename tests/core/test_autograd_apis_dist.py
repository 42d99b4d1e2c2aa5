"""Every autograd entry point on sharded inputs equals one process, or raises clearly.

A plain ``nn.Linear`` applied to a 7-row batch sharded over 2 or 3 ranks (4/3 and 3/3/1 rows)
and a sharded parameter, against plain torch on the global values in the same rank: gradients
w.r.t. plain and sharded parameters (``torch.autograd.grad``, ``allow_unused``,
``create_graph``), ``backward(inputs=)``, ``retain_graph``, hooks, checkpointing, the
``torch.autograd.functional`` API, and three patterns built on them: per-sample gradient
clipping, a MAML inner step, a gradient penalty. ``torch.func`` transforms and forward-mode
dual tensors raise the same clear error on every rank (they bypass spmdgt's per-op routes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS, IN, OUT = 7, 3, 2


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def _model():
    torch.manual_seed(1)
    return torch.nn.Linear(IN, OUT)


def _loss(lin, x, y, weight=None):
    out = lin(x) if weight is None else x @ weight.T + lin.bias
    return ((out - y) ** 2).sum()


def _patterns(x, y, lin, w) -> dict:
    """The same program on sharded (x, y, w) or on plain ones; every value it returns."""
    from torch.autograd import functional as AF
    from torch.utils.checkpoint import checkpoint

    params = [lin.weight, lin.bias]
    out = {}
    out["grad_plain"] = torch.autograd.grad(_loss(lin, x, y), params)
    out["grad_sharded_param"] = torch.autograd.grad(_loss(lin, x, y, w), [w, lin.bias])
    unused = torch.nn.Parameter(torch.ones(2))
    out["allow_unused"] = torch.autograd.grad(
        _loss(lin, x, y), [lin.weight, unused], allow_unused=True
    )[0]
    # backward(inputs=[x]): only x's .grad
    xx = x.detach().requires_grad_()
    lin.zero_grad(set_to_none=True)
    _loss(lin, xx, y).backward(inputs=[xx])
    out["backward_inputs"] = (xx.grad, lin.weight.grad is None)
    # retain_graph: two backwards accumulate
    loss = _loss(lin, x, y)
    loss.backward(retain_graph=True)
    loss.backward()
    out["retain_graph"] = (lin.weight.grad, lin.bias.grad)
    # hooks on a sharded leaf and a plain parameter
    lin.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_()
    xx.register_hook(lambda g: g * 2)
    h = lin.weight.register_hook(lambda g: g * 3)
    _loss(lin, xx, y).backward()
    h.remove()
    out["hooks"] = (xx.grad, lin.weight.grad)
    # checkpointing, both implementations
    for reentrant in (True, False):
        lin.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        checkpoint(lambda a: _loss(lin, a, y), xx, use_reentrant=reentrant).backward()
        out[f"checkpoint_reentrant={reentrant}"] = (xx.grad, lin.weight.grad)
    # a gradient penalty w.r.t. the parameters (create_graph, then a second backward)
    lin.zero_grad(set_to_none=True)
    gw, gb = torch.autograd.grad(_loss(lin, x, y), params, create_graph=True)
    (_loss(lin, x, y) + gw.pow(2).sum() + gb.pow(2).sum()).backward()
    out["gradient_penalty"] = (lin.weight.grad, lin.bias.grad)
    # a MAML inner step: adapted parameters, an outer loss, gradients w.r.t. the originals
    gw, gb = torch.autograd.grad(_loss(lin, x, y), params, create_graph=True)
    fast_w, fast_b = lin.weight - 0.1 * gw, lin.bias - 0.1 * gb
    outer = ((x.flip(0) @ fast_w.T + fast_b - y) ** 2).sum()
    out["maml"] = torch.autograd.grad(outer, params)
    # per-sample gradient clipping (DP-SGD): each sample's gradient clipped to norm 1
    total = [torch.zeros_like(p) for p in params]
    for i in range(ROWS):
        grads = torch.autograd.grad(_loss(lin, x[i : i + 1], y[i : i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        scale = (1.0 / (norm + 1e-6)).clamp(max=1.0)
        total = [t + g * scale for t, g in zip(total, grads)]
    out["per_sample_clipping"] = total
    # torch.autograd.functional (vectorize=False: reverse mode, exact)
    cube = lambda a: (a**3).sum()  # noqa: E731
    v = torch.ones_like(x)
    out["AF.jacobian"] = AF.jacobian(lambda a: lin(a).sum(0), x)
    out["AF.hessian"] = AF.hessian(cube, x[:, 0])  # 7 backward passes, not 21
    out["AF.vjp"] = AF.vjp(lambda a: _loss(lin, a, y), x)
    out["AF.jvp"] = AF.jvp(lambda a: _loss(lin, a, y), x, v)
    out["AF.hvp"] = AF.hvp(cube, x, v)
    out["AF.vhp"] = AF.vhp(cube, x, v)
    return out


def _refused(x, lin) -> dict:
    """The entry points spmdgt refuses over sharded values: each error's type and text."""
    import torch.func as tf
    from torch.autograd import forward_ad as fwad

    w = torch.randn(IN, 4, generator=torch.Generator().manual_seed(2))
    params = dict(lin.named_parameters())
    attempts = {
        "vmap": lambda: tf.vmap(lambda r: (r @ w).relu().sum())(x),
        "grad": lambda: tf.grad(lambda a: lin(a).sum())(x),
        "per_sample_vmap_grad": lambda: tf.vmap(
            tf.grad(lambda p, r: tf.functional_call(lin, p, (r,)).sum()), in_dims=(None, 0)
        )(params, x),
        "jvp": lambda: tf.jvp(lambda a: lin(a).sum(), (x,), (torch.ones_like(x),)),
    }

    def dual():
        with fwad.dual_level():
            return fwad.make_dual(x, torch.ones_like(x))

    attempts["forward_ad"] = dual
    out = {}
    for name, fn in attempts.items():
        try:
            fn()
            out[name] = "returned"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _flat(v) -> list:
    """Values as numpy arrays and plain Python, in order (a collective for sharded ones)."""
    from spmdgt.tensor._moves import global_value

    if isinstance(v, torch.Tensor):
        return [global_value(v).numpy().copy()]
    if isinstance(v, (list, tuple)):
        return [a for b in v for a in _flat(b)]
    return [v]


def _ranks(rank, world):
    import spmdgt as gt

    gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    X, Y = _data()
    with gt.signal.context("data"):
        x, y = gt.tensor(X), gt.tensor(Y)
    lin = _model()
    with gt.signal.context("cols"):
        w = gt.tensor(lin.weight.detach()).requires_grad_()
    got = {k: _flat(v) for k, v in _patterns(x, y, lin, w).items()}
    ref_lin = _model()
    ref_w = lin.weight.detach().clone().requires_grad_()
    want = {k: _flat(v) for k, v in _patterns(X, Y, ref_lin, ref_w).items()}
    return got, want, _refused(x, lin), type(w).__name__


# 2 ranks: slow (3 ranks, uneven, stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_autograd_entry_points_equal_one_process(tmp_path, world):
    results = run_ranks(_ranks, world, tmp_path)
    for got, want, refused, w_type in results:
        assert w_type == "Tensor"  # the sharded parameter really is sharded
        assert set(got) == set(want)
        for name in want:
            assert len(got[name]) == len(want[name]), name
            for g, r in zip(got[name], want[name]):
                if isinstance(r, np.ndarray):
                    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
                else:
                    assert g == r, name
        assert refused == results[0][2]  # every rank raised the same error
        for name, text in refused.items():
            assert text.startswith("NotImplementedError"), (name, text)
            assert "sharded spmdgt tensor" in text, (name, text)
            assert "torch.autograd" in text, (name, text)  # the way out is named
        assert "torch.func" in refused["vmap"] and "vmap" in refused["vmap"]
        assert "forward-mode AD" in refused["forward_ad"]
