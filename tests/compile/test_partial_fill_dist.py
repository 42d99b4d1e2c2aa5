"""``fill_`` of a partial value, compiled: the ranks' parts sum to the value, not to the value
times the ranks.

torch's ``Scalar - Tensor`` is ``empty_like(t).fill_(s).sub_(t)`` in C++; ``empty_like`` keeps a
``Partial`` placement and DTensor's ``fill_`` rule fills every rank's part, so a composite
torch traces to aten ops gave ``world * s - t``. Found by the parity sweep with both compile
halves on, 3 ranks: ``cosine_embedding_loss`` after an ``nn.Linear`` whose weight is split by
rows (its output sharded on the feature dim the cosine sums) read ``3 - cos`` for ``1 - cos``
on every positive pair, compiled by the hot-function pass or by a user's ``torch.compile``
(eagerly spmdgt routes the whole loss, exactly). Raw DTensor gives the same wrong value
eagerly. Forward and gradients against one process, 2 and 3 ranks, uneven rows and an empty
shard.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks
from tests.compile._both import with_both_halves


def cosine_after_linear(x, target, w, b, x2):
    return F.cosine_embedding_loss(F.linear(x, w, b), x2, target, reduction="sum")


def filled(x):
    p = x.sum(1)  # partial where x is split by columns
    return torch.empty_like(p).fill_(1.5) * 2 + p, torch.empty_like(p).fill_(torch.tensor(2.5)) - p


def _values(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 5, generator=g), torch.randn(5, 5, generator=g)
    b = torch.randn(5, generator=g)
    target = torch.tensor([1.0, -1.0] * rows)[:rows]
    return x, target, w, b, torch.randn(rows, 5, generator=g)


def _reference(rows):
    x, target, w, b, x2 = _values(rows)
    w.requires_grad_()
    b.requires_grad_()
    loss = cosine_after_linear(x, target, w, b, x2)
    loss.backward()
    return loss.item(), w.grad, b.grad, [v.tolist() for v in filled(x)]


def _ranked(rank, world, rows):
    from torch.distributed.tensor import Shard

    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    rows_of = Target(mesh_for(None), (Shard(0),))
    columns_of = Target(mesh_for(None), (Shard(1),))

    def loss_call(fn):
        x, target, w, b, x2 = (place(v, rows_of) for v in _values(rows))
        w.requires_grad_()
        b.requires_grad_()
        loss = fn(x, target, w, b, x2)
        loss.backward()
        return global_value(loss).item(), global_value(w.grad), global_value(b.grad)

    def fill_call(fn):
        x = place(_values(rows)[0], columns_of)
        return [global_value(v).tolist() for v in fn(x)]

    out = {
        "compiled loss": loss_call(torch.compile(cosine_after_linear, backend="aot_eager")),
        "compiled fill": fill_call(torch.compile(filled, backend="aot_eager")),
    }
    torch._dynamo.reset()
    out["hot"], _ = with_both_halves(
        lambda: [loss_call(cosine_after_linear) for _ in range(4)], every=1, hot_at=2, batch=16
    )
    return out


# 2 ranks, uneven rows: slow (3 ranks, an empty shard, the layout the sweep found, stands for it)
@pytest.mark.parametrize("world, rows", [pytest.param(2, 5, marks=pytest.mark.slow), (3, 2)])
def test_compiled_fill_of_a_partial_value_equals_one_process(tmp_path, world, rows):
    loss, w_grad, b_grad, fills = _reference(rows)
    for r in run_ranks(_ranked, world, tmp_path, rows, timeout=300):
        torch.testing.assert_close(torch.tensor(r["compiled fill"]), torch.tensor(fills))
        for name, got in [("compiled loss", r["compiled loss"]), *[("hot", h) for h in r["hot"]]]:
            assert got[0] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, got[0], loss)
            torch.testing.assert_close(got[1], w_grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[2], b_grad, rtol=1e-5, atol=1e-6)
