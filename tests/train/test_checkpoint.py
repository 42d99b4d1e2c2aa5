"""Checkpoint/resume through DCP: bitwise resume, a different world size, crash-safe writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.nn.functional as F

import spmdgt.train._checkpoint as ckpt_mod
from spmdgt.train import (
    CheckpointConfig,
    DistributedTrainer,
    OptimizedDataLoader,
    SchedulerConfig,
    TrainConfig,
    TrainingConfig,
)
from spmdgt.train._checkpoint import find_latest
from tests._dist import run_ranks
from tests.train._models import (
    full_state,
    make_dataset,
    make_model,
    make_optimizer,
    reference_train,
)


def _config(strategy, ckpt_dir, every=0, dropout_sched=True):
    sched = (
        SchedulerConfig(type="cosine", warmup_steps=2, total_steps=12)
        if dropout_sched
        else SchedulerConfig()
    )
    return TrainConfig(
        strategy=strategy,
        training=TrainingConfig(max_grad_norm=0.5, scheduler=sched),
        checkpoint=CheckpointConfig(dir=ckpt_dir, every_steps=every),
    )


def _trainer(strategy, ckpt_dir, seed=0, dropout=0.1, every=0, sched=True):
    model = make_model(seed=seed, dropout=dropout)
    return DistributedTrainer(
        model,
        make_optimizer(model),
        loss_fn=F.mse_loss,
        config=_config(strategy, ckpt_dir, every, sched),
        strategy=strategy,
    )


def _resume_run(rank, world, root, strategy):
    # Dropout draws from the RNG, the cosine schedule moves the lr, the sampler shuffles per
    # epoch: every piece of state must come back for the resumed run to be bitwise equal.
    root = Path(root)
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=True, seed=7)
    torch.manual_seed(123)
    full = _trainer(strategy, None)
    full.train(loader, epochs=2)  # 48 samples / (4 x 2 ranks) = 6 steps per epoch
    ref_losses, ref_state = full.last_stats.global_losses, full_state(full.model)

    torch.manual_seed(123)
    first = _trainer(strategy, str(root / "ck"))
    first.train(loader, epochs=2, max_steps=8)  # stops mid-epoch 2, saves at the end
    torch.manual_seed(999)  # a different RNG and a different init: all must be overwritten
    second = _trainer(strategy, str(root / "ck"), seed=5)
    second.train(loader, epochs=2)
    return ref_losses, ref_state, first.last_stats.global_losses, second, full_state(second.model)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_is_bitwise(tmp_path, strategy):
    results = run_ranks(_resume_run_wrapped, 2, tmp_path, str(tmp_path), strategy)
    for ref_losses, ref_state, first_losses, second_losses, second_state, step in results:
        assert step == 12
        assert first_losses == ref_losses[:8]
        assert second_losses == ref_losses[8:]  # exact float equality: bitwise on CPU fp32
        for k, v in ref_state.items():
            assert torch.equal(second_state[k], v), k


def _resume_run_wrapped(rank, world, root, strategy):
    ref_losses, ref_state, first_losses, second, state = _resume_run(rank, world, root, strategy)
    return (
        ref_losses,
        ref_state,
        first_losses,
        second.last_stats.global_losses,
        state,
        (second.global_step),
    )


def _save_on_two(rank, world, root):
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=False)
    t = _trainer("fsdp", root, dropout=0.0, sched=False)
    t.train(loader, epochs=1, max_steps=3)
    return t.last_stats.global_losses


def test_resume_on_a_different_world_size(tmp_path):
    """FSDP shards written by 2 ranks load into one unwrapped process and training continues
    exactly like uninterrupted one-process training (1e-5: the 2-rank steps sum two per-rank
    means, rounding differently from the one-process mean)."""
    root = str(tmp_path / "ck")
    first_losses = run_ranks(_save_on_two, 2, tmp_path, root)[0]
    ref_state, ref_losses = reference_train(make_dataset(), 8, 6, max_grad_norm=0.5)
    loader = OptimizedDataLoader.create(make_dataset(), 8, shuffle=False)  # world of one
    t = _trainer("fsdp", root, seed=3, dropout=0.0, sched=False)
    t.train(loader, epochs=1)
    assert t.global_step == 6
    losses = first_losses + t.last_stats.global_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(t.model.state_dict()[k], v, atol=1e-5, rtol=0)


def _resume_on_two(rank, world, root):
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=False)  # 2 x 4 = 8 global
    t = _trainer("fsdp", root, seed=3, dropout=0.0, sched=False)  # init overwritten by the load
    t.train(loader, epochs=1)
    return t.global_step, t.last_stats.global_losses, full_state(t.model)


def test_resume_from_one_process_on_two_ranks(tmp_path):
    """A checkpoint written by one unwrapped process loads into FSDP2 on 2 ranks (DCP shards
    it; the data position, 24 global samples, becomes 12 per rank) and training continues like
    uninterrupted one-process torch. Tolerance 1e-5 as above: after the switch each step's
    gradient is the mean of two 4-sample means instead of one 8-sample mean (~1e-7 relative
    rounding), carried through 3 AdamW steps with clipping."""
    root = str(tmp_path / "ck")
    loader = OptimizedDataLoader.create(make_dataset(), 8, shuffle=False)  # world of one
    first = _trainer("fsdp", root, dropout=0.0, sched=False)
    first.train(loader, epochs=1, max_steps=3)  # saves step 3 at the end
    assert find_latest(root).name == "step_00000003"
    ref_state, ref_losses = reference_train(make_dataset(), 8, 6, max_grad_norm=0.5)
    # One process against plain torch: the same ops in the same order, so exact.
    assert first.last_stats.global_losses == ref_losses[:3]

    results = run_ranks(_resume_on_two, 2, tmp_path, root)
    for step, losses, state in results:
        assert step == 6
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses[3:]), atol=1e-5, rtol=0
        )
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=k)
    # Both ranks hold the same (all-reduced) losses and the same unsharded weights.
    assert results[0][1] == results[1][1]


def test_crash_mid_save_keeps_last_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    loader = OptimizedDataLoader.create(make_dataset(), 8, shuffle=True)
    torch.manual_seed(0)
    full = _trainer("ddp", None)
    full.train(loader, epochs=1)
    torch.manual_seed(0)
    t = _trainer("ddp", str(root), every=2)
    t.train(loader, epochs=1, max_steps=4)
    assert find_latest(root).name == "step_00000004"

    real_save = ckpt_mod.dcp.save

    def crashing_save(state, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # shards on disk, then the "crash"
        raise OSError("disk full (simulated crash mid-save)")

    monkeypatch.setattr(ckpt_mod.dcp, "save", crashing_save)
    t2 = _trainer("ddp", str(root), seed=9, every=2)
    with pytest.raises(OSError, match="simulated crash"):
        t2.train(loader, epochs=1)  # resumes at 4, trains to 6, crashes saving step 6
    monkeypatch.setattr(ckpt_mod.dcp, "save", real_save)
    assert (root / ".tmp-step_00000006").is_dir()  # the half-written save
    assert not (root / "step_00000006").exists()
    assert (root / "latest").read_text().strip() == "step_00000004"

    t3 = _trainer("ddp", str(root), seed=11, every=2)
    t3.train(loader, epochs=1)  # resumes from the last good checkpoint (step 4)
    assert t3.last_stats.global_losses == full.last_stats.global_losses[4:]
    for k, v in full.model.state_dict().items():
        assert torch.equal(t3.model.state_dict()[k], v), k
    assert not (root / ".tmp-step_00000006").exists()  # cleaned by the next good save
