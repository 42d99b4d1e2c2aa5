"""The step's loss: which rule a model's loss follows, and the loss of one micro-batch.

``LossRule.of(model, loss_fn)`` reads, before wrapping (FSDP2 swaps the model's class), how the
trainer gets a loss that is one process's global mean (docs/trainer.md, "Hugging Face models"):

* a ``loss_fn``, or a model that returns its loss: the loss as computed, per micro-batch;
* an HF model counted by the model (``_batches.loss_token_rule``: ``num_items_in_batch``):
  the step's label tokens are passed as that keyword;
* an HF head recomputed by the trainer (``_hf_ce``): its token cross-entropy sum over the
  step's global label tokens, checked once against its own mean.

A ``transformers`` model of neither kind keeps the mean of per-micro-batch means: the rule says
so in a warning (``warn_mean_of_means``) when there is more than one micro-batch per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from spmdgt.train import _hf_ce
from spmdgt.train._batches import call_model, describe, loss_from_output, loss_token_rule

__all__ = ["LossRule"]


class LossRule:
    """How one model's loss is computed (decided from its class and ``loss_fn``, the same on
    every rank, never from data)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        self.loss_fn = loss_fn
        # HF's num_items_in_batch rule ("shifted", "plain", _hf_ce.RULE) or None
        self.tokens: str | None = loss_token_rule(model) if loss_fn is None else None
        # _hf_ce's recomputed heads: named in errors (FSDP2 renames the class), checked once
        self.model_name = type(model).__name__
        self.checked_ce = False
        self._hf = type(model).__module__.startswith("transformers.")

    @property
    def splits_logits(self) -> bool:
        """Whether the loss is the model's own shifted token cross-entropy of its logits
        (HF's causal LMs, no ``loss_fn``): the one rule under which ``placements: auto`` may
        split the output layer over the vocabulary (``loss_parallel``), since nothing else
        reads the logits."""
        return self.loss_fn is None and self.tokens == "shifted"

    def warn_mean_of_means(self, dp_size: int, accum: int, rank: int) -> None:
        """Say once, on every rank, that a Hugging Face model whose loss takes no
        ``num_items_in_batch`` and is not recomputed (``_hf_ce``; e.g.
        ``BertForSequenceClassification``, three losses by problem type) keeps the mean of
        per-micro-batch means when there is more than one micro-batch per step (data
        parallelism or accumulation)."""
        spread = dp_size > 1 or accum > 1
        if self.loss_fn is None and self.tokens is None and self._hf and spread:
            warnings.warn(
                f"rank {rank}: {self.model_name}'s loss is neither one of HF's "
                "token cross-entropies taking num_items_in_batch nor a CrossEntropyLoss() of "
                "its logits against labels the trainer can recompute (docs/trainer.md, Hugging "
                "Face models), so each micro-batch's loss is its "
                f"own mean and the trainer averages {dp_size} data-parallel "
                f"rank(s) x {accum} micro-step(s) of them: one process's global mean only "
                "when every micro-batch holds as many of the loss's items (no uneven -100 "
                "padding); pass loss_fn=... for another reduction",
                stacklevel=4,
            )

    def loss(
        self,
        model: nn.Module,
        inputs: object,
        targets: object,
        num_items: torch.Tensor | None = None,
        *,
        world_size: int = 1,
        comm_device: torch.device | None = None,
    ) -> torch.Tensor:
        """One micro-batch's forward and loss (a plain 0-dim tensor). ``num_items``: the
        step's label tokens (HF's ``num_items_in_batch``), when the rule counts them."""
        if num_items is not None and self.tokens == _hf_ce.RULE:
            return self._recomputed(model, inputs, num_items, world_size, comm_device)
        if num_items is not None:  # HF's keyword: the model's loss is sum / num_items
            inputs = {**inputs, "num_items_in_batch": num_items}
        out = loss_from_output(call_model(model, inputs), self.loss_fn is not None)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, targets)
        elif targets is not None and not (isinstance(out, torch.Tensor) and out.ndim == 0):
            raise ValueError(
                f"no loss_fn was given and the model returned {describe(out)}, not a scalar "
                "loss; pass loss_fn=... (e.g. nn.functional.cross_entropy)"
            )
        else:
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"the loss must be a scalar tensor, got {describe(loss)}")
        if hasattr(loss, "full_tensor"):  # a DTensor loss (tensor parallel) -> plain
            loss = loss.full_tensor()
        return loss

    def _recomputed(
        self,
        model: nn.Module,
        inputs: dict,
        num_items: torch.Tensor,
        world_size: int,
        comm_device: torch.device | None,
    ) -> torch.Tensor:
        """A head that computes ``CrossEntropyLoss()`` itself (``_hf_ce``): its token sum
        recomputed from the output's logits over the step's global label tokens. The first
        time, every rank checks that the model's own loss is that sum's local mean (one
        all-reduce, on every rank at the first counted micro-step: the schedule's, never the
        data's)."""
        out = call_model(model, inputs)
        total = _hf_ce.token_ce_sum(out, inputs["labels"], self.model_name)
        if not self.checked_ce:
            self.checked_ce = True
            _hf_ce.check_token_ce(
                loss_from_output(out, False),
                total,
                inputs["labels"],
                model=self.model_name,
                world_size=world_size,
                comm_device=comm_device or torch.device("cpu"),
            )
        return total / num_items
