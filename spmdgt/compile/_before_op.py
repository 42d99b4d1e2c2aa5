"""Before-op hooks: see a torch-level call before it runs, and answer it instead.

The lazy regions record ops and hand back placeholders through one such hook. The hooks run
in their own function mode, pushed when the first hook is added and popped when the last
goes, so the interceptor's modes and its native level pay nothing for them, and with no hook
nothing is pushed. Owned by the compile pass, its only user: ``add`` / ``remove``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PASS", "add_before_op_hook", "remove_before_op_hook", "without_hooks"]

# A hook sees a torch-level call *before* it runs and may answer it instead (the compile
# pass's lazy regions record ops and hand back placeholders). They run in their own function
# mode, pushed when the first hook is added and popped when the last goes, so the interceptor's
# own modes and its native level pay nothing for them, and with no hook nothing is pushed.

PASS: Any = object()  # a hook's answer: "not mine, run the op"
_before_hooks: list[Callable[..., Any]] = []
_hook_mode: Any = None
_is_compiling = torch.compiler.is_compiling
_suspended = 0  # > 0 while a hot function's graph runs under a mode pushed after ours


class _BeforeOpMode(TorchFunctionMode):
    """Calls the before-op hooks in order; the first answer other than ``PASS`` is the op's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch-level call pays this while a hook is in: module-level names, no
        # attribute chains (``torch.compiler.is_compiling`` is still the function dynamo
        # folds to True while it traces)
        if not _suspended and not _is_compiling():
            for hook in _before_hooks:
                got = hook(func, types, args, kwargs)
                if got is not PASS:
                    return got
        return func(*args, **kwargs) if kwargs else func(*args)


def add_before_op_hook(hook: Callable[..., Any]) -> None:
    """Call ``hook(func, types, args, kwargs)`` before every torch-level call on this thread;
    it returns ``PASS`` to let the op run, or the op's result. The mode that runs the hooks is
    pushed with the first hook; inside a hook the mode is off (ops a hook issues are not seen
    by it, as for any ``TorchFunctionMode``)."""
    global _hook_mode
    if hook in _before_hooks:
        return
    _before_hooks.append(hook)
    if _hook_mode is None:
        _hook_mode = _BeforeOpMode()
        _hook_mode.__enter__()


def remove_before_op_hook(hook: Callable[..., Any]) -> None:
    """Stop calling ``hook``. The mode leaves with the last hook when it is the innermost
    function mode (modes leave in LIFO order); otherwise it stays, passing every op through,
    until a later removal finds it innermost."""
    global _hook_mode
    if hook in _before_hooks:
        _before_hooks.remove(hook)
    if _before_hooks or _hook_mode is None:
        return
    from torch.overrides import _get_current_function_mode

    if _get_current_function_mode() is _hook_mode:
        _hook_mode.__exit__(None, None, None)  # modes leave in LIFO order
        _hook_mode = None


def without_hooks(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the hooks off: their mode popped while it is the innermost mode and
    pushed back after, else passing every call through. A hot function's compiled graph runs
    this way: its runtime wrappers make a few torch-level calls per run (grad mode, aliases of
    outputs) that no hook needs, and the mode's Python dispatch of each cost more than the
    graph of a small function itself."""
    global _suspended
    mode = _hook_mode
    if mode is None or torch._C._len_torch_function_stack() == 0:
        return fn(*args)
    from torch.overrides import _get_current_function_mode

    if _get_current_function_mode() is not mode:
        # a mode pushed after ours (the interceptor's) is above it: ours cannot leave the
        # stack, so it passes every call through (before, its hooks went on seeing the
        # graph's runtime calls, which the innermost case above already keeps from them)
        _suspended += 1
        try:
            return fn(*args)
        finally:
            _suspended -= 1
    torch._C._pop_torch_function_stack()
    try:
        return fn(*args)
    finally:
        torch._C._push_on_torch_function_stack(mode)
