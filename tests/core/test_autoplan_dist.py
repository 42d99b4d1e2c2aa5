"""``GT_AUTO_SHARD=plan``: placements chosen from the ops, values those of one process.

A GT program (new inputs each iteration, a product, an activation, a reduction, a backward)
runs four iterations on 2 and 3 ranks under the plan. The first iteration runs as axis 0
places it; from the second on, the right operand of the product is replicated (no gather per
product), the batch stays split. Every value and gradient equals one process's, whatever
the plan chose (principle 4).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests._dist import run_ranks

SHAPES = [(24, 6), (6, 12)]  # a batch and a smaller right operand (dims divide 2 and 3)


def _program(make, steps=4):
    """The user's program over a creation function: values and gradients per step."""
    out = []
    for _ in range(steps):
        a, b = [make(*s) for s in SHAPES]
        a.requires_grad_(True)
        y = (a @ b).tanh()
        loss = (y * y).mean()
        loss.backward()
        out.append((a, b, y, loss, a.grad))
    return out


def _planned(rank, world):
    import spmdgt as gt
    from spmdgt.tensor import _autoplan

    torch.manual_seed(3)
    got = _program(gt.randn)
    placements = [
        tuple(getattr(t, "placements", ())) if isinstance(t, gt.Tensor) else "replicated"
        for step in got
        for t in step[:2]
    ]
    values = [[t.detach().numpy() if t.dim() else t.item() for t in step] for step in got]
    return {"placements": placements, "values": values, "recording": _autoplan.active()}


@pytest.mark.parametrize("world", [2, 3])
def test_plan_replicates_the_right_operand_and_keeps_values(tmp_path, world):
    torch.manual_seed(3)
    ref = [
        [t.detach().numpy() if t.dim() else t.item() for t in step]
        for step in _program(torch.randn)
    ]
    results = run_ranks(_planned, world, tmp_path, env={"GT_AUTO_SHARD": "plan"})
    for r in results:
        assert r["placements"][:2] == [(Shard(0),), (Shard(0),)]  # the first pass: axis 0
        for i in range(1, 4):  # then the plan: rows x replicated
            assert r["placements"][2 * i : 2 * i + 2] == [(Shard(0),), "replicated"]
        assert not r["recording"]
        for got, want in zip(r["values"], ref):
            for g, w in zip(got, want):
                torch.testing.assert_close(torch.as_tensor(g), torch.as_tensor(w))


def test_a_pass_that_never_repeats_keeps_axis_0(tmp_path):
    def once(rank, world):
        import spmdgt as gt

        a, b = gt.randn(8, 4), gt.randn(4, 8)
        c = a @ b
        return [tuple(t.placements) for t in (a, b)], c.numpy().shape

    for placements, shape in run_ranks(once, 2, tmp_path, env={"GT_AUTO_SHARD": "plan"}):
        assert placements == [(Shard(0),), (Shard(0),)] and shape == (8, 8)


def test_pricing_prefers_no_gather_and_stays_with_axis_0_for_elementwise():
    from spmdgt.tensor import _autoplan as ap

    def priced(ops, sites):
        p = ap._Pass(first=sites[0].key, sites=sites, ops=ops, nodes=10)
        return ap._choose(p, 4, "cpu")

    def site(i, shape):
        return ap._Site((f"f.py:{i}", shape), shape, 4, ap._options(shape, 4), node=i)

    # a @ b with both made here: the right operand replicated, the batch split
    sites = [site(0, (64, 32)), site(1, (32, 16))]
    ops = [("matmul", [(0, (64, 32), 4), (1, (32, 16), 4)], [(2, (64, 16))])]
    assert priced(ops, sites) == [0, ap.R]
    # a + b elementwise: both split alike (axis 0's rule), nothing replicated
    sites = [site(0, (64, 32)), site(1, (64, 32))]
    ops = [("add", [(0, (64, 32), 4), (1, (64, 32), 4)], [(2, (64, 32))])]
    assert priced(ops, sites) == [0, 0]
    # linear(x, w): the weight (out, in) replicated; x split on its batch
    sites = [site(0, (64, 32)), site(1, (16, 32))]
    ops = [("linear", [(0, (64, 32), 4), (1, (16, 32), 4)], [(2, (64, 16))])]
    assert priced(ops, sites) == [0, ap.R]


def test_env_accepts_plan_and_names_it_in_errors():
    from spmdgt._core import env

    assert env.flag("GT_AUTO_SHARD", {"GT_AUTO_SHARD": " Plan "}) == "plan"
    with pytest.raises(env.EnvError, match=r"\(off\), or plan$"):
        env.flag("GT_AUTO_SHARD", {"GT_AUTO_SHARD": "planned"})
