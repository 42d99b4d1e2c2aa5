"""Signals on the config's 2-D mesh: 4 forked gloo ranks as ``mesh: {dp: 2, tp: 2}``.

A GT program (YAML, ``gt.load_config``, ``gt.signal.context``) on each layout -- rows
``(Shard(0), Replicate())``, cols ``(Replicate(), Shard(1))``, grid ``(Shard(0), Shard(1))``,
flat ``(Shard(0), Shard(0))`` -- with uneven sizes (7 and 5 rows), forward and backward,
against one-process torch on every rank; creation, host reads, moves to a 1-D ``workers``
sub-mesh and back, ``backward:`` signals, agreement points and lazy regions on the mesh.
"""

from __future__ import annotations

import textwrap

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard

from tests._dist import run_ranks

MESH_YAML = textwrap.dedent(
    """
    mesh: {dp: 2, tp: -1}
    rows:
      shard: {axis: 0, over: dp}
    cols:
      shard: {axis: 1, over: tp}
    grid:
      shard: {axis: [0, 1], over: [dp, tp]}
      backward: cols
    flat:
      shard: {axis: 0, over: [dp, tp]}
    stage:
      shard: {axis: 0, workers: [2, 3]}
    """
)

LAYOUTS = {
    "rows": (Shard(0), Replicate()),
    "cols": (Replicate(), Shard(1)),
    "grid": (Shard(0), Shard(1)),
    "flat": (Shard(0), Shard(0)),
}
# float32 matmul chains on shards sum in another order than one process: a few ulps
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _yaml(tmp_path, text=MESH_YAML, name="mesh.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _mlp(make, seed):
    """A small MLP with uneven sizes: x (7, 5) @ w1 (5, 6) -> tanh -> @ w2 (6, 3)."""
    torch.manual_seed(seed)
    x = make(7, 5)
    w1 = make(5, 6)
    w2 = make(6, 3)
    h = torch.tanh(x @ w1)
    y = h @ w2
    loss = (y * y).sum() + y.mean()
    loss.backward()
    return loss, y, (x, w1, w2)


def _program(rank, world, path):
    import spmdgt as gt
    from spmdgt.tensor import _draw

    gt.load_config(path)
    out = {"mesh": gt.get_mesh_config().describe()}
    for name in LAYOUTS:
        with gt.signal.context(name):
            loss, y, params = _mlp(lambda *s: gt.randn(*s, requires_grad=True), 0)
        x = params[0]
        out[name] = {
            "loss": loss.item(),
            "y": y.numpy(),
            "y_list": y.tolist(),
            "grads": [p.grad.numpy() for p in params],
            "x_placements": tuple(x.placements),
            "x_grad_placements": tuple(x.grad.placements),
            "x_local": tuple(x.to_local().shape),
            "mesh_names": x.device_mesh.mesh_dim_names,
            "repr": repr(x),
        }
    # creation: the same global values whatever the placement (uneven 7 x 5, 13 x 5)
    created = {}
    for name in LAYOUTS:
        with gt.signal.context(name):
            gt.manual_seed(3)
            created[name] = [
                gt.randn(7, 5).numpy(),
                gt.rand(13, 5).numpy(),
                gt.zeros(7, 5).numpy(),
                gt.full((5, 7), 2.5).numpy(),
                gt.tensor(np.arange(35.0).reshape(7, 5)).numpy(),
                torch.randn(2).numpy(),  # the generator is where one full draw leaves it
            ]
            if name in ("rows", "flat"):  # 1-D: cols and grid split axis 1, which it lacks
                created[name].append(gt.arange(7).numpy())
    # the blocked draw (no rank holds the whole tensor) on 2-D layouts splitting one dim
    _draw.MIN_NUMEL, _draw.BLOCK = 16, 64
    blocked = {}
    for name in ("rows", "cols", "flat"):
        with gt.signal.context(name):
            gt.manual_seed(4)
            t = gt.randn(37, 9)
            blocked[name] = (t.numpy(), tuple(t.to_local().shape), torch.randn(2).numpy())
    out["created"], out["blocked"] = created, blocked
    # moves: grid (2-D) -> a 1-D workers sub-mesh (a pipeline stage) -> grid, with gradients
    gt.manual_seed(5)
    with gt.signal.context("grid"):
        a = gt.randn(7, 5, requires_grad=True)
        b = torch.sin(a)
    with gt.signal.context("stage"):
        c = b * 2.0 + 1.0
        stage_mesh = c.device_mesh.mesh.tolist()
    with gt.signal.context("flat"):
        d = c * b  # c back from the stage, b from grid's layout to flat's
        flat_placements = tuple(d.placements)
    (d * d).sum().backward()
    out["moves"] = (d.numpy(), a.grad.numpy(), stage_mesh, flat_placements)
    # gt.signal.tensor between 2-D layouts and to the stage
    with gt.signal.context("rows"):
        e = gt.arange(35.0).reshape(7, 5)
    moved = [gt.signal.tensor(e, n) for n in ("grid", "flat", "cols", "stage", "rows")]
    out["signal_tensor"] = [(tuple(m.placements), m.numpy()) for m in moved]
    # .data = a plain value: laid out as the tensor is (a shard dim the value lacks replicated)
    with gt.signal.context("grid"):
        p = gt.randn(7, 5)
    p.data = torch.arange(35.0).reshape(7, 5)
    p2 = gt.signal.tensor(p, "flat")
    p2.data = torch.arange(7.0)
    out["data"] = (tuple(p.placements), p.numpy(), tuple(p2.placements), p2.numpy())
    # GT_AUTO_SHARD beside the mesh: an unscoped tensor is Shard(0) over the 1-D world mesh
    gt.manual_seed(6)
    z = gt.randn(8, 5, requires_grad=True)
    with gt.signal.context("grid"):
        q = gt.randn(8, 5)
        r = (z * q).sum(1)
    r.sum().backward()
    out["auto"] = (tuple(z.placements), z.device_mesh.ndim, r.numpy(), z.grad.numpy())
    return out


def _reference():
    loss, y, params = _mlp(lambda *s: torch.randn(*s, requires_grad=True), 0)
    ref = {"loss": loss.item(), "y": y.detach().numpy(), "grads": [p.grad for p in params]}
    torch.manual_seed(3)
    created = [
        torch.randn(7, 5),
        torch.rand(13, 5),
        torch.zeros(7, 5),
        torch.full((5, 7), 2.5),
        torch.arange(35.0).reshape(7, 5),
        torch.randn(2),
        torch.arange(7),
    ]
    torch.manual_seed(4)
    blocked = (torch.randn(37, 9), torch.randn(2))
    torch.manual_seed(5)
    a = torch.randn(7, 5, requires_grad=True)
    b = torch.sin(a)
    d = (b * 2.0 + 1.0) * b
    (d * d).sum().backward()
    torch.manual_seed(6)
    z, q = torch.randn(8, 5), torch.randn(8, 5)
    auto = ((z * q).sum(1), q)  # r, and z's gradient
    return ref, created, blocked, (d.detach(), a.grad), auto


def test_gt_program_on_each_2d_layout_matches_one_process(tmp_path):
    ref, created, blocked, moves, auto = _reference()
    results = run_ranks(_program, 4, tmp_path, _yaml(tmp_path), env={"GT_AUTO_SHARD": "1"})
    # (Shard(0), Shard(0)) of 7 rows: dp splits 4 + 3, tp splits those 2 + 2 and 2 + 1
    flat_rows = [(2, 5), (2, 5), (2, 5), (1, 5)]
    for rank, r in enumerate(results):
        assert r["mesh"] == "dp=2, tp=-1"
        for name, placements in LAYOUTS.items():
            got = r[name]
            assert got["x_placements"] == placements, (rank, name)
            assert got["mesh_names"] == ("dp", "tp")
            np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
            np.testing.assert_allclose(got["y"], ref["y"], **TOL)
            np.testing.assert_allclose(got["y_list"], ref["y"], **TOL)
            for g, rg in zip(got["grads"], ref["grads"], strict=True):
                np.testing.assert_allclose(g, rg.numpy(), **TOL)
            assert "placements=(Shard(dim=0)" in got["repr"] or name == "cols"
        # grid's backward signal is cols: its gradients take (Replicate(), Shard(1))
        assert r["grid"]["x_grad_placements"] == LAYOUTS["cols"]
        # without one, DTensor's propagated layout (tp's half sums pending: Partial)
        assert r["rows"]["x_grad_placements"][0] == Shard(0)
        assert r["rows"]["x_local"] == ((4, 5), (4, 5), (3, 5), (3, 5))[rank]
        assert r["cols"]["x_local"] == ((7, 3), (7, 2), (7, 3), (7, 2))[rank]
        assert r["grid"]["x_local"] == ((4, 3), (4, 2), (3, 3), (3, 2))[rank]
        assert r["flat"]["x_local"] == flat_rows[rank]
        for name in LAYOUTS:
            want_all = created if name in ("rows", "flat") else created[:-1]
            for got, want in zip(r["created"][name], want_all, strict=True):
                np.testing.assert_array_equal(got, want.numpy(), err_msg=f"{rank} {name}")
        for name, (value, local, after) in r["blocked"].items():
            np.testing.assert_array_equal(value, blocked[0].numpy(), err_msg=name)
            np.testing.assert_array_equal(after, blocked[1].numpy(), err_msg=name)
            assert (
                local
                == {
                    "rows": ((19, 9), (19, 9), (18, 9), (18, 9)),
                    "cols": ((37, 5), (37, 4), (37, 5), (37, 4)),
                    "flat": ((10, 9), (9, 9), (9, 9), (9, 9)),
                }[name][rank]
            )
        d, a_grad, stage_mesh, flat_placements = r["moves"]
        np.testing.assert_allclose(d, moves[0].numpy(), **TOL)
        np.testing.assert_allclose(a_grad, moves[1].numpy(), **TOL)
        assert stage_mesh == [2, 3] and flat_placements == LAYOUTS["flat"]
        want = [LAYOUTS["grid"], LAYOUTS["flat"], LAYOUTS["cols"], (Shard(0),), LAYOUTS["rows"]]
        for (placements, value), w in zip(r["signal_tensor"], want, strict=True):
            assert placements == w
            np.testing.assert_array_equal(value, np.arange(35.0).reshape(7, 5))
        grid_p, p_value, flat_p, p2_value = r["data"]
        assert grid_p == LAYOUTS["grid"] and flat_p == LAYOUTS["flat"]
        np.testing.assert_array_equal(p_value, np.arange(35.0).reshape(7, 5))
        np.testing.assert_array_equal(p2_value, np.arange(7.0))
        z_placements, z_ndim, r_value, z_grad = r["auto"]
        assert z_placements == (Shard(0),) and z_ndim == 1
        np.testing.assert_allclose(r_value, auto[0].numpy(), **TOL)
        np.testing.assert_allclose(z_grad, auto[1].numpy(), **TOL)


def _agreement(rank, world, good, other, bad_world):
    import spmdgt as gt

    out = {}
    try:
        gt.load_config(bad_world)  # sizes that do not multiply to 4: at load, on every rank
    except gt.ConfigError as e:
        out["world"] = str(e)
    gt.load_config(other if rank == 1 else good)  # rank 1 read another mesh
    try:
        with gt.signal.context("rows"):
            gt.randn(7, 5)
    except gt.RankDivergenceError as e:
        out["diverged"] = str(e)
    gt.load_config(good)
    with gt.signal.context("grid"):
        x = gt.randn(7, 5)
    try:  # GT_CHECK_RANKS=1: rank 1 redistributes to another layout than its peers
        x.redistribute(x.device_mesh, [Shard(0), Shard(0)] if rank == 1 else [Shard(0), Shard(1)])
        x.redistribute(x.device_mesh, [Replicate(), Shard(1)])
    except gt.RankDivergenceError as e:
        out["redistribute"] = str(e)
    return out


def test_sizes_and_divergent_meshes_are_errors_on_every_rank(tmp_path):
    good = _yaml(tmp_path)
    other = _yaml(tmp_path, MESH_YAML.replace("{dp: 2, tp: -1}", "{dp: 4, tp: 1}"), "o.yaml")
    bad = _yaml(tmp_path, "\nmesh: {dp: 3, tp: 2}\nrows: {shard: {axis: 0, over: dp}}\n", "b.yaml")
    env = {"GT_CHECK_RANKS": "1"}
    for rank, r in enumerate(run_ranks(_agreement, 4, tmp_path, good, other, bad, env=env)):
        assert r["world"] == (
            f"{bad}:2, key 'mesh': mesh {{dp=3, tp=2}}: the sizes dp=3 x tp=2 multiply to 6, "
            "but the world has 4 rank(s); make the sizes multiply to 4 (or give one dim -1, "
            "the rest)"
        ), rank
        # the creation's agreement point names each rank's mesh
        assert "mesh (dp=4, tp=1)" in r["diverged"] and "mesh (dp=2, tp=-1)" in r["diverged"]
        assert "rank 1: " in r["redistribute"], r["redistribute"]
        assert "on mesh (dp=2, tp=2) over ranks [0, 1, 2, 3]" in r["redistribute"]


def _regions(rank, world, path):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    assert gt_compile.enable_regions(backend="aot_eager")
    gt.load_config(path)
    gt.manual_seed(0)
    with gt.signal.context("gridc"):
        x = gt.randn(37, 29, requires_grad=True)
        b = gt.randn(37, 29)
        y = torch.sin(x) * b + x * x
        pending = "_gt_lazy" in y.__dict__
        loss = (torch.softmax(y, 1) * y).sum()
        loss.backward()
        out = (loss.item(), y.numpy(), x.grad.numpy(), tuple(y.placements))
    return out, pending, gt_compile.stats()["regions"]


def test_lazy_regions_on_the_2d_mesh_are_recorded_and_exact(tmp_path):
    text = MESH_YAML + "gridc:\n  shard: {axis: [0, 1], over: [dp, tp]}\n  compile: true\n"
    torch.manual_seed(0)
    x = torch.randn(37, 29, requires_grad=True)
    b = torch.randn(37, 29)
    y = torch.sin(x) * b + x * x
    loss = (torch.softmax(y, 1) * y).sum()
    loss.backward()
    env = {"GT_LAZY_MIN_NUMEL": "100"}
    for rank, (got, pending, st) in enumerate(
        run_ranks(_regions, 4, tmp_path, _yaml(tmp_path, text), env=env, timeout=240)
    ):
        np.testing.assert_allclose(got[0], loss.item(), rtol=1e-5)
        np.testing.assert_allclose(got[1], y.detach().numpy(), **TOL)
        np.testing.assert_allclose(got[2], x.grad.numpy(), rtol=1e-5, atol=1e-5)
        assert got[3] == LAYOUTS["grid"]
        assert pending, rank  # recorded, not run eagerly
        assert st["compiled"] >= 1 and st["graph_runs"] >= 1 and not st["fallbacks"], st
