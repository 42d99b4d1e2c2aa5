"""2 ranks: measured collective bytes agree with the algebra; the loader shards; the
bandwidth probe measures something; mismatched loaders fail fast instead of hanging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmdgt.train import CommunicationProfiler, DistributedTrainer, OptimizedDataLoader
from tests._dist import run_ranks
from tests.train._models import make_dataset, make_model, make_optimizer


def _measure(rank, world, strategy):
    model = make_model()
    prof = CommunicationProfiler()
    est = (
        prof.estimate_ddp_comm_cost(model, world)
        if strategy == "ddp"
        else prof.estimate_fsdp_comm_cost(model, world)
    )
    t = DistributedTrainer(model, make_optimizer(model), strategy=strategy, loss_fn=F.mse_loss)
    t.train(OptimizedDataLoader.create(make_dataset(), 4, shuffle=False), epochs=1)
    totals = t.wrapped.log.totals()
    measured = prof.measured_bytes_per_rank(totals, world)
    table = prof.compare(est, totals, t.last_stats and len(t.last_stats.step_times), world)
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=True)
    loader.sampler.set_epoch(1)
    counts = {k: v["count"] for k, v in totals.items()}
    return est, measured, table, sorted(loader.sampler), counts


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_measured_bytes_match_estimate(tmp_path, strategy):
    results = run_ranks(_measure, 2, tmp_path, strategy)
    est, measured, table, _, counts = results[0]
    steps = 6
    # Both terms probed on the group, never assumed: the large all-reduce's bus bandwidth and
    # a small message's time per kind, the same numbers on every rank (slowest rank's median).
    assert est["bandwidth_bytes_per_sec"] > 0
    assert results[1][0]["estimated_sec"] == est["estimated_sec"]
    # DDP: one bucket holds every gradient. FSDP: 3 units (up, down, norm), every parameter's
    # dim 0 padded to a multiple of 2 (11 -> 12 rows, 3 -> 4), gathered in forward and
    # backward, reduce-scattered once. The estimate models exactly that, so measured and
    # estimated collectives and bytes agree exactly.
    kinds = ("all_reduce",) if strategy == "ddp" else ("all_gather", "reduce_scatter")
    for kind in kinds:
        assert measured[f"{kind}_bytes"] / steps == pytest.approx(est[f"{kind}_bytes"]), kind
        assert counts[kind] == est[f"{kind}_count"] * steps, kind
        assert 0 < est[f"{kind}_latency_per_collective_sec"] < 0.1, kind
        assert est[f"{kind}_bandwidth_bytes_per_sec"] > 0, kind
    expected = sum(
        est[f"{k}_count"] * est[f"{k}_latency_per_collective_sec"]
        + est[f"{k}_bytes"] / est[f"{k}_bandwidth_bytes_per_sec"]
        for k in kinds
    )
    assert est["estimated_sec"] == pytest.approx(expected, rel=1e-12)
    assert "est n" in table and "meas ms" in table and " latency + " in table
    assert f"{kinds[0]} " in table.splitlines()[-1] and " GB/s" in table
    shards = [r[3] for r in results]
    assert set(shards[0]).isdisjoint(shards[1]) and sorted(shards[0] + shards[1]) == list(range(48))


def _uneven(rank, world):
    ds = make_dataset(n=8 if rank == 0 else 16)
    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss)
    # a plain loader: the trainer shards it over the 2 ranks (8 / 2 rows: 1 batch; 16 / 2: 2)
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    try:
        t.train(loader)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_loaders_fail_fast(tmp_path):
    msgs = run_ranks(_uneven, 2, tmp_path, timeout=60)
    for m in msgs:
        assert "rank 0: 1, rank 1: 2" in m
