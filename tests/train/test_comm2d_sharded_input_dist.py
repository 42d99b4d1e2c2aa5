"""The trainer's tp all-reduce of ``sharded_input`` gradients, counted on ``tp`` (issue 19).

Under FSDP x TP the trainer sums the gradients of ``sharded_input`` layers (Qwen3's per-head
q_norm/k_norm) over the tp group with one all-reduce per dtype per optimizer step
(``Wrapped.sum_partial_grads``). On four gloo ranks (``dp_shard=2 x tp=2``), a few AdamW
steps with clipping on an attention-like block with q_norm and k_norm (uneven FSDP shards: 7
and 5 rows), with ``profile=True`` (which turns the interceptor's op stream on for the dims
torch's hooks do not see), every dispatched collective counted with its mesh dim:

1. the trainer's per-dim log (``CollectiveLog.totals_by_dim``) equals every collective the
   last step dispatched, per dim, kind and bytes, the sum's all-reduce included on ``tp``;
2. the dry run of the same config counts the same per dim, kind and bytes;
3. removing the sum from the dry run's step would change its ``tp`` all-reduce count by one
   (the all-reduce of the two norms' gradients is there, once, not once per layer);
4. the losses equal one process's.

And tensor parallelism alone over a world of 2 (``placements``), where the sums run in
gradient hooks during backward: the trainer's log (the op-stream sink) keeps those
all-reduces and equals what was dispatched and the dry run (it dropped them before).
"""

from __future__ import annotations

import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from spmdgt.train import ParallelismConfig, TrainConfig, TrainingConfig
from spmdgt.train._dryrun import CollectiveCounter, dry_run
from tests._dist import run_ranks

IN, OUT, HEADS, HEAD_DIM, ROWS = 6, 3, 2, 4, 7  # ROWS: 7 over dp_shard=2, uneven on purpose
PER_DP_RANK, STEPS, CLIP = 3, 3, 0.5
PLAN = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "o_proj": "rowwise",
    "q_norm": "sharded_input",
    "k_norm": "sharded_input",
    "inp": "replicate",
}
LAYOUT = {"dp_shard": 2, "tp": 2}


class HeadNormBlock(nn.Module):
    """A replicated input layer, then q/k projections with per-head norms (Qwen3's q_norm and
    k_norm: ``sharded_input``, each tp rank normalises its own heads) and an output one."""

    def __init__(self) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.inp = nn.Linear(IN, ROWS)
        self.q_proj = nn.Linear(ROWS, width)
        self.k_proj = nn.Linear(ROWS, width)
        self.q_norm = nn.LayerNorm(HEAD_DIM)
        self.k_norm = nn.LayerNorm(HEAD_DIM)
        self.o_proj = nn.Linear(width, OUT)
        with torch.no_grad():  # weights that are not all ones: per-head gradients differ
            self.q_norm.weight.copy_(torch.linspace(0.5, 1.5, HEAD_DIM))
            self.k_norm.weight.copy_(torch.linspace(1.5, 0.5, HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        q = self.q_norm(self.q_proj(h).unflatten(-1, (-1, HEAD_DIM))).flatten(-2)
        k = self.k_norm(self.k_proj(h).unflatten(-1, (-1, HEAD_DIM))).flatten(-2)
        return self.o_proj(torch.tanh(q) * k)


def _model() -> HeadNormBlock:
    torch.manual_seed(0)
    return HeadNormBlock()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _dataset(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))


def _config(strategy: str = "fsdp", logdir: str | None = None) -> TrainConfig:
    """FSDP x TP on 2 x 2, or (``placements``) tensor parallelism alone over a world of 2."""
    layout = LAYOUT if strategy == "fsdp" else {"dp_shard": 1, "tp": 2}
    return TrainConfig(
        strategy=strategy,
        placements=PLAN,
        parallelism=ParallelismConfig(**layout),
        training=TrainingConfig(max_grad_norm=CLIP),
        log_every=100,
        logdir=logdir,  # profile=True writes its traces under it, not into the checkout
    )


def _rank(rank: int, world: int, tmp: str, strategy: str = "fsdp") -> dict:
    from spmdgt.train import DistributedTrainer, OptimizedDataLoader

    torch.set_num_threads(1)
    model = _model()
    cfg = _config(strategy, logdir=tmp)
    trainer = DistributedTrainer(model, _optimizer(model), loss_fn=F.mse_loss, config=cfg)

    class PerStep(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.step = trainer.global_step  # the step in progress (0-based)
            return super().__torch_dispatch__(func, types, args, kwargs)

    loader = OptimizedDataLoader.create(
        _dataset(),
        PER_DP_RANK,
        shuffle=False,
        num_replicas=trainer.data_parallel_size,
        rank=trainer.data_parallel_rank,
    )
    counter = PerStep()
    with counter:
        summary = trainer.train(loader, max_steps=STEPS, profile=True)
    last = [r for r in trainer.wrapped.log.records if r.step == STEPS - 1]
    logged = {
        dim: {k: {"count": int(t["count"]), "bytes": int(t["bytes"])} for k, t in kinds.items()}
        for dim, kinds in trainer.wrapped.log.totals_by_dim(last).items()
    }
    counted = counter.totals_by_dim(step=STEPS - 1)
    return {
        "counted": counted,
        "logged": logged,
        "losses": trainer.last_stats.global_losses,
        "measured_by": summary["comm_measured_by"],
        "partial": len(trainer.wrapped.partial_grads),
    }


def _reference_losses() -> list[float]:
    """One process, the global batch of each step (2 data-parallel ranks x PER_DP_RANK)."""
    model = _model()
    opt = _optimizer(model)
    data = _dataset()
    batch = PER_DP_RANK * LAYOUT["dp_shard"]
    losses = []
    for step in range(STEPS):
        x, y = data[step * batch : (step + 1) * batch]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _build():
    model = _model()
    return model, _optimizer(model), (torch.randn(PER_DP_RANK, IN), torch.randn(PER_DP_RANK, OUT))


def test_the_sharded_input_all_reduce_is_counted_on_tp(tmp_path, monkeypatch):
    runs = run_ranks(_rank, 4, tmp_path, str(tmp_path), timeout=240)
    dry = dry_run(_build, 4, _config(), loss_fn=F.mse_loss).collectives_by_dim()
    ref = _reference_losses()
    for rank, r in enumerate(runs):
        where = f"rank {rank}"
        assert r["partial"] == 4, where  # q_norm and k_norm: weight and bias each
        assert r["measured_by"] == "fsdp2_collective_hooks+interceptor", where
        # the clip's norm of the FSDP x TP gradients: one all-reduce over dp_shard x tp
        # flattened, here the world (before: one on each dim); the plain ones' on dp_shard
        assert set(r["counted"]) == {"tp", "dp_shard", "world"}, where
        assert r["counted"]["world"] == {"all_reduce": {"count": 1, "bytes": 24}}, where
        assert r["counted"]["dp_shard"]["all_reduce"]["count"] == 1, where
        # 1. the trainer's log is every collective the step dispatched, per dim and kind
        assert r["logged"] == r["counted"], where
        # 2. the dry run counts the same
        assert dry == r["counted"], where
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), atol=1e-5, rtol=0)
    # 3. the sum is one tp all-reduce of both norms' local gradient shards (fp32)
    from spmdgt.train import _strategies

    monkeypatch.setattr(_strategies.Wrapped, "sum_partial_grads", lambda self: None)
    without = dry_run(_build, 4, _config(), loss_fn=F.mse_loss).collectives_by_dim()
    tp, tp_without = dry["tp"]["all_reduce"], without.get("tp", {}).get("all_reduce")
    assert tp["count"] == (tp_without["count"] if tp_without else 0) + 1
    # the norms' 4 parameters of HEAD_DIM each, split by FSDP over dp_shard=2: 8 floats
    assert tp["bytes"] - (tp_without["bytes"] if tp_without else 0) == 4 * HEAD_DIM // 2 * 4


def test_tensor_parallel_alone_logs_the_sharded_input_hooks_all_reduces(tmp_path):
    """``placements`` over the whole world (tp = 2 = the world): the ``sharded_input`` sums run
    in gradient hooks during backward (``c10d`` all-reduces on the world group), which the
    trainer's op-stream sink used to drop with the trainer's own ``dist.*`` bookkeeping (4
    all-reduces of 16 bytes a step missing from its log). Log = dispatched = dry run."""
    runs = run_ranks(_rank, 2, tmp_path, str(tmp_path), "placements", timeout=240)
    dry = dry_run(_build, 2, _config("placements"), loss_fn=F.mse_loss).collectives_by_dim()
    for rank, r in enumerate(runs):
        assert r["measured_by"] == "interceptor", rank
        assert r["logged"] == r["counted"] == dry, rank
    # the rowwise all-reduce (1 a step), the clip's norm, and one per norm parameter (4)
    assert dry["world"]["all_reduce"]["count"] >= 4 + 1 + 1


def test_the_placements_sink_keeps_backward_all_reduces_only():
    from spmdgt.interceptor._events import OpEvent
    from spmdgt.train._comm import CollectiveLog, InterceptorCollectiveSink

    spec = ((torch.Size([4]), torch.float32, None),)

    def event(op: str, phase: str, group: str, t0: int) -> OpEvent:
        return OpEvent(1, t0, 5, op, "comm", 1, phase, None, spec, spec, 16, group)

    events = [
        event("dist.all_reduce", "fwd", "world", 10),  # the trainer's loss flush: dropped
        event("c10d.allreduce_.default", "bwd", "world", 11),  # a gradient hook's: kept
        event("dist.broadcast", "bwd", "world", 12),  # not an all-reduce: dropped
        event("_c10d_functional.all_reduce.default", "fwd", "tp", 13),  # DTensor's: kept
    ]
    plain = InterceptorCollectiveSink()
    plain.on_events(events)
    log = CollectiveLog()
    plain.fill(log, [(0, 0.0, 1.0)])
    got = {d: {k: t["count"] for k, t in v.items()} for d, v in log.totals_by_dim().items()}
    assert got == {"world": {"all_reduce": 1}, "tp": {"all_reduce": 1}}
    beside = InterceptorCollectiveSink({"tp"})  # beside torch's hooks: theirs stay theirs
    beside.on_events(events)
    assert [e[4] for e in beside.events] == ["tp"]
