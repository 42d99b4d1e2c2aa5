"""Every op on every placement equals one process, or raises the same error on every rank.

The cases a review found silently wrong (in-place ops dropped, data-dependent reads failing,
reductions hanging on an empty shard, out-of-order workers permuting values, ranks drawing
different "replicated" values), each on 2 and 3 ranks, against plain torch in one process.
Sizes are uneven on purpose (5 rows over 2 or 3 ranks: 3+2, 2+2+1) and include an empty
shard (2 rows over 3 ranks, 1 row over 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS, COLS = 5, 3

# name -> mutation (applied to a sharded tensor and to a plain one alike)
MUTATIONS = {
    "mask_set": lambda x: x.__setitem__(x > 0, 0.0),
    "list_set": lambda x: x.__setitem__([0, 4], 1.0),
    "int_set": lambda x: x.__setitem__(2, 5.0),
    "slice_set": lambda x: x.__setitem__(slice(1, 4), 0.0),
    "col_set": lambda x: x.__setitem__((slice(None), 1), -1.0),
    "tensor_set": lambda x: x.__setitem__(torch.tensor([3, 1]), torch.tensor([7.0, 8.0, 9.0])),
    "index_fill_": lambda x: x.index_fill_(0, torch.tensor([1, 3]), 9.0),
    "scatter_": lambda x: x.scatter_(0, torch.tensor([[0, 1, 2]]), 9.0),
    "index_add_": lambda x: x.index_add_(0, torch.tensor([0, 4]), torch.ones(2, COLS)),
    "masked_fill_": lambda x: x.masked_fill_(x < -3, 4.0),
    "view_zero_": lambda x: x[0].zero_(),
    "view_mul_": lambda x: x[1:3].mul_(10),
    "view_col_add_": lambda x: x[:, 2].add_(100),
    "chunk_view_fill_": lambda x: x.chunk(2)[1].fill_(-2.0),
    "add_": lambda x: x.add_(1),
    "iadd": lambda x: x.__iadd__(x * 2),
    "clamp_": lambda x: x.clamp_(max=2.0),
    "copy_": lambda x: x.copy_(torch.arange(15.0).reshape(5, 3)),
    "cumsum_": lambda x: x.cumsum_(0),
    "normal_": lambda x: x.normal_(),
    "out=": lambda x: torch.mul(x.clone(), 3, out=x),
}


def _start(gt):
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gt.register_config("sub", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1])))
    gt.register_config(
        "subrep", gt.SignalConfig(shard=gt.ShardConfig(workers=[1, 0], replicated=True))
    )


def _base() -> torch.Tensor:
    return torch.arange(15.0).reshape(ROWS, COLS) - 7


def _mutations(rank, world, signal):
    import spmdgt as gt

    _start(gt)
    out = {}
    for name, mutate in MUTATIONS.items():
        with gt.signal.context(signal):
            x = gt.tensor(_base())
        before = (type(x), getattr(x, "placements", None))
        ref = _base()
        gt.manual_seed(3)
        mutate(x)
        torch.manual_seed(3)
        mutate(ref)
        out[name] = (x.numpy(), ref.numpy(), before == (type(x), getattr(x, "placements", None)))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("signal", ["rows", "cols", "sub", "subrep"])
def test_mutations_write_into_the_sharded_tensor(tmp_path, world, signal):
    for got in run_ranks(_mutations, world, tmp_path, signal):
        for name, (value, ref, same_layout) in got.items():
            np.testing.assert_array_equal(value, ref, err_msg=f"{name} on {signal}")
            assert same_layout, name  # written in place: same tensor class and placements


def _reads(rank, world):
    import spmdgt as gt

    _start(gt)
    with gt.signal.context("rows"):
        x = gt.tensor(_base(), requires_grad=True)
    ref = _base().requires_grad_(True)
    got, want = [], []
    for t, acc in ((x, got), (ref, want)):
        acc.append(t[t > 0])
        acc.append(torch.nonzero(t))
        acc.append(torch.unique(t.detach().abs()))
        acc.append(torch.masked_select(t, t < -2))
        acc.append(torch.where(t > 3)[0])
        acc.append(t.argwhere())
        (t[t > 0].pow(2).sum() + torch.masked_select(t, t < -2).sum()).backward()
        acc.append(t.grad)
    return [(g.detach().numpy(), w.detach().numpy()) for g, w in zip(got, want)]


def _stale_views(rank, world, signal):
    import spmdgt as gt

    _start(gt)
    with gt.signal.context(signal):
        x = gt.tensor(_base())
    r = _base()
    out = []
    for t in (x, r):  # the same program on a sharded and a plain tensor
        v, w = t[0], t[:, 1]
        t.mul_(2)
        first = (v + 1).clone(), w.clone()
        t[0] = 7.0
        second = v.clone(), w.sum()
        v.add_(1)
        out.append([a.numpy() for a in (*first, *second, t)])
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("signal", ["rows", "cols"])
def test_views_see_writes_to_their_base_and_back(tmp_path, world, signal):
    for sharded, plain in run_ranks(_stale_views, world, tmp_path, signal):
        for got, ref in zip(sharded, plain):
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_data_dependent_reads_forward_and_backward(tmp_path, world):
    for got in run_ranks(_reads, world, tmp_path):
        for value, ref in got:
            np.testing.assert_array_equal(value, ref)


REDUCTIONS = {
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "argmax": lambda t: t.argmax(),
    "argmin": lambda t: t.argmin(),
    "prod": lambda t: t.prod(),
    "median": lambda t: t.median(),
    "amax0": lambda t: t.amax(0),
    "max_dim0": lambda t: t.max(dim=0).values,
    "argmax_dim0": lambda t: t.argmax(0),
    "std": lambda t: t.std(),
    "var0": lambda t: t.var(0),
    "sum": lambda t: t.sum(),
    "topk": lambda t: t.flatten().topk(2).values,
}


def _empty_shard(rank, world, rows):
    import spmdgt as gt

    _start(gt)
    data = torch.tensor([[1.0, 5.0, 3.0, 2.0], [4.0, -1.0, 0.5, 8.0]])[:rows]
    with gt.signal.context("rows"):
        x = gt.tensor(data)
    local_rows = x.to_local().shape[0]
    return local_rows, {k: (f(x).numpy(), f(data).numpy()) for k, f in REDUCTIONS.items()}


@pytest.mark.parametrize("world,rows", [(2, 1), (3, 1), (3, 2)])
def test_reductions_over_an_empty_shard(tmp_path, world, rows):
    results = run_ranks(_empty_shard, world, tmp_path, rows)
    assert min(r[0] for r in results) == 0  # some rank really holds no rows
    for _, got in results:
        for name, (value, ref) in got.items():
            np.testing.assert_allclose(value, ref, rtol=1e-6, err_msg=name)


def _workers_out_of_order(rank, world, workers):
    import spmdgt as gt

    gt.register_config("w", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=workers)))
    gt.manual_seed(0)
    with gt.signal.context("w"):
        a = gt.arange(12.0).reshape(4, 3)
        r = gt.randn(7, 3)
        t = gt.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    m = r @ t
    torch.manual_seed(0)
    rr = torch.randn(7, 3)
    rt = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    return [
        (a.numpy(), torch.arange(12.0).reshape(4, 3).numpy()),
        (r.numpy(), rr.numpy()),
        (t.numpy(), rt.numpy()),
        (m.numpy(), (rr @ rt).numpy()),
    ]


@pytest.mark.parametrize("world,workers", [(2, [1, 0]), (3, [2, 0, 1])])
def test_workers_listed_out_of_order_keep_the_value_in_order(tmp_path, world, workers):
    for got in run_ranks(_workers_out_of_order, world, tmp_path, workers):
        for value, ref in got:
            np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)


def _no_seed_call(rank, world):
    import spmdgt as gt

    # no manual_seed anywhere: ranks started with different generators (tests/_dist.py)
    a = gt.randn(4, 4)
    lin = torch.nn.Linear(3, 2)
    _start(gt)
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
    y = lin(x)
    return a.numpy(), lin.weight.detach().numpy(), lin.bias.detach().numpy(), x.numpy(), y.numpy()


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_values_agree_without_a_seed_call(tmp_path, world):
    results = run_ranks(_no_seed_call, world, tmp_path)
    for got in results[1:]:
        for value, first in zip(got, results[0]):
            np.testing.assert_array_equal(value, first)
    _, w, b, x, y = results[0]
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-6)  # one weight, every shard


def _random_ops(rank, world):
    import spmdgt as gt

    _start(gt)
    gt.manual_seed(7)
    with gt.signal.context("rows"):
        x = gt.randn(5, 4, requires_grad=True)
    d = torch.nn.functional.dropout(x, 0.5)
    b = torch.bernoulli(torch.sigmoid(x))
    r = torch.rand_like(x)
    d.sum().backward()
    torch.manual_seed(7)
    rx = torch.randn(5, 4, requires_grad=True)
    rd = torch.nn.functional.dropout(rx, 0.5)
    rb = torch.bernoulli(torch.sigmoid(rx))
    rr = torch.rand_like(rx)
    rd.sum().backward()
    return [(g.detach().numpy(), w.detach().numpy()) for g, w in ((d, rd), (b, rb), (r, rr))] + [
        (x.grad.numpy(), rx.grad.numpy())
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_random_ops_on_sharded_tensors_draw_what_one_process_draws(tmp_path, world):
    for got in run_ranks(_random_ops, world, tmp_path):
        for value, ref in got:
            np.testing.assert_array_equal(value, ref)


def _grads_are_gt_tensors(rank, world):
    import spmdgt as gt

    gt.register_config("g", gt.SignalConfig(shard=gt.ShardConfig(axis=0), backward_signal="c"))
    gt.register_config("c", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gt.manual_seed(1)
    with gt.signal.context("g"):
        w = gt.randn(5, 3, requires_grad=True)
    (w * w).sum().backward()
    (gx,) = torch.autograd.grad((w**3).sum(), [w])
    opt = torch.optim.Adam([w], lr=0.1)
    opt.step()
    state = opt.state[w]["exp_avg"]
    torch.manual_seed(1)
    rw = torch.randn(5, 3, requires_grad=True)
    (rw * rw).sum().backward()
    (rgx,) = torch.autograd.grad((rw**3).sum(), [rw])
    ropt = torch.optim.Adam([rw], lr=0.1)
    ropt.step()
    return [
        (type(t).__module__, t.numpy(), r.detach().numpy())
        for t, r in ((w.grad, rw.grad), (gx, rgx), (state, ropt.state[rw]["exp_avg"]), (w, rw))
    ] + [str(w.grad.placements)]


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_and_optimizer_state_are_gt_tensors(tmp_path, world):
    for got in run_ranks(_grads_are_gt_tensors, world, tmp_path):
        *pairs, grad_place = got
        assert grad_place == "(Shard(dim=1),)"  # the backward signal's placement
        for kind, value, ref in pairs:
            assert kind == "spmdgt.tensor._tensor"  # a gt.Tensor, not a raw DTensor
            np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)


def _fallback_policy(rank, world):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    import spmdgt as gt

    _start(gt)
    with gt.signal.context("rows"):
        x = gt.tensor(_base())
    errors = []
    # a genuine user error is torch's own error, raised on every rank, not swallowed
    for bad in (lambda: x @ torch.ones(4, 2), lambda: x.index_fill_(0, torch.tensor([9]), 1.0)):
        try:
            bad()
            errors.append(None)
        except (RuntimeError, IndexError) as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    # DTensor's implicit replication is on only inside spmdgt's calls: a raw DTensor mixed
    # with a plain tensor still raises as DTensor does (the trainer's own DTensors)
    raw = distribute_tensor(torch.ones(4, 3), gt.device_mesh(), [Replicate()])
    try:
        raw + torch.ones(4, 3)
        raw_mix = "ran"
    except RuntimeError as e:
        raw_mix = "mixed torch.Tensor and DTensor" in str(e)
    flag = torch._C._get_dtensor_allow_implicit_replication()
    torch.nonzero(x)
    x[x > 0] = 0
    stats = gt.debug.get_worker_stats()
    return errors, raw_mix, flag, isinstance(raw, DTensor), stats[rank]["fallbacks"], sorted(stats)


@pytest.mark.parametrize("world", [2, 3])
def test_fallback_is_chosen_by_op_and_scoped(tmp_path, world):
    results = run_ranks(_fallback_policy, world, tmp_path)
    for errors, raw_mix, flag, _, fallbacks, ranks in results:
        assert errors == results[0][0] and all(errors), errors  # same error on every rank
        assert "mat1 and mat2 shapes cannot be multiplied" in errors[0]
        assert "out of bounds" in errors[1]
        assert raw_mix is True and flag is False
        # the two errors above ran on global values too: torch itself raised them
        assert fallbacks == {"matmul": 1, "index_fill_": 1, "nonzero": 1, "__setitem__": 1}
        assert ranks == list(range(world))  # get_worker_stats is keyed by rank, as GT's was


def _gt_spellings(rank, world):
    import spmdgt as gt

    _start(gt)
    a = np.arange(15, dtype=np.float32).reshape(5, 3)
    p = gt.from_numpy(a.copy(), requires_grad=True)
    with gt.signal.context("rows"):
        s = gt.tensor(a)
    out = []
    for t in (p, s):
        out.append(
            [
                t.mean(axis=0).detach().numpy(),
                t.var(axis=1, keepdims=True).detach().numpy(),
                t.std(axis=0, keepdims=True).detach().numpy(),
                t.sum(axis=0, keepdims=True).detach().numpy(),
                t.transpose().detach().numpy(),
            ]
        )
    return p.requires_grad, out


@pytest.mark.parametrize("world", [2, 3])
def test_gt_spellings_on_plain_and_sharded_tensors(tmp_path, world):
    a = torch.arange(15.0).reshape(5, 3)
    ref = [
        a.mean(0).numpy(),
        a.var(1, keepdim=True).numpy(),
        a.std(0, keepdim=True).numpy(),
        a.sum(0, keepdim=True).numpy(),
        a.T.numpy(),
    ]
    for requires_grad, out in run_ranks(_gt_spellings, world, tmp_path):
        assert requires_grad
        for got in out:  # plain, then sharded
            for value, want in zip(got, ref):
                np.testing.assert_allclose(value, want, rtol=1e-6)


def _plain_scalar_parameter(rank, world):
    import spmdgt as gt

    _start(gt)
    s = torch.tensor(2.0, requires_grad=True)  # a plain 0-d parameter (a learned scale)
    with gt.signal.context("rows"):
        x = gt.tensor(_base(), requires_grad=True)
    torch.nn.functional.relu6(x * s + s).sum().backward()
    rs = torch.tensor(2.0, requires_grad=True)
    rx = _base().requires_grad_(True)
    torch.nn.functional.relu6(rx * rs + rs).sum().backward()  # relu6's backward has no DTensor rule
    return type(s.grad) is torch.Tensor, s.grad.item(), rs.grad.item(), x.grad.numpy(), rx.grad


@pytest.mark.parametrize("world", [2, 3])
def test_plain_scalar_parameter_gets_a_plain_exact_gradient(tmp_path, world):
    for plain, g, ref, gx, rgx in run_ranks(_plain_scalar_parameter, world, tmp_path):
        assert plain and g == pytest.approx(ref, rel=1e-6)
        np.testing.assert_array_equal(gx, rgx.numpy())
