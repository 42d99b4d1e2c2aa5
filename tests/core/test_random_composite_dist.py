"""Random ops that draw inside a composite, on sharded values: one process's numbers and one
process's generator state, on every rank.

``F.gumbel_softmax`` reaches spmdgt as itself and draws through ``empty_like(x).exponential_()``
on DTensors: each rank drew its own shard's numbers and advanced its generator by its shard's
size, so the values differed from one process and every later draw differed between ranks.
Each check here runs the same program on sharded values (rows or columns, 7 x 5: 4/3 and
3/3/1 rows, 3/2 and 2/2/1 columns) and on plain tensors in one process, seeded alike, and
compares the values, gradients, ``torch.get_rng_state()`` after the program, a draw after
it, and a user ``torch.Generator``'s state.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks

ROWS, COLS = 7, 5


def _data(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _np(t) -> np.ndarray:
    """The global value (a collective for a sharded tensor: every rank calls it)."""
    return t.numpy() if hasattr(t, "placements") else t.detach().numpy()


def _after(out: dict) -> dict:
    """``out`` with the generator's state after the program and a draw after it."""
    out["rng_state"] = torch.get_rng_state().numpy()
    out["draw_after"] = torch.rand(4).numpy()
    return out


def _draw_then_no_rule(x):
    """A composite of the user's own (it reaches spmdgt as itself, as F.gumbel_softmax does):
    a draw, an op DTensor has no rule for (``nonzero``), a second draw."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_draw_then_no_rule, (x,), x)
    y = x + torch.empty_like(x).exponential_()
    return y + torch.rand_like(y), torch.nonzero(y > 1.0)


def _program(put, outside=None, traced=None) -> dict[str, dict]:
    """Every check on tensors laid out by ``put`` (plain in the reference); name -> results.
    ``outside(x)`` (ranks only) first draws on ``x``'s layout with DTensor itself;
    ``traced(x)`` traces a draw on it with fake tensors, as dynamo does."""
    out = {}

    torch.manual_seed(1)
    x = put(_data(0))
    out["gumbel_soft"] = _after({"y": _np(F.gumbel_softmax(x, tau=0.5))})

    torch.manual_seed(2)
    x = put(_data(1)).requires_grad_()
    y = F.gumbel_softmax(x, tau=0.7, hard=True)
    (y * torch.arange(float(COLS))).sum().backward()
    out["gumbel_hard_grad"] = _after({"y": _np(y), "grad": _np(x.grad)})

    torch.manual_seed(3)
    out["gumbel_dim0"] = _after({"y": _np(F.gumbel_softmax(put(_data(2)), dim=0))})

    torch.manual_seed(4)
    x = put(_data(3)).requires_grad_()
    y = F.rrelu(x, training=True)
    y.pow(2).sum().backward()
    out["rrelu"] = _after({"y": _np(y), "grad": _np(x.grad)})

    torch.manual_seed(5)
    y = nn.RReLU().train()(put(_data(4)))
    out["RReLU"] = _after({"y": _np(y)})

    torch.manual_seed(6)
    ws = {n: nn.Parameter(put(_data(5))) for n in ("kaiming", "xavier", "trunc", "orth", "gen")}
    g = torch.Generator().manual_seed(9)
    nn.init.kaiming_uniform_(ws["kaiming"], a=math.sqrt(5))
    nn.init.xavier_normal_(ws["xavier"])
    nn.init.trunc_normal_(ws["trunc"], std=0.5)
    nn.init.orthogonal_(ws["orth"])
    nn.init.uniform_(ws["gen"], -1, 1, generator=g)
    inits = {n: _np(w) for n, w in ws.items()}
    out["nn_init"] = _after({**inits, "generator": g.get_state().numpy()})

    torch.manual_seed(7)
    x = put(_data(6))
    parts = torch.utils.data.random_split(x, [3, 4])
    g = torch.Generator().manual_seed(11)
    seeded = torch.utils.data.random_split(x, [0.5, 0.5], generator=g)
    out["random_split"] = _after(
        {
            "indices": np.array([i for p in (*parts, *seeded) for i in p.indices]),
            "rows": _np(torch.stack([p[i] for p in parts for i in range(len(p))])),
            "generator": g.get_state().numpy(),
        }
    )

    torch.manual_seed(8)
    g = torch.Generator().manual_seed(12)
    y = torch.bernoulli(put(_data(7)).sigmoid(), generator=g)
    out["bernoulli_generator"] = _after({"y": _np(y), "generator": g.get_state().numpy()})

    torch.manual_seed(9)
    y, hits = _draw_then_no_rule(put(_data(8)))
    out["draw_then_no_rule"] = _after({"y": _np(y), "hits": _np(hits)})

    # DTensor used directly draws on this layout first, outside spmdgt's calls: DTensor
    # caches its sharding of exponential_ there, which spmdgt's next call must not be served
    torch.manual_seed(10)
    x = put(_data(9))
    if outside is not None:
        outside(x)
    out["after_a_dtensor_draw"] = _after({"y": _np(F.gumbel_softmax(x))})

    # a trace (a hot function's compile that then fell back to eager) fills the same cache
    torch.manual_seed(11)
    x = put(_data(10))
    if traced is not None:
        traced(x)
    out["after_a_trace"] = _after({"y": _np(F.gumbel_softmax(x))})
    return out


def _ranks(rank, world, signal):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))

    def put(t):
        with gt.signal.context(signal):
            return gt.tensor(t)

    def outside(x):
        from torch.distributed.tensor import DTensor

        d = x.detach().clone()
        d.__class__ = DTensor  # a plain DTensor: DTensor's own random op, per shard
        state = torch.get_rng_state()
        d.exponential_()
        torch.set_rng_state(state)  # its per-shard draw is not the program's

    def traced(x):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as fake:
            F.gumbel_softmax(fake.from_tensor(x))  # no data: DTensor's sharding, cached

    return _program(put, outside, traced)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("signal", ["rows", "cols"])
def test_composite_random_ops_draw_as_one_process(tmp_path, world, signal):
    want = _program(lambda t: t.clone())
    for rank, got in enumerate(run_ranks(_ranks, world, tmp_path, signal)):
        for check, results in want.items():
            for key, ref in results.items():
                np.testing.assert_allclose(
                    got[check][key],
                    ref,
                    rtol=1e-6,
                    atol=1e-6,
                    err_msg=f"{check}: {key} on rank {rank} of {world} ({signal})",
                )
