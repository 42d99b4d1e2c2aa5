"""The before-op hooks (``compile/_before_op.py``) stay out of a hot graph's run.

``without_hooks`` runs a hot function's compiled graph: its runtime wrappers make torch-level
calls that no hook needs. When the hooks' mode is the innermost function mode it leaves the
stack; when a mode was pushed after it (the interceptor's), it cannot leave, so it passes every
call through instead. Before that fix, the hooks went on seeing the graph's calls there.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from spmdgt.compile import _before_op


class _Above(TorchFunctionMode):
    """A mode pushed after the hooks' (as the interceptor's is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _ops() -> torch.Tensor:
    a = torch.ones(3)
    return (a * 2 + 1).sum()


def test_hooks_see_no_call_inside_without_hooks_with_a_mode_above_or_not():
    seen: list[str] = []

    def hook(func, types, args, kwargs):
        seen.append(getattr(func, "__name__", str(func)))
        return _before_op.PASS

    _before_op.add_before_op_hook(hook)
    try:
        _ops()
        assert seen, "the hook sees calls outside without_hooks"
        seen.clear()
        got = _before_op.without_hooks(_ops)
        assert seen == [], seen  # innermost: the mode left the stack
        assert float(got) == 9.0
        with _Above():
            _ops()
            assert seen, "the hook sees calls under a mode above it"
            seen.clear()
            got = _before_op.without_hooks(_ops)
            assert seen == [], seen  # not innermost: the mode passed them through
            assert float(got) == 9.0
            assert _before_op._suspended == 0
            _ops()
            assert seen, "the hook sees calls again after without_hooks"
    finally:
        _before_op.remove_before_op_hook(hook)
    seen.clear()
    _ops()
    assert seen == []
