"""A world of one (plain ``python``): the loop, AMP, summary, TensorBoard, traces, profilers."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
import torch.nn.functional as F

from spmdgt.config import ConfigError
from spmdgt.train import (
    CommunicationProfiler,
    DistributedTrainer,
    OptimizedDataLoader,
    PerformanceProfiler,
    TrainConfig,
)
from spmdgt.train._summary import ProgressBar
from tests.train._models import (
    HIDDEN,
    IN,
    OUT,
    make_dataset,
    make_model,
    make_optimizer,
    reference_train,
)

SUMMARY_KEYS = {
    "num_steps",
    "avg_step_time",
    "min_step_time",
    "max_step_time",
    "throughput_samples_per_sec",
    "avg_loss",
    "final_loss",
    "peak_memory_allocated_gb",
    "avg_memory_allocated_gb",
    "memory_kind",
    "peak_rss_gb",
    "avg_rss_gb",
    "warmup_steps_excluded",
    "comm_time_share",
}


def _loader(bs=8):
    return OptimizedDataLoader.create(make_dataset(), bs, shuffle=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_world_one_matches_plain_torch(strategy, capsys):
    model = make_model()
    t = DistributedTrainer(
        model, make_optimizer(model), strategy=strategy, loss_fn=F.mse_loss, max_grad_norm=0.5
    )
    summary = t.train(_loader(), epochs=1)
    ref, ref_losses = reference_train(make_dataset(), 8, 6, max_grad_norm=0.5)
    # 1e-6: same ops as the reference except the clip norm is summed in another order.
    for k, v in ref.items():
        torch.testing.assert_close(t.model.state_dict()[k], v, atol=1e-6, rtol=0)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["num_steps"] == 6 and summary["warmup_steps_excluded"] == 2
    assert summary["min_step_time"] <= summary["avg_step_time"] <= summary["max_step_time"]
    assert summary["final_loss"] == pytest.approx(ref_losses[-1], abs=1e-6)
    assert summary["avg_loss"] == pytest.approx(sum(ref_losses) / 6, abs=1e-6)
    assert summary["throughput_samples_per_sec"] == pytest.approx(
        8 * 4 / sum(t.last_stats.step_times[2:]), rel=1e-9
    )
    assert summary["comm_time_share"] == 0.0 and summary["peak_memory_allocated_gb"] > 0
    out = capsys.readouterr().out
    assert "Training Summary\n" + "=" * 50 in out and "num_steps: 6" in out


def test_amp_autocasts_to_bf16_on_cpu():
    seen = []

    def loss_fn(out, y):
        seen.append(out.dtype)
        return F.mse_loss(out.float(), y)

    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=loss_fn, use_amp=True)
    s = t.train(_loader(), epochs=1, max_steps=2)
    assert seen == [torch.bfloat16, torch.bfloat16]  # LayerNorm output under autocast: bf16
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # master weights fp32
    assert math.isfinite(s["final_loss"]) and t.scaler is None  # bf16 needs no scaler


def test_model_returning_its_loss_and_token_throughput():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.out = torch.nn.Linear(8, 16)

        def forward(self, batch):
            ids = batch[0]
            logits = self.out(self.emb(ids[:, :-1]))
            return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    ds = torch.utils.data.TensorDataset(torch.randint(0, 16, (20, 5)))
    model = LM()
    t = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    s = t.train(OptimizedDataLoader.create(ds, 4), epochs=1)
    assert s["num_steps"] == 5
    assert s["throughput_tokens_per_sec"] == pytest.approx(5 * s["throughput_samples_per_sec"])


def test_bad_inputs_raise_clear_errors():
    model = make_model()
    with pytest.raises(ConfigError, match="unknown strategy 'zero'"):
        DistributedTrainer(model, make_optimizer(model), strategy="zero")
    cfg = TrainConfig(strategy="placements", placements={"layers.*.up": "colwise"})
    with pytest.raises(ConfigError, match=r"match no module.*up, down, norm"):
        DistributedTrainer(model, make_optimizer(model), config=cfg)
    cfg = TrainConfig(strategy="placements", placements={"norm": "colwise"})
    with pytest.raises(ConfigError, match=r"needs an nn\.Linear"):
        DistributedTrainer(model, make_optimizer(model), config=cfg)
    # a module with parameters beside a colwise layer (a per-head norm) that the table does
    # not name: refused before any step, by name; naming it says what it reads
    attn = torch.nn.ModuleDict(
        {
            "q_proj": torch.nn.Linear(8, 8),
            "q_norm": torch.nn.LayerNorm(4),
            "o_proj": torch.nn.Linear(8, 8),
        }
    )
    table = {"q_proj": "colwise", "o_proj": "rowwise"}
    cfg = TrainConfig(strategy="placements", placements=table)
    with pytest.raises(ConfigError, match=r"'q_norm' \(LayerNorm\).*beside the colwise 'q_proj'"):
        DistributedTrainer(attn, make_optimizer(attn), config=cfg)
    for style in ("replicate", "sharded_input"):
        cfg = TrainConfig(strategy="placements", placements={**table, "q_norm": style})
        DistributedTrainer(attn, make_optimizer(attn), config=cfg)
    t = DistributedTrainer(model, make_optimizer(model))  # no loss_fn, model output not scalar
    with pytest.raises(ValueError, match="loss_fn"):
        t.train(_loader(), max_steps=1)
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        DistributedTrainer(make_model(), other, strategy="fsdp", config=TrainConfig())


def test_tensorboard_scalars_and_profiler_traces(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, logdir=str(tmp_path))
    t.train(_loader(), epochs=1, profile=True)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/step_time_sec", "perf/rss_gb"} <= tags
    assert "perf/memory_allocated_gb" not in tags  # on CPU no allocator count: RSS, named so
    assert {"perf/throughput_samples_per_sec"} <= tags
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert loss == pytest.approx(t.last_stats.global_losses)
    traces = list((tmp_path / "profile").glob("rank0*.pt.trace.json*"))
    assert traces, list(tmp_path.rglob("*"))


def test_progress_lines_when_stdout_is_not_a_terminal(capsys):
    # pytest captures stdout into a file: no terminal, so no bar, and a line per loss flush.
    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, log_every=2)
    t.train(_loader(), epochs=1)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    losses = t.last_stats.global_losses
    assert len(lines) == 3 and "\r" not in out  # steps 2, 4, 6 of 6
    for i, line in enumerate(lines):
        window = losses[2 * i : 2 * i + 2]
        mean = sum(window) / 2
        assert line.startswith(f"step {2 * i + 2}/6 loss {window[-1]:.4f} ")
        assert f"(mean of last 2: {mean:.4f})" in line and " ms/step " in line
        assert " TFLOP/s/dev MFU " in line and " elapsed " in line
        assert " mem " in line and " GB rss " in line  # the tensor peak, and the RSS apart
    assert out.index(lines[-1]) < out.index("Training Summary")


def test_log_every_and_max_steps_from_the_config(capsys):
    # The config is the place: the same progress lines as log_every=2 above, and max_steps
    # from training.max_steps (a train() keyword overrides it for that call only).
    from spmdgt.train import TrainingConfig

    cfg = TrainConfig(log_every=2, training=TrainingConfig(max_steps=4))
    model = make_model()
    t = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, config=cfg)
    assert t.train(_loader(), epochs=1)["num_steps"] == 4
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["2/4", "4/4"]
    assert t.train(_loader(), epochs=1, max_steps=5)["num_steps"] == 1  # resumes at step 4
    assert t.config.training.max_steps == 4


def test_progress_bar_only_on_a_tty():
    class TTY(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = TTY(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar(4, True, stream)
        window = {"step_time": 0.02, "tokens_per_sec_per_device": 1234.0}
        window |= {"tflops_per_device": 0.0125, "mfu": 0.0312, "data_wait_share": 0.04}
        window |= {"memory_peak": 1.5e9, "rss": 2.25e9}
        bar.update(2, 0.5, window)
        bar.report(2, [0.75, 0.5], window)
        bar.close()
    assert tty.getvalue().startswith("\r[" + "#" * 15 + "-" * 15 + "] 2/4 loss 0.5000 20.0 ms/step")
    # the bar shows what a progress line shows: rates, MFU, the tensor peak and the RSS
    assert tty.getvalue().endswith("MFU 3.1% data 4% mem 1.5 GB rss 2.25 GB\n")
    assert "mean of last" not in tty.getvalue()  # the bar shows progress on a terminal
    assert pipe.getvalue().startswith(
        "step 2/4 loss 0.5000 (mean of last 2: 0.6250) 20.0 ms/step 1,234 tok/s/dev "
        "0.0125 TFLOP/s/dev MFU 3.1% data 4% mem 1.5 GB rss 2.25 GB elapsed"
    )
    assert pipe.getvalue().count("\n") == 1 and "[" not in pipe.getvalue()
    for off in (TTY(), io.StringIO()):  # not rank 0: neither
        bar = ProgressBar(4, False, off)
        bar.update(1, 0.1, {"step_time": 0.1})
        bar.report(1, [0.1], {"step_time": 0.1})
        assert off.getvalue() == ""


def test_performance_profiler_sections_and_percent(capsys):
    prof = PerformanceProfiler()
    prof.times["step"] = [0.1, 0.1]
    prof.times["forward"] = [0.05, 0.05]
    with prof.profile("backward"):
        pass
    prof.record_gpu_memory()
    s = prof.summary()
    assert s["forward"]["percent_of_step"] == pytest.approx(50.0)
    assert s["memory"]["peak_gb"] > 0
    prof.print_summary()
    out = capsys.readouterr().out
    assert "forward" in out and "50.0%" in out and "CPU RSS" in out


def test_comm_cost_algebra():
    model = make_model()
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    lat, bw = 1e-4, 1e9  # per collective, bus bytes/s
    prof = CommunicationProfiler(bandwidth=bw, latency=lat)
    ddp = prof.estimate_ddp_comm_cost(model, world_size=4)
    assert ddp["bytes_per_rank"] == pytest.approx(2 * 3 / 4 * nbytes)
    # the whole model (about 0.5 kB) fits one 25 MiB bucket: one all-reduce
    assert ddp["all_reduce_count"] == ddp["collectives"] == 1
    assert ddp["estimated_sec"] == pytest.approx(lat + ddp["bytes_per_rank"] / bw)
    assert ddp["latency_sec"] == pytest.approx(lat)
    # Buckets close once they reach the cap, walking parameters in reverse: with a 64-byte cap
    # norm.bias+norm.weight (24 B), down.bias (12 B) -> 36 < 64, then down.weight (132 B)
    # closes bucket 1; up.bias (44 B) + up.weight (264 B) close bucket 2.
    small = prof.estimate_ddp_comm_cost(model, 4, bucket_cap_mb=64 / 2**20)
    assert small["all_reduce_count"] == 2
    assert small["estimated_sec"] == pytest.approx(2 * lat + small["bytes_per_rank"] / bw)
    # FSDP2 pads dim 0 to a multiple of the world: 11 -> 12 rows, 3 -> 4 for world 4.
    padded = 4 * (12 * 6 + 12 + 4 * 11 + 4 + 4 + 4)
    fsdp = prof.estimate_fsdp_comm_cost(model, world_size=4)
    # forward all-gather + backward all-gather + reduce-scatter, (n-1)/n each
    assert fsdp["all_gather_bytes"] == pytest.approx(2 * 3 / 4 * padded)
    assert fsdp["reduce_scatter_bytes"] == pytest.approx(3 / 4 * padded)
    assert fsdp["bytes_per_rank"] == pytest.approx(3 * 3 / 4 * padded)
    # 3 units (up, down, norm; the root holds no parameters of its own): 6 gathers, 3 scatters
    assert (fsdp["all_gather_count"], fsdp["reduce_scatter_count"]) == (6, 3)
    assert fsdp["estimated_sec"] == pytest.approx(9 * lat + fsdp["bytes_per_rank"] / bw)
    no_reshard = prof.estimate_fsdp_comm_cost(model, 4, reshard_after_forward=False)
    assert no_reshard["all_gather_bytes"] == pytest.approx(3 / 4 * padded)
    assert no_reshard["all_gather_count"] == 3
    accum = prof.estimate_fsdp_comm_cost(model, 4, micro_steps=4)  # gathers scale, RS do not
    assert (accum["all_gather_count"], accum["reduce_scatter_count"]) == (24, 3)
    # Placements: rowwise 'down' all-reduces its [8, 3] fp32 output per micro-step; colwise
    # 'up' reads the raw batch (no gradient to reduce); the clip adds one all-reduce of the
    # 4 sharded gradients' norms (up and down, weight and bias: one fp32 each).
    tp = prof.estimate_placements_comm_cost(
        make_model(hidden=12), 4, {"up": "colwise", "down": "rowwise"}, torch.randn(8, IN), 2
    )
    assert tp["all_reduce_count"] == 2 * 1 + 1
    assert tp["bytes_per_rank"] == pytest.approx(2 * 3 / 4 * (2 * 8 * 3 * 4 + 4 * 4))
    assert prof.estimate_ddp_comm_cost(model, world_size=1)["bytes_per_rank"] == 0
    # A world of one has no peer to probe: the time for 4 ranks is unknown, not 0, and so it
    # is when only the bandwidth is known.
    for p in (CommunicationProfiler(), CommunicationProfiler(bandwidth=bw)):
        unknown = p.estimate_ddp_comm_cost(model, world_size=4)
        assert math.isnan(unknown["estimated_sec"]) and unknown["bytes_per_rank"] > 0
    assert (IN, HIDDEN, OUT) == (6, 11, 3)


@pytest.mark.parametrize(
    ("cores", "local_world", "workers"),
    [(16, 2, 7), (16, 1, 8), (64, 1, 8), (2, 2, 0), (2, 1, 1), (1, 1, 0), (12, 4, 2)],
)
def test_data_loader_default_workers(monkeypatch, cores, local_world, workers):
    # cores per local rank minus one (the rank's own), capped at 8; what the loader gets here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    loader = OptimizedDataLoader.create(make_dataset(), 5)
    assert loader.num_workers == workers
    if workers:
        assert loader.prefetch_factor == 2 and loader.persistent_workers is True


def test_data_loader_defaults_and_overrides():
    loader = OptimizedDataLoader.create(make_dataset(), 5, num_workers=0)
    assert loader.num_workers == 0 and loader.pin_memory is False  # no CUDA here
    assert sorted(i for b in loader.sampler for i in [b]) == list(range(48))
    loader = OptimizedDataLoader.create(make_dataset(), 5, num_workers=1, prefetch_factor=3)
    assert loader.num_workers == 1 and loader.prefetch_factor == 3
    assert sum(len(b[0]) for b in loader) == 48
