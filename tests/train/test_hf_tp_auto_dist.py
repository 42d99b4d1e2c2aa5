"""``placements: auto``: tensor parallelism for Hugging Face models with no table written.

Ten tiny HF families (Llama, Qwen3, Mistral, Gemma3, Phi3, Olmo2, GPT-NeoX, Mixtral: their
config's ``base_model_tp_plan``; T5 and ViT: no plan, the module tree) train on 2 ranks with
``strategy: placements, placements: auto`` under SGD, and every step's loss and every final
weight equal one plain HF process's within 1e-5. Each run_ranks call trains several models
(the process start is paid once); the references are computed here, in the test process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it

from spmdgt.config import ConfigError
from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig, override
from tests._dist import run_ranks
from tests._hf import plain_sgd, tiny_batches, tiny_hf

STEPS, LR = 3, 0.2


def _rows(name: str) -> list[dict]:
    """The batches as per-row items (the loader batches them back, in order)."""
    return [
        {k: v[i] for k, v in batch.items()}
        for batch in tiny_batches(name, STEPS)
        for i in range(len(next(iter(batch.values()))))
    ]


def reference(name: str, **sizes: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One plain HF process: every step's loss and the final weights."""
    return plain_sgd(tiny_hf(name, **sizes), tiny_batches(name, STEPS), LR)


def train_auto(
    name: str, config: TrainConfig, **sizes: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The trainer under ``config`` (every rank): its losses and its final weights whole
    (DTensor parameters gathered: a collective, in the same order on every rank)."""
    model = tiny_hf(name, **sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = DistributedTrainer(model, opt, config=config, log_every=1)
    rows = _rows(name)
    loader = OptimizedDataLoader.create(
        rows,
        len(rows) // STEPS // trainer.data_parallel_size,
        shuffle=False,
        num_replicas=trainer.data_parallel_size,
        rank=trainer.data_parallel_rank,
    )
    losses = trainer.train(loader, epochs=1)["losses"]
    weights = {}
    for n, p in trainer.model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        weights[n] = p.detach().clone()
    return losses, weights


def _ranks_train(rank: int, world: int, names: list[str], sizes: dict | None = None) -> dict:
    torch.set_num_threads(1)
    cfg = TrainConfig(strategy="placements", placements="auto")
    return {name: train_auto(name, cfg, **(sizes or {})) for name in names}


def assert_like_one_process(
    results: list[dict], names: list[str], sizes: dict | None = None
) -> dict[str, tuple]:
    """Every rank's losses and weights within 1e-5 of one process; the largest differences."""
    worst = {}
    for name in names:
        ref_losses, ref_weights = reference(name, **(sizes or {}))
        dl = dw = 0.0
        for rank, per in enumerate(results):
            losses, weights = per[name]
            got, want = torch.tensor(losses), torch.tensor(ref_losses)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} r{rank}")
            dl = max(dl, float((got - want).abs().max()))
            assert set(weights) == set(ref_weights), name
            for n, w in weights.items():
                torch.testing.assert_close(
                    w, ref_weights[n], atol=1e-5, rtol=0, msg=f"{name} {n} r{rank}"
                )
                dw = max(dw, float((w - ref_weights[n]).abs().max()))
        assert ref_losses[-1] != ref_losses[0], name  # the steps changed the model
        worst[name] = (dl, dw)
    print({n: f"loss {a:.1e} weight {b:.1e}" for n, (a, b) in worst.items()})
    return worst


GROUPS = {
    "plan-dense": ["llama", "qwen3", "mistral", "gemma3"],
    "plan-packed-gathered": ["phi3", "olmo2", "gpt_neox", "mixtral"],
    "tree": ["t5", "vit"],
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_placements_auto_on_two_ranks_equals_one_process(tmp_path, group, capfd):
    names = GROUPS[group]
    results = run_ranks(_ranks_train, 2, tmp_path, names, timeout=400)
    assert_like_one_process(results, names)
    log = capfd.readouterr().out
    assert log.count("spmdgt.train: placements: auto, from ") == len(names)  # rank 0 only


# 6 query and 3 key/value heads of 8, FFN 96: every split divides by 3 ranks
THREE = {
    "hidden_size": 48,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 8,
    "intermediate_size": 96,
}


def test_placements_auto_on_three_ranks_equals_one_process(tmp_path):
    # Qwen3: per-head norms summed over 3 ranks; Olmo2: gathered attention, 3-way MLP
    names = ["qwen3", "olmo2"]
    results = run_ranks(_ranks_train, 3, tmp_path, names, THREE, timeout=400)
    assert_like_one_process(results, names, THREE)


L = "model.layers.*."
# Hand tables that cannot be exact: (model, table, the module the error names, what it says
# the module reads, the style the working table gives it)
REFUSED = {
    "phi3-packed-qkv": (
        "phi3",
        {
            L + "self_attn.qkv_proj": "colwise",
            L + "self_attn.o_proj": "rowwise",
            L + "mlp.gate_up_proj": "colwise",
            L + "mlp.down_proj": "rowwise",
        },
        "model.layers.0.self_attn.qkv_proj",
        "q, k and v side by side",
        ("model.layers.*.self_attn.qkv_proj", "colwise_gather"),
    ),
    "phi3-packed-gate-up": (
        "phi3",
        {L + "mlp.gate_up_proj": "colwise", L + "mlp.down_proj": "rowwise"},
        "model.layers.0.mlp.gate_up_proj",
        "gate then up",
        ("model.layers.*.mlp.gate_up_proj", "packed_colwise"),
    ),
    "olmo2-norm-over-all-heads": (
        "olmo2",
        {
            L + "self_attn.[qkv]_proj": "colwise",
            L + "self_attn.o_proj": "rowwise",
            L + "self_attn.[qk]_norm": "sharded_input",  # the old docs' advice
            L + "mlp.[gu]*_proj": "colwise",
            L + "mlp.down_proj": "rowwise",
        },
        "model.layers.0.self_attn.q_norm",
        "the whole output of the colwise 'model.layers.0.self_attn.q_proj'",
        ("model.layers.*.self_attn.q_norm", "replicate"),
    ),
    "t5-global-head-count": (
        "t5",
        {
            "*.SelfAttention.[qkv]": "colwise",
            "*.SelfAttention.o": "rowwise",
            "*.relative_attention_bias": "replicate",  # the old error's suggestion
            "*.DenseReluDense.wi": "colwise",
            "*.DenseReluDense.wo": "rowwise",
        },
        "encoder.block.0.layer.0.SelfAttention",
        "reads the global head count (self.n_heads)",
        ("encoder.block.*.layer.*.SelfAttention.q", "colwise_gather"),
    ),
}


def _refusal(name: str, table: dict) -> ConfigError:
    """The trainer's error for ``table`` (in this process: a world of one checks the table
    as every rank does, before any shard is made or step run)."""
    model = tiny_hf(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ConfigError) as info:
        DistributedTrainer(model, opt, config=TrainConfig(strategy="placements", placements=table))
    return info.value


def _ranks_train_tables(rank: int, world: int, runs: dict) -> dict:
    torch.set_num_threads(1)
    return {
        case: train_auto(name, TrainConfig(strategy="placements", placements=table))
        for case, (name, table) in runs.items()
    }


def test_inexact_tables_are_refused_and_each_suggested_table_trains_exactly(tmp_path):
    fixes = {}
    for case, (name, table, module, reads, (pattern, style)) in REFUSED.items():
        err = _refusal(name, table)
        msg = str(err)
        assert f"cannot be exact for {module!r}" in msg and reads in msg, (case, msg)
        fix = err.suggested_placements
        assert fix[pattern] == style, (case, fix)
        assert f'"{pattern}": {style}' in msg  # the message prints the table it carries
        fixes[case] = (name, fix)
    # every suggestion trains, on 2 ranks, as one process does
    results = run_ranks(_ranks_train_tables, 2, tmp_path, fixes, timeout=400)
    per_case = [{case: r[case] for case in fixes} for r in results]
    for case, (name, _) in fixes.items():
        assert_like_one_process([{name: r[case]} for r in per_case], [name])


def _ranks_train_2d(rank: int, world: int, names: list[str]) -> dict:
    torch.set_num_threads(1)
    cfg = TrainConfig(strategy="fsdp", placements="auto")
    cfg = override(cfg, dp_shard=2, tp=2)
    return {name: train_auto(name, cfg) for name in names}


@pytest.mark.slow
def test_placements_auto_inside_tp_with_fsdp_over_data_equals_one_process(tmp_path):
    # 2x2 (dp_shard x tp): the derived table inside each tp pair, FSDP2 across them, each
    # data-parallel pair reading half of every step's rows. Qwen3: sharded_input norms under
    # FSDP; Olmo2: gathered attention beside a split MLP.
    names = ["qwen3", "olmo2"]
    results = run_ranks(_ranks_train_2d, 4, tmp_path, names, timeout=500)
    assert_like_one_process(results, names)
