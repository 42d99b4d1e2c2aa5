"""BatchNorm under DDP and FSDP trains as one process (``sync_batchnorm``, on by default):
every step's loss, the final weights and the running statistics within 1e-5 of one process
reading the global batch, on 2 and 3 ranks, BatchNorm1d and BatchNorm2d (one with a
cumulative average, ``momentum=None``). With ``sync_batchnorm: false`` each rank normalises
its own rows, as DDP does: the losses differ (the check bites).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig
from tests._dist import run_ranks
from tests.train._models import IN, OUT, full_state, make_dataset

STEPS, PER_RANK = 5, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, 8)
        self.bn1 = nn.BatchNorm1d(8, momentum=0.3)
        self.bn2 = nn.BatchNorm2d(2, momentum=None)
        self.down = nn.Linear(8, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.up(x)))
        h = self.bn2(h.view(-1, 2, 2, 2)).flatten(1)
        return self.down(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_dataset().tensors
    batch, losses = PER_RANK * world, []
    for step in range(STEPS):
        rows = slice(step * batch, (step + 1) * batch)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, strategy: str, sync: bool) -> tuple:
    torch.set_num_threads(1)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = TrainConfig(strategy=strategy, sync_batchnorm=sync, log_every=2)
    trainer = DistributedTrainer(model, opt, loss_fn=F.mse_loss, config=cfg)
    loader = OptimizedDataLoader.create(make_dataset(), PER_RANK, shuffle=False)
    trainer.train(loader, epochs=1, max_steps=STEPS)
    return (
        trainer.last_stats.global_losses,
        full_state(trainer.wrapped.module),
        trainer.wrapped.synced_norms,
    )


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("fsdp", 3)])
def test_batchnorm_trains_as_one_process(tmp_path, strategy, world):
    want_losses, want_state = _reference(world)
    for losses, state, synced in run_ranks(_train, world, tmp_path, strategy, True):
        assert synced == ["bn1", "bn2"]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=0
        )
        assert set(state) == set(want_state)
        for name, value in want_state.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
    assert int(want_state["bn2.num_batches_tracked"]) == STEPS


def test_without_sync_each_rank_normalises_its_own_rows(tmp_path):
    want_losses, _ = _reference(2)
    got = run_ranks(_train, 2, tmp_path, "ddp", False)
    losses, _, synced = got[0]
    assert synced == []
    assert abs(losses[0] - want_losses[0]) > 1e-2  # another first step than one process


def test_a_dry_run_of_synced_norms_reads_no_value():
    """The dry run (fake tensors on a fake group) wraps and steps the same model: the
    synced norms read no value there (the row count and ``momentum=None``'s step count are
    tensors, never ``float()``-ed: a fake tensor has no data)."""
    from spmdgt.train._dryrun._api import dry_run

    def build():
        model = _net()
        batch = (torch.randn(8, IN), torch.randn(8, OUT))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), batch

    for strategy in ("ddp", "fsdp"):
        report = dry_run(build, 4, TrainConfig(strategy=strategy), loss_fn=F.mse_loss)
        assert "per rank" in str(report), strategy
