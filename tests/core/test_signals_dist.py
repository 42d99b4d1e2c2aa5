"""Signals on N ranks: sub-meshes, GT's pipeline pattern, backward placements, auto-shard."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests._calls import CreationShapes
from tests._dist import run_ranks

PIPELINE_YAML = textwrap.dedent(
    """
    stage_1:
      shard: {axis: 0, workers: [0, 1]}
      backward: stage_1_backward
    stage_1_backward:
      shard: {axis: 1, workers: [0, 1]}
    stage_2:
      shard: {axis: 0, workers: [2, 3]}
      backward: stage_2_backward
    stage_2_backward:
      shard: {axis: 0, workers: [2, 3], replicated: true}
    """
)


def _pipeline(rank, world, path):
    import spmdgt as gt

    gt.load_config(path)
    gt.manual_seed(0)
    with gt.signal.context("stage_1"):
        x = gt.randn(9, 6, requires_grad=True)
        w1 = gt.randn(6, 5, requires_grad=True)
        h = torch.relu(x @ w1)
    with gt.signal.context("stage_2"):
        w2 = gt.randn(5, 3, requires_grad=True)
        y = h @ w2
        loss = (y * y).mean()
    loss.backward()
    torch.manual_seed(0)
    rx = torch.randn(9, 6, requires_grad=True)
    rw1 = torch.randn(6, 5, requires_grad=True)
    rw2 = torch.randn(5, 3, requires_grad=True)
    rloss = ((torch.relu(rx @ rw1) @ rw2) ** 2).mean()
    rloss.backward()
    return {
        "loss": (loss.item(), rloss.item()),
        "grads": [(t.grad.numpy(), r.grad.numpy()) for t, r in ((x, rx), (w1, rw1), (w2, rw2))],
        "x_mesh": x.device_mesh.mesh.tolist(),
        "y_mesh": y.device_mesh.mesh.tolist(),
        "x_grad_place": x.grad.placements,
        "w2_grad_place": w2.grad.placements,
        "x_local": tuple(x.to_local().shape),
        "y_local": tuple(y.to_local().shape),
    }


def test_pipeline_stages_move_values_forward_and_backward(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(PIPELINE_YAML)
    results = run_ranks(_pipeline, 4, tmp_path, str(path))
    for rank, r in enumerate(results):
        got, ref = r["loss"]
        assert abs(got - ref) < 1e-5
        for g, rg in r["grads"]:
            torch.testing.assert_close(torch.tensor(g), torch.tensor(rg), rtol=1e-5, atol=1e-6)
        assert r["x_mesh"] == [0, 1] and r["y_mesh"] == [2, 3]
        # backward signals applied: stage_1's grads Shard(1), stage_2's replicated
        assert r["x_grad_place"] == (Shard(1),)
        assert r["w2_grad_place"] == (Replicate(),)
        # only the stage's ranks hold data (9 rows -> 5 + 4)
        assert r["x_local"] == ((5, 6), (4, 6), (0,), (0,))[rank]
        assert r["y_local"] == ((0,), (0,), (5, 3), (4, 3))[rank]


def _pipeline_modules(rank, world, path, bias):
    import spmdgt as gt

    gt.load_config(path)
    gt.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 6, bias=bias), torch.nn.Linear(6, 2, bias=bias)
    with gt.signal.context("stage_1"):
        x = gt.randn(7, 4)
        h = torch.relu(l1(x))
    with gt.signal.context("stage_2"):
        loss = (l2(h) ** 2).mean()
    loss.backward()
    torch.manual_seed(0)
    r1, r2 = torch.nn.Linear(4, 6, bias=bias), torch.nn.Linear(6, 2, bias=bias)
    rloss = (r2(torch.relu(r1(torch.randn(7, 4)))) ** 2).mean()
    rloss.backward()
    grads = [
        (type(p.grad) is torch.Tensor, p.grad.numpy(), q.grad.numpy())
        for p, q in zip([*l1.parameters(), *l2.parameters()], [*r1.parameters(), *r2.parameters()])
    ]
    return loss.item(), rloss.item(), grads


@pytest.mark.parametrize("bias", [True, False])
def test_pipeline_with_plain_modules_matches_one_process(tmp_path, bias):
    path = tmp_path / "pipe.yaml"
    path.write_text(PIPELINE_YAML)
    for loss, ref, grads in run_ranks(_pipeline_modules, 4, tmp_path, str(path), bias):
        assert loss == pytest.approx(ref, rel=1e-5)
        assert len(grads) == (4 if bias else 2)
        for plain, g, rg in grads:
            # plain parameters keep plain, full gradients on every rank, stage or not
            assert plain and g.shape == rg.shape
            torch.testing.assert_close(torch.tensor(g), torch.tensor(rg), rtol=1e-5, atol=1e-6)


def _workers_and_unknown(rank, world):
    import warnings

    import spmdgt as gt

    gt.register_config("few", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[1])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gt.register_config(
            "many", gt.SignalConfig(shard=gt.ShardConfig(axis=1, workers=[0, 1, 2, 3, 4]))
        )
        gt.manual_seed(1)
        with gt.signal.context("many"):
            a = gt.randn(4, 7)
        gt.manual_seed(1)
        with gt.signal.context("few"):
            b = gt.randn(4, 7)
        gt.manual_seed(1)
        with gt.signal.context("not_in_config"):
            c = gt.randn(4, 7)
        with gt.signal.context("few"), gt.signal.context("many"):
            inner = gt.signal.current_signal()
            d = gt.zeros(2, 4)
        outer_after = gt.signal.current_signal()
    return {
        "a": (a.numpy(), a.placements, a.device_mesh.mesh.tolist()),
        "b": (b.numpy(), b.device_mesh.mesh.tolist(), tuple(b.to_local().shape)),
        "c_plain": type(c) is torch.Tensor,
        "c": c.numpy(),
        "inner": inner,
        "outer": outer_after,
        "d_place": d.placements,
        "warned": [str(w.message) for w in caught if "workers" in str(w.message)],
    }


def test_workers_subset_unknown_signal_and_too_many_workers(tmp_path):
    r0, r1 = run_ranks(_workers_and_unknown, 2, tmp_path)
    torch.manual_seed(1)
    ref = torch.randn(4, 7)
    for r in (r0, r1):
        torch.testing.assert_close(torch.tensor(r["a"][0]), ref)
        assert r["a"][1] == (Shard(1),) and r["a"][2] == [0, 1]
        torch.testing.assert_close(torch.tensor(r["b"][0]), ref)
        assert r["b"][1] == [1]
        assert r["c_plain"]  # unknown signal: ignored, replicated
        torch.testing.assert_close(torch.tensor(r["c"]), ref)
        assert r["inner"] == "many" and r["outer"] is None
        assert r["d_place"] == (Shard(1),)
        assert len(r["warned"]) == 1 and "[2, 3, 4]" in r["warned"][0]
    assert r0["b"][2] == (0,) and r1["b"][2] == (4, 7)


def _auto_shard(rank, world):
    import spmdgt as gt

    gt.manual_seed(2)
    even = gt.randn(8, 3)
    odd = gt.randn(13, 3)
    scalar = gt.tensor(3.0)
    gt.manual_seed(2)
    ref_even = torch.randn(8, 3)
    ref_odd = torch.randn(13, 3)
    w = gt.randn(3, 4)  # 3 % 2 != 0: replicated
    y = (even @ w).relu().sum(axis=0)
    return {
        "even": (type(even).__name__, getattr(even, "placements", None), even.numpy()),
        "odd_plain": type(odd) is torch.Tensor,
        "odd": odd.numpy(),
        "scalar_plain": type(scalar) is torch.Tensor,
        "ref": (ref_even.numpy(), ref_odd.numpy()),
        "y": y.numpy(),
        "y_ref": (ref_even @ w).relu().sum(0).numpy(),
    }


def test_auto_shard_even_sizes_shard_uneven_replicate(tmp_path):
    for r in run_ranks(_auto_shard, 2, tmp_path, env={"GT_AUTO_SHARD": "1"}):
        assert r["even"][0] == "Tensor" and r["even"][1] == (Shard(0),)
        torch.testing.assert_close(torch.tensor(r["even"][2]), torch.tensor(r["ref"][0]))
        assert r["odd_plain"] and r["scalar_plain"]
        torch.testing.assert_close(torch.tensor(r["odd"]), torch.tensor(r["ref"][1]))
        torch.testing.assert_close(torch.tensor(r["y"]), torch.tensor(r["y_ref"]))


def _shape_mismatch(rank, world):
    import spmdgt as gt

    gt.register_config("s", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    with gt.signal.context("s"):
        gt.tensor([[1.0, 2.0]] * (3 + rank))


def test_ranks_disagreeing_on_a_shape_get_one_clear_error(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_ranks(_shape_mismatch, 2, tmp_path, timeout=60)
    text = str(info.value)
    assert text.count("RankDivergenceError: ranks stopped") == 2, text  # both ranks, both named
    for rank in (0, 1):
        assert f"rank {rank}: gt.tensor of float32[{3 + rank}, 2]" in text.split("---")[-1]
    assert "timed out" not in text


def _bad_axis(rank, world, path):
    import spmdgt as gt

    gt.load_config(path)
    with gt.signal.context("s"):
        gt.randn(3, 4)


def test_axis_out_of_range_for_tensor_names_file_signal_and_shape(tmp_path):
    path = tmp_path / "axes.yaml"
    path.write_text("s:\n  shard: {axis: 2}\n")
    with pytest.raises(AssertionError) as info:
        run_ranks(_bad_axis, 2, tmp_path, str(path), timeout=60)
    assert (
        f"{path}, signal 's', key 'shard.axis': axis 2 is out of range for a tensor of shape (3, 4)"
        in str(info.value)
    )


def _signal_tensor(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    ws = gt.signal.tensor(w, "rows")
    wc = gt.signal.tensor(ws, "cols")
    loss = (wc * wc).sum() + ws.sum()
    loss.backward()
    return (
        ws.placements,
        wc.placements,
        isinstance(ws, DTensor),
        w.grad.numpy(),
        (2 * w + 1).detach().numpy(),
    )


def test_signal_tensor_places_existing_tensor_differentiably(tmp_path):
    for ps, pc, is_dt, grad, ref in run_ranks(_signal_tensor, 2, tmp_path):
        assert is_dt and ps == (Shard(0),) and pc == (Shard(1),)
        torch.testing.assert_close(torch.tensor(grad), torch.tensor(ref))


CONST_YAML = textwrap.dedent(
    """
    rows: {shard: {axis: 0}}
    cols: {shard: {axis: 1}}
    front: {shard: {axis: 0, workers: [0, 1]}}
    back_copy: {shard: {axis: 0, workers: [1, 2], replicated: true}}
    """
)


def _constant_fills(rank, world, path):
    import spmdgt as gt
    from spmdgt.tensor._placement import creation_target
    from spmdgt.tensor._tensor import place

    gt.load_config(path)
    out = []
    # uneven, empty-shard (1 row over 3 ranks), sub-mesh member/non-member, replicated sub-mesh
    for sig, shape in [
        ("rows", (7, 3)),
        ("rows", (1, 4)),
        ("cols", (2, 5)),
        ("front", (5, 2)),
        ("back_copy", (3, 3)),
    ]:
        with gt.signal.context(sig):
            target = creation_target(shape)
            fills = (torch.zeros, torch.ones, torch.full, torch.empty)
            with CreationShapes(*fills) as seen:
                made_all = [
                    gt.zeros(*shape),
                    gt.ones(*shape, dtype="float64"),
                    gt.full(shape, 2.5),
                    gt.empty(*shape),
                ]
            local_shape = tuple(made_all[0].to_local().shape)
            # no rank allocates the whole tensor when its part is smaller
            assert all(s == local_shape for s in seen) and len(seen) == 4, (seen, shape)
            refs = [
                torch.zeros(shape),
                torch.ones(shape, dtype=torch.float64),
                torch.full(shape, 2.5),
                None,
            ]
            for made, ref in zip(made_all, refs):
                sliced = place(torch.zeros(shape, dtype=made.dtype), target)  # the old way
                assert type(made) is gt.Tensor and made.placements == sliced.placements
                assert made.shape == shape and made.stride() == sliced.stride()
                assert made.to_local().shape == sliced.to_local().shape, (sig, shape)
                if ref is not None:
                    out.append((sig, made.numpy(), ref.numpy()))
    return out


def test_constant_fills_build_only_the_local_part(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONST_YAML)
    # GT_CHECK_SHAPES=0: the shape check's own small buffers would count as allocations
    env = {"GT_CHECK_SHAPES": "0"}
    for rows in run_ranks(_constant_fills, 3, tmp_path, str(path), env=env):
        assert len(rows) == 15
        for sig, got, want in rows:
            assert got.dtype == want.dtype and (got == want).all(), sig
