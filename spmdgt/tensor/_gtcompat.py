"""GT spellings torch lacks, made to work on every torch tensor, plain or sharded.

GT code ported to spmdgt runs in a world of one on plain torch tensors and under torchrun on
``gt.Tensor``s; a spelling that worked on one and not the other would make ``python`` and
``torchrun`` disagree. So each one here is added to ``torch.Tensor`` itself, and only where
torch would raise: every call torch accepts goes to torch unchanged.

- ``t.transpose()`` with no dims reverses the dims, as GT and numpy do (torch requires two).

Most of GT's keywords need nothing: torch accepts ``axis=`` and ``keepdims=`` on its
reductions (``sum/mean/var/std/max/min/prod/all/any``...).
"""

from __future__ import annotations

import torch

__all__ = ["install"]

_installed = False


def install() -> None:
    """Add the spellings above to ``torch.Tensor`` (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    transpose = torch.Tensor.transpose

    def gt_transpose(self, *dims, **kwargs):
        if not dims and not kwargs:  # GT / numpy: reverse the dims
            # a tuple: dynamo misreads ``permute(*range(...))`` under a function mode
            return self.permute(tuple(range(self.dim() - 1, -1, -1)))
        # torch's function, not the C method ``TensorBase.transpose``: under a function mode
        # (the lazy regions' before-op mode, or a user's) dynamo refuses that method called as
        # a plain function (gb0007), and the whole frame being compiled fell back to eager
        return torch.transpose(self, *dims, **kwargs)

    gt_transpose.__doc__ = transpose.__doc__
    gt_transpose.__name__ = "transpose"
    torch.Tensor.transpose = gt_transpose
