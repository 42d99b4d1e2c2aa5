"""Lazy regions of the compile pass (``spmdgt.compile._lazy_regions``): lazy regions.

Graphs are compiled with ``aot_eager`` (AOTAutograd, eager kernels): the point here is capture,
sync points, keys and autograd, not inductor's speed, and results then match eager to float
rounding (1e-6). Tensors are 256x256 (65536 elements: the capture threshold).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import spmdgt
import spmdgt.compile as gt_compile
from spmdgt.interceptor import _control
from tests._dist import run_ranks
from tests._functions import Cube, DoubleInPlace, Exp

N = 256


def chain(x, b, s=0.5):
    y = x
    for i in range(6):
        y = (y * s + b).sin() if i % 2 else y * 0.5 + 1.0
    return y


def _reg():
    return gt_compile.stats()["regions"]


def test_each_sync_point_gives_eager_values(regions, capsys):
    torch.manual_seed(0)
    x, b = torch.randn(N, N), torch.randn(N, N)
    ref = chain(x, b)
    regions(batch=1000)
    assert chain(x, b).sum().item() == pytest.approx(ref.sum().item(), rel=1e-6)
    np.testing.assert_allclose(chain(x, b).numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)
    assert bool((chain(x, b) > -2).all()) is True
    y = chain(x, b)[:2, :3]  # a view: uncapturable
    np.testing.assert_allclose(y.numpy(), ref[:2, :3].numpy(), rtol=1e-6)
    print(chain(x, b).sum())  # a placeholder printed: aot_eager runs eager's kernels
    assert capsys.readouterr().out.strip() == str(ref.sum())
    torch.testing.assert_close(torch.cumsum(chain(x, b), 0), torch.cumsum(ref, 0))
    st = _reg()
    assert st["flushes"] == {
        "item": 2, "numpy": 1, "all": 1, "__getitem__": 1, "__repr__": 2, "cumsum": 1,
    }  # fmt: skip
    assert st["regions_seen"] == 8 == st["cache_hits"] + st["cache_misses"]
    assert st["compiled"] == st["cache_misses"] and st["fallbacks"] == {}


def test_autograd_forward_and_grads_match_eager(regions):
    torch.manual_seed(0)
    x = torch.randn(N, N, requires_grad=True)
    b = torch.randn(N, N, requires_grad=True)
    ref = chain(x, b).mean()
    ref.backward()
    rgx, rgb = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    regions()
    with torch.enable_grad():
        y = chain(x, b)
        assert "_gt_lazy" in y.__dict__  # still a placeholder
        loss = y.mean()  # recorded too; backward is the sync point
        loss.backward()
    assert loss.grad_fn is not None
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, rgx, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.grad, rgb, rtol=1e-6, atol=1e-7)
    assert _reg()["flushes"] == {"backward": 1} and _reg()["compiled"] == 1


def test_a_changing_float_becomes_a_graph_input(regions):
    x, b = torch.randn(N, N), torch.randn(N, N)
    scales = (0.5, 0.25, 0.125, 0.0625)
    refs = [chain(x, b, s).sum().item() for s in scales]
    regions()
    for s, ref in zip(scales, refs, strict=True):
        assert chain(x, b, s).sum().item() == pytest.approx(ref, rel=1e-6)
    st = _reg()
    assert st["compiled"] == 2  # the first value baked in, then the slot is an input
    assert st["dynamic_floats"] == 3 and st["cache_hits"] == 2


def test_cache_caps(regions, monkeypatch):
    monkeypatch.setenv("GT_LAZY_CACHE", "2")
    monkeypatch.setenv("GT_LAZY_REGION_GRAPHS", "2")
    regions()
    for k in range(3):  # three int exponents: three keys
        x = torch.full((N, N), 2.0)
        assert (x + 1).pow(k + 1).sum().item() == 3.0 ** (k + 1) * N * N
    st = _reg()
    assert st["compiled"] == 2 and st["cache_size"] <= 2
    assert st["fallbacks"] == {"region graph cap (2)": 1} and st["eager_runs"] == 1


def test_dropped_results_are_not_computed_and_ids_do_not_confuse(regions):
    x = torch.ones(N, N)
    regions()
    for _ in range(3):
        y = x * 3.0
        del y
        gc.collect()
    z = x * 5.0  # may reuse a dead placeholder's id: found by its own node, not by id
    assert z.sum().item() == 5.0 * N * N
    st = _reg()
    assert st["dead"] == 0  # the three dead ones are still pending in the same region
    assert st["regions_seen"] == 1 and st["ops_captured"] == 5


def _random_program():
    import torch.nn.functional as F

    torch.manual_seed(5)
    a = torch.randn(N, N)
    b = torch.cat([a * 2.0, torch.sin(a)], 0)
    d = F.dropout(b, 0.3)
    F.dropout(a * 3.0, 0.5)  # dropped: it still moves the generator, as in eager
    s = torch.stack([d, b * 0.5]).sum(0)
    recorded = ["_gt_lazy" in t.__dict__ for t in (b, d, s)]
    small = F.dropout(torch.ones(4, 4), 0.5)  # a small draw: the region's draws run first
    t = F.dropout(s, 0.5) + 1.0
    torch.manual_seed(7)  # moves the generator behind the region (no hook sees it)
    return [b, d, s, small, t, torch.rand(3)], recorded


def test_cat_stack_and_dropout_are_recorded_with_eager_random_numbers(regions):
    want, _ = _random_program()
    regions()
    for _ in range(2):  # the compile's call, then a cache hit
        got, recorded = _random_program()
        assert all(recorded), recorded
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    assert gt_compile.stats()["regions"]["graph_runs"] >= 2


def test_inplace_and_views_flush_and_stay_exact(regions):
    x = torch.ones(N, N)
    regions()
    y = x * 3.0
    x.mul_(2.0)  # in-place on the region's input: the region runs first
    assert y.sum().item() == 3.0 * N * N
    z = x + 1.0
    z.add_(1.0)  # in-place on a placeholder: filled, then eager
    v = (x * 2.0).view(-1)
    assert z[0, 0].item() == 4.0 and v.shape == (N * N,) and v[0].item() == 4.0
    assert set(_reg()["flushes"]) == {"mul_", "add_", "view", "item"}


def test_a_region_ended_inside_inference_mode_or_autocast_runs_as_recorded(regions):
    """A region recorded outside ``inference_mode``/``autocast`` and ended by a call inside
    one runs its calls as recorded: under autocast ``b``'s own matmul ran in bfloat16 (its
    placeholder then refused the result), under inference mode ``b`` lost its history (its
    backward raised). An inference tensor is no region input (it has no version counter)."""
    torch.manual_seed(0)
    x, w = torch.randn(N, N, requires_grad=True), torch.randn(N, N)
    regions()
    b = (x @ w).sin()
    assert "_gt_lazy" in b.__dict__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = b @ w
    assert (b.dtype, c.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(b, (x @ w).sin(), rtol=0, atol=0)
    b = (x @ w).cos()
    with torch.inference_mode():
        d = b * 3
    assert d.is_inference() and not b.is_inference() and b.grad_fn is not None
    b.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((x2 @ w).cos().sum(), x2)
    torch.testing.assert_close(x.grad, want)
    with torch.inference_mode():
        frozen = torch.randn(N, N)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        (frozen * x).sum().backward()


def _functions(x):
    y = Cube.apply(x * 1.5)
    z = DoubleInPlace.apply(y.clone())
    w = Exp.apply((x * 0.5).sin())
    (z * torch.arange(N) + w).sum().backward()
    return y.detach(), z.detach(), w.detach(), x.grad


def test_custom_autograd_functions_on_pending_inputs_equal_eager(regions):
    """A custom ``autograd.Function`` on a pending input (one that needs grad: its region
    runs first, else the backward aborted the process), returning a pending output (filled
    with its values alone: its history is the Function's, and its version unmoved for a
    Function that saved it), or writing its input (``mark_dirty``)."""
    torch.manual_seed(0)
    x = torch.randn(N, N, requires_grad=True)
    want = _functions(x)
    x.grad = None
    regions()
    got = _functions(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert _reg()["flushes"].get("autograd.Function", 0) >= 2


def test_batch_size_flushes_every_n_ops(regions):
    x = torch.ones(N, N)
    regions(batch=4)
    y = x
    for _ in range(10):
        y = y + 1.0
    assert y.sum().item() == 11.0 * N * N
    st = _reg()
    assert st["flushes"] == {"batch size": 2, "item": 1} and st["ops_captured"] == 11


def test_compile_true_scope_from_yaml(tmp_path):
    import spmdgt as gt
    from spmdgt.config import clear_config

    cfg = tmp_path / "signals.yaml"
    cfg.write_text("hot:\n  compile: true\ncold: {}\n")
    gt.load_config(cfg)
    x, b = torch.randn(N, N), torch.randn(N, N)
    ref = chain(x, b)
    try:
        with gt.signal.context("cold"):
            chain(x, b)
        assert not gt_compile.regions_enabled()  # nothing set: nothing on
        with gt.signal.context("hot"):
            y = chain(x, b)
            assert "_gt_lazy" in y.__dict__
        assert "_gt_lazy" not in y.__dict__  # the scope's end ran the region
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert torch._C._len_torch_function_stack() == 0  # the hook left with the scope
        assert _reg()["flushes"] == {"scope end": 1} and _reg()["compiled"] == 1
    finally:
        spmdgt.session.reset("compile")
        clear_config()


def test_nothing_set_imports_nothing_and_compile_0_vetoes(monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GT_")}
    code = "import sys, spmdgt; print('spmdgt.compile' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    monkeypatch.setenv("GT_COMPILE", "0")
    assert gt_compile.enable_regions() is False and not gt_compile.regions_enabled()


def _sharded_and_one_rank_fails(rank, world):
    import spmdgt as gt

    def flaky(gm, example_inputs):
        if rank == 1:
            raise RuntimeError("only rank 1 fails")
        return gm.forward

    assert gt_compile.enable_regions(backend=flaky)
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("hot", gt.SignalConfig(compile=True))
    torch.manual_seed(0)
    a, b = torch.randn(N, N), torch.randn(N, N)
    with gt.signal.context("rows"):
        xs = gt.tensor(a.numpy())
    with gt.signal.context("hot"):
        sharded = chain(xs, b).numpy()  # sharded input: eager, exact
        plain = chain(a, b).sum().item()  # plain: compiled on rank 0, eager on rank 1
    st = gt_compile.stats()["regions"]
    gt_compile.disable_regions()
    return sharded, plain, st


def test_two_ranks_sharded_region_and_a_one_rank_compile_failure(tmp_path):
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    res = run_ranks(_sharded_and_one_rank_fails, 2, tmp_path, env=env, timeout=240)
    torch.manual_seed(0)
    a, b = torch.randn(N, N), torch.randn(N, N)
    ref = chain(a, b)
    for rank, (sharded, plain, st) in enumerate(res):
        np.testing.assert_allclose(sharded, ref.numpy(), rtol=1e-6, atol=1e-6)
        assert plain == pytest.approx(ref.sum().item(), rel=1e-6)
        assert st["regions_seen"] == 1  # sharded ops mixed with plain b are not recorded
        if rank == 0:
            assert st["compiled"] == 1 and st["fallbacks"] == {}
        else:
            [(reason, n)] = st["fallbacks"].items()
            assert n == 1 and "only rank 1 fails" in reason and st["eager_runs"] == 1


def test_lazy_regions_run_while_hot_functions_run(regions):
    # both halves at once (tests/compile/test_both_halves_dist.py runs them on several ranks)
    regions(batch=64)
    gt_compile.enable(backend="aot_eager")
    try:
        assert gt_compile.is_enabled() and gt_compile.regions_enabled()
        assert gt_compile.enable_regions(batch=64)
        x = torch.randn(300, 300)
        y = torch.sin(x) * 0.5
        assert "_gt_lazy" in y.__dict__  # recorded
        assert torch.equal(y, torch.sin(x) * 0.5)
    finally:
        gt_compile.disable()
        _control.disable()  # hot functions turned the interceptor on


def test_both_variables_set_turn_both_halves_on(monkeypatch):
    monkeypatch.setenv("GT_AUTO_COMPILE", "1")
    monkeypatch.setenv("GT_WORKER_BATCH_SIZE", "16")
    try:
        assert gt_compile.maybe_enable_from_env() is True
        assert gt_compile.regions_enabled()
    finally:
        spmdgt.session.reset("compile")
        _control.disable()


def test_a_second_backward_through_a_region_is_exact_or_refused(regions):
    """``retain_graph=True`` through a compiled region works (no donated buffers); a backward
    with ``create_graph=True`` that ends the open region runs it op by op, so its second
    derivative is eager's; one that reaches a region compiled before raises a clear error
    (it returned zeros for ``torch.autograd.functional.hessian``, found by the autograd
    scenario sweep with both halves on)."""
    torch.manual_seed(0)
    x = torch.randn(N, N, requires_grad=True)
    cube = lambda t: (t**3).sum()  # noqa: E731
    ones, first, second = torch.ones(N, N), 6 * x.detach() ** 2, 6 * x.detach()
    regions(batch=1000)
    z = cube(x)
    z.backward(retain_graph=True)  # ends the region: compiled
    z.backward()
    torch.testing.assert_close(x.grad, first, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(cube(x), x, create_graph=True)  # the open region: eagerly
    (gg,) = torch.autograd.grad(g, x, ones)
    torch.testing.assert_close(gg, second, rtol=1e-6, atol=1e-6)
    z = cube(x)
    z.item()  # ended by a read: the compiled graph again
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(z, x, create_graph=True)
    st = _reg()
    assert st["compiled"] == 1 and st["eager_runs"] == 1 and st["fallbacks"] == {}, st
