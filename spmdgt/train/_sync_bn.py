"""BatchNorm over the global batch: one process's statistics under DDP and FSDP.

DDP and FSDP give each rank its own rows, and ``nn.BatchNorm*`` in training normalises with
the statistics of the rows it sees: on N ranks every rank's batch statistics, running means
and variances, and so every loss, differ from one process reading the global batch (2 ranks,
a Linear-BatchNorm-Linear under SGD: step 1's loss 1.0346 where one process gives 1.1720).
The trainer's contract is one process's numbers, so ``sync_batchnorm`` (on by default)
swaps each BatchNorm for one whose statistics are the data-parallel group's:

- on CUDA (NCCL) torch's own ``nn.SyncBatchNorm`` (``convert_sync_batchnorm``);
- elsewhere (gloo on CPU, which ``nn.SyncBatchNorm`` refuses) ``GlobalBatchNorm`` below: the
  per-channel sum and row count all-reduced, then the sum of squared deviations from the
  global mean (two passes, as torch's CPU kernel: no ``E[x^2] - E[x]^2`` cancellation), each
  through ``torch.distributed.nn``'s differentiable all-reduce, so the backward is the
  global batch's too. The running statistics take the global mean and the unbiased global
  variance, as one process's.

Eval mode (running statistics) needs no collective and runs torch's kernel. Every rank
takes the same branches from the module's mode and the global row count, so the collectives
line up; a global batch of one row per channel raises torch's own error on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["GlobalBatchNorm", "batchnorms", "sync_batchnorm"]


class GlobalBatchNorm(_BatchNorm):
    """``nn.BatchNorm{1,2,3}d`` whose training statistics are over ``group``'s global batch
    (see the module docstring). Made by ``sync_batchnorm`` from an existing BatchNorm."""

    def __init__(self, *args, group: object = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or (self.running_mean is None and self.running_var is None)):
            return super().forward(input)  # the running statistics: torch's kernel
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                done = self.num_batches_tracked  # a dry run's is fake: no value to read
                factor = 1.0 / (done if is_fake(done) else float(done))
        return _global_batch_norm(self, input, factor)


def _global_batch_norm(bn: GlobalBatchNorm, x: torch.Tensor, factor: object) -> torch.Tensor:
    from torch.distributed.nn.functional import all_reduce

    dims = [0, *range(2, x.dim())]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    rows = torch.full((1,), x.numel() / x.shape[1], dtype=torch.float32, device=x.device)
    stats = all_reduce(torch.cat([x.sum(dims, dtype=torch.float32), rows]), group=bn.group)
    n = stats[-1].detach()  # the global values per channel, the same on every rank
    if not is_fake(n) and float(n) <= 1:  # a dry run's fake tensors hold no count to read
        raise ValueError(
            "Expected more than 1 value per channel when training, got input size "
            f"{tuple(x.shape)} per rank ({int(n)} value(s) per channel over the group)"
        )
    mean = stats[:-1] / n
    centred = x - mean.view(shape).to(x.dtype)
    squares = all_reduce(centred.pow(2).sum(dims, dtype=torch.float32), group=bn.group)
    var = squares / n
    out = centred * torch.rsqrt(var + bn.eps).view(shape).to(x.dtype)
    if bn.affine:
        out = out * bn.weight.view(shape) + bn.bias.view(shape)
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            bn.running_mean.mul_(1 - factor).add_(mean * factor)
            bn.running_var.mul_(1 - factor).add_(var * (n / (n - 1)) * factor)
    return out


def batchnorms(model: nn.Module) -> list[str]:
    """The names of ``model``'s BatchNorm layers that normalise with their own rows."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, GlobalBatchNorm))
    ]


def sync_batchnorm(model: nn.Module, group: object, device: torch.device) -> list[str]:
    """Swap every BatchNorm in ``model`` (in place) for one over ``group``'s global batch:
    torch's ``nn.SyncBatchNorm`` on CUDA, ``GlobalBatchNorm`` elsewhere; weights, buffers
    and mode kept. Returns the swapped modules' names (the same on every rank)."""
    names = batchnorms(model)
    if not names:
        return []
    if names[0] == "":
        raise ValueError(
            "sync_batchnorm: the model is a bare BatchNorm; wrap it in a module (or set "
            "sync_batchnorm: false for each rank's own statistics)"
        )
    if device.type == "cuda":
        nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
        return names
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = owner.get_submodule(leaf)
        new = GlobalBatchNorm(
            old.num_features,
            old.eps,
            old.momentum,
            old.affine,
            old.track_running_stats,
            group=group,
            device=device,
        )
        new.load_state_dict(old.state_dict())
        if old.affine:  # the same Parameter objects: the optimizer built on them keeps them
            new.weight, new.bias = old.weight, old.bias
        new.train(old.training)
        setattr(owner, leaf, new)
    return names
