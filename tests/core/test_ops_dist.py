"""Sharded ops equal single-process torch, forward and backward, with uneven sizes (2 ranks)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from tests._dist import run_ranks

# Sizes like world * 3 + 1 so shards come out uneven (torch.chunk rule).
M, K, N = 7, 5, 9


def _signals(gt, specs):
    for name, (axis, replicated) in specs.items():
        gt.register_config(
            name, gt.SignalConfig(shard=gt.ShardConfig(axis=axis, replicated=replicated))
        )


def _make(gt, name, shape, seed):
    gt.manual_seed(seed)
    with gt.signal.context(name):
        return gt.randn(*shape, requires_grad=True)


def _matmul_case(rank, world, a_sig, b_sig):
    import spmdgt as gt

    _signals(gt, {"s0": (0, False), "s1": (1, False), "rep": (0, True)})
    a = _make(gt, a_sig, (M, K), 1)
    b = _make(gt, b_sig, (K, N), 2)
    c = a @ b
    loss = (c * c).sum()
    loss.backward()
    # Reference: the same seeds in plain torch on one process.
    torch.manual_seed(1)
    ra = torch.randn(M, K, requires_grad=True)
    torch.manual_seed(2)
    rb = torch.randn(K, N, requires_grad=True)
    rc = ra @ rb
    (rc * rc).sum().backward()
    return {
        "c": c.numpy(),
        "loss": loss.item(),
        "ga": a.grad.numpy(),
        "gb": b.grad.numpy(),
        "ref": (rc.detach().numpy(), ra.grad.numpy(), rb.grad.numpy()),
        "a_place": str(getattr(a, "placements", "plain")),
        "c_type": type(c).__name__,
    }


def _check(results, world):
    for r in results:
        rc, rga, rgb = r["ref"]
        # fp32 sums over K=5 / N=9 terms in a different order: 1e-5 relative is ample.
        torch.testing.assert_close(torch.tensor(r["c"]), torch.tensor(rc), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["ga"]), torch.tensor(rga), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["gb"]), torch.tensor(rgb), rtol=1e-5, atol=1e-5)
    assert results[0]["loss"] == results[1]["loss"]


def test_row_parallel_matmul(tmp_path):
    res = run_ranks(_matmul_case, 2, tmp_path, "s0", "rep")
    _check(res, 2)
    assert res[0]["a_place"] == "(Shard(dim=0),)" and res[0]["c_type"] == "Tensor"


def test_column_parallel_matmul(tmp_path):
    _check(run_ranks(_matmul_case, 2, tmp_path, "rep", "s1"), 2)


def test_contraction_sharded_matmul(tmp_path):
    _check(run_ranks(_matmul_case, 2, tmp_path, "s1", "s0"), 2)


def test_both_sharded_matmul(tmp_path):
    _check(run_ranks(_matmul_case, 2, tmp_path, "s0", "s1"), 2)


def _reductions(rank, world):
    import spmdgt as gt

    _signals(gt, {"s0": (0, False), "s1": (1, False)})
    out = {}
    for sig in ("s0", "s1"):
        x = _make(gt, sig, (M, N), 3)
        torch.manual_seed(3)
        rx = torch.randn(M, N, requires_grad=True)
        vals = {
            "sum": (x.sum(), rx.sum()),
            "mean": (x.mean(), rx.mean()),
            "max": (x.max(), rx.max()),
            "sum0": (x.sum(axis=0), rx.sum(dim=0)),
            "sum1k": (x.sum(axis=1, keepdims=True), rx.sum(dim=1, keepdim=True)),
            "mean1": (x.mean(axis=1), rx.mean(dim=1)),
            "max0": (x.max(axis=0).values, rx.max(dim=0).values),
            "max1i": (x.max(axis=1).indices, rx.max(dim=1).indices),
        }
        total = sum((v[0].float() * (i + 1)).sum() for i, v in enumerate(vals.values()))
        rtotal = sum((v[1].float() * (i + 1)).sum() for i, v in enumerate(vals.values()))
        total.backward()
        rtotal.backward()
        out[sig] = {k: (v[0].numpy(), v[1].detach().numpy()) for k, v in vals.items()}
        out[sig]["grad"] = (x.grad.numpy(), rx.grad.numpy())
    return out


def test_reductions_with_and_without_axis(tmp_path):
    for res in run_ranks(_reductions, 2, tmp_path):
        for sig, vals in res.items():
            for k, (got, ref) in vals.items():
                torch.testing.assert_close(
                    torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5, msg=f"{sig} {k}"
                )


def _views(rank, world):
    import spmdgt as gt

    _signals(gt, {"s0": (0, False), "s1": (1, False)})
    x = _make(gt, "s0", (M, 6), 4)
    y = _make(gt, "s1", (M, 6), 5)
    torch.manual_seed(4)
    rx = torch.randn(M, 6, requires_grad=True)
    torch.manual_seed(5)
    ry = torch.randn(M, 6, requires_grad=True)

    def prog(x, y, cat):
        parts = [
            x.reshape(6, M).sum(0),
            x.T @ y,
            x.transpose(0, 1).reshape(-1)[:10],
            cat([x, y], axis=0)[2:9].sum(0),
            cat([x, y], axis=1).sum(1),
            x[1:5, 2:],
            x[3],
            y.view(M * 6).unsqueeze(0).squeeze(0)[::5],
            x.permute(1, 0).flatten(),
            torch.relu(x) * torch.exp(y) - torch.tanh(x) / (1 + torch.sigmoid(y)),
            (2.0 + x) ** 3 <= y.abs().sqrt(),
        ]
        return parts

    def gcat(ts, axis):
        return gt.cat(ts, axis=axis)

    def tcat(ts, axis):
        return torch.cat(ts, dim=axis)

    got = prog(x, y, gcat)
    ref = prog(rx, ry, tcat)
    sum(p.float().sum() * (i + 1) for i, p in enumerate(got) if p.dtype != torch.bool).backward()
    sum(p.float().sum() * (i + 1) for i, p in enumerate(ref) if p.dtype != torch.bool).backward()
    return (
        [(g.numpy(), r.detach().numpy()) for g, r in zip(got, ref)],
        (x.grad.numpy(), rx.grad.numpy()),
        (y.grad.numpy(), ry.grad.numpy()),
    )


def test_views_cat_indexing_pointwise(tmp_path):
    for parts, gx, gy in run_ranks(_views, 2, tmp_path):
        for i, (got, ref) in enumerate([*parts, gx, gy]):
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5, msg=f"part {i}"
            )


def _plain_module(rank, world):
    import spmdgt as gt

    _signals(gt, {"data": (0, False)})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        gt.manual_seed(10 + step)
        with gt.signal.context("data"):
            x = gt.randn(M, 5)
        torch.manual_seed(10 + step)
        rx = torch.randn(M, 5)
        loss = model(x).pow(2).mean()
        rloss = ref(rx).pow(2).mean()
        loss.backward()
        rloss.backward()
        assert type(model[0].weight.grad) is torch.Tensor  # plain params keep plain grads
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        losses.append((loss.item(), rloss.item(), str(x.placements)))
    return losses, [
        (p.detach().numpy(), q.detach().numpy())
        for p, q in zip(model.parameters(), ref.parameters())
    ]


def test_plain_torch_module_and_optimizer_on_sharded_input(tmp_path):
    for losses, params in run_ranks(_plain_module, 2, tmp_path):
        for got, ref, place in losses:
            assert place == "(Shard(dim=0),)"
            assert abs(got - ref) < 1e-6
        for p, q in params:
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)


def _partial_and_print(rank, world):
    import spmdgt as gt

    _signals(gt, {"s1": (1, False), "s0": (0, False)})
    a = _make(gt, "s1", (3, 4), 0)
    b = _make(gt, "s0", (4, 2), 1)
    c = a @ b
    placements = c.placements
    return {
        "partial": isinstance(placements[0], Partial),
        "print": repr(c),
        "numpy": c.numpy(),
        "data_numpy": c.data.numpy(),
        "list": c.tolist(),
        "item": c.sum().item(),
        "fmt": f"{c.sum():.4f}",
        "array": __import__("numpy").asarray(c),
        "repl": isinstance(c.redistribute(placements=[Replicate()]).placements[0], Replicate),
        "local": tuple(a.to_local().shape),
        "shard": isinstance(a.placements[0], Shard),
    }


def test_global_value_on_every_rank(tmp_path):
    r0, r1 = run_ranks(_partial_and_print, 2, tmp_path)
    torch.manual_seed(0)
    ra = torch.randn(3, 4)
    torch.manual_seed(1)
    rc = ra @ torch.randn(4, 2)
    for r in (r0, r1):
        assert r["partial"] and r["repl"] and r["shard"]
        for key in ("numpy", "data_numpy", "array"):
            torch.testing.assert_close(torch.tensor(r[key]), rc, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["list"]), rc, rtol=1e-5, atol=1e-6)
        assert abs(r["item"] - rc.sum().item()) < 1e-5
        assert r["fmt"] == f"{rc.sum().item():.4f}"
        assert "placements=(Partial(sum),)" in r["print"] and "tensor([[" in r["print"]
    assert r0["local"] == (3, 2) and r1["local"] == (3, 2)
    assert r0["print"] == r1["print"]


def _sub_mesh_values(rank, world):
    from torch.distributed.tensor import Replicate

    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    target = Target(mesh_for(list(range(1, world))), (Replicate(),))
    x = place(torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0]), target)
    m = place(torch.arange(12.0).reshape(3, 4), target)
    out = {}
    for name, y in (("nonzero", torch.nonzero(x)), ("transposed", m.t()), ("same", m)):
        g = global_value(y)
        g.add_(1)  # the caller's own memory on every rank, not the tensor's on some
        out[name] = (g.tolist(), g.stride())
    out["after"] = global_value(m).tolist()
    return out


def test_global_value_of_a_sub_mesh_is_laid_out_alike_on_every_rank(tmp_path):
    """A value held on ranks 1..N-1 reaches every rank with the same strides (a stride that
    differs by rank fails dynamo's guards on some ranks only) and as a copy everywhere."""
    results = run_ranks(_sub_mesh_values, 3, tmp_path)
    nz = torch.nonzero(torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0])) + 1
    m = torch.arange(12.0).reshape(3, 4)
    for r in results:
        assert r["nonzero"] == (nz.tolist(), (1, 1))
        assert r["transposed"] == ((m.t() + 1).tolist(), (3, 1))
        assert r["same"] == ((m + 1).tolist(), (4, 1))
        assert r["after"] == m.tolist()


def _as_strided(rank, world):
    from torch.distributed.tensor import Replicate, Shard

    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    full = torch.arange(36.0).reshape(3, 6, 2)
    sub = place(full, Target(mesh_for(list(range(1, world))), (Replicate(),)))
    rows = place(full, Target(mesh_for(None), (Shard(0),)))
    out = {
        "sub": global_value(sub.as_strided((3, 2, 3, 2), (12, 6, 2, 1))).tolist(),
        "rows": global_value(rows.as_strided((3, 6, 2), (12, 2, 1))).tolist(),
        "sub permuted": global_value(sub.as_strided((6, 2, 3), (1, 6, 12))).tolist(),
        "rows permuted": global_value(rows.as_strided((2, 3, 6), (1, 12, 2))).tolist(),
    }
    for name, call in (
        ("reshape of a shard", lambda: rows.as_strided((3, 2, 3, 2), (12, 6, 2, 1))),
        ("permuted reshape of a shard", lambda: rows.as_strided((3, 6, 2), (12, 1, 6))),
        ("not a view", lambda: sub.as_strided((3, 3), (1, 3))),
    ):
        try:
            call()
            out[name] = "ran"
        except Exception as e:
            out[name] = type(e).__name__
    return out


def test_as_strided_that_is_a_local_view_runs_and_others_raise(tmp_path):
    """``as_strided`` as AOTAutograd regenerates an output that aliases an input (a compiled
    function returning ``x.unflatten`` or ``x.permute``): a reshape of a replicated value
    and a permutation of any, or the identity, is ``view`` then ``permute`` and equals
    torch; anything else raises, as DTensor does (found by the parity sweep with both
    compile halves on: the holder of a sub-mesh value called it alone)."""
    full = torch.arange(36.0).reshape(3, 6, 2)
    for r in run_ranks(_as_strided, 3, tmp_path):
        assert r["sub"] == full.as_strided((3, 2, 3, 2), (12, 6, 2, 1)).tolist()
        assert r["rows"] == full.tolist()
        assert r["sub permuted"] == full.as_strided((6, 2, 3), (1, 6, 12)).tolist()
        assert r["rows permuted"] == full.permute(2, 0, 1).tolist()
        for refused in ("reshape of a shard", "permuted reshape of a shard", "not a view"):
            assert r[refused] != "ran", refused


def _partial_bits(rank, world):
    from torch.distributed.tensor import Shard

    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    columns = place(torch.arange(10.0).reshape(2, 5) / 7, Target(mesh_for(None), (Shard(1),)))
    p = columns.sum(1)  # partial: each rank's sum of its columns
    return global_value(p.view(torch.int32)), str(p.placements)


def test_a_partial_values_bits_read_as_another_dtype_are_the_reduced_values_bits(tmp_path):
    """``view(dtype)`` of a partial value: DTensor's rule keeps the placement, so the ranks'
    reinterpreted bits were summed (a float32 sum read as int32 gave -1134858824 for
    1068948334); now the exact fallback reads the reduced value's bits."""
    want = (torch.arange(10.0).reshape(2, 5) / 7).sum(1)
    for bits, placements in run_ranks(_partial_bits, 3, tmp_path):
        assert "Partial" in placements  # the case it is about
        torch.testing.assert_close(bits.view(torch.float32), want)


# A row of column parts that cancel: 3 ranks hold 2 columns each; the row sums 0.55 (float32),
# each rank's part rounds to half precision on its own (1000.3 -> 1000.5), torch rounds 0.55.
_CANCELLING = [[1000.3, 0.0, -1000.0, 0.0, 0.25, 0.0], [0.1, -7.3, 2.0, 5.0, 0.0, 1.0]]


def _casts_and_convs_of_partial_values(rank, world):
    import torch.nn.functional as F

    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    cols = Target(mesh_for(None), (Shard(1),))
    out = {}
    x = place(torch.tensor(_CANCELLING), cols).requires_grad_(True)
    p = x.sum(1)  # partial: each rank's sum of its columns
    out["placements"] = str(p.placements)
    half, bf16 = p.half(), p.to(torch.bfloat16)
    (half.float() * torch.tensor([1.0, 2.0])).sum().backward()
    out["half"], out["bf16"] = global_value(half), global_value(bf16)
    out["cast grad"] = global_value(x.grad)

    g = torch.Generator().manual_seed(0)
    signal = torch.randn(2, 2, 5, 6, generator=g)  # (N, C, L) summed over a sharded last dim
    weight = torch.randn(3, 2, 3, generator=g)
    xs = place(signal, Target(mesh_for(None), (Shard(3),))).requires_grad_(True)
    y = F.conv1d(xs.sum(3), weight)
    y.pow(2).sum().backward()
    out["conv"], out["conv grad"] = global_value(y), global_value(xs.grad)
    return out


def test_a_cast_or_a_convolution_of_a_partial_value_reduces_it_first(tmp_path):
    """A partial value (a sum over a sharded dim) cast to half precision, and fed to a
    convolution, equals one process on every rank, forward and backward. DTensor's cast rule
    keeps the partial placement and rounds each rank's part (parts that cancel came out 0.75
    for torch's 0.55), and its convolution handler runs the kernel on each rank's part and
    calls the result replicated (each rank a different wrong value); found by the parity
    sweep's ``partial`` layout."""
    x = torch.tensor(_CANCELLING, requires_grad=True)
    p = x.sum(1)
    (p.half().float() * torch.tensor([1.0, 2.0])).sum().backward()
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(2, 2, 5, 6, generator=g).requires_grad_(True)
    weight = torch.randn(3, 2, 3, generator=g)
    y = torch.nn.functional.conv1d(signal.sum(3), weight)
    y.pow(2).sum().backward()
    for r in run_ranks(_casts_and_convs_of_partial_values, 3, tmp_path):
        assert "Partial" in r["placements"]  # the case it is about
        assert torch.equal(r["half"], p.half()) and torch.equal(r["bf16"], p.bfloat16())
        torch.testing.assert_close(r["cast grad"], x.grad)
        torch.testing.assert_close(r["conv"], y.detach())
        torch.testing.assert_close(r["conv grad"], signal.grad)


def _sums_of_norms(rank, world):
    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    g = torch.Generator().manual_seed(0)
    x = place(torch.randn(4, 7, generator=g), Target(mesh_for(None), (Shard(1),)))
    x.requires_grad_(True)
    norms = {p: torch.linalg.vector_norm(x, p, dim=1) for p in (1, 2, 3)}
    out = {f"placement {p}": str(n.placements) for p, n in norms.items()}
    out.update({f"sum {p}": global_value(n.sum()) for p, n in norms.items()})
    out["sum(0) 2"] = global_value(norms[2].sum(0))
    out["nansum 2"] = global_value(norms[2].nansum())
    sum(n.sum() for n in norms.values()).backward()
    out["grad"] = global_value(x.grad)
    return out


def test_a_sum_of_norms_over_a_sharded_dim_is_the_sum_of_the_norms(tmp_path):
    """``x.norm(dim=1).sum()`` with ``x``'s columns sharded: DTensor holds the norms as a
    ``_NormPartial`` (each rank the norm of its columns), which calls its reduction ``sum``,
    so DTensor's sum rule kept it and the ranks took the norm of their sums of norms (7.135
    for torch's 7.395 on 2 ranks, silently). A 1-norm's parts do add; 2- and 3-norms are
    reduced before the sum, forward and backward."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    norms = {p: torch.linalg.vector_norm(x, p, dim=1) for p in (1, 2, 3)}
    sum(n.sum() for n in norms.values()).backward()
    for r in run_ranks(_sums_of_norms, 3, tmp_path):
        assert "NormPartial(2" in r["placement 2"]  # the case it is about
        for p, n in norms.items():
            torch.testing.assert_close(r[f"sum {p}"], n.sum().detach())
        torch.testing.assert_close(r["sum(0) 2"], norms[2].sum(0).detach())
        torch.testing.assert_close(r["nansum 2"], norms[2].nansum().detach())
        torch.testing.assert_close(r["grad"], x.grad)


# (p, value): a sum partial's -0.0, a negative fill of a 2- and a 3-norm, a positive one
_NORM_FILLS = ((1, -0.0), (2, -2.5), (3, -2.5), (2, 3.0))


def _fills_by_name(rank, world):
    import spmdgt  # noqa: F401  (initialises the rank)
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import global_value, place
    from spmdgt.tensor._placement import Target

    g = torch.Generator().manual_seed(0)
    x = place(torch.randn(4, 7, generator=g), Target(mesh_for(None), (Shard(1),)))
    out = {}
    for p, v in _NORM_FILLS:
        n = torch.linalg.vector_norm(x, p, dim=1)
        torch.ops.aten.fill_.Scalar(n, v)  # the aten op the rewrite sees
        out[f"fill {p} {v}"] = global_value(n)
    y = place(torch.arange(7.0 * 3).reshape(7, 3), Target(mesh_for(None), (Shard(0),)))
    torch.ops.aten.cumsum_.default(y, 0)  # no DTensor rule for it on Shard(0): the fallback
    out["cumsum_"] = global_value(y)
    return out


def test_a_fill_of_a_partial_norm_and_an_aten_write_by_name_are_exact(tmp_path):
    """A partial p-norm (p != 1) holds a filled value as the value on one rank and 0 on the
    others, which its reduction (the root of the summed p-th powers) turns into the absolute
    value: ``fill_(-2.5)`` read back 2.5 (p = 2) and NaN (p = 3). And an in-place aten overload
    called by name (``torch.ops.aten.cumsum_.default``) with no DTensor rule took the
    out-of-place fallback: the write was lost, silently. Both exact now, on 3 ranks."""
    for r in run_ranks(_fills_by_name, 3, tmp_path):
        for p, v in _NORM_FILLS:
            got = r[f"fill {p} {v}"]
            torch.testing.assert_close(got, torch.full((4,), v))
            assert torch.equal(got.signbit(), torch.full((4,), v).signbit()), (p, v)
        torch.testing.assert_close(r["cumsum_"], torch.arange(7.0 * 3).reshape(7, 3).cumsum(0))


def _raw_dtensor_partials(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import spmdgt  # noqa: F401  (initialises the rank; installs the hook)

    # what a trainer's TP model holds: raw DTensor parameters, used outside spmdgt's calls
    mesh = init_device_mesh("cpu", (world,))
    w0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 100
    w = distribute_tensor(w0, mesh, [Shard(1)]).requires_grad_(True)
    norms = torch.linalg.vector_norm(w, 2, dim=1)  # a row-parallel weight's row norms
    sums = w.sum(1)
    loss = norms.sum() + sums.half().float().sum() + norms.nansum()
    loss.backward()
    out = {"placement": str(norms.placements), "loss": loss.full_tensor()}
    out["grad"] = w.grad.full_tensor()
    filled = torch.linalg.vector_norm(w.detach(), 2, dim=1)
    torch.ops.aten.fill_.Scalar(filled, 1.5)
    out["fill"] = filled.full_tensor()
    # a convolution of a partial input (DTensor's own handler, before its propagation)
    x0, k0 = _conv_inputs()
    parts = torch.zeros_like(x0) if rank else x0  # the value on rank 0, zeros elsewhere
    x = DTensor.from_local(parts, mesh, [Partial()], run_check=False).requires_grad_(True)
    k = distribute_tensor(k0, mesh, [Replicate()]).requires_grad_(True)
    y = torch.nn.functional.conv1d(x, k)
    (y * y).sum().backward()
    out["conv"], out["conv grad"] = y.full_tensor(), k.grad.full_tensor()
    return out


def _conv_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 8, generator=g), torch.randn(4, 3, 3, generator=g)


def test_partial_rewrites_act_on_raw_dtensors_too(tmp_path):
    """The trainer's TP and FSDP parameters are raw DTensors, outside spmdgt's calls: there
    DTensor's own rules ran, and a loss that sums a row-parallel weight's row norms came out
    8.243 for torch's 8.403 (2 ranks, silently), its half cast rounded each rank's part. The
    ``_partials`` rewrites act on every DTensor op of the process now, forward and backward;
    and DTensor's convolution handler (which runs before its propagation) ran the kernel on
    each rank's part of a partial input and called the result replicated (4.37 off)."""
    w0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 100
    w = w0.clone().requires_grad_(True)
    norms = torch.linalg.vector_norm(w, 2, dim=1)
    loss = norms.sum() + w.sum(1).half().float().sum() + norms.nansum()
    loss.backward()
    x, k = _conv_inputs()
    k.requires_grad_(True)
    y = torch.nn.functional.conv1d(x, k)
    (y * y).sum().backward()
    for r in run_ranks(_raw_dtensor_partials, 3, tmp_path):
        assert "NormPartial(2" in r["placement"]  # the case it is about
        torch.testing.assert_close(r["loss"], loss.detach())
        torch.testing.assert_close(r["grad"], w.grad)
        torch.testing.assert_close(r["fill"], torch.full((5,), 1.5))
        torch.testing.assert_close(r["conv"], y.detach())
        torch.testing.assert_close(r["conv grad"], k.grad)


def _raw_losses(rank, world):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import spmdgt  # noqa: F401  (initialises the rank; installs the hook)

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dim in (0, 1):
        for name in _RAW_LOSSES:
            x0, t0 = _loss_inputs()
            x = distribute_tensor(x0, mesh, [Shard(dim)]).requires_grad_(True)
            t = distribute_tensor(t0, mesh, [Shard(dim)])
            loss = getattr(F, name)(x, t.sigmoid() if "cross" in name else t)
            loss.backward()
            out[(name, dim)] = (loss.full_tensor(), x.grad.full_tensor())
    return out


_RAW_LOSSES = ("mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits")


def _loss_inputs():
    g = torch.Generator().manual_seed(2)
    return torch.randn(M, N, generator=g), torch.randn(M, N, generator=g)


def test_losses_on_raw_dtensors_with_uneven_shards_equal_one_process(tmp_path):
    """DTensor derives these losses' sharding from their decompositions, which read a size
    at the global shape while the op runs on local shards: raw DTensors (the trainer's, a
    regularizer on TP parameters) got a wrong mean on uneven shards (``mse_loss`` on 7 x 9 rows
    or columns over 2 and 3 ranks, with spmdgt imported). The hook now runs those
    decompositions on every DTensor op of the process, forward and backward (3 ranks)."""
    import torch.nn.functional as F

    want = {}
    for name in _RAW_LOSSES:
        x0, t0 = _loss_inputs()
        x = x0.clone().requires_grad_(True)
        loss = getattr(F, name)(x, t0.sigmoid() if "cross" in name else t0)
        loss.backward()
        want[name] = (loss.detach(), x.grad)
    for r in run_ranks(_raw_losses, 3, tmp_path):
        for (name, dim), (loss, grad) in r.items():
            torch.testing.assert_close(loss, want[name][0], msg=f"{name} Shard({dim})")
            torch.testing.assert_close(grad, want[name][1], msg=f"{name} Shard({dim}) grad")
