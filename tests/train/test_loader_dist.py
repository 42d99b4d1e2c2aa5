"""DataLoader workers and the rank processes that start them.

On a 16-core GPU machine the test harness's ranks (daemonic ``multiprocessing`` children) built
default loaders with 7 workers each, and the first batch failed: "daemonic processes are not
allowed to have children". The loader now takes 0 workers by default in a daemonic process and
refuses an explicit request with an error naming ``num_workers``; non-daemonic ranks (as
torchrun starts them) run real workers. Both train to the one-process numbers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from spmdgt.train import DistributedTrainer, OptimizedDataLoader
from spmdgt.train._data import _default_workers
from tests._dist import run_ranks
from tests.train._models import make_dataset, make_model, make_optimizer, reference_train

STEPS = 6  # 48 samples / (4 per rank x 2 ranks)


def _train(loader) -> tuple[dict, list[float]]:
    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), strategy="ddp", loss_fn=F.mse_loss)
    t.train(loader, epochs=1)
    state = {k: v.detach().clone() for k, v in t.model.module.state_dict().items()}
    return state, t.last_stats.global_losses


def _as_on_16_cores(rank, world):
    # What _default_workers reads: 16 usable cores, 2 local ranks -> 7 workers per rank.
    os.sched_getaffinity = lambda pid: set(range(16))
    default = _default_workers()
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=False)
    state, losses = _train(loader)
    try:
        OptimizedDataLoader.create(make_dataset(), 4, num_workers=2)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return default, loader.num_workers, state, losses, refused


def _check(state, losses):
    ref_state, ref_losses = reference_train(make_dataset(), 8, STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=k)


def test_daemonic_ranks_on_a_many_core_machine(tmp_path):
    for default, workers, state, losses, refused in run_ranks(_as_on_16_cores, 2, tmp_path):
        assert default == 7  # the machine would give 7 workers per rank...
        assert workers == 0  # ...which a daemonic rank cannot start
        _check(state, losses)
        assert "num_workers=2" in refused and "daemonic" in refused


def _with_workers(rank, world):
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=False, num_workers=1)
    state, losses = _train(loader)
    return loader.num_workers, state, losses


def test_non_daemonic_ranks_run_loader_workers(tmp_path):
    for workers, state, losses in run_ranks(_with_workers, 2, tmp_path, daemon=False):
        assert workers == 1
        _check(state, losses)


def test_negative_workers_are_refused():
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        OptimizedDataLoader.create(make_dataset(), 4, num_workers=-1)
