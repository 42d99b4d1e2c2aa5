"""2-rank DDP / FSDP2 / tensor-parallel training equals one-process torch on the same data.

Tolerance 1e-5 (fp32): the distributed gradient is the mean of two per-rank means, summed in a
different order than the one-process mean over the global batch (~1e-7 relative rounding); six
AdamW steps with clipping carry that into the weights at ~1e-7, well inside 1e-5.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.distributed.tensor.parallel
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from spmdgt.train import (
    CommunicationProfiler,
    DistributedTrainer,
    FSDPConfig,
    OptimizedDataLoader,
    TrainConfig,
)
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

GLOBAL_BATCH, STEPS, CLIP = 8, 6, 0.5
TP_PLAN = {"up": "colwise", "down": "rowwise", "norm": "replicate"}  # norm: after down


class CountC10d(TorchDispatchMode):
    """Counts every c10d collective op dispatched, including those DDP's C++ reducer issues
    (they go through the dispatcher): an count independent of the trainer's own log."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = f"c10d.{func._opname}"
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _train(
    rank,
    world,
    strategy,
    accum,
    count_comms=False,
    profile_dir=None,
    logdir=None,
    log_every=10,
    accumulate_sharded=False,
):
    hidden = TP_HIDDEN if strategy == "placements" else HIDDEN
    model = make_model(hidden=hidden)
    cfg = TrainConfig(
        strategy=strategy,
        placements=TP_PLAN if strategy == "placements" else {},
        profile=profile_dir is not None,
        logdir=profile_dir,
        fsdp=FSDPConfig(accumulate_sharded=accumulate_sharded),
    )
    trainer = DistributedTrainer(
        model,
        make_optimizer(model),
        strategy=strategy,
        loss_fn=F.mse_loss,
        max_grad_norm=CLIP,
        gradient_accumulation_steps=accum,
        config=cfg,
        logdir=logdir,
        log_every=log_every,
    )
    shard = strategy != "placements"  # tensor parallel: every rank sees the whole batch
    per_rank = GLOBAL_BATCH // (world if shard else 1) // accum
    loader = OptimizedDataLoader.create(make_dataset(), per_rank, shuffle=False, shard=shard)
    counts = {}
    if count_comms:
        with CountC10d() as mode:
            summary = trainer.train(loader, epochs=1)
        counts = mode.counts
    else:
        summary = trainer.train(loader, epochs=1)
    if profile_dir is not None:  # the run turned the interceptor on for itself: now off again
        from spmdgt import interceptor

        counts = {"interceptor_on_after": interceptor.is_enabled()}
        counts["all_reduce_bytes"] = trainer.wrapped.log.totals()["all_reduce"]["bytes"]
        # The cost model's count and bytes for the same run (time terms given: not probed).
        prof = CommunicationProfiler(bandwidth=1e9, latency=1e-4)
        x = make_dataset().tensors[0][:per_rank]
        counts["estimate"] = prof.estimate_placements_comm_cost(
            make_model(hidden=hidden), world, TP_PLAN, x, micro_steps=accum
        )
    return full_state(trainer.model), trainer.last_stats.global_losses, summary, counts


def _check(results, strategy, accum):
    hidden = TP_HIDDEN if strategy == "placements" else HIDDEN
    ref, ref_losses = reference_train(
        make_dataset(), GLOBAL_BATCH, STEPS, max_grad_norm=CLIP, accum=accum, hidden=hidden
    )
    for state, losses, summary, _ in results:
        assert summary["num_steps"] == STEPS
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=f"{strategy} {k}")
        # Reported losses are the all-reduced mean: equal to the one-process loss per step.
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0
        )


def _both(rank, world, strategy):
    return [_train(rank, world, strategy, 1), _train(rank, world, strategy, 2)]


def test_ddp_matches_single_process(tmp_path):
    out = run_ranks(_both, 2, tmp_path, "ddp")
    _check([r[0] for r in out], "ddp", 1)
    _check([r[1] for r in out], "ddp", 2)


def test_fsdp_matches_single_process(tmp_path):
    # HIDDEN=11: every parameter's dim 0 shards unevenly (6/5) across the 2 ranks.
    out = run_ranks(_both, 2, tmp_path, "fsdp")
    _check([r[0] for r in out], "fsdp", 1)
    _check([r[1] for r in out], "fsdp", 2)


def _placements(rank, world, profile_dir):
    return [
        _train(rank, world, "placements", 1),
        _train(rank, world, "placements", 2, profile_dir=f"{profile_dir}/r{rank}"),
    ]


def test_placements_match_single_process(tmp_path):
    out = run_ranks(_placements, 2, tmp_path, str(tmp_path))
    _check([r[0] for r in out], "placements", 1)
    _check([r[1] for r in out], "placements", 2)
    # Not asked to measure: nothing traced, and the summary says so instead of guessing.
    plain = out[0][0][2]
    assert plain["comm_time_share"] is None and plain["collectives_per_step"] is None
    assert plain["comm_measured_by"].startswith("not measured")
    # profile=True: collectives read from the interceptor's op stream. Per optimizer step,
    # rowwise 'down' all-reduces its [4, 3] fp32 output once per micro-step (2) and clipping
    # all-reduces the sharded grads' norm once; the trainer's own dist.* calls do not count.
    for _, _, summary, extra in (r[1] for r in out):
        assert summary["comm_measured_by"] == "interceptor"
        assert summary["collectives_per_step"] == 3
        assert 0 < summary["comm_time_share"] < 1
        assert extra["interceptor_on_after"] is False
        # 6 steps x (2 micro-steps x 48 bytes of activations + the norms of the 4 sharded
        # gradients, one fp32 each), which is what the cost model predicts from one forward
        # of the unwrapped model.
        assert extra["all_reduce_bytes"] == 6 * (2 * 48 + 4 * 4)
        est = extra["estimate"]
        assert est["all_reduce_count"] == summary["collectives_per_step"] == 3
        assert est["bytes_per_rank"] == extra["all_reduce_bytes"] / 6  # ring factor 1 at n=2


def _accum_counts(rank, world, strategy):
    return [_train(rank, world, strategy, a, count_comms=True) for a in (1, 4)]


def test_ddp_accumulation_skips_allreduce(tmp_path):
    (one, four), _ = run_ranks(_accum_counts, 2, tmp_path, "ddp")
    _check([four], "ddp", 4)
    # Same optimizer steps, 4x the micro-steps, the same number of all-reduces: the 3 non-final
    # micro-steps of every step communicate nothing. (Both runs also flush losses once and
    # gather loader lengths once, identically.)
    assert one[3]["c10d.allreduce_"] == four[3]["c10d.allreduce_"] == STEPS + 1  # + loss flush
    # Our hook-based log agrees: one gradient bucket per optimizer step, whatever the accumulation.
    assert one[2]["collectives_per_step"] == four[2]["collectives_per_step"] == 1


def test_fsdp_accumulation_skips_reduce_scatter(tmp_path):
    (one, four), _ = run_ranks(_accum_counts, 2, tmp_path, "fsdp")
    _check([four], "fsdp", 4)
    # 3 FSDP units with parameters (up, down, norm): 3 reduce-scatters per optimizer step,
    # with or without accumulation. All-gathers do scale with micro-steps (forward needs the
    # parameters each time), which is expected.
    rs = "c10d._reduce_scatter_base_"
    assert one[3][rs] == four[3][rs] == 3 * STEPS
    assert four[3]["c10d._allgather_base_"] > one[3]["c10d._allgather_base_"]


def _sharded_accumulation(rank, world):
    return _train(rank, world, "fsdp", 4, count_comms=True, accumulate_sharded=True)


def test_fsdp_sharded_accumulation_reduce_scatters_every_micro_step(tmp_path):
    """``fsdp: {accumulate_sharded: true}`` (torchtitan's accumulation): every micro-step's
    gradients are reduce-scattered and added up sharded, so a rank never holds them whole;
    the step equals one process's all the same (uneven shards: HIDDEN 11 over 2 ranks)."""
    out = run_ranks(_sharded_accumulation, 2, tmp_path)
    _check(out, "fsdp", 4)
    # 3 units x 4 micro-steps x 6 steps, where the default holds them to one per step
    assert out[0][3]["c10d._reduce_scatter_base_"] == 3 * 4 * STEPS
    assert out[0][2]["collectives_per_step"] == out[1][2]["collectives_per_step"]


def _logging_on_rank0_only(rank, world, strategy, logdir):
    # the usual pattern: only rank 0 writes; log_every below the 6 steps: several flushes.
    # stdout is a StringIO (no terminal), as for a job logged to a file: progress lines.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = _train(rank, world, strategy, 1, logdir=logdir if rank == 0 else None, log_every=2)
    return result, out.getvalue()


def test_logdir_on_rank0_only_does_not_change_the_collectives(tmp_path):
    # Once, rank 0 flushed losses every log_every steps and rank 1 every 256: a hang (or a gloo
    # size mismatch). Every strategy, more steps than log_every, TensorBoard on rank 0 only.
    for strategy in ("ddp", "fsdp", "placements"):
        logdir = str(tmp_path / strategy)
        out = run_ranks(_logging_on_rank0_only, 2, tmp_path, strategy, logdir, timeout=90)
        _check([r[0] for r in out], strategy, 1)
        assert any(p.name.startswith("events") for p in (tmp_path / strategy).rglob("*"))
        # Progress lines every log_every steps from rank 0 only, with the all-reduced loss.
        losses = out[0][0][1]
        lines = [ln for ln in out[0][1].splitlines() if ln.startswith("step ")]
        assert [ln.split(" loss ")[0] for ln in lines] == ["step 2/6", "step 4/6", "step 6/6"]
        for i, line in enumerate(lines):
            assert line.split(" loss ")[1].startswith(f"{losses[2 * i + 1]:.4f} ")
        assert out[1][1] == ""  # rank 1 prints nothing (no summary either)


class _HeadNormAttention(torch.nn.Module):
    """q/o projections around a per-head norm (Qwen3's q_norm): colwise q_proj hands each
    rank its heads, the norm's weight is shared by every head."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 8)
        self.q_norm = torch.nn.LayerNorm(4)  # head_dim 4, 2 heads
        self.o_proj = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.q_proj(x)
        h = self.q_norm(h.unflatten(-1, (-1, 4))).flatten(-2)
        return self.o_proj(torch.tanh(h))


def _head_norm_grads(rank, world):
    from spmdgt import runtime
    from spmdgt.train._layout import build_layout
    from spmdgt.train._strategies import wrap_model

    torch.manual_seed(0)
    model, ref = _HeadNormAttention(), _HeadNormAttention()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():  # a weight that is not all ones: its gradient differs per head
        for m in (model, ref):
            m.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 4))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    table = {"q_proj": "colwise", "o_proj": "rowwise", "q_norm": "sharded_input"}
    cfg = TrainConfig(strategy="placements", placements=table)
    rt = runtime.get_runtime()
    layout = build_layout(cfg.parallelism, "placements", world, rank, rt.device, rt.backend)
    wrapped = wrap_model(model, cfg, layout)
    for _ in range(2):  # accumulation: each backward's partial gradient summed once
        wrapped.module(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
    return model.q_norm.weight.grad, ref.q_norm.weight.grad


@pytest.mark.parametrize("world", [2])
def test_per_head_norm_beside_colwise_gets_one_process_gradient(tmp_path, world):
    for got, want in run_ranks(_head_norm_grads, world, tmp_path):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
