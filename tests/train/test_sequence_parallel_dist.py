"""Sequence parallelism: ``placements: auto`` with ``parallelism.sequence_parallel`` splits the
residual stream between the tensor-parallel layers over the sequence, and the numbers are one
process's.

Tiny Llama, 3 steps of 2 micro-steps with ``-100`` labels spread unevenly, a sequence of 9
tokens (5 + 4 on 2 ranks, 3 + 3 + 3 on 3: uneven and even splits), clipping on, its head
split for the loss: losses and final weights within 1e-5 of one plain HF process on the
global batch, on 2 and 3 ranks and under activation checkpointing (each block saves its
split input). Every tiny family whose table takes it (Gemma3 with its tied head whole and
four norms a block, Qwen3 with per-head norms inside the split attention, GPT-NeoX's
parallel residual, ViT from its module tree) against one process; the example's own
decoder; what it refuses, and why; the dry run's checkpointed bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it

from spmdgt.config import ConfigError
from spmdgt.train import TrainConfig, derive_placements, dry_run
from spmdgt.train._config import ParallelismConfig
from tests._dist import run_ranks
from tests._hf import tiny_hf

STEPS, ACCUM, ROWS, SEQ, LR, CLIP = 3, 2, 6, 9, 0.2, 0.5


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        ids = torch.randint(3, 128, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[step % ROWS, 2:] = -100
        labels[(step + 3) % ROWS, :4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(family: str, sizes: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One plain HF process, SGD with the gradient norm clipped as the trainer does."""
    model = tiny_hf(family, **sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, family: str, sizes: dict, ac: bool) -> dict:
    from torch.distributed.tensor import DTensor

    from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainingConfig

    torch.set_num_threads(1)
    model = tiny_hf(family, **sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cfg = TrainConfig(
        strategy="placements",
        placements="auto",
        activation_checkpointing=ac,
        parallelism=ParallelismConfig(sequence_parallel=True),
        training=TrainingConfig(gradient_accumulation_steps=ACCUM, max_grad_norm=CLIP),
    )
    trainer = DistributedTrainer(model, opt, config=cfg, log_every=2)
    seen = []  # the local stream each block's first norm reads
    norm = next(
        m
        for n, m in trainer.model.named_modules()
        if "layers.1." in n and n.endswith("input_layernorm")  # under AC inside its wrapper
    )
    norm.register_forward_hook(
        lambda m, args, out: seen.append((type(args[0]).__name__, tuple(args[0].to_local().shape)))
    )
    rows = [{k: v[i] for k, v in b.items()} for b in _batches() for i in range(ROWS)]
    loader = OptimizedDataLoader.create(rows, ROWS // ACCUM, shuffle=False)
    losses = trainer.train(loader, epochs=1)["losses"]
    weights = {  # named as in the plain model (activation checkpointing wraps each block)
        n.replace("._checkpoint_wrapped_module", ""): (
            p.full_tensor() if isinstance(p, DTensor) else p
        )
        .detach()
        .clone()
        for n, p in trainer.model.named_parameters()
    }
    return {"losses": losses, "weights": weights, "table": trainer.config.placements, "seen": seen}


CASES = {
    "llama": ("llama", {}, False, 2),
    "llama-3-ranks": ("llama", {"hidden_size": 48, "num_attention_heads": 6,
                                "num_key_value_heads": 3, "intermediate_size": 96,
                                "vocab_size": 129}, False, 3),
    "llama-ac": ("llama", {}, True, 2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_stream_is_split_and_the_numbers_are_one_process(case, tmp_path):
    family, sizes, ac, world = CASES[case]
    want_losses, want_weights = _reference(family, sizes)
    results = run_ranks(_train, world, tmp_path, family, sizes, ac, timeout=300)
    tokens = [len(c) for c in torch.arange(SEQ).tensor_split(world)]
    for rank, r in enumerate(results):
        table = r["table"]
        assert table[next(p for p in table if p.endswith("layers.0"))] == "sequence_split"
        # the norm reads this rank's tokens alone: 9 split 5 + 4 or 3 + 3 + 3
        assert set(r["seen"]) == {("DTensor", (ROWS // ACCUM, tokens[rank], sizes.get(
            "hidden_size", 64)))}, (rank, r["seen"][:2])  # fmt: skip
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(want_losses), atol=1e-5, rtol=0
        )
        for n, w in r["weights"].items():
            torch.testing.assert_close(w, want_weights[n], atol=1e-5, rtol=0, msg=f"{n} r{rank}")
    start = dict(tiny_hf(family, **sizes).named_parameters())
    moved = max((want_weights[n] - p).abs().max().item() for n, p in start.items())
    assert moved > 1e-3


def _families(rank: int, world: int, names: list[str]) -> dict:
    from tests.train.test_hf_tp_auto_dist import train_auto

    torch.set_num_threads(1)
    cfg = TrainConfig(
        strategy="placements",
        placements="auto",
        parallelism=ParallelismConfig(sequence_parallel=True),
    )
    return {name: train_auto(name, cfg) for name in names}


def test_which_families_it_splits():
    """Every tiny HF family whose table takes the split (their HF plans, ViT's module tree);
    the others refuse it, naming why."""
    from tests._hf import TINY

    split, refused = [], []
    for name in [*TINY, "t5", "vit"]:
        try:
            derive_placements(tiny_hf(name), loss_parallel=True, sequence_parallel=True)
            split.append(name)
        except ConfigError:
            refused.append(name)
    assert split == ["llama", "qwen3", "mistral", "gemma3", "gpt_neox", "vit"]
    assert refused == ["phi3", "olmo2", "mixtral", "t5"]  # gathered heads, a router


# Llama trains split in the tests above; Mistral's blocks are Llama's: both under -m slow
SPLIT = ["qwen3", "gemma3", "gpt_neox", "vit"]


@pytest.mark.parametrize(
    "names",
    [SPLIT, pytest.param(["llama", "mistral"], marks=pytest.mark.slow)],
    ids=["four", "llama-mistral"],
)
def test_every_family_it_splits_trains_as_one_process(tmp_path, names):
    """Each family that takes the split, on 2 ranks under SGD: losses and weights within
    1e-5 of one process (the harness of ``test_hf_tp_auto_dist.py``)."""
    from tests.train.test_hf_tp_auto_dist import assert_like_one_process

    results = run_ranks(_families, 2, tmp_path, names, timeout=400)
    assert_like_one_process(results, names)


def test_the_rows_it_derives():
    llama = tiny_hf("llama")
    table, _ = derive_placements(llama, loss_parallel=True, sequence_parallel=True)
    assert table["model.layers.0"] == "sequence_split"
    for name in ("self_attn", "mlp"):
        assert table[f"model.layers.*.{name}"] == "sequence_gather"
    for name in ("input_layernorm", "post_attention_layernorm"):
        assert table[f"model.layers.*.{name}"] == "sequence_parallel"
    assert table["model.layers.*.self_attn.o_proj"] == "rowwise_scatter"
    assert table["model.layers.*.mlp.down_proj"] == "rowwise_scatter"
    assert table["model.norm"] == "sequence_parallel_gather"
    assert "rowwise" not in table.values()
    # without the flag the table is plain tensor parallelism's
    assert "sequence_split" not in derive_placements(llama)[0].values()
    gemma = derive_placements(tiny_hf("gemma3"), sequence_parallel=True)[0]
    norms = [p for p, s in gemma.items() if s == "sequence_parallel"]
    assert len(norms) == 4, norms  # Gemma3's pre and post norms around both sub-blocks


@pytest.mark.parametrize(
    "family, why",
    [
        ("mixtral", "holds experts layers"),  # a router reads the stream inside the MoE block
        ("olmo2", "holds colwise_gather layers"),  # q/k norms over all heads: gathered heads
    ],
)
def test_what_it_refuses_and_why(family, why):
    with pytest.raises(ConfigError, match=why) as err:
        derive_placements(tiny_hf(family), sequence_parallel=True)
    assert err.value.key == "parallelism.sequence_parallel"
    assert "turn sequence_parallel off" in str(err.value)


def test_a_hand_table_names_its_rows_itself():
    with pytest.raises(ConfigError, match="a hand table names them itself"):
        TrainConfig(
            strategy="placements",
            placements={"layers.*.up": "colwise"},
            parallelism=ParallelismConfig(sequence_parallel=True),
        )


def test_the_dry_run_holds_the_checkpointed_stream_split():
    """TP 2 under activation checkpointing, a long sequence: each block saves its input, the
    residual stream, whole on every rank without sequence parallelism and half with it."""

    def build():
        model = tiny_hf("llama", num_hidden_layers=2)
        ids = torch.randint(3, 128, (8, 64))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"input_ids": ids, "labels": ids}

    def run(sp: bool):
        cfg = TrainConfig(
            strategy="placements",
            placements="auto",
            activation_checkpointing=True,
            parallelism=ParallelismConfig(sequence_parallel=sp),
        )
        return dry_run(build, 2, cfg)

    split, whole = run(True), run(False)
    saved = 2 * 8 * 64 * 64 * 4  # 2 blocks' inputs, 8 x 64 tokens x 64 floats
    # at least half of them (2.06 MiB against 2.45: the norms' and the loss's bytes split too)
    assert split.peak < whole.peak - saved / 2, (split.peak, whole.peak, saved)


def _example_losses(rank: int, world: int, argv: list[str]) -> list[float]:
    from tests.train.test_plan import _example

    torch.set_num_threads(1)
    ex = _example()
    return ex.run_trainer(ex.parse_args(argv))["losses"]


def test_a_model_of_its_own_trains_split_as_one_process(tmp_path):
    """Not only HF: the example's decoder (its table from the module tree: ``attn_norm``,
    ``attn`` with per-head ``q_norm``/``k_norm``, ``mlp_norm``, ``mlp``, a final ``norm``)
    under ``placements: auto`` with the stream split, 2 ranks against one process."""
    from tests.train.test_plan import TINY, _example

    path = tmp_path / "sp.yaml"
    path.write_text(
        "strategy: placements\nplacements: auto\nparallelism: {sequence_parallel: true}\n"
    )
    argv = [*TINY, "--steps", "3", "--workers", "0", "--lr", "0.05", "--batch-size", "4"]
    got = run_ranks(_example_losses, 2, tmp_path, [*argv, "--config", str(path)])
    ex = _example()
    ref = ex.run_trainer(ex.parse_args([*argv, "--strategy", "ddp"]))["losses"]
    assert got[0] == got[1] and len(ref) == 3
    assert got[0] == pytest.approx(ref, rel=1e-5)


def test_the_split_runs_outside_the_first_blocks_checkpoint():
    """Inside the checkpoint the first block would save its input whole on every rank; on
    its wrapper the split comes first and the checkpoint saves this rank's tokens (the dry
    run at 4 blocks: 2.25 MiB, 2.37 with the split inside)."""
    from spmdgt.train._strategies import apply_ac
    from spmdgt.train._tp_sequence import SequenceSplit

    model = tiny_hf("llama")
    first = model.model.layers[0]
    SequenceSplit()._apply(first, None)  # the mesh is read only when the hook runs
    assert len(first._forward_pre_hooks) == 1
    apply_ac(model)
    wrapper = model.model.layers[0]
    assert wrapper._checkpoint_wrapped_module is first
    assert len(first._forward_pre_hooks) == 0 and len(wrapper._forward_pre_hooks) == 1


def _resumable(rank: int, world: int, ckpt: str, sp: bool, max_steps: int) -> list[float]:
    """Tiny Llama under SGD, a checkpoint every 2 steps in ``ckpt`` (resumed when there)."""
    from spmdgt.train import (
        CheckpointConfig,
        DistributedTrainer,
        OptimizedDataLoader,
        TrainingConfig,
    )

    torch.set_num_threads(1)
    model = tiny_hf("llama")
    cfg = TrainConfig(
        strategy="placements" if sp else "ddp",
        placements="auto" if sp else {},
        parallelism=ParallelismConfig(sequence_parallel=sp),
        checkpoint=CheckpointConfig(dir=ckpt, every_steps=2),
        training=TrainingConfig(max_steps=max_steps),
    )
    trainer = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=LR), config=cfg)
    rows = [{k: v[i] for k, v in b.items()} for b in _batches() for i in range(ROWS)] * 2
    loader = OptimizedDataLoader.create(rows, ROWS, shuffle=False)
    return trainer.train(loader, epochs=1)["losses"]


def test_a_checkpoint_saved_split_resumes_in_one_process(tmp_path):
    """Saved on 2 ranks with the stream split (its norms' weights replicated DTensors), at
    step 2; resumed by one plain process for steps 3 and 4: the losses are the uninterrupted
    one-process run's."""
    want = _resumable(0, 1, str(tmp_path / "whole"), False, 4)
    run_ranks(_resumable, 2, tmp_path, str(tmp_path / "split"), True, 2)
    resumed = _resumable(0, 1, str(tmp_path / "split"), False, 4)
    assert len(want) == 4 and len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(want[2:]), atol=1e-5, rtol=0)
