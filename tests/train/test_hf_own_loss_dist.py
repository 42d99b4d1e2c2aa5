"""HF heads that compute ``CrossEntropyLoss()`` themselves (T5ForConditionalGeneration,
BertForMaskedLM, BertForTokenClassification): over data-parallel ranks and accumulated
micro-batches their loss is one process's global token mean, whatever each rank's ``-100``
padding.

Such a head takes no ``num_items_in_batch``; the trainer recomputes its loss from the output's
logits and the labels, the sum of the per-token cross-entropy over the step's label tokens
counted on every rank (``spmdgt/train/_hf_ce.py``). The reference, the data (every row padded
to its own length) and the trainer run are those of ``test_hf_loss_tokens_dist.py``: one
plain one-process HF forward of the step's whole global batch, SGD; every step's loss and the
final weights agree within 1e-5. The old loop (each micro-batch's own mean) misses it.
"""

from __future__ import annotations

import ast
import functools
import textwrap

import pytest
import torch
import transformers as T
from transformers.modeling_outputs import MaskedLMOutput

from spmdgt.config import ConfigError
from spmdgt.train import DistributedTrainer, TrainConfig
from spmdgt.train._batches import loss_token_rule
from spmdgt.train._hf_ce import _is_token_ce
from tests._dist import run_ranks
from tests._hf import tiny_bert
from tests.train.test_hf_loss_tokens_dist import (
    LR,
    ROWS,
    _assert_equal_to_reference,
    _max_diff,
    _rank_batches,
    reference,
    train,
)

DDP, FSDP = TrainConfig(strategy="ddp"), TrainConfig(strategy="fsdp")


def _train_kinds(rank, world, kinds, config, accum):
    # several models in one set of ranks: one process start and import for all of them
    return [train(rank, world, kind, config, accum) for kind in kinds]


CASES = {  # world, strategy, accumulation, models
    "ddp2": (2, DDP, 1, ["t5", "bert-mlm", "bert-tok"]),
    "fsdp2": (2, FSDP, 1, ["t5", "bert-mlm", "bert-tok"]),
    "ddp3-accum2": (3, DDP, 2, ["t5", "bert-mlm"]),
    "fsdp3": (3, FSDP, 1, ["t5", "bert-tok"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_own_cross_entropy_is_the_global_token_mean(tmp_path, case):
    world, config, accum, kinds = CASES[case]
    results = run_ranks(_train_kinds, world, tmp_path, kinds, config, accum, timeout=300)
    for i, kind in enumerate(kinds):
        ref = reference(kind, world * accum * ROWS)
        _assert_equal_to_reference([r[i] for r in results], ref)


def test_one_process_accumulation_is_the_global_token_mean():
    # a world of one: the two micro-batches' token mean, no collective, not their two means
    for kind in ("t5", "bert-tok"):
        _assert_equal_to_reference([train(0, 1, kind, TrainConfig(), 2)], reference(kind, 2 * ROWS))


def test_the_own_mean_of_means_differs(tmp_path):
    # the data is uneven enough to tell for these heads too: their own means, averaged
    kinds = ["t5", "bert-mlm", "bert-tok"]
    results = run_ranks(_old_loop, 2, tmp_path, kinds)
    for i, kind in enumerate(kinds):
        loss_diff, param_diff = _max_diff([r[i] for r in results], reference(kind, 2 * ROWS))
        assert loss_diff > 1e-3 and param_diff > 1e-3, (kind, loss_diff, param_diff)


def _old_loop(rank, world, kinds):
    return [train(rank, world, kind, DDP, 1, count=False) for kind in kinds]


# ------------------------------------------------------- which forwards are recomputed

# A forward that reads exactly like the pattern, but whose CrossEntropyLoss smooths its
# labels: the code alone cannot tell, the first step's check must.
CrossEntropyLoss = functools.partial(torch.nn.CrossEntropyLoss, label_smoothing=0.1)


class SmoothedMLM(T.BertForMaskedLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.cls(hidden)
        loss = None
        if labels is not None:
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits)


def _smoothed(rank, world):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SmoothedMLM(tiny_bert().config)
    trainer = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    try:
        trainer.train(_rank_batches(world, rank, 1))
    except ConfigError as e:
        return str(e)
    return None


def test_a_head_whose_own_loss_differs_is_refused_on_every_rank(tmp_path):
    assert loss_token_rule(SmoothedMLM(tiny_bert().config)) == "logits"  # reads right
    errors = run_ranks(_smoothed, 2, tmp_path)
    assert errors[0] is not None and errors[0] == errors[1]
    assert "SmoothedMLM's forward reads as a token cross-entropy" in errors[0]
    assert "loss_fn=..." in errors[0]


def test_a_head_not_recomputed_says_so():
    # three losses chosen by problem type: no one token mean to recompute, its own mean kept
    torch.set_num_threads(1)
    model = tiny_bert("BertForSequenceClassification")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.warns(UserWarning, match=r"BertForSequenceClassification's loss is neither"):
        trainer = DistributedTrainer(model, opt, gradient_accumulation_steps=2)
    assert trainer._loss_tokens is None


PATTERN = """
def forward(self, input_ids, labels=None):
    logits = self.head(input_ids)
    loss = None
    if labels is not None:
        labels = labels.to(logits.device)
        loss_fct = CrossEntropyLoss(ignore_index=-100)
        loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))
    return Output(loss=loss, logits=logits)
"""

# one change each that makes the loss something else than the token mean of logits vs labels
NOT_A_TOKEN_MEAN = {
    "label smoothing": ("ignore_index=-100", "label_smoothing=0.1"),
    "class weights": ("ignore_index=-100", "weight=self.w"),
    "another ignore index": ("ignore_index=-100", "ignore_index=0"),
    "a sum": ("ignore_index=-100", "reduction='sum'"),
    "shifted logits": ("loss_fct(logits.view", "loss_fct(logits[:, :-1].contiguous().view"),
    "shifted labels": ("labels.view(-1))", "labels[:, 1:].reshape(-1))"),
    "labels changed in place": ("labels = labels.to(logits.device)", "labels[labels == 0] = -100"),
    "labels filled in place": ("labels = labels.to(logits.device)", "labels.masked_fill_(m, -100)"),
    "labels rebound": ("labels.to(logits.device)", "labels.clamp(min=0)"),
    "logits rescaled": ("loss = None", "loss = None\n    logits = logits * 2"),
    "another output's logits": ("logits=logits)", "logits=logits.detach())"),
    "a second term": ("return Output", "loss = loss + 1\n    return Output"),
    "a second loss": ("return", "aux = loss_fct(logits.view(-1, 2), labels.view(-1))\n    return"),
}  # fmt: skip


def _forward(src: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(src)).body[0]


def test_which_forwards_read_as_a_token_mean():
    assert _is_token_ce(_forward(PATTERN))
    assert _is_token_ce(_forward(PATTERN.replace("(ignore_index=-100)", "()")))  # the default
    for what, (old, new) in NOT_A_TOKEN_MEAN.items():
        assert old in PATTERN, what
        assert not _is_token_ce(_forward(PATTERN.replace(old, new))), what
