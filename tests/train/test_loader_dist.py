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


class _Batches:
    """An iterable of ``(x, y)`` batches with no ``len()``: ``count`` micro-batches of 4 for
    ``rank``, micro-batch m holding global samples [8m + 4 rank, 8m + 4 rank + 4)."""

    def __init__(self, rank: int, count: int) -> None:
        self.rank, self.count = rank, count

    def __iter__(self):
        x, y = make_dataset().tensors
        for m in range(self.count):
            lo = 8 * m + 4 * self.rank
            yield x[lo : lo + 4], y[lo : lo + 4]


def _unsized(rank, world):
    import warnings

    from tests.train._models import full_state

    model = make_model()
    t = DistributedTrainer(
        model,
        make_optimizer(model),
        strategy="fsdp",  # forward and backward communicate: a skipped batch would hang
        loss_fn=F.mse_loss,
        gradient_accumulation_steps=2,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Rank 1's loaders hold one batch more than rank 0's, for training and validation.
        t.train(_Batches(rank, 5 + rank), epochs=1)
        val = t.evaluate(_Batches(rank, 2 + rank))
    dropped = [str(w.message) for w in caught if "dropped" in str(w.message)]
    return t.global_step, t.last_stats.global_losses, full_state(t.model), val, dropped


def test_unsized_loaders_agree_on_every_step(tmp_path):
    """Loaders without len() that end at different points: every rank runs the batches all of
    them have (rank 1 drops its extra one, with a warning), the epoch's last, short group
    syncs its gradients, and validation stops where the shortest rank does. Once, the short
    group ran entirely under no_sync (gradients never reduced: ranks silently diverged) and a
    rank with an extra batch waited in a collective nobody else joined."""
    x, y = make_dataset().tensors
    model = make_model()
    opt = make_optimizer(model)
    losses = []
    for group in ([0, 1], [2, 3], [4]):  # micro-batches of 8 global samples: 2, 2, then 1
        total = 0.0
        for m in group:
            loss = F.mse_loss(model(x[8 * m : 8 * m + 8]), y[8 * m : 8 * m + 8])
            (loss / len(group)).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / len(group))
    with torch.no_grad():
        ref_val = (
            sum(F.mse_loss(model(x[lo : lo + 4]), y[lo : lo + 4]).item() for lo in range(0, 16, 4))
            / 4
        )
    for rank, (steps, got, state, val, dropped) in enumerate(
        run_ranks(_unsized, 2, tmp_path, timeout=60)
    ):
        assert steps == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), atol=1e-5, rtol=0)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=k)
        assert val == pytest.approx(ref_val, abs=1e-6)
        if rank == 1:
            assert len(dropped) == 2 and "validation" in dropped[1], dropped
        else:
            assert dropped == []
