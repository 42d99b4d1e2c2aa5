"""The training-pattern sweep: every loss of ``torch.nn.functional``, as training uses it.

The OpInfo sweep checks each op on its own, with the op's own input as the only thing whose
gradient is compared. Training lives elsewhere: a target that needs no grad, a ``mean``
reduction, a plain ``nn.Linear`` between the sharded batch and the loss, a parameter's
gradient rather than the op's input's. These rows run there. They use the OpInfo sweep's
harness, layouts, verdicts and ledger unchanged: each pattern is an object with the few
attributes of an OpInfo the harness reads.

A pattern row is ``train.<loss>.<reduction>.<mode>``; modes:

| mode          | what runs                                          | gradients compared          |
|---------------|----------------------------------------------------|-----------------------------|
| `input`       | ``loss(x, target)``                                | x                           |
| `target_grad` | the same, the target needing grad too              | x, target                   |
| `linear`      | ``loss(F.linear(x, w, b), target)``, w/b plain     | x, w, b (a plain Linear)    |
| `param`       | the same, ``w`` laid out as x is (a ``gt.Tensor``) | x, w, b                     |

The sample's input ``x`` is laid out by the row's placement (shard0: the batch dim, shard1: a
feature dim, subrep, shard0_empty), and so are the batch-shaped targets (``placed`` below).
Two samples a row: a batch of 6 rows (even on 2 and 3 ranks: DTensor's own path) and of 7
(uneven). Non-scalar results get a random ``grad_output`` (observe.py), never ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PLANTED", "Pattern", "Sample", "pattern_ops", "planted_ops"]

FEATURES = 5  # != every batch size, so only x-shaped tensors are laid out by shape
BATCHES = (6, 7)  # even on 2 and 3 ranks, and uneven on both


@dataclass(frozen=True)
class _Loss:
    """One loss: how to call it and how to draw its extra arguments (seeded, per batch)."""

    name: str
    call: Callable[..., torch.Tensor]  # call(x, target, *extra, reduction=r)
    target: Callable[[int, torch.Generator], torch.Tensor]
    extra: Callable[[int, torch.Generator], tuple] = lambda n, g: ()
    reductions: tuple[str, ...] = ("none", "mean", "sum")
    target_grad: bool = False  # the target is a differentiable float


def _float(n, g):
    return torch.randn(n, FEATURES, generator=g)


def _unit(n, g):
    return torch.rand(n, FEATURES, generator=g)


def _sign(n, g):
    return torch.randint(0, 2, (n, FEATURES), generator=g).float() * 2 - 1


def _classes(n, g):
    t = torch.randint(0, FEATURES, (n,), generator=g)
    t[1] = 2  # a tie on a class, and the class ignore_index hits below
    return t


def _class_weight(n, g):
    return (torch.rand(FEATURES, generator=g) + 0.5,)


def _multilabel(n, g):
    t = torch.randint(0, FEATURES, (n, FEATURES), generator=g)
    t[:, 3] = -1  # multilabel_margin_loss reads targets up to the first -1
    return t


def _probs(n, g):
    return torch.softmax(torch.randn(n, FEATURES, generator=g), dim=-1)


def _var(n, g):
    return ((torch.rand(n, FEATURES, generator=g) + 0.1).requires_grad_(),)


def _pair(n, g):
    return (torch.randn(n, FEATURES, generator=g).requires_grad_(),)


def _row_sign(n, g):
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def _ctc_extra(n, g):
    lengths = torch.full((n,), FEATURES, dtype=torch.long)
    return lengths, torch.randint(1, 3, (n,), generator=g)


def _ctc_target(n, g):
    return torch.randint(1, 4, (n, 2), generator=g)


def _ctc(x, target, in_len, tgt_len, reduction):
    # x is (batch, time, classes) so the batch is dim 0 like every other pattern
    logp = torch.log_softmax(x.unsqueeze(-1) * torch.linspace(-1, 1, 4), -1)
    return F.ctc_loss(logp.transpose(0, 1), target, in_len, tgt_len, reduction=reduction)


LOSSES: tuple[_Loss, ...] = (
    _Loss("mse_loss", F.mse_loss, _float, target_grad=True),
    _Loss("l1_loss", F.l1_loss, _float, target_grad=True),
    _Loss("smooth_l1_loss", F.smooth_l1_loss, _float, target_grad=True),
    _Loss("huber_loss", F.huber_loss, _float, target_grad=True),
    _Loss("soft_margin_loss", F.soft_margin_loss, _sign),
    _Loss(
        "binary_cross_entropy",
        lambda x, t, reduction: F.binary_cross_entropy(torch.sigmoid(x), t, reduction=reduction),
        _unit,
    ),
    _Loss(
        "binary_cross_entropy_with_logits",
        F.binary_cross_entropy_with_logits,
        _unit,
        target_grad=True,
    ),
    _Loss("cross_entropy", F.cross_entropy, _classes),
    _Loss(
        "cross_entropy.weighted_ignore",
        lambda x, t, w, reduction: F.cross_entropy(
            x, t, weight=w, ignore_index=2, reduction=reduction
        ),
        _classes,
        _class_weight,
    ),
    _Loss(
        "cross_entropy.smoothing",
        lambda x, t, w, reduction: F.cross_entropy(
            x, t, weight=w, label_smoothing=0.1, reduction=reduction
        ),
        _classes,
        _class_weight,
    ),
    _Loss("cross_entropy.probs", F.cross_entropy, _probs, target_grad=True),
    _Loss(
        "nll_loss",
        lambda x, t, reduction: F.nll_loss(torch.log_softmax(x, -1), t, reduction=reduction),
        _classes,
    ),
    _Loss(
        "nll_loss.weighted_ignore",
        lambda x, t, w, reduction: F.nll_loss(
            torch.log_softmax(x, -1), t, weight=w, ignore_index=2, reduction=reduction
        ),
        _classes,
        _class_weight,
    ),
    _Loss(
        "kl_div",
        lambda x, t, reduction: F.kl_div(torch.log_softmax(x, -1), t, reduction=reduction),
        _probs,
        reductions=("none", "mean", "sum", "batchmean"),
        target_grad=True,
    ),
    _Loss("poisson_nll_loss", F.poisson_nll_loss, _unit, target_grad=True),
    _Loss(
        "gaussian_nll_loss",
        lambda x, t, var, reduction: F.gaussian_nll_loss(x, t, var, reduction=reduction),
        _float,
        _var,
        target_grad=True,
    ),
    _Loss("hinge_embedding_loss", F.hinge_embedding_loss, _sign),
    _Loss(
        "margin_ranking_loss",
        lambda x, t, x2, reduction: F.margin_ranking_loss(x, x2, t, reduction=reduction),
        _sign,
        _pair,
    ),
    _Loss("multilabel_margin_loss", F.multilabel_margin_loss, _multilabel),
    _Loss("multilabel_soft_margin_loss", F.multilabel_soft_margin_loss, _unit),
    _Loss("multi_margin_loss", F.multi_margin_loss, _classes),
    _Loss(
        "cosine_embedding_loss",
        lambda x, t, x2, reduction: F.cosine_embedding_loss(x, x2, t, reduction=reduction),
        _row_sign,
        _pair,
    ),
    _Loss(
        "triplet_margin_loss",
        lambda x, t, n, reduction: F.triplet_margin_loss(x, t, n, reduction=reduction),
        _float,
        _pair,
        target_grad=True,
    ),
    _Loss(
        "triplet_margin_with_distance_loss",
        lambda x, t, n, reduction: F.triplet_margin_with_distance_loss(
            x, t, n, reduction=reduction
        ),
        _float,
        _pair,
        target_grad=True,
    ),
    _Loss("ctc_loss", _ctc, _ctc_target, _ctc_extra),
)

MODES = ("input", "target_grad", "linear", "param")


def _with_linear(loss: _Loss, reduction: str) -> Callable[..., torch.Tensor]:
    def fn(x, target, w, b, *extra):
        return loss.call(F.linear(x, w, b), target, *extra, reduction=reduction)

    return fn


def _plain(loss: _Loss, reduction: str) -> Callable[..., torch.Tensor]:
    def fn(x, target, *extra):
        return loss.call(x, target, *extra, reduction=reduction)

    return fn


class Sample:
    """What the harness reads of an OpInfo ``SampleInput``, plus the labels of the tensors
    laid out like ``input`` whatever their shape (``placed``): the batch-shaped targets."""

    def __init__(self, input, args=(), kwargs=None, placed: frozenset[str] = frozenset()):
        self.input, self.args, self.kwargs = input, tuple(args), dict(kwargs or {})
        self.placed = placed


@dataclass
class Pattern:
    """A training pattern, shaped like the OpInfo entries the sweep's harness reads."""

    name: str
    op: Callable[..., Any]
    samples: Callable[[], list[Sample]]
    variant_test_name: str = ""
    inplace_variant: Any = None
    supports_out: bool = False
    supports_autograd: bool = True
    supports_inplace_autograd: bool = False
    _drawn: list = field(default_factory=list)

    def supported_dtypes(self, device: str) -> set[torch.dtype]:
        return {torch.float32}

    def sample_inputs(self, device, dtype, requires_grad=True, **kw):
        return iter(self.samples())


def _loss_samples(loss: _Loss, mode: str, seed: int) -> Callable[[], list[Sample]]:
    def draw() -> list[Sample]:
        out = []
        for n in BATCHES:
            g = torch.Generator().manual_seed(seed + n)
            x = torch.randn(n, FEATURES, generator=g).requires_grad_()
            target = loss.target(n, g)
            if mode == "target_grad":
                target.requires_grad_()
            extra = loss.extra(n, g)
            placed = {"args[0]"} if target.dim() >= 1 and target.shape[0] == n else set()
            first = 3 if mode in ("linear", "param") else 1  # where extra args start
            for i, e in enumerate(extra):
                if isinstance(e, torch.Tensor) and e.dim() and e.shape[0] == n:
                    placed.add(f"args[{first + i}]")
            if mode in ("linear", "param"):
                w = (torch.randn(FEATURES, FEATURES, generator=g) * 0.5).requires_grad_()
                b = torch.randn(FEATURES, generator=g).requires_grad_()
                if mode == "param":
                    placed.add("args[1]")
                args = (target, w, b, *extra)
            else:
                args = (target, *extra)
            out.append(Sample(x, args, placed=frozenset(placed)))
        return out

    return draw


def pattern_ops() -> dict[str, Pattern]:
    """Every training pattern, by its row name."""
    from tests.parity.prepare import stable_seed

    out = {}
    for loss in LOSSES:
        for reduction in loss.reductions:
            for mode in MODES:
                if mode == "target_grad" and not loss.target_grad:
                    continue
                name = f"train.{loss.name}.{reduction}.{mode}"
                fn = _with_linear(loss, reduction) if mode in ("linear", "param") else None
                fn = fn or _plain(loss, reduction)
                out[name] = Pattern(name, fn, _loss_samples(loss, mode, stable_seed(name)))
    return out


# -- the sweep's check of itself ----------------------------------------------------------


def _world() -> int:
    """The world size on a rank, 1 in the parent that computes the reference."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by ``k`` (the planted backward error)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


def _planted_value(x, target, w, b):
    return F.mse_loss(F.linear(x, w, b), target) * _world()


def _planted_grad(x, target, w, b):
    # Right value and input gradient, the weight's gradient alone off by the world size: the
    # defect the training sweep exists for (a backward that normalises by a local size).
    return F.mse_loss(F.linear(x, _ScaleGrad.apply(w, float(_world())), b), target)


PLANTED = ("planted.value", "planted.grad")


def planted_ops() -> dict[str, Pattern]:
    """Two patterns wrong by the world size on purpose, for the sweep's test of itself: the
    loss value, and (value right) the upstream parameters' gradients."""
    loss = LOSSES[0]
    return {
        name: Pattern(name, fn, _loss_samples(loss, "linear", 7))
        for name, fn in zip(PLANTED, (_planted_value, _planted_grad))
    }
