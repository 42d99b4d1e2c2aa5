"""The models ``benchmarks/plan.py`` plans and trains: the example decoder and Hugging Face
GPT-2 and Llama at two sizes each, built from configs (nothing downloaded), tiny enough for 4
gloo ranks on 2 shared cores.

Each trains through its example script as a user runs it with the planner's YAML
(``--config``, nothing else changed): the decoder through ``examples/train_transformer.py``
(its loader's batch is the YAML's ``training.batch_size``), the HF models through
``examples/train_hf.py`` (``--global-batch`` split over the data-parallel ranks and the YAML's
accumulation steps; the model's own loss).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from benchmarks._example import load_script

SEQ = 32
VOCAB = 128


@dataclass(frozen=True)
class BenchModel:
    """One model of the benchmark: the example script that trains it and its flags."""

    name: str
    script: str  # "train_transformer" or "train_hf"
    flags: tuple[str, ...]
    micro_batches: tuple[int, ...] | None = None
    """Micro-batches to search (None: the benchmark's ``--micro-batches``)."""

    @property
    def hf(self) -> bool:
        return self.script == "train_hf"

    def module(self):
        """The example script, loaded once per process."""
        return sys.modules.get(self.script) or load_script(self.script)

    def build(self) -> torch.nn.Module:
        mod = self.module()
        return mod.build_model(mod.parse_args(list(self.flags)))

    def batch(self, rows: int) -> object:
        """One micro-batch as the trainer's loop takes it (the planner's calibration)."""
        ids = torch.zeros(rows, SEQ, dtype=torch.long)
        if self.hf:  # train_hf's rows: HF's dict, labels are the inputs (the model shifts)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return (ids, ids)

    def loss_fn(self):
        """The decoder's loss; HF models train on the loss they return (``None``)."""
        return None if self.hf else self.module().lm_loss

    def argv(self, yaml_path: str, steps: int, global_batch: int) -> list[str]:
        """The example's command line for the planner's YAML."""
        run = ["--config", yaml_path, "--steps", str(steps)]
        if self.hf:
            return [*self.flags, *run, "--global-batch", str(global_batch), "--log-every", "100"]
        return [*self.flags, *run, "--workers", "0"]

    def train(self, yaml_path: str, steps: int, global_batch: int) -> dict:
        """One rank's run of the example with the YAML: the trainer's summary."""
        mod = self.module()
        return mod.run_trainer(mod.parse_args(self.argv(yaml_path, steps, global_batch)))


def _hf(model: str, dim: int, layers: int, heads: int, kv: int) -> tuple[str, ...]:
    flags = ["--model", model, "--dim", str(dim), "--layers", str(layers), "--heads", str(heads)]
    if model != "gpt2":
        flags += ["--kv-heads", str(kv)]
    return (*flags, "--vocab", str(VOCAB), "--seq-len", str(SEQ))


_DECODER = ("--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "32")
MODELS = {
    m.name: m
    for m in (
        BenchModel("decoder", "train_transformer", _DECODER),
        # GPT-2 offers no TP (Conv1D layers): micro-batches 2 and 4 give it about as many
        # candidates as the others at 4 alone
        BenchModel("gpt2-s", "train_hf", _hf("gpt2", 64, 2, 4, 4), (2, 4)),
        BenchModel("gpt2-m", "train_hf", _hf("gpt2", 128, 4, 4, 4), (2, 4)),
        BenchModel("llama-s", "train_hf", _hf("llama", 64, 2, 4, 2)),
        BenchModel("llama-m", "train_hf", _hf("llama", 128, 4, 8, 4)),
    )
}
