"""Assignments and ties on sharded tensors equal one process, or raise alike on every rank.

Silently wrong before: ``.data =`` kept the old shards (or took the new shape over the old
values), ``plain.data = <sharded>`` broke the plain tensor, a write into a sub-mesh tensor
from a world-sharded one went into a copy, ``argmax()`` broke ties by rank instead of by flat
index, ``argmax`` of a bool tensor answered where torch raises, and a complex ``prod`` over a
sharded dim raised in the collective. Each on 2 and 3 ranks against plain torch; sizes are
uneven (5 rows over 2 or 3 ranks) and the sub-mesh is ``[1]`` on 2 ranks, ``[1, 2]`` on 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

from tests._dist import run_ranks

WORLDS = (2, 3)
PLACES = ("rows", "cols", "sub", "plain")


def _start(gt, world):
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    workers = [1, 2] if world == 3 else [1]
    gt.register_config("sub", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=workers)))


def _make(gt, place, value):
    if place == "plain":
        return value.clone()
    with gt.signal.context(place):
        return gt.tensor(value)


def _np(t):
    """``t``'s value as a numpy array of its own (a plain tensor's ``numpy()`` shares its
    memory, so a later write would change the reference)."""
    return np.array(t.detach().numpy())


def _outcome(fn):
    """The value ``fn`` gives, or its error's type and first line."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _same(got, want, what):
    if isinstance(want, str) or isinstance(got, str):
        assert got == want, what
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{what}[{i}]")
    elif isinstance(want, np.ndarray):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        assert got == want, what


# -- 1. ``.data =`` on a gt.Tensor ------------------------------------------------------------


def _data_setter(rank, world):
    import spmdgt as gt

    _start(gt, world)
    out = []
    gt.manual_seed(0)
    with gt.signal.context("rows"):
        p = gt.randn(7, 4, requires_grad=True)
    p.data = torch.zeros(7, 4)
    out.append((_np(p), tuple(p.shape), p.requires_grad, str(p.placements)))
    (p * p + p).sum().backward()  # autograd reads the new shards
    out.append(_np(p.grad))
    p.data = torch.ones(3, 2)  # another shape: laid out as p was (rows)
    out.append((_np(p), tuple(p.shape), p.requires_grad, str(p.placements)))
    p.data = torch.arange(5.0)  # p's shard dim 0 still exists
    out.append((_np(p), tuple(p.shape), p.requires_grad, str(p.placements)))
    with gt.signal.context("cols"):
        q = gt.tensor(torch.arange(12.0).reshape(3, 4))
    p.data = q  # takes q's layout and shares its shards, as torch shares memory
    q.add_(1)
    out.append((_np(p), tuple(p.shape), p.requires_grad, str(p.placements)))
    p.data.mul_(2)  # .data reads alias too
    out.append((_np(p), _np(q)))
    for bad in (lambda: setattr(p, "data", 3), lambda: setattr(p, "data", torch.zeros(2).long())):
        out.append(_outcome(bad))
    # the reference, in one process
    r = torch.randn(7, 4, requires_grad=True)
    ref = []
    r.data = torch.zeros(7, 4)
    ref.append((_np(r), tuple(r.shape), r.requires_grad))
    (r * r + r).sum().backward()
    ref.append(_np(r.grad))
    r.data = torch.ones(3, 2)
    ref.append((_np(r), tuple(r.shape), r.requires_grad))
    r.data = torch.arange(5.0)
    ref.append((_np(r), tuple(r.shape), r.requires_grad))
    rq = torch.arange(12.0).reshape(3, 4)
    r.data = rq
    rq.add_(1)
    ref.append((_np(r), tuple(r.shape), r.requires_grad))
    r.data.mul_(2)
    ref.append((_np(r), _np(rq)))
    for bad in (lambda: setattr(r, "data", 3), lambda: setattr(r, "data", torch.zeros(2).long())):
        ref.append(_outcome(bad))
    return out, ref


@pytest.mark.parametrize("world", WORLDS)
def test_data_setter_takes_the_value_shape_and_layout(tmp_path, world):
    for out, ref in run_ranks(_data_setter, world, tmp_path):
        assigned = [o for i, o in enumerate(out[:5]) if i != 1]  # (value, shape, grad, layout)
        placements = [o[3] for o in assigned]
        assert placements == ["(Shard(dim=0),)"] * 3 + ["(Shard(dim=1),)"]
        _same([o[:3] if i != 1 else o for i, o in enumerate(out[:5])] + out[5:], ref, ".data =")


# -- 2. ``plain.data = <gt.Tensor>`` ----------------------------------------------------------


def _plain_parameter(rank, world):
    import spmdgt as gt

    _start(gt, world)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    before = lin.weight.detach().clone()
    with gt.signal.context("rows"):
        t = gt.tensor(torch.arange(28.0).reshape(7, 4))
    refused = _outcome(lambda: setattr(lin.weight, "data", t))
    kept = torch.equal(lin.weight.detach(), before) and type(lin.weight) is torch.nn.Parameter
    x = torch.ones(2, 4)
    still_works = lin(x).detach().numpy()
    plain = torch.zeros(3)
    refused_plain = _outcome(lambda: setattr(plain, "data", t))
    # what the message suggests
    with torch.no_grad():
        lin.weight.copy_(t)
    copied = (type(lin.weight) is torch.nn.Parameter, lin(x).detach().numpy())
    lin.weight = torch.nn.Parameter(t)
    sharded = (type(lin.weight).__module__, lin(x).detach().numpy())
    bias = lin.bias.detach().numpy()
    # a value every rank holds whole (replicated over the world) is taken, sharing memory
    whole = t.redistribute(placements=[Replicate()])
    assert isinstance(whole, DTensor) and whole.placements == (Replicate(),)
    held = torch.nn.Linear(4, 7)
    held.weight.data = whole
    with torch.no_grad():
        whole.add_(1)  # shared as torch shares: the parameter sees it
    taken = (type(held.weight) is torch.nn.Parameter, held.weight.detach().numpy())
    return refused, kept, still_works, refused_plain, copied, sharded, before.numpy(), bias, taken


@pytest.mark.parametrize("world", WORLDS)
def test_plain_tensor_refuses_sharded_data_at_the_assignment(tmp_path, world):
    results = run_ranks(_plain_parameter, world, tmp_path)
    for refused, kept, works, refused_plain, copied, sharded, before, bias, taken in results:
        assert taken[0] and np.array_equal(taken[1], np.arange(1.0, 29.0).reshape(7, 4))
        assert refused == results[0][0]  # the same error on every rank
        assert refused.startswith("RuntimeError: cannot set .data of a plain Parameter")
        assert "torch.nn.Parameter(value)" in refused and ".copy_(value)" in refused
        assert refused_plain.startswith("RuntimeError: cannot set .data of a plain Tensor")
        assert kept  # the parameter is untouched and still usable
        np.testing.assert_allclose(works, np.ones((2, 4)) @ before.T + bias, rtol=1e-5)
        want = np.ones((2, 4), np.float32) @ np.arange(28.0, dtype=np.float32).reshape(7, 4).T
        assert copied[0]
        np.testing.assert_allclose(copied[1], want + bias, rtol=1e-6)
        assert sharded[0] == "spmdgt.tensor._tensor"
        np.testing.assert_allclose(sharded[1], want + bias, rtol=1e-6)


# -- 3. writes between a sub-mesh and the world ----------------------------------------------


def _sub_mesh_writes(rank, world):
    import spmdgt as gt

    _start(gt, world)
    w_value = torch.arange(12.0).reshape(4, 3)
    out = []
    for dst_place, src_place in (("sub", "rows"), ("rows", "sub")):
        for write in (
            lambda d, s: d.__setitem__(0, s[1]),
            lambda d, s: d.__setitem__(slice(1, 3), s[0:2]),
            lambda d, s: d.copy_(s),
            lambda d, s: d.add_(s),
            lambda d, s: d.index_add_(0, torch.tensor([3, 0]), s[1:3]),
            lambda d, s: torch.mul(s, 2, out=d),
        ):
            d, s = _make(gt, dst_place, torch.zeros(4, 3)), _make(gt, src_place, w_value)
            rd, rs = torch.zeros(4, 3), w_value.clone()
            write(d, s)
            write(rd, rs)
            out.append((_np(d), _np(rd)))
            with gt.signal.context("rows"):  # a signal active: the written tensor stays put
                write(d, s)
            write(rd, rs)
            out.append((_np(d), _np(rd)))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_writes_between_a_sub_mesh_and_the_world(tmp_path, world):
    for got in run_ranks(_sub_mesh_writes, world, tmp_path):
        for i, (value, ref) in enumerate(got):
            np.testing.assert_array_equal(value, ref, err_msg=f"write {i}")


# -- 4. ties ---------------------------------------------------------------------------------

TIE_OPS = {
    "argmax": lambda t: t.argmax(),
    "argmin": lambda t: t.argmin(),
    "argmax_keepdim": lambda t: t.argmax(keepdim=True),
    "argmax0": lambda t: t.argmax(0),
    "argmax1": lambda t: t.argmax(1),
    "argmin-1": lambda t: t.argmin(-1, keepdim=True),
    "max": lambda t: t.max(),
    "max0": lambda t: tuple(t.max(0)),
    "max1": lambda t: tuple(t.max(1)),
    "min0": lambda t: tuple(t.min(0, keepdim=True)),
    "min1": lambda t: tuple(t.min(1)),
    "sort0": lambda t: tuple(t.sort(0, stable=True)),
    "sort1": lambda t: tuple(t.sort(1, descending=True, stable=True)),
    "sort0_unstable": lambda t: tuple(t.sort(0)),
    "argsort1": lambda t: t.argsort(1, stable=True),
    "topk0": lambda t: tuple(t.topk(2, 0)),
    "topk1": lambda t: tuple(t.topk(2, 1, largest=False)),
    "kthvalue0": lambda t: tuple(t.kthvalue(2, 0)),
    "kthvalue1": lambda t: tuple(t.kthvalue(2, 1)),
    "mode0": lambda t: tuple(t.mode(0)),
    "mode1": lambda t: tuple(t.mode(1)),
    "median": lambda t: t.median(),
    "median0": lambda t: tuple(t.median(0)),
    "median1": lambda t: tuple(t.median(1)),
    "nanmedian0": lambda t: tuple(t.nanmedian(0)),
    "cummax0": lambda t: tuple(t.cummax(0)),
    "cummax1": lambda t: tuple(t.cummax(1)),
    "cummin0": lambda t: tuple(t.cummin(0)),
    "cummin1": lambda t: tuple(t.cummin(1)),
    "aminmax0": lambda t: tuple(t.aminmax(dim=0)),
    "unique": lambda t: tuple(torch.unique(t, return_inverse=True, return_counts=True)),
    "unique_dim0": lambda t: tuple(torch.unique(t, dim=0, return_inverse=True)),
    "unique_consecutive": lambda t: tuple(torch.unique_consecutive(t, return_counts=True)),
}

# even and uneven over 2 and 3 ranks, on either dim; 4x3 over 3 ranks by columns is one
# column per rank, where a later rank's extreme can come first in flat order
TIE_SHAPES = ((7, 5), (6, 6), (4, 3))


def _numpy(v):
    return tuple(_np(a) for a in v) if isinstance(v, tuple) else _np(v)


def _ties(rank, world):
    import spmdgt as gt

    _start(gt, world)
    gt.register_config(
        "subc", gt.SignalConfig(shard=gt.ShardConfig(axis=1, workers=[1, 2] if world == 3 else [1]))
    )
    out = {}
    for shape in TIE_SHAPES:
        for seed in (0, 1):
            data = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed))
            data = data.float()
            for place in ("rows", "cols", "sub", "subc"):
                x = _make(gt, place, data)
                for name, op in TIE_OPS.items():
                    key = f"{name} of {shape} seed {seed} on {place}"
                    out[key] = tuple(_outcome(lambda t=t, op=op: _numpy(op(t))) for t in (x, data))
    return out


# 2 ranks: slow (3 ranks' uneven shards stand for it; the assignment tests run both)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_ties_resolve_as_in_one_process(tmp_path, world):
    for got in run_ranks(_ties, world, tmp_path):
        for key, (value, ref) in got.items():
            _same(value, ref, key)  # values and indices


def _ties_by_columns(rank, world):
    import spmdgt as gt

    _start(gt, world)
    data = torch.tensor([[0.0, 1.0, 5.0], [5.0, 1.0, 0.0], [2.0, 2.0, 2.0], [-1.0, 3.0, -1.0]])
    x = _make(gt, "cols", data)
    return x.argmax().item(), x.argmin().item(), x.argmax(keepdim=True).numpy()


@pytest.mark.parametrize("world", WORLDS)
def test_argmax_without_dim_takes_the_first_flat_index(tmp_path, world):
    # the maximum 5 sits at flat 2 (column 2) and flat 3 (column 0): the first is 2, though
    # column 0 is on the first rank; the minimum -1 at flat 9 and 11
    for amax, amin, keep in run_ranks(_ties_by_columns, world, tmp_path):
        assert (amax, amin) == (2, 9)
        np.testing.assert_array_equal(keep, [[2]])


# -- 5. errors torch raises, and a complex product -------------------------------------------


def _dtypes(rank, world):
    import spmdgt as gt

    _start(gt, world)
    flags = torch.tensor([[True, False, True], [False, True, True], [True, True, False]] * 2)
    z = torch.arange(1.0, 19.0).reshape(6, 3) / 4 + 1j * torch.arange(18.0).reshape(6, 3) / 8
    z = z.to(torch.complex64)
    out = {}
    for place in ("rows", "cols", "sub"):
        b, c = _make(gt, place, flags), _make(gt, place, z)
        for name, op in {
            "argmax": lambda t: t.argmax(),
            "argmax0": lambda t: t.argmax(0),
            "argmax1": lambda t: t.argmax(1),
            "argmin0": lambda t: t.argmin(0, keepdim=True),
        }.items():
            out[f"{name} of bool on {place}"] = tuple(
                _outcome(lambda t=t, op=op: _numpy(op(t))) for t in (b, flags)
            )
        for name, op in {
            "prod": lambda t: t.prod(),
            "prod0": lambda t: t.prod(0),
            "prod1": lambda t: t.prod(1, keepdim=True),
            "prod-2": lambda t: torch.prod(t, -2),
            "prod_as_complex": lambda t: t.real.prod(0, dtype=torch.complex64),
            "cumprod0": lambda t: t.cumprod(0),
        }.items():
            out[f"{name} of complex on {place}"] = tuple(
                _outcome(lambda t=t, op=op: _numpy(op(t))) for t in (c, z)
            )
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_bool_argmax_raises_and_complex_prod_computes(tmp_path, world):
    results = run_ranks(_dtypes, world, tmp_path)
    for got in results:
        for key, (value, ref) in got.items():
            if "bool" in key:
                assert ref.endswith("(): does not support bool input"), key
                assert value == ref, key  # torch's error, on every rank
            else:
                assert not isinstance(value, str), f"{key}: {value}"
                np.testing.assert_allclose(value, ref, rtol=1e-5, err_msg=key)


# -- 6. every assignment between every pair of placements ------------------------------------

DST = torch.arange(15.0).reshape(5, 3) - 7
SRC = torch.arange(15.0).reshape(5, 3) * 10
SRC_OTHER = torch.arange(24.0).reshape(4, 6) + 0.5  # another shape

# name -> assignment (dst, src of DST's shape, src of another shape)
ASSIGNMENTS = {
    "data": lambda d, s, o: setattr(d, "data", s),
    "data_reshaped": lambda d, s, o: setattr(d, "data", o),
    "data_view": lambda d, s, o: setattr(d, "data", s.flatten()),  # a copy, on columns
    "data_row": lambda d, s, o: setattr(d, "data", s[1]),
    "set_": lambda d, s, o: d.set_(s),
    "set_reshaped": lambda d, s, o: d.set_(o),
    "copy_": lambda d, s, o: d.copy_(s),
    "copy_row": lambda d, s, o: d.copy_(s[1]),
    "setitem_all": lambda d, s, o: d.__setitem__(slice(None), s),
    "setitem_row": lambda d, s, o: d.__setitem__(0, s[1]),
    "setitem_rows": lambda d, s, o: d.__setitem__(slice(1, 3), s[2:4]),
    "setitem_col": lambda d, s, o: d.__setitem__((slice(None), 1), s[:, 2]),
    "setitem_mask": lambda d, s, o: d.__setitem__(d > 0, s[s > 70]),
}
# torch shares memory here; spmdgt does too, but a plain value laid out as a sharded tensor
# (or a sharded one given to a plain tensor's set_) is a copy: no rank holds it whole
_SHARES = ("data", "data_reshaped", "data_view", "data_row", "set_", "set_reshaped")


# (into, from, assignment); a plain tensor's .data refuses a sharded value (tested above)
CASES = [
    (dst, src, name)
    for dst in PLACES
    for src in PLACES
    for name in ASSIGNMENTS
    if not (name.startswith("data") and dst == "plain" and src != "plain")
]


def _assignments(rank, world):
    import spmdgt as gt

    _start(gt, world)
    out = {}
    for dst_place, src_place, name in CASES:
        assign = ASSIGNMENTS[name]
        results = []  # on spmdgt's placements, then on plain tensors (one process)
        for make in (lambda p, v: _make(gt, p, v), lambda p, v: v.clone()):
            d, s, o = make(dst_place, DST), make(src_place, SRC), make(src_place, SRC_OTHER)

            def run(d=d, s=s, o=o, assign=assign):
                assign(d, s, o)
                first = (_np(d), tuple(d.shape))
                s.add_(1000)  # a later write to the source: seen where memory is shared
                o.add_(1000)
                return (*first, _np(d))

            results.append(_outcome(run))
        out[(dst_place, src_place, name)] = results
    return out


@pytest.fixture(scope="module", params=WORLDS)
def assignment_results(request, tmp_path_factory):
    world = request.param
    results = run_ranks(_assignments, world, tmp_path_factory.mktemp(f"assign{world}"))
    return world, results


@pytest.mark.parametrize("dst,src,name", CASES, ids=["-".join(c) for c in CASES])
def test_assignment_between_placements(assignment_results, dst, src, name):
    world, results = assignment_results
    key = (dst, src, name)
    for rank, got in enumerate(results):
        value, ref = got[key]
        what = f"{name}: {src} into {dst}, rank {rank} of {world}"
        if isinstance(ref, str) or isinstance(value, str):
            assert value == ref, what
            continue
        _same(value[:2], ref[:2], what)  # the value and shape right after the assignment
        shares = name in _SHARES and (src == dst == "plain" or "plain" not in (src, dst))
        if shares or name not in _SHARES:  # then memory is shared exactly where torch shares
            _same(value[2], ref[2], f"{what}, after a write to the source")
