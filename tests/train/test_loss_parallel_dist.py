"""Loss parallel: ``placements: auto`` splits a causal LM's output layer over the vocabulary
(``loss_parallel``) when the loss is the model's own token cross-entropy, and the trainer
runs forward, loss and backward under torch's ``loss_parallel``: no rank holds a row's whole
logits, and the numbers are one process's.

Tiny Llama, vocabulary 128 (64 per rank on 2), 3 steps of 2 micro-steps with ``-100``
labels spread unevenly over the rows (so the step's global token count, not each
micro-batch's mean, is what one process divides by); losses and final weights within 1e-5 of
one plain HF process on the global batch. What is left whole, and why: a user ``loss_fn``
(it may read the logits any way), a tied head (one parameter, read whole by the embedding),
a vocabulary that does not divide over the ranks (said in the printed table).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it
import torch.nn.functional as F

from spmdgt.train import TrainConfig, derive_placements, dry_run
from spmdgt.train._loss import LossRule
from spmdgt.train._tp_plan import LOSS_PARALLEL, resolve_placements
from tests._dist import run_ranks
from tests._hf import plain_sgd, tiny_hf

STEPS, ACCUM, ROWS, SEQ, LR = 3, 2, 6, 8, 0.2


def _batches() -> list[dict]:
    """STEPS global batches of ROWS rows; some labels -100, more in some rows than others."""
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        ids = torch.randint(3, 128, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[step % ROWS, 2:] = -100  # one row mostly ignored, a different one each step
        labels[(step + 3) % ROWS, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One plain HF process on each global batch: its loss is the global token mean."""
    return plain_sgd(tiny_hf("llama"), _batches(), LR)


def _train(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainingConfig

    torch.set_num_threads(1)
    model = tiny_hf("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cfg = TrainConfig(
        strategy="placements",
        placements="auto",
        training=TrainingConfig(gradient_accumulation_steps=ACCUM),
    )
    trainer = DistributedTrainer(model, opt, config=cfg, log_every=1)
    rows = [{k: v[i] for k, v in b.items()} for b in _batches() for i in range(ROWS)]
    loader = OptimizedDataLoader.create(rows, ROWS // ACCUM, shuffle=False)
    losses = trainer.train(loader, epochs=1)["losses"]
    head = trainer.model.lm_head.weight
    with torch.no_grad():
        logits = trainer.model(input_ids=_batches()[0]["input_ids"]).logits
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    return {
        "losses": losses,
        "weights": weights,
        "table": trainer.config.placements,
        "split": trainer.wrapped.loss_parallel,
        "head": (str(head.placements), tuple(head.to_local().shape)),
        "logits": (
            type(logits).__name__,
            str(getattr(logits, "placements", None)),
            tuple(logits.to_local().shape) if isinstance(logits, DTensor) else None,
        ),
    }


def test_the_head_is_split_and_the_numbers_are_one_process(tmp_path):
    want_losses, want_weights = _reference()
    results = run_ranks(_train, 2, tmp_path, timeout=240)
    for rank, r in enumerate(results):
        assert r["table"]["lm_head"] == LOSS_PARALLEL and r["split"], rank
        assert r["head"] == ("(Shard(dim=0),)", (64, 64)), rank
        # the logits stay split over the vocabulary: this rank's 64 of 128 per token
        assert r["logits"] == ("DTensor", "(Shard(dim=2),)", (ROWS, SEQ, 64)), rank
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(want_losses), atol=1e-5, rtol=0
        )
        for n, w in r["weights"].items():
            torch.testing.assert_close(w, want_weights[n], atol=1e-5, rtol=0, msg=f"{n} r{rank}")
    # the steps moved the head (a loop that did nothing would match an untrained reference)
    start = tiny_hf("llama").lm_head.weight
    assert (want_weights["lm_head.weight"] - start).abs().max() > 1e-3


def test_what_stays_whole():
    llama = tiny_hf("llama")
    rule = LossRule(llama, None)
    assert rule.splits_logits
    assert derive_placements(llama, loss_parallel=True)[0]["lm_head"] == LOSS_PARALLEL
    # a loss_fn may read the logits any way: the head stays whole
    assert not LossRule(llama, F.cross_entropy).splits_logits
    assert "lm_head" not in derive_placements(llama)[0]
    # a tied head is the embedding's weight, read whole by the lookup
    gemma = tiny_hf("gemma3")
    assert gemma.lm_head.weight is gemma.get_input_embeddings().weight
    assert LOSS_PARALLEL not in derive_placements(gemma, loss_parallel=True)[0].values()


def test_a_vocabulary_that_does_not_divide_is_kept_whole_and_said(capsys):
    llama = tiny_hf("llama")
    table = resolve_placements(llama, "auto", tp=3, loss_parallel=True)
    assert "lm_head" not in table
    said = capsys.readouterr().out
    assert "lm_head kept whole: its 128 outputs do not divide over 3 ranks" in said
    assert resolve_placements(llama, "auto", tp=2, loss_parallel=True)["lm_head"] == LOSS_PARALLEL


@pytest.mark.parametrize("vocab", [4096])
def test_the_dry_run_holds_half_the_logits(vocab):
    """TP 2 of a Llama whose logits dwarf its activations: the dry run's peak with the head
    split is at least a third of the whole logits' bytes (and their gradient) under the peak
    with it whole (the same table less the head's row)."""

    def build():
        model = tiny_hf("llama", vocab_size=vocab)
        ids = torch.randint(3, vocab, (8, 32))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"input_ids": ids, "labels": ids}

    table, _ = derive_placements(tiny_hf("llama", vocab_size=vocab), loss_parallel=True)
    whole = {p: s for p, s in table.items() if s != LOSS_PARALLEL}
    split = dry_run(build, 2, TrainConfig(strategy="placements", placements="auto"))
    kept = dry_run(build, 2, TrainConfig(strategy="placements", placements=whole))
    logits = 8 * 32 * vocab * 4
    assert split.peak < kept.peak - logits / 3, (split.peak, kept.peak, logits)


def test_the_plan_says_the_head_is_split():
    from spmdgt.train._plan import _space, device_spec
    from spmdgt.train._plan._model import read_model

    llama = tiny_hf("llama")
    ids = torch.zeros(2, 16, dtype=torch.long)
    facts = read_model(llama, {"input_ids": ids, "labels": ids}, loss_parallel=True)
    assert facts.loss_parallel and facts.tp_table["lm_head"] == LOSS_PARALLEL
    _, notes = _space(facts, device_spec("h100"), 2, 4, None, (False,), (False,), ("fsdp",))
    assert any("LM head split over the vocabulary (loss_parallel)" in n for n in notes)
    # the head's weight is split with the layers': TP's bytes count its 128 x 64 floats
    assert facts.tp_bytes - read_model(llama, {"input_ids": ids}).tp_bytes == 128 * 64 * 4
