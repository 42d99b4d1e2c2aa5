"""Every route of the op table on a 2x2 (dp, tp) mesh equals one-process torch, forward and
backward, with uneven sizes (7 rows, 5 columns: 4/3 over dp, 3/2 over tp, 2/2/2/1 over both).

Four gloo ranks. Each case runs twice on every rank: on plain tensors (the one-process
reference) and on gt tensors laid out on the 2x2 mesh as (Shard(0), Shard(1)),
(Shard(0), Replicate()), (Replicate(), Shard(1)) or (Shard(0), Shard(0)); the parent compares
the global values (outputs, then the leaves' gradients) at 1e-5. The routes are those of
``spmdgt/tensor/_optable.py``: DTensor's path, views, in-place, global, empty-sensitive, ties,
guarded, irregular, batch-only, attention, autograd.

``test_nested_uneven_shards`` holds the cases that were wrong before the op table read every
mesh coordinate's shard: one tensor dim sharded over both mesh dims, (Shard(0), Shard(0)),
with pieces of unequal or no rows, which DTensor's reshape rule and the 1-D-only empty and
evenness checks got wrong (an error on some ranks only, or a hang).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests._dist import run_ranks

MESH = (("dp", 2), ("tp", 2))
ROWS, COLS = 7, 5


def _layout(kind: str):
    """``put(t)``: ``t`` laid out as ``kind`` on the 2x2 mesh (``plain``: as it is)."""
    if kind == "plain":
        return lambda t: t
    from torch.distributed.tensor import Replicate, Shard

    from spmdgt.tensor._meshes import named_mesh
    from spmdgt.tensor._placement import Target
    from spmdgt.tensor._tensor import place

    pls = {
        "s0s1": (Shard(0), Shard(1)),
        "s0r": (Shard(0), Replicate()),
        "rs1": (Replicate(), Shard(1)),
        "s0s0": (Shard(0), Shard(0)),
    }[kind]
    target = Target(named_mesh(MESH), pls)
    return lambda t: place(t, target)


def _leaf(put, t: torch.Tensor) -> torch.Tensor:
    return put(t.detach().clone()).requires_grad_(True)


def _data(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


# Each case: (layout, fn(put) -> (outputs, leaves)); outputs are compared, then the leaves'
# gradients after backward of the sum of the floating outputs that need a gradient.


def _dtensor(put):
    a, b = _leaf(put, _data(1, ROWS, COLS)), _leaf(put, _data(2, ROWS, COLS))
    w = _data(3, COLS, 9).requires_grad_(True)  # a plain weight: replicated, plain gradient
    return [a @ w, a * b + 1, (a - b).sum(dim=0), a.sum()], [a, b, w]


def _view(put):
    a = _leaf(put, _data(4, ROWS, COLS))
    base = put(_data(5, ROWS, COLS))
    part = base[1:5]
    part.mul_(2)  # a write through a view reaches the base
    return [a.t() * 1, a[2:6], a.reshape(COLS, ROWS) * 1, a.flatten()[3:20], base], [a]


def _inplace(put):
    a = _leaf(put, _data(6, ROWS, COLS))
    y = a * 3
    y.add_(1)  # pointwise in place: DTensor's path
    y.mul_(2).sub_(a)  # another operand with a gradient
    z = put(_data(7, ROWS, COLS))
    z.index_fill_(1, torch.tensor([0, 3]), 0.5)  # not pointwise: the in-place fallback
    z[2, 1] = -4.0
    return [y, z], [a]


def _global(put):
    a = _leaf(put, _data(8, ROWS, COLS))
    torch.manual_seed(11)
    d = F.dropout(a, 0.5)  # random: the global value, one process's numbers
    return [torch.nonzero(a > 0), torch.masked_select(a, a > 0.3), d], [a]


def _reductions(put):
    a = _leaf(put, _data(9, ROWS, COLS))
    ties = _leaf(put, torch.round(_data(10, ROWS, COLS)))  # many tied maxima
    return [
        a.max(dim=1).values,
        torch.median(a, dim=0).values,
        a.std(dim=0),
        torch.amax(ties, dim=0),  # ties: torch shares the gradient among them
        torch.argmax(a),  # guarded: no dim, shards not in flat order
        torch.argmin(a, dim=1),
    ], [a, ties]


def _embedding(put):
    # guarded: a weight with rows over both mesh dims took DTensor's masked-partial rule,
    # which shares one mask among them (ranks 0 and 3 raised, 1 and 2 went on)
    w = _leaf(put, _data(22, ROWS, COLS))
    return [F.embedding(torch.tensor([[0, 6, 2], [3, 3, 1]]), w)], [w]


def _invented(put):
    # DTensor's strategy for pixel_unshuffle on (Replicate(), Shard(1)) re-laid the 6 rows
    # out as (Shard(2), Shard(2)), pieces 2/1/2/1: each rank's kernel refused its own height
    x = _leaf(put, _data(23, 1, 1, 6, 6))
    return [F.pixel_unshuffle(x, 3)], [x]


def _masked(put):
    # DTensor's gather on a dim sharded over tp makes a masked partial whose one shared mask
    # buffer got two different masks on 2x2 ("materialized with conflicting data")
    outs, leaves = [], []
    for seed in (24, 25):  # twice: a count left behind by the first would fail the second
        x = _leaf(put, _data(seed, ROWS, 6))
        w = _data(seed + 10, 6, 6).requires_grad_(True)
        target = torch.tensor([0, 5, 2, 1, 3, 3, 4])
        outs.append(F.multi_margin_loss(F.linear(x, w), target))
        outs.append(torch.gather(x, 1, target[:, None]))
        leaves += [x, w]
    return outs, leaves


def _irregular(put):
    a, t = _leaf(put, _data(12, ROWS, COLS)), put(_data(13, ROWS, COLS))
    target = torch.tensor([0, 4, 2, 1, 3, 3, 0])
    return [F.mse_loss(a, t), F.cross_entropy(a, target), F.l1_loss(a, t, reduction="sum")], [a]


def _batch_only(put, rows: int = ROWS):
    x = _leaf(put, _data(14, rows, 3, 8))
    w = _data(15, 4, 3, 3).requires_grad_(True)
    return [F.conv1d(x, w), F.adaptive_avg_pool1d(x, 3)], [x, w]


def _attention(put):
    q, k, v = (_leaf(put, _data(16 + i, ROWS, 2, COLS, 4)) for i in range(3))
    return [F.scaled_dot_product_attention(q, k, v, is_causal=True)], [q, k, v]


def _autograd(put):
    a = _leaf(put, _data(19, ROWS, COLS))
    loss = (a.exp() * a).sum()
    (g,) = torch.autograd.grad(loss, [a], create_graph=False)
    return [loss.detach(), g], []


CASES = {
    "dtensor s0s1": ("s0s1", _dtensor),
    "dtensor s0s0": ("s0s0", _dtensor),
    "view s0s1": ("s0s1", _view),
    "view s0s0": ("s0s0", _view),
    "inplace s0s1": ("s0s1", _inplace),
    "inplace rs1": ("rs1", _inplace),
    "global s0s1": ("s0s1", _global),
    "reductions s0s1": ("s0s1", _reductions),
    "reductions s0s0": ("s0s0", _reductions),
    "guarded embedding s0s0": ("s0s0", _embedding),
    "invented nesting rs1": ("rs1", _invented),
    "masked partial rs1": ("rs1", _masked),
    "masked partial s0s1": ("s0s1", _masked),
    "irregular s0r": ("s0r", _irregular),
    "irregular s0s0": ("s0s0", _irregular),
    "batch_only s0r": ("s0r", _batch_only),
    "batch_only s0s0": ("s0s0", _batch_only),
    "batch_only s0s0 even": ("s0s0", lambda put: _batch_only(put, 8)),  # DTensor's path
    "attention s0r": ("s0r", _attention),
    "attention s0s1": ("s0s1", _attention),
    "autograd rs1": ("rs1", _autograd),
}


def _nested(rows: int, what: str):
    """A case on ``rows`` rows laid out (Shard(0), Shard(0)): pieces of unequal or no rows."""

    def case(put):
        x = _leaf(put, _data(20, rows, 3, COLS))
        y = _leaf(put, _data(21, rows, 3, COLS))
        if what == "reshape":  # DTensor's view rule: views pieces at sizes they do not have
            return [x.reshape(rows * 3, COLS) * 2, y.flatten(0, 1)[1:] * 1], [x, y]
        if what == "reduce":  # empty-sensitive: a rank's kernel on its empty piece
            return [torch.amax(x, dim=0), x.std(dim=0), torch.argmax(y, dim=0)], [x]
        return [F.mse_loss(x, y), F.smooth_l1_loss(x, y)], [x, y]  # irregular

    return case


NESTED = {
    f"s0s0 {rows} rows ({pieces}) {what}": ("s0s0", _nested(rows, what))
    for rows, pieces in ((2, "pieces 1,0,1,0"), (3, "pieces 1,1,1,0"), (6, "pieces 2,1,2,1"))
    for what in ("reshape", "reduce", "loss")
}


def _values(outs, leaves) -> tuple[list, list]:
    """Global values of ``outs``, and the leaves' gradients after one backward."""
    from spmdgt.tensor._tensor import global_value

    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    if floats:
        sum(o.float().sum() * (i + 1) for i, o in enumerate(floats)).backward()
    got = [global_value(o).detach().clone() for o in outs]
    grads = [None if t.grad is None else global_value(t.grad).clone() for t in leaves]
    return got, grads


def _rank(rank: int, world: int, names: list[str], table: str) -> dict:
    import warnings

    from spmdgt.tensor._meshes import named_mesh

    warnings.simplefilter("ignore")  # the fallbacks' "ran on the global value" notes
    torch.set_num_threads(1)
    named_mesh(MESH)  # every rank, before any case
    cases = CASES if table == "routes" else NESTED
    out = {}
    for name in names:
        kind, fn = cases[name]
        want = _values(*fn(_layout("plain")))
        try:
            got = _values(*fn(_layout(kind)))
        except Exception as e:  # reported per case, by the parent, with the rank
            got = f"rank {rank} raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out[name] = (got, want)
    return out


def _check(results: list[dict], names: list[str]) -> None:
    problems = []
    for rank, res in enumerate(results):
        for name in names:
            got, want = res[name]
            if isinstance(got, str):
                problems.append(f"{name}: {got}")
                continue
            for what, g_list, w_list in (("output", got[0], want[0]), ("grad", got[1], want[1])):
                for i, (g, w) in enumerate(zip(g_list, w_list, strict=True)):
                    try:
                        if w is None or g is None:
                            assert g is None and w is None, "a gradient is missing"
                        else:
                            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                    except AssertionError as e:
                        problems.append(f"{name}: rank {rank} {what} {i}: {str(e)[:300]}")
    assert not problems, "\n".join(problems)


def test_routes_mesh2d(tmp_path):
    """Every route of the op table, forward and backward, on 2x2 with 7 x 5 inputs."""
    names = list(CASES)
    results = run_ranks(_rank, 4, tmp_path, names, "routes", timeout=240)
    _check(results, names)


def test_nested_uneven_shards(tmp_path):
    """(Shard(0), Shard(0)) with pieces of unequal or no rows: reshape, an empty-sensitive
    reduction and an irregular loss equal torch on every rank (before the op table read every
    mesh coordinate's piece: an error on some ranks only, or a hang)."""
    names = list(NESTED)
    results = run_ranks(_rank, 4, tmp_path, names, "nested", timeout=90)
    _check(results, names)


def test_shard_shapes_follow_dtensor_nesting():
    """``shard_shapes`` gives each mesh coordinate's piece as DTensor cuts it (mesh dims left
    to right, nested cuts of one dim cutting the first cut's pieces), one process, no mesh."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from spmdgt.tensor._shards import nested_uneven, shard_shapes

    def spec(shape, *pls):
        return SimpleNamespace(shape=shape, mesh=SimpleNamespace(shape=(2, 2)), placements=pls)

    assert shard_shapes(spec((3, 5), Shard(0), Shard(0))) == ((1, 5), (1, 5), (1, 5), (0, 5))
    assert shard_shapes(spec((7, 5), Shard(0), Shard(1))) == ((4, 3), (4, 2), (3, 3), (3, 2))
    assert shard_shapes(spec((7, 5), Replicate(), Shard(1))) == ((7, 3), (7, 2)) * 2
    assert nested_uneven(spec((6, 5), Shard(0), Shard(0)))  # 2, 1, 2, 1: 6 % 2 == 0 misleads
    assert not nested_uneven(spec((8, 5), Shard(0), Shard(0)))
    assert not nested_uneven(spec((7, 5), Shard(0), Shard(1)))  # one mesh dim per tensor dim
