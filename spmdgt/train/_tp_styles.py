"""The tensor-parallel styles the ``placements`` table names, as DTensor ``ParallelStyle``s.

torch's own cover four of them: ``colwise`` (``ColwiseParallel``: output features split, the
output stays this rank's part), ``rowwise`` (``RowwiseParallel``: input features split,
partial outputs summed), ``colwise_gather`` (``ColwiseParallel(output_layouts=Replicate())``:
the split output is gathered whole, for a reader that needs every feature: Phi3's packed
``qkv_proj`` sliced at global offsets, Olmo2's q/k norms over all heads) and ``rowwise_split``
(``RowwiseParallel(input_layouts=Replicate())``: a whole input, each rank takes its slice).
Two more are here, both running the module's own forward on local shards:

* ``packed_colwise`` (``PackedColwise``): a linear layer whose output is ``parts`` equal parts
  side by side (Phi3's ``gate_up_proj``: gate then up). A plain colwise split would give rank
  0 all of gate and rank 1 all of up; this one gives each rank its slice of every part
  (``_StridedShard(0, split_factor=parts)``: the parameter's global value keeps HF's order),
  so the module's own ``chunk(parts)`` of the local output pairs matching features.
* ``experts`` (``ExpertsParallel``): HF's fused MoE experts (Mixtral, Qwen3-MoE:
  ``gate_up_proj [E, 2I, H]`` packed as above on dim 1, ``down_proj [E, H, I]`` split on its
  input dim), HF's ``moe_tp_experts``: every rank runs every expert on its slice of the
  intermediate features and the partial outputs are summed.

Gradients are one process's: a replicated input read by a split weight gets a partial input
gradient, summed over the group in backward (``_SumBackward``); the summed output's gradient
is the same on every rank (``_SumForward`` is the identity backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Shard, _StridedShard

__all__ = ["ExpertsParallel", "PackedColwise"]


class _SumBackward(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (a replicated input read
    by split weights: each rank's input gradient is its part of the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """Sum over ``group`` forward (each rank's partial output); identity backward (the sum's
    gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _whole(x: object) -> object:
    """A DTensor input as its global value on this rank (plain tensors pass through)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


@contextlib.contextmanager
def _local_params(module: nn.Module, names: list[str]) -> Iterator[None]:
    """Run the module's forward on its parameters' local shards: each ``to_local()`` is
    differentiable, so the gradients land on the DTensor parameters with their placements."""
    saved = {n: module._parameters[n] for n in names}
    try:
        for n, p in saved.items():
            module._parameters[n] = p.to_local()  # a plain tensor in the graph, for this call
        yield
    finally:
        module._parameters.update(saved)


def _shard(module: nn.Module, name: str, mesh: object, placement: object) -> None:
    p = module._parameters[name]
    dp = distribute_tensor(p.data, mesh, [placement])
    module._parameters[name] = nn.Parameter(dp, requires_grad=p.requires_grad)


class PackedColwise(ParallelStyle):
    """``packed_colwise``: a linear layer's output features are ``parts`` equal parts; each
    rank holds its slice of every part (weight and bias), reads the whole input and returns
    its local output (the parts' slices side by side)."""

    def __init__(self, parts: int = 2) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        for n in names:
            _shard(module, n, device_mesh, _StridedShard(0, split_factor=self.parts))
        group = device_mesh.get_group()
        forward = module.forward

        def packed_forward(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            x = _SumBackward.apply(_whole(x), group)
            with _local_params(module, names):
                return forward(x, *args, **kwargs)

        module.forward = packed_forward
        return module


class ExpertsParallel(ParallelStyle):
    """``experts``: HF's fused experts module (``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``, forward ``(hidden_states, top_k_index, top_k_weights)``): each rank runs
    every expert on its slice of the ``I`` intermediate features (gate and up sliced alike)
    and the ranks' partial outputs are summed. The whole inputs' gradients (the hidden states
    and the routing weights, both read by every rank's part) are summed in backward."""

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        _shard(module, "gate_up_proj", device_mesh, _StridedShard(1, split_factor=2))
        _shard(module, "down_proj", device_mesh, Shard(2))
        group = device_mesh.get_group()
        forward = module.forward

        def experts_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            hidden_states = _SumBackward.apply(_whole(hidden_states), group)
            top_k_weights = _SumBackward.apply(_whole(top_k_weights), group)
            with _local_params(module, ["gate_up_proj", "down_proj"]):
                out = forward(hidden_states, _whole(top_k_index), top_k_weights, *args, **kwargs)
            return _SumForward.apply(out, group)

        module.forward = experts_forward
        return module
