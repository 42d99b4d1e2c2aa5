"""Communication on a 2-D mesh, per mesh dim, on four gloo ranks (2 x 2).

One job per rank, two trainings: ``dp_shard=2 x tp=2`` (FSDP2 over tensor-parallel DTensors)
and ``dp_replicate=2 x dp_shard=2`` (HSDP), each a few AdamW steps with clipping on the
tests' stack (11 rows: uneven FSDP shards), with the interceptor on (instruction log and the
run folder ``top`` reads) and every dispatched collective counted with its process group's
mesh dim (``CollectiveCounter``). Checked, per mesh dim and kind:

1. the trainer's communication log (torch's FSDP2 hooks plus the op stream for what they
   cannot see: TP's collectives inside ``tp``, HSDP's replica all-reduce) equals the count of
   every collective dispatched on that dim in the last step, bytes included;
2. the instruction log names the dim of each collective (column 15) and holds as many
   collectives per dim as were dispatched over the whole run; ``top`` shows them per dim;
3. ``CommunicationProfiler(mesh=...)`` probes each dim on its own group: latency and bandwidth
   positive and finite, the same on every rank, and its estimate of the counted step is;
4. the dry run of the same config (one process, fake world of 4) counts, per dim and kind,
   exactly what each real rank counted in its last step, and the same per-rank bytes.
The losses equal one process's (the 2-D trainer's own tests check them in detail).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it
import torch.nn.functional as F

from spmdgt.train import ParallelismConfig, TrainConfig, TrainingConfig
from spmdgt.train._dryrun import CollectiveCounter, dry_run
from tests._dist import run_ranks
from tests.train._models import (
    IN,
    OUT,
    TP_HIDDEN,
    make_dataset,
    make_model,
    make_optimizer,
    reference_train,
)

PER_DP_RANK, STEPS, CLIP = 3, 3, 0.5
TP_PLAN = {"up": "colwise", "down": "rowwise", "norm": "replicate"}
LAYOUTS = {"fsdp_tp": {"dp_shard": 2, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2}}
KNOWN = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}  # what the counter counts


def _config(parallelism: dict) -> TrainConfig:
    return TrainConfig(
        strategy="fsdp",
        placements=TP_PLAN if parallelism.get("tp", 1) > 1 else {},
        parallelism=ParallelismConfig(**parallelism),
        training=TrainingConfig(max_grad_norm=CLIP),
        log_every=100,
    )


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _train(rank: int, name: str, tmp: str) -> dict:
    """One training on this rank with the interceptor on: what the log, the counter and the
    instruction log saw."""
    import spmdgt.interceptor as interceptor
    from spmdgt.interceptor._logreader import read_log
    from spmdgt.train import CommunicationProfiler, DistributedTrainer, OptimizedDataLoader
    from spmdgt.train._comm import _collective_kind

    model = make_model(hidden=TP_HIDDEN)
    optimizer = make_optimizer(model)
    trainer = DistributedTrainer(
        model, optimizer, loss_fn=F.mse_loss, config=_config(LAYOUTS[name])
    )

    class PerStep(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.step = trainer.global_step  # the step in progress (0-based)
            return super().__torch_dispatch__(func, types, args, kwargs)

    loader = OptimizedDataLoader.create(
        make_dataset(),
        PER_DP_RANK,
        shuffle=False,
        num_replicas=trainer.data_parallel_size,
        rank=trainer.data_parallel_rank,
    )
    log = os.path.join(tmp, f"{name}.log")
    interceptor.enable(instruction_log=log, run_dir=os.path.join(tmp, name), hotpath=False)
    counter = PerStep()
    try:
        with counter:
            summary = trainer.train(loader, max_steps=STEPS)
    finally:
        interceptor.disable()
    last = [r for r in trainer.wrapped.log.records if r.step == STEPS - 1]
    logged = {
        dim: {k: {"count": int(t["count"]), "bytes": int(t["bytes"])} for k, t in kinds.items()}
        for dim, kinds in trainer.wrapped.log.totals_by_dim(last).items()
    }
    in_log: dict[str, dict[str, int]] = {}
    for r in read_log(log.replace(".log", f".rank{rank}.log")):
        if r.event == "COMM" and _collective_kind(r.op) in KNOWN:
            per = in_log.setdefault(r.group, {})
            per[_collective_kind(r.op)] = per.get(_collective_kind(r.op), 0) + 1
    prof = CommunicationProfiler(mesh=trainer.device_mesh, probe_bytes=2 << 20)
    counted = counter.totals_by_dim(step=STEPS - 1)
    model_dims = {d: v for d, v in counted.items() if d != "world"}
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "counted": counted,
        "counted_all": counter.totals_by_dim(),
        "logged": logged,
        "in_log": in_log,
        "losses": trainer.last_stats.global_losses,
        "measured_by": summary["comm_measured_by"],
        "summary_dims": {
            k: summary[k] for k in summary if k.startswith("comm_") and k.endswith("_per_step")
        },
        "latency": prof.latency_by_dim,
        "bandwidth": prof.bandwidths_by_dim,
        "estimate": prof.estimate_counted_by_dim(model_dims),
        "params": sum(_local_bytes(p) for p in trainer.model.parameters()),
        "optimizer": sum(_local_bytes(v) for v in state),
    }


def _job(rank: int, world: int, tmp: str) -> dict:
    import spmdgt.interceptor._mode as mode

    torch.set_num_threads(1)
    mode._TICK_NS = 0  # publish on every op: the test cannot wait for 1 s ticks
    return {name: _train(rank, name, tmp) for name in LAYOUTS}


def _build():
    model = make_model(hidden=TP_HIDDEN)
    return (
        model,
        make_optimizer(model),
        (torch.randn(PER_DP_RANK, IN), torch.randn(PER_DP_RANK, OUT)),
    )


# slow (4 ranks, two layouts, ~18 s on 2 cores): the default suite counts fsdp x tp's
# collectives per mesh dim on 2x2 (test_comm2d_sharded_input_dist.py), trains hsdp 2x2 against
# one process (test_mesh2d_dist.py) and checks dry runs against real ones (test_dryrun*.py)
@pytest.mark.slow
def test_comm_per_mesh_dim_on_2x2(tmp_path):
    from spmdgt.interceptor._logreader import read_statuses
    from spmdgt.scripts import top

    out = run_ranks(_job, 4, tmp_path, str(tmp_path), timeout=240)
    cases = (("fsdp_tp", {"tp", "dp_shard"}, 2), ("hsdp", {"dp_shard", "dp_replicate"}, 4))
    for name, dims, dp_size in cases:
        runs = [r[name] for r in out]
        _, ref_losses = reference_train(
            make_dataset(), PER_DP_RANK * dp_size, STEPS, max_grad_norm=CLIP, hidden=TP_HIDDEN
        )
        report = dry_run(_build, 4, _config(LAYOUTS[name]), loss_fn=F.mse_loss)
        dry = report.collectives_by_dim()
        assert set(dry) == dims, name
        for rank, r in enumerate(runs):
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref_losses), atol=1e-5, rtol=0
            )
            # 1. the trainer's log, per dim and kind, is every collective the step dispatched
            assert r["measured_by"] == "fsdp2_collective_hooks+interceptor", where
            model_dims = {d: v for d, v in r["counted"].items() if d != "world"}
            assert set(model_dims) == dims, where
            assert r["logged"] == model_dims, where
            # the Training Summary carries each dim's collectives per step
            for dim in dims:
                n = sum(int(t["count"]) for t in model_dims[dim].values())
                assert r["summary_dims"][f"comm_{dim}_collectives_per_step"] > 0, (where, dim)
                assert r["summary_dims"][f"comm_{dim}_collectives_per_step"] <= n * 2, where
            # 2. the instruction log names each collective's dim, as many as were dispatched
            for dim in dims:
                want = {k: v["count"] for k, v in r["counted_all"][dim].items()}
                assert r["in_log"].get(dim) == want, (where, dim)
            # 3. per-dim probes and the estimate: positive, finite, every rank the same
            assert set(r["latency"]) == set(r["bandwidth"]) == dims, where
            for table in (r["latency"], r["bandwidth"]):
                for dim, per_kind in table.items():
                    assert all(math.isfinite(v) and v > 0 for v in per_kind.values()), dim
            assert r["latency"] == runs[0]["latency"] and r["bandwidth"] == runs[0]["bandwidth"]
            est = r["estimate"]
            for dim in dims:
                assert 0 < est[dim]["estimated_sec"] < 1, (where, dim)
                assert est[dim]["collectives"] == sum(v["count"] for v in model_dims[dim].values())
            assert est["total"]["estimated_sec"] == sum(est[d]["estimated_sec"] for d in dims)
            # 4. the dry run counts what this rank counted, per dim, kind and bytes
            assert dry == model_dims, where
        assert report.params == [r["params"] for r in runs], name
        assert report.optimizer == [r["optimizer"] for r in runs], name
        assert len(set(report.params)) > 1, name  # 11 rows over 2 shards: uneven
        # top: a column of collectives per mesh dim, from every rank's status
        statuses = read_statuses(str(tmp_path / name))
        assert [s["rank"] for s in statuses] == [0, 1, 2, 3]
        frame = top.render(statuses)
        assert "by mesh dim" in frame.splitlines()[1]
        for line in frame.splitlines()[2:6]:
            for dim in dims:
                assert f"{dim}:" in line, (name, line)
