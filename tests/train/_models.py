"""Tiny models, data and a single-process torch reference loop shared by the trainer tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

# HIDDEN=11: FSDP shards split 6/5 over 2 ranks (uneven on purpose). Tensor parallelism needs
# the sharded dim divisible by the world (torch's colwise -> rowwise hand-off assumes even
# local shards), so placements tests use TP_HIDDEN.
IN, HIDDEN, OUT, TP_HIDDEN = 6, 11, 3, 12


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout  # > 0 makes training consume RNG (checkpoint tests)
        self.up = nn.Linear(IN, hidden)
        self.down = nn.Linear(hidden, OUT)
        self.norm = nn.LayerNorm(OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.up(x)), self.dropout, self.training)
        return self.norm(self.down(h))


def make_model(seed: int = 0, hidden: int = HIDDEN, dropout: float = 0.0) -> MLP:
    torch.manual_seed(seed)
    return MLP(hidden, dropout)


def make_dataset(n: int = 48, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return TensorDataset(x, y)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def reference_train(
    dataset: TensorDataset,
    global_batch: int,
    steps: int,
    *,
    max_grad_norm: float | None = None,
    accum: int = 1,
    seed: int = 0,
    hidden: int = HIDDEN,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain one-process torch: the numbers every distributed run must reproduce."""
    model = make_model(seed, hidden)
    opt = make_optimizer(model)
    x, y = dataset.tensors
    losses = []
    micro = global_batch // accum
    for step in range(steps):
        total = 0.0
        for m in range(accum):
            lo = step * global_batch + m * micro
            loss = F.mse_loss(model(x[lo : lo + micro]), y[lo : lo + micro])
            (loss / accum).backward()
            total += loss.item()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total / accum)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a (possibly DDP/FSDP/TP-wrapped) model, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out = {}
    for k, v in sd.items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


# A stack of residual blocks in a ModuleList named ``layers`` (torchtitan's layout): what
# ``compile=True`` compiles block by block. FFN=12 splits evenly for tensor parallelism;
# HIDDEN=11 leaves FSDP's dim-0 shards uneven (6/5).
FFN, N_LAYERS = 12, 2


class Block(nn.Module):
    def __init__(self, dim: int = HIDDEN, ffn: int = FFN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, ffn)
        self.down = nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = N_LAYERS) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def make_stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def reference_stack(
    dataset: TensorDataset, global_batch: int, steps: int, max_grad_norm: float
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """One-process eager torch on ``Stack``: final state, per-step losses, and the gradients
    of one more forward/backward on the first global batch with the final weights."""
    model = make_stack()
    opt = make_optimizer(model)
    x, y = dataset.tensors
    losses = []
    for step in range(steps):
        lo = step * global_batch
        loss = F.mse_loss(model(x[lo : lo + global_batch]), y[lo : lo + global_batch])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    F.mse_loss(model(x[:global_batch]), y[:global_batch]).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return state, losses, grads
