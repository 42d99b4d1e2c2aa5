"""A dry run leaves nothing behind in its process (issue 19's follow-up).

Its fake world is rank 0 of ``world`` ranks, and DTensor caches its sharding plans with the
meshes in the key: a plan cached there used to be served, after the dry run, to any equal
mesh of this process or of a child it forks, whose DTensors then sat at rank 0's coordinate
on every rank (FSDP2 parameters all at offset 0: DCP refused the checkpoint). So:

1. dry run at world 4, then a real forked 4-rank FSDP job in the same process trains and
   checkpoints: every rank's parameters sit at its own coordinate and the save succeeds
   (before the fix: DCP refused the save, "invalid fill tensor-volume ... chunks-volume");
2. a dry run that fails in its step leaves no process group and no cached plan;
3. a world of one trains the same losses, bit for bit, before and after a dry run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.nn.functional as F

from spmdgt.train import CheckpointConfig, DistributedTrainer, OptimizedDataLoader, TrainConfig
from spmdgt.train._dryrun import DryRunError, dry_run
from tests._dist import run_ranks
from tests.train._models import IN, OUT, make_dataset, make_optimizer, make_stack

STEPS, BATCH = 2, 4


def _build():
    model = make_stack()
    return model, make_optimizer(model), (torch.randn(BATCH, IN), torch.randn(BATCH, OUT))


def _train(root: str | None) -> tuple[DistributedTrainer, list[float]]:
    torch.manual_seed(0)
    model = make_stack()
    cfg = TrainConfig(strategy="fsdp", log_every=100, checkpoint=CheckpointConfig(dir=root))
    trainer = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, config=cfg)
    loader = OptimizedDataLoader.create(
        make_dataset(n=BATCH * 4 * STEPS), BATCH, shuffle=False, num_workers=0
    )
    trainer.train(loader, max_steps=STEPS)
    return trainer, list(trainer.last_stats.global_losses)


def _rank(rank: int, world: int, root: str) -> dict:
    trainer, losses = _train(root)
    coords = {p.device_mesh.get_coordinate() for p in trainer.model.parameters()}
    return {"coords": coords, "losses": losses}


def _plans_cached() -> int:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize


def test_a_forked_fsdp_job_checkpoints_after_a_dry_run(tmp_path):
    report = dry_run(_build, 4, TrainConfig(strategy="fsdp"), loss_fn=F.mse_loss)
    assert {row.kind for row in report.collectives} >= {"all_gather", "reduce_scatter"}
    assert not dist.is_initialized()
    assert _plans_cached() == 0  # the fake world's plans are gone
    results = run_ranks(_rank, 4, tmp_path, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["coords"] == {(rank,)}, f"rank {rank} holds another rank's mesh"
        assert r["losses"] == results[0]["losses"]
    assert (tmp_path / "ckpt" / f"step_{STEPS:08d}" / ".metadata").is_file()


def test_a_dry_run_that_fails_in_its_step_leaves_nothing():
    def not_scalar(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out - y  # not a scalar: the step raises

    with pytest.raises(ValueError, match="scalar"):
        dry_run(_build, 4, TrainConfig(strategy="fsdp"), loss_fn=not_scalar)
    assert not dist.is_initialized()
    assert _plans_cached() == 0
    with pytest.raises(DryRunError, match="world size"):
        dry_run(_build, 0)


def test_a_world_of_one_trains_the_same_losses_after_a_dry_run():
    _, before = _train(None)
    dry_run(_build, 4, TrainConfig(strategy="fsdp"), loss_fn=F.mse_loss)
    dry_run(_build, 2, TrainConfig(strategy="ddp"), loss_fn=F.mse_loss)
    _, after = _train(None)
    assert len(before) == STEPS
    assert after == before
