"""Custom ``torch.autograd.Function``s the tests share: one saving its input, one its output,
one writing its input in place (``mark_dirty``)."""

from __future__ import annotations

import torch


class Cube(torch.autograd.Function):
    """``x ** 3``; saves its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class Exp(torch.autograd.Function):
    """``exp(x / 10)``; saves its output."""

    @staticmethod
    def forward(ctx, x):
        y = (x * 0.1).exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y * 0.1


class DoubleInPlace(torch.autograd.Function):
    """``x.mul_(2)``: writes its input (``mark_dirty``)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2
