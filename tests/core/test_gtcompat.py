"""GT's spellings added to ``torch.Tensor`` (``spmdgt/tensor/_gtcompat.py``) stay traceable:
importing spmdgt must not make ``torch.compile`` fail on code that uses ``x.transpose``, with
or without a function mode on the stack (the lazy regions push one)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

import spmdgt  # noqa: F401  (installs the spellings)


def _attention_like(x: torch.Tensor) -> torch.Tensor:
    return (x.transpose(0, 1) @ x).softmax(-1) + x.transpose(dim0=1, dim1=0) + x.transpose()


class _PassThrough(TorchFunctionMode):
    """A function mode on the stack, as the compile pass's lazy regions push one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_transpose_compiles_whole_with_and_without_a_function_mode():
    torch._dynamo.reset()
    x = torch.randn(4, 4)
    expected = _attention_like(x)
    compiled = torch.compile(_attention_like, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    with _PassThrough():  # before: "Attempted to call function marked as skipped" (gb0007)
        torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    torch._dynamo.reset()
