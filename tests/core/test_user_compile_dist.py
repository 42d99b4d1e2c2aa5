"""The user's own ``torch.compile`` over ``gt.Tensor``s: a function (fullgraph, inductor) and an
``nn.Module`` (aot_eager), forward and backward, equal one process; outputs stay gt.Tensors.

Compiles take seconds here, so this is the one compile-heavy test of the core suite; 5 rows
over 2 ranks makes the local shapes differ between ranks (3 and 2 rows), which is what once
made ranks load each other's cached kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from tests._dist import run_ranks


def _compiled(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.manual_seed(0)
    with gt.signal.context("rows"):
        x = gt.randn(5, 4, requires_grad=True)
        w = gt.randn(4, 3, requires_grad=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def f(x, w):
        return torch.relu(x @ w.sum(1, keepdim=True).expand(4, 3)) * 2 + x.sum(1, keepdim=True)

    y = torch.compile(f, fullgraph=True)(x, w)
    y.sum().backward()
    m = torch.compile(model, backend="aot_eager")(x.detach())
    m.pow(2).sum().backward()

    torch.manual_seed(0)
    rx = torch.randn(5, 4, requires_grad=True)
    rw = torch.randn(4, 3, requires_grad=True)
    ref_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref_model.load_state_dict(model.state_dict())
    ry = f(rx, rw)
    ry.sum().backward()
    rm = ref_model(rx.detach())
    rm.pow(2).sum().backward()
    pairs = [(y, ry), (x.grad, rx.grad), (w.grad, rw.grad), (m, rm)]
    pairs += [(p.grad, q.grad) for p, q in zip(model.parameters(), ref_model.parameters())]
    return [type(y).__module__, type(m).__module__] + [
        (a.detach().numpy(), b.detach().numpy()) for a, b in pairs
    ]


def test_torch_compile_of_gt_tensors_function_and_module(tmp_path):
    for y_kind, m_kind, *pairs in run_ranks(_compiled, 2, tmp_path, timeout=300):
        assert y_kind == m_kind == "spmdgt.tensor._tensor"
        for got, ref in pairs:
            # inductor fuses and reorders fp32 sums: 1e-5 relative
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
