"""Every hook the compile pass installs has one owner and goes when its owner says so:
enabling and disabling N times leaves at most one registration, ``disable_regions()`` sticks
(a ``compile: true`` scope does not turn lazy regions back on), and ``session.reset()``
leaves nothing registered."""

from __future__ import annotations

import torch

import spmdgt as gt
import spmdgt.compile as gt_compile
from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree


def _listeners() -> int:
    return len(_agree._listeners)


def _step_hooks() -> int:  # the pass counts optimizer steps through a global post-hook
    from torch.optim.optimizer import _global_optimizer_post_hooks

    return len(_global_optimizer_post_hooks)


def test_enable_disable_n_times_leaves_one_listener_then_none():
    try:
        hooks = None
        for _ in range(4):
            gt_compile.enable(backend="eager")
            assert gt_compile.is_enabled() and _listeners() == 1
            gt_compile.enable(backend="eager")  # a second enable adds nothing
            assert _listeners() == 1
            with_pass = _step_hooks()
            gt_compile.disable()
            assert not gt_compile.is_enabled() and _listeners() == 0
            hooks = _step_hooks() if hooks is None else hooks
            assert _step_hooks() == hooks == with_pass - 1  # ours went, once
    finally:
        gt.session.reset("compile")


def test_disable_regions_sticks_through_a_compile_scope():
    gt.register_config("hot_scope", gt.SignalConfig(compile=True))
    x = torch.randn(256, 256)
    try:
        assert gt_compile.enable_regions(backend="aot_eager")
        gt_compile.disable_regions()
        with gt.signal.context("hot_scope"):
            y = x * 2 + 1
            assert "_gt_lazy" not in y.__dict__  # ran eagerly: nothing recorded
        assert not gt_compile.regions_enabled() and _scope.lazy_hook is None
        assert gt_compile.enable_regions(backend="aot_eager")  # the program turns it back on
        with gt.signal.context("hot_scope"):
            y = x * 2 + 1
            assert "_gt_lazy" in y.__dict__
        torch.testing.assert_close(y, x * 2 + 1)
    finally:
        gt.session.reset("compile")
        gt.session.reset("signals")


def test_session_reset_leaves_no_registration():
    gt.register_config("hot_scope", gt.SignalConfig(compile=True))
    gt_compile.enable(backend="eager")
    with gt.signal.context(
        "hot_scope"
    ):  # refused while the hot-function half runs, but the hook is set
        pass
    gt.session.reset("compile", "signals")
    assert _listeners() == 0 and _scope.lazy_hook is None and _scope.lazy_sync is None
    assert not gt_compile.is_enabled() and not gt_compile.regions_enabled()
    assert torch._C._len_torch_function_stack() == 0
