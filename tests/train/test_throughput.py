"""Throughput figures in every run: the FLOP rule, the peak's source, and the summary's
per-device tokens/s, TFLOP/s, MFU and data-wait share computed from the run's own times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spmdgt.train import DistributedTrainer, OptimizedDataLoader
from spmdgt.train._throughput import Throughput, _probe, flop_model, peak_flops


class _LM(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_flop_rule_counts_multiplying_parameters_and_attention():
    untied, tied = flop_model(_LM(tie=False)), flop_model(_LM(tie=True))
    mid, head = 8 * 8 + 8, 50 * 8
    assert untied.params == mid + head  # the lookup table does no arithmetic
    assert tied.params == mid + head  # the tied table is the head's weight: it multiplies
    assert untied.per_step(samples=4, tokens=0) == 4 * 6 * (mid + head)
    assert untied.per_step(samples=2, tokens=32) == 32 * 6 * (mid + head)  # no layer count
    assert "attention omitted" in untied.describe(2, 32)

    import transformers  # the dev extra installs it

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    llama = flop_model(transformers.LlamaForCausalLM(cfg))
    assert (llama.layers, llama.width) == (3, 32)
    n = llama.params
    assert llama.per_step(samples=2, tokens=2 * 16) == 32 * (6 * n + 12 * 3 * 32 * 16)
    assert "L=3, d=32, T=16" in llama.describe(2, 32)


def test_peak_from_the_table_or_a_probe_and_says_which(monkeypatch):
    _probe.cache_clear()
    rng = torch.get_rng_state()
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream is untouched
    assert peak > 1e6 and source.startswith("measured: 512^3 float32 matmul on cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    peak, source = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == 989.4e12 and source == "table: NVIDIA H100 80GB HBM3, torch.bfloat16 dense"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16)[0] == 756e12


def test_figures_are_per_device():
    tp = Throughput(_LM(tie=False), torch.device("cpu"), torch.float32, world_size=2)
    tp._peak = (1e12, "test")
    f = tp.figures(samples=4, tokens=64, seconds=0.5)
    flops = tp.flops.per_step(4, 64)
    assert f["tokens_per_sec_per_device"] == 64 / 0.5 / 2
    assert f["tflops_per_device"] == pytest.approx(flops / 0.5 / 2 / 1e12)
    assert f["mfu"] == pytest.approx(flops / 0.5 / 2 / 1e12)


def test_the_summary_reports_throughput_from_its_own_times():
    torch.manual_seed(0)
    model = _LM(tie=True)
    ids = torch.randint(0, 50, (40, 12))
    data = [(ids[i], ids[i]) for i in range(40)]

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    trainer = DistributedTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    s = trainer.train(OptimizedDataLoader.create(data, 4, shuffle=False))
    steps = s["num_steps"] - s["warmup_steps_excluded"]
    seconds = s["avg_step_time"] * steps
    flops = trainer.throughput.flops.per_step(4 * steps, 4 * 12 * steps)
    assert s["tokens_per_sec_per_device"] == pytest.approx(s["throughput_tokens_per_sec"])
    assert s["tflops_per_device"] == pytest.approx(flops / seconds / 1e12)
    assert s["mfu"] == pytest.approx(s["tflops_per_device"] / s["peak_tflops_per_device"])
    assert s["peak_flops_source"].startswith("measured: ")
    assert s["flops_estimate"].startswith("6N per token (N=")
    assert 0 < s["data_wait_share"] < 1
