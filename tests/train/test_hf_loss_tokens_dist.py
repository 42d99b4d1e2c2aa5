"""HF's causal-LM loss over data-parallel ranks and accumulated micro-batches: the step's loss
and gradients are one process's global token mean, whatever each rank's ``-100`` padding.

HF's loss is a mean over a micro-batch's non-ignored label tokens. Averaging such means over
ranks and micro-steps (a mean of means) differs from the global mean whenever the micro-
batches hold different numbers of label tokens. The trainer counts the step's label tokens
over its micro-batches and the data-parallel ranks and passes HF's ``num_items_in_batch``
(``_batches.step_label_tokens``), as HF's ``Trainer`` does. The reference is the plain
truth: one forward of a one-process HF model on the step's whole global batch, its own mean
over every label token, one SGD step (SGD: the update is the gradient itself, nothing
normalises an error away). Every row is right-padded to a different length, so every rank
and micro-batch has its own token count; ``test_the_mean_of_means_differs`` shows the old
loop (no count) misses the reference by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from spmdgt.train import DistributedTrainer, TrainConfig
from spmdgt.train._batches import loss_token_rule
from spmdgt.train._config import ParallelismConfig
from tests._dist import run_ranks
from tests._hf import plain_sgd, tiny_bert, tiny_llama, tiny_t5
from tests.train.test_hf_dist import EX

ROWS, SEQ, STEPS, LR, VOCAB = 2, 12, 3, 0.5, 128  # rows per micro-batch, tokens per row


# heads that compute CrossEntropyLoss() themselves (the trainer recomputes their loss):
# tests/train/test_hf_own_loss_dist.py; a class per vocabulary id, so the batches' labels fit
OWN_CE = {
    "t5": lambda: tiny_t5(seed=0),
    "bert-mlm": lambda: tiny_bert("BertForMaskedLM"),
    "bert-tok": lambda: tiny_bert("BertForTokenClassification", num_labels=VOCAB),
}


def _model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        return tiny_llama(seed=0)
    if kind in OWN_CE:
        return OWN_CE[kind]()
    return EX.build_model(EX.parse_args(["--model", kind, "--seq-len", str(SEQ)]))


def _global_batches(world_rows: int) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of ``world_rows`` rows, each row right-padded with ``-100``
    labels (and attention mask 0) after its own length, 2 to ``SEQ`` tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (world_rows, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (world_rows,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _slice(batch: dict, rows: slice) -> dict:
    return {k: v[rows].clone() for k, v in batch.items()}


def _rank_batches(dp: int, dp_rank: int, accum: int) -> list[dict]:
    """This data-parallel rank's micro-batches, in order: micro-batch ``m`` of a step is
    rows ``(m * dp + dp_rank) * ROWS`` onwards of that step's global batch."""
    out = []
    for batch in _global_batches(dp * accum * ROWS):
        for m in range(accum):
            start = (m * dp + dp_rank) * ROWS
            out.append(_slice(batch, slice(start, start + ROWS)))
    return out


def reference(kind: str, world_rows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain HF: one forward per step on the whole global batch (HF's mean over
    every label token of it), SGD. Returns the losses and the final parameters."""
    torch.set_num_threads(1)
    return plain_sgd(_model(kind), _global_batches(world_rows), LR)


def _params(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().clone()
    return out


def train(rank, world, kind, config, accum, count=True):
    """The trainer on this rank's micro-batches; ``count=False``: the old loop (a mean of
    per-micro-batch means). Returns the logged losses and, on rank 0, the parameters."""
    torch.set_num_threads(1)
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = DistributedTrainer(
        model, opt, config=config, gradient_accumulation_steps=accum, log_every=100
    )
    if not count:
        trainer._loss_tokens = None
    batches = _rank_batches(trainer.data_parallel_size, trainer.data_parallel_rank, accum)
    losses = trainer.train(batches)["losses"]
    params = _params(trainer)  # collective under FSDP / TP: every rank
    return losses, params if rank == 0 else None


def _assert_equal_to_reference(results, ref):
    ref_losses, ref_params = ref
    for losses, _ in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5
        )
    params = results[0][1]
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], atol=1e-5, rtol=1e-5, msg=name)


def _max_diff(results, ref) -> tuple[float, float]:
    losses = max(abs(a - b) for a, b in zip(results[0][0], ref[0]))
    params = max((p - ref[1][n]).abs().max().item() for n, p in results[0][1].items())
    return losses, params


CASES = {
    "ddp2-llama": (2, "llama", TrainConfig(strategy="ddp"), 1),
    "fsdp2-llama": (2, "llama", TrainConfig(strategy="fsdp"), 1),
    "fsdp2-qwen3": (2, "qwen3", TrainConfig(strategy="fsdp"), 1),
    "ddp3-accum2-llama": (3, "llama", TrainConfig(strategy="ddp"), 2),
    "hsdp2-llama": (
        2,
        "llama",
        TrainConfig(strategy="fsdp", parallelism=ParallelismConfig(dp_replicate=2, dp_shard=1)),
        1,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_hf_loss_is_the_global_token_mean(tmp_path, case):
    world, kind, config, accum = CASES[case]
    results = run_ranks(train, world, tmp_path, kind, config, accum, timeout=240)
    _assert_equal_to_reference(results, reference(kind, world * accum * ROWS))


def test_one_process_accumulation_is_the_global_token_mean():
    # a world of one: the two micro-batches' token mean, not the mean of their means
    results = [train(0, 1, "llama", TrainConfig(), 2)]
    _assert_equal_to_reference(results, reference("llama", 2 * ROWS))


def _llama_table() -> str:
    """The example's tensor-parallel plan: ``auto``, derived from Llama's own
    ``base_model_tp_plan`` (``examples/train_hf.yaml``)."""
    table = EX._train_config(EX.parse_args([])).placements
    assert table == "auto", table
    return table


def test_tensor_parallel_accumulation_is_the_global_token_mean(tmp_path):
    # placements: every rank reads the same batch (data-parallel size 1), the loss is the
    # DTensor path's; only the accumulation's micro-batches have different counts
    config = TrainConfig(strategy="placements", placements=_llama_table())
    results = run_ranks(train, 2, tmp_path, "llama", config, 2, timeout=240)
    _assert_equal_to_reference(results, reference("llama", 2 * ROWS))


def test_fsdp_x_tp_counts_the_data_parallel_ranks_only(tmp_path):
    # 4 ranks as dp_shard 2 x tp 2, accumulation 2: the two TP ranks of a data group share
    # its batch, so the count is over the 2 data groups (the world's sum / tp), not 4 ranks
    config = TrainConfig(
        strategy="fsdp", placements=_llama_table(), parallelism=ParallelismConfig(tp=2)
    )
    results = run_ranks(train, 4, tmp_path, "llama", config, 2, timeout=240)
    _assert_equal_to_reference(results, reference("llama", 2 * 2 * ROWS))


def test_the_mean_of_means_differs(tmp_path):
    # the data is uneven enough to tell: the old loop (no count) misses the reference
    ref = reference("llama", 2 * ROWS)
    results = run_ranks(train, 2, tmp_path, "llama", TrainConfig(strategy="ddp"), 1, False)
    loss_diff, param_diff = _max_diff(results, ref)
    assert loss_diff > 1e-3 and param_diff > 1e-3, (loss_diff, param_diff)


def test_a_model_whose_loss_takes_no_count_says_so_and_keeps_the_mean_of_means():
    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    model.accepts_loss_kwargs = False  # as some HF models declare: no num_items_in_batch
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM's loss .* num_items_in_batch"):
        trainer = DistributedTrainer(model, opt, gradient_accumulation_steps=2, log_every=100)
    losses = trainer.train(_rank_batches(1, 0, 2))["losses"]
    ref = reference("llama", 2 * ROWS)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref)) > 1e-3  # today's mean of means


def _without_labels(rank, world):
    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    trainer = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    batches = _rank_batches(world, rank, 1)
    if rank == 1:  # one rank's first batch lacks its labels
        del batches[0]["labels"]
    try:
        trainer.train(batches)
    except ValueError as e:
        return str(e)
    return None


def test_a_batch_without_labels_is_the_same_error_on_every_rank(tmp_path):
    errors = run_ranks(_without_labels, 2, tmp_path)
    assert errors[0] is not None and errors[0] == errors[1]
    assert "1 micro-batch(es) of this step's global batch have no 'labels'" in errors[0]


def test_which_models_get_the_count():
    import transformers as T

    from tests._hf import tiny_gpt2

    assert loss_token_rule(tiny_llama()) == "shifted"  # labels[..., 1:] != -100
    assert loss_token_rule(tiny_gpt2()) == "shifted"
    assert loss_token_rule(_model("qwen3")) == "shifted"
    cfg = T.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    # BertForMaskedLM takes **kwargs but computes CrossEntropyLoss() itself: a count passed
    # would be ignored, so the trainer recomputes its loss from the logits instead
    assert loss_token_rule(T.BertForMaskedLM(cfg)) == "logits"
    assert loss_token_rule(T.BertForTokenClassification(cfg)) == "logits"  # the same
    assert loss_token_rule(tiny_t5()) == "logits"  # CE of lm_logits vs labels, unshifted
    # three losses by problem type, or two terms added: not one token mean, kept as they are
    assert loss_token_rule(T.BertForSequenceClassification(cfg)) is None
    assert loss_token_rule(T.BertForPreTraining(cfg)) is None
    assert loss_token_rule(torch.nn.Linear(2, 2)) is None
