"""The trainer's memory on CPU ranks: the tensor peak is the tensors' (torch's trackers on the
first steps), not the process's RSS, which the summary reports apart as ``peak_rss_gb``.

One bias-free ``Linear(N, N)`` (``P`` = its weight's bytes, 1 MiB) under plain SGD with
momentum makes the peak a sum of known sizes: at the optimizer step of a DDP rank the weight,
its gradient, DDP's flat gradient bucket (``gradient_as_bucket_view`` off, DDP's default) and
the momentum buffer (made from the gradient in step 1) are alive together: ``4 P``, plus this
rank's few activations (its rows x ``N`` floats each); accumulating over two micro-steps
(the root's forward twice a step: the tracker's per-module statistics are reset for it), the
second micro-step's gradient before it is added to the first: ``5 P``. Under FSDP each rank
holds a shard of the weight and of the momentum but the whole gradient before its
reduce-scatter. The global batch is 7 rows, split 4/3 on 2 ranks and 3/3/1 on 3 ranks.
"""

from __future__ import annotations

import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks

N = 512
P = N * N * 4  # the weight's bytes
ROWS = 7  # global batch: 4/3 on 2 ranks, 3/3/1 on 3
STEPS = 3


def _rows(rank: int, world: int) -> int:
    """This rank's share of the ROWS-row global batch: 4/3 on 2 ranks, 3/3/1 on 3."""
    per = -(-ROWS // world)
    return max(0, min(per, ROWS - rank * per))


def _train(strategy: str, accum: int, rank: int, world: int) -> dict:
    from spmdgt.train import DistributedTrainer, TrainConfig, TrainingConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N, N, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1 + rank)
    rows = _rows(rank, world)
    batches = [
        (torch.randn(rows, N, generator=g), torch.randn(rows, N, generator=g))
        for _ in range(STEPS * accum)
    ]
    training = TrainingConfig(gradient_accumulation_steps=accum, warmup_steps=0)
    cfg = TrainConfig(strategy=strategy, log_every=100, training=training)
    summary = DistributedTrainer(model, opt, loss_fn=F.mse_loss, config=cfg).train(batches)
    summary["rows"] = rows
    summary["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return summary


def _ranks(rank: int, world: int) -> list[dict]:
    return [
        _train("ddp", 1, rank, world),
        _train("ddp", 2, rank, world),
        _train("fsdp", 1, rank, world),
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_the_tensor_peak_is_the_tensors_and_rss_is_named_rss(world, tmp_path):
    results = run_ranks(_ranks, world, tmp_path)
    for rank, (ddp, ddp_accum, fsdp) in enumerate(results):
        for s in (ddp, ddp_accum, fsdp):
            peak = s["peak_memory_allocated_gb"] * 1e9
            # RSS is reported, named as such, and it is the process's: far above the tensors
            assert s["peak_rss_gb"] * 1e9 <= s["ru_maxrss"]
            assert s["peak_rss_gb"] * 1e9 > 10 * peak, (rank, s)
            assert s["avg_rss_gb"] > 0 and s["avg_memory_allocated_gb"] is None  # no allocator
            # the tracked steps are left out of the timing statistics
            assert s["warmup_steps_excluded"] == 2
        activation = ddp["rows"] * N * 4
        # DDP: weight + gradient + DDP's bucket + momentum alive at once, and a few
        # activations; accumulating, the second micro-step's gradient before it is added too
        for s, known in ((ddp, 4 * P), (ddp_accum, 5 * P)):
            assert s["memory_kind"] == "tensors (MemTracker, steps 1-2)"
            peak = s["peak_memory_allocated_gb"] * 1e9
            assert known <= peak <= known + 8 * activation, (rank, peak / P)
        # FSDP: at least the whole gradient before its reduce-scatter beside the weight's
        # shard and the momentum's (rank 0 holds the largest: ceil(N / world) rows)
        shard = -(-N // world) * N * 4
        assert fsdp["memory_kind"] == "tensors (FSDPMemTracker, steps 1-2)"
        assert P + 2 * shard <= fsdp["peak_memory_allocated_gb"] * 1e9 <= 6 * P
