"""HF models train with their key/value cache off (``_batches.call_model``), as HF's own
gradient checkpointing does. Left on under activation checkpointing, each recomputed block
appended its keys and values to the cache a second time: eager attention then raised (its
mask is for the sequence once), SDPA's causal attention gave the right values while the
cache kept every finished block's recomputed graph alive to the backward's end (3 x tokens
x width fp32 per block on Llama: ``test_plan_memory.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spmdgt.train import DistributedTrainer, TrainConfig
from spmdgt.train._batches import call_model
from tests._hf import plain_sgd, tiny_llama

STEPS, ROWS, SEQ, VOCAB, LR = 3, 3, 10, 128, 0.5


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_checkpointed_hf_llama_trains_as_one_plain_process(attention):
    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    model.config._attn_implementation = attention
    ref_losses, ref_params = plain_sgd(tiny_llama(seed=0), _batches(), LR)
    trainer = DistributedTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        config=TrainConfig(activation_checkpointing=True),
        log_every=100,
    )
    losses = trainer.train(_batches())["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for name, p in trainer.model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
        torch.testing.assert_close(p.detach(), ref_params[name], rtol=1e-5, atol=1e-5, msg=name)
    assert model.config.use_cache  # the user's config is left as it was


class _Recorder(nn.Module):
    """Records the ``use_cache`` it is called with."""

    def __init__(self, use_cache: bool | None) -> None:
        super().__init__()
        self.config = type("Config", (), {"use_cache": use_cache})()
        self.seen: list[object] = []

    def forward(self, input_ids, use_cache=None):
        self.seen.append(use_cache)
        return input_ids


class _NoCacheArgument(_Recorder):
    def forward(self, input_ids):
        self.seen.append("no use_cache")
        return input_ids


def test_the_cache_is_turned_off_only_where_the_model_has_one_and_the_batch_is_silent():
    ids = torch.zeros(1, 2)
    on = _Recorder(True)
    call_model(on, {"input_ids": ids})
    call_model(on, {"input_ids": ids, "use_cache": True})  # the batch's own word stands
    assert on.seen == [False, True]
    off, none, plain = _Recorder(False), _Recorder(None), _NoCacheArgument(True)
    for m in (off, none, plain):
        call_model(m, {"input_ids": ids})
    assert off.seen == [None] and none.seen == [None] and plain.seen == ["no use_cache"]
    for inner in (_Recorder(True), _NoCacheArgument(True)):
        wrapped = _Wrapper(inner)  # as DDP: the model is its ``module``
        call_model(wrapped, {"input_ids": ids})
        assert inner.seen == [False if type(inner) is _Recorder else "no use_cache"]


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
