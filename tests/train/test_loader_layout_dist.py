"""Loaders written as for one process train as one process on any layout (``shard_loader``).

A plain ``DataLoader`` given to the trainer is sharded over its data-parallel ranks (as
accelerate's ``prepare`` does): before, each rank read the whole dataset and the step's global
batch was one rank's batch repeated. A loader sharded over the world under ``placements``
(tensor parallelism: one data group) reads the whole dataset on every rank: before, the
first-batch check refused it. On 2 and 3 ranks, every step's loss and the final weights equal
the one-process reference on the same global batches (``HIDDEN=11``: uneven FSDP shards, 6/5
and 4/4/3). The 2 x 2 mesh is ``test_mesh2d_dist.py``'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig
from tests._dist import run_ranks
from tests.train._models import (
    HIDDEN,
    TP_HIDDEN,
    full_state,
    make_dataset,
    make_model,
    make_optimizer,
    reference_train,
)

PER_RANK, STEPS = 2, 3
TP_PLAN = {"up": "colwise", "down": "rowwise", "norm": "replicate"}


def _run(strategy: str, loader: object, hidden: int) -> tuple[dict, list[float], int]:
    model = make_model(hidden=hidden)
    cfg = TrainConfig(strategy=strategy, placements=TP_PLAN if strategy == "placements" else {})
    trainer = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, config=cfg)
    trainer.train(loader, max_steps=STEPS)
    return full_state(trainer.model), trainer.last_stats.global_losses, trainer.data_parallel_size


def _rank(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    return [
        # a plain shuffled DataLoader under fsdp: sharded over the world's data ranks
        _run("fsdp", DataLoader(make_dataset(), batch_size=PER_RANK, shuffle=True), HIDDEN),
        # a plain sequential one under ddp
        _run("ddp", DataLoader(make_dataset(), batch_size=PER_RANK), HIDDEN),
        # placements with a world-sharded loader: every rank reads the whole dataset
        _run("placements", OptimizedDataLoader.create(make_dataset(), PER_RANK), TP_HIDDEN),
    ]


def _shuffled(dataset: TensorDataset) -> TensorDataset:
    """The epoch-0 order the sharded loader deals (seed 0, as ``OptimizedDataLoader``)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    return TensorDataset(*(t[order] for t in dataset.tensors))


@pytest.mark.parametrize("world", [2, 3])
def test_one_process_loaders_follow_the_data_parallel_layout(tmp_path, world):
    results = run_ranks(_rank, world, tmp_path)
    references = [
        reference_train(_shuffled(make_dataset()), PER_RANK * world, STEPS),
        reference_train(make_dataset(), PER_RANK * world, STEPS),
        reference_train(_shuffled(make_dataset()), PER_RANK, STEPS, hidden=TP_HIDDEN),
    ]
    for rank, runs in enumerate(results):
        for (state, losses, _), (ref_state, ref_losses) in zip(runs, references):
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0
            )
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=f"rank {rank} {k}")
        assert [dp for _, _, dp in runs] == [world, world, 1]
