"""Hot functions of the compile pass (``spmdgt.compile``): hot functions compiled by dynamo.

Compiles take seconds here, so the tests are few and use ``aot_eager`` (dynamo and AOTAutograd,
no inductor) except the one that states inductor's tolerance. Sampling is made eager to decide
(a sample every 2 top-level ops, hot at 4) so a function turns hot within its first calls.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import spmdgt.compile as gt_compile
from spmdgt.interceptor import _control
from tests._dist import run_ranks


@pytest.fixture
def compile_pass():
    """Yields ``enable(backend)``; turns the pass and the interceptor off afterwards."""
    import torch._dynamo

    torch._dynamo.reset()

    def enable(backend="aot_eager"):
        gt_compile.enable(backend=backend, every=2, hot_at=4)
        assert gt_compile.is_enabled()

    try:
        yield enable
    finally:
        gt_compile.disable()
        _control.disable()
        torch._dynamo.reset()


def small(a, b):
    c = torch.zeros_like(a)
    for _ in range(10):
        c = c * b + a
    return c


def _call_until_compiled(fn, *args, limit=50):
    for _ in range(limit):
        out = fn(*args)
        if gt_compile.stats()["compiled"]:
            return out
    raise AssertionError(f"not compiled after {limit} calls: {gt_compile.stats()}")


def _mlp(x, w1, w2):
    return (torch.tanh(x @ w1) * 0.5 + x.sum(1, keepdim=True) * 0.01) @ w2


def test_hot_function_compiled_with_inductor_matches_eager(compile_pass):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 4, requires_grad=True)
    ref = _mlp(x, w1, w2)
    ref.pow(2).sum().backward()
    ref_g1, ref_g2 = w1.grad.clone(), w2.grad.clone()
    compile_pass("inductor")
    for _ in range(3):  # hot, then compiled, then a cached run
        w1.grad = w2.grad = None
        _call_until_compiled(_mlp, x, w1, w2)
    w1.grad = w2.grad = None
    out = _mlp(x, w1, w2)
    out.pow(2).sum().backward()
    st = gt_compile.stats()
    assert st["compiled"] == 1 and st["fallbacks"] == {} and st["cache_hits"] >= 1
    # inductor fuses and reorders fp32 reductions: the documented tolerance (docs/compilation.md)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, ref_g1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, ref_g2, rtol=1e-5, atol=1e-5)


def branchy(x, w):
    y = torch.sin(x * w) + x
    if y.sum() > 0:  # noqa: SIM108  data-dependent: a graph break, each side compiled
        y = y * 2
    else:
        y = y - 1
    scale = y.abs().max().item()  # a host read inside the function
    loss = (y / (scale + 1)).pow(2).sum()
    loss.backward()  # backward inside the hot function
    return loss.detach(), scale


def test_data_dependent_if_item_and_backward_inside_stay_correct(compile_pass):
    torch.manual_seed(1)
    xs = [torch.randn(32) + (3 if i % 3 else -3) for i in range(12)]  # both branches
    w_ref = torch.randn(32, requires_grad=True)
    w = w_ref.detach().clone().requires_grad_(True)
    refs = []
    for x in xs:
        w_ref.grad = None
        loss, scale = branchy(x, w_ref)
        refs.append((loss, scale, w_ref.grad.clone()))
    compile_pass()
    for x, (ref_loss, ref_scale, ref_grad) in zip(xs * 2, refs * 2):
        w.grad = None
        loss, scale = branchy(x, w)
        # aot_eager runs the same ATen ops as eager: equal to float rounding of the order
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert scale == pytest.approx(ref_scale, rel=1e-6)
        torch.testing.assert_close(w.grad, ref_grad, rtol=1e-6, atol=1e-6)
    st = gt_compile.stats()
    assert st["compiled"] >= 1 and st["fallbacks"] == {}, st


def test_user_compiled_function_is_not_recompiled(compile_pass):
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def chain(x):
        for _ in range(8):
            x = torch.sin(x) * 1.01 + 0.01
        return x

    compile_pass()
    user = torch.compile(chain, backend=counting)
    x = torch.randn(100)
    for _ in range(40):  # plenty of samples: the ops all run inside the user's compiled call
        out = user(x)
    torch.testing.assert_close(out, chain(x))
    assert len(compiles) == 1  # compiled once, by the user's torch.compile, never again
    st = gt_compile.stats()
    assert st["hot"] == 0 and st["compiled"] == 0 and st["cache_misses"] == 0, st


def test_failing_compile_falls_back_and_is_counted(compile_pass):
    def broken(gm, example_inputs):
        raise RuntimeError("backend says no")

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ref = small(a, b)
    compile_pass(broken)
    for _ in range(10):
        torch.testing.assert_close(small(a, b), ref, rtol=0, atol=0)  # eager: exact
    st = gt_compile.stats()
    # (this test function turns hot too, from assert_close's ops, but is never called again)
    assert st["compiled"] == 0 and st["hot"] >= 1
    [(reason, n)] = st["fallbacks"].items()
    assert n == 1 and reason.startswith("compile error:") and "backend says no" in reason


def test_stats_are_exact(compile_pass):
    import spmdgt as gt

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    compile_pass()
    _call_until_compiled(small, a, b)
    st = gt_compile.stats()
    assert (st["hot"], st["compiled"], st["cache_misses"], st["cache_size"]) == (1, 1, 1, 1)
    assert (st["graph_runs"], st["cache_hits"], st["recompiles"]) == (1, 0, 0)
    for _ in range(5):
        small(a, b)
    st = gt_compile.stats()
    nodes = 1 + 2 * 10  # zeros_like, then 10 x (mul, add): the graph's op nodes
    assert (st["graph_runs"], st["cache_hits"], st["compiled_ops"]) == (6, 5, 6 * nodes)
    entry = gt.debug.get_worker_stats()[0]
    assert entry["operations"]["compiled"] == 6 * nodes
    assert entry["operations"]["total"] == entry["operations"]["eager"] + 6 * nodes
    assert entry["compilation"]["hit_rate"] == pytest.approx(5 / 6)


def test_gt_compile_0_and_nothing_set(monkeypatch):
    monkeypatch.setenv("GT_COMPILE", "0")
    monkeypatch.setenv("GT_AUTO_COMPILE", "1")
    assert gt_compile.maybe_enable_from_env() is False
    gt_compile.enable()
    assert not gt_compile.is_enabled() and gt_compile.stats() == {}
    # nothing set: importing spmdgt imports neither the pass nor dynamo's frame machinery
    env = {k: v for k, v in os.environ.items() if not k.startswith("GT_")}
    code = "import sys, spmdgt; print('spmdgt.compile' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def _one_rank_fails(rank, world):
    import torch

    import spmdgt.compile as gt_compile

    def flaky(gm, example_inputs):
        if rank == 1:
            raise RuntimeError("only rank 1 fails")
        return gm.forward

    import spmdgt as gt

    a, b = torch.ones(8, 8) * 0.5, torch.ones(8, 8) * 0.25
    ref = small(a, b)
    gt_compile.enable(backend=flaky, every=2, hot_at=4)
    try:
        outs = []
        for _ in range(10):
            outs.append(small(a, b))
            # an agreement point: on >1 rank, hotness found by one rank's op counts is settled
            # here, and every rank compiles at the same next call
            gt.zeros(2)
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return st, all(torch.equal(o, ref) for o in outs)


def test_fallback_on_one_rank_is_a_fallback_on_every_rank(tmp_path):
    (st0, ok0), (st1, ok1) = run_ranks(_one_rank_fails, 2, tmp_path, timeout=240)
    assert ok0 and ok1  # eager on both: exact
    assert st0["compiled"] == st1["compiled"] == 0
    assert st0["fallbacks"] == {"another rank's compile failed": 1}
    [(reason, n)] = st1["fallbacks"].items()
    assert n == 1 and "only rank 1 fails" in reason


def test_python_level_sampler_finds_the_same_function(compile_pass, monkeypatch):
    from spmdgt.interceptor._mode import get_interceptor

    monkeypatch.setenv("GT_INTERCEPT", "torch")  # the function mode samples, not the C++ code
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    compile_pass()
    assert get_interceptor().level == "torch"
    out = _call_until_compiled(small, a, b)
    torch.testing.assert_close(small(a, b), out)
    st = gt_compile.stats()
    assert st["compiled"] == 1 and st["fallbacks"] == {}, st


def test_a_restarted_interceptor_does_not_count_a_function_hot_twice(compile_pass):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    compile_pass()
    _call_until_compiled(small, a, b)
    from spmdgt.interceptor._mode import get_interceptor

    level = get_interceptor().level  # the same level: a mode pushed would be a dynamo guard
    _control.disable()  # e.g. a tool switched off and on: the sampler's counts restart
    _control.enable(stats=False, hotpath=False, level=level)
    for _ in range(10):
        small(a, b)
    st = gt_compile.stats()
    hot = gt_compile._hot.hook.hot  # (the test function may turn hot too: it calls small)
    assert small.__code__ in hot and st["hot"] == len(hot), st  # each code counted once
    assert (st["compiled"], st["cache_misses"]) == (1, 1), st


def test_the_pass_alone_counts_and_a_tool_turns_recording_on(compile_pass):
    # With no tool on, the native observer only counts and samples for the pass (~0.1 us an
    # op instead of a record's ~0.45 us); asking for a tool later restarts it recording.
    import spmdgt as gt
    from spmdgt.interceptor._mode import get_interceptor

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    compile_pass()
    ic = get_interceptor()
    assert ic.count_only == (ic.level == "native")
    _call_until_compiled(small, a, b)  # the samples still find the hot function
    _control.enable(stats=True)
    assert not ic.count_only and ic.active
    c = torch.ones(3) * 2.0 + 1.0
    assert c.sum().item() == 9.0
    ops = gt.debug.get_worker_stats()[0]["operations"]
    assert ops["eager"] > 0 and ops["compiled"] > 0, ops
    assert gt_compile.stats()["compiled"] == 1


def test_a_second_backward_through_a_hot_function(compile_pass):
    """``retain_graph=True`` through a compiled hot function works (no donated buffers: it
    raised a RuntimeError the program would not have eagerly); ``create_graph=True`` through
    it raises a clear error, where the second derivative would be missing."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 4, requires_grad=True)
    ref = _mlp(x, w1, w2).pow(2).sum()
    (want,) = torch.autograd.grad(ref, w1)
    compile_pass()
    _call_until_compiled(_mlp, x, w1, w2)
    loss = _mlp(x, w1, w2).pow(2).sum()
    (once,) = torch.autograd.grad(loss, w1, retain_graph=True)
    (again,) = torch.autograd.grad(loss, w1)
    torch.testing.assert_close(once, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again, want, rtol=1e-6, atol=1e-6)
    loss = _mlp(x, w1, w2).pow(2).sum()
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(loss, x, create_graph=True)
    assert gt_compile.stats()["fallbacks"] == {}


def _checkpointed(lin, x):
    from torch.utils.checkpoint import checkpoint

    h = x * 2.0  # ops enough to turn hot
    for _ in range(4):
        h = h + 1.0
    return checkpoint(lin, h, use_reentrant=True).pow(2).sum()


def _checkpointed_non_reentrant(lin, x):
    from torch.utils.checkpoint import checkpoint

    h = x * 2.0
    for _ in range(4):
        h = h + 1.0
    return checkpoint(lin, h, use_reentrant=False).pow(2).sum()


def test_a_reentrant_checkpoint_keeps_eagers_gradients(compile_pass):
    """Dynamo compiles ``checkpoint(use_reentrant=True)`` as the non-reentrant kind. Eager's
    reentrant checkpoint runs its forward without grad, so only its inputs connect it to the
    graph: ``autograd.grad`` w.r.t. a parameter inside raises, and with no input needing
    grad the parameters get no gradient at all; compiled, both gave values (the scenario
    sweep with both halves: ``autograd.checkpoint.reentrant_grad``). The pass runs such a
    function eagerly; the non-reentrant kind compiles."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(6, 3), torch.randn(5, 6, requires_grad=True)
    compile_pass()
    for _ in range(12):
        loss = _checkpointed(lin, x)
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(loss, [lin.weight])
    st = gt_compile.stats()
    assert st["compiled"] == 0, st
    assert any("use_reentrant=True" in k for k in st["fallbacks"]), st["fallbacks"]
    want = torch.autograd.grad(_checkpointed_non_reentrant(lin, x), [lin.weight])
    for _ in range(12):
        got = torch.autograd.grad(_checkpointed_non_reentrant(lin, x), [lin.weight])
    assert gt_compile.stats()["compiled"] == 1
    torch.testing.assert_close(got, want)
