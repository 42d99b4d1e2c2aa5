"""The dry run (``spmdgt.train._dryrun``) against real runs, at a scale that is not here, and
on bad input.

1. For 2 and 4 ranks under fsdp and ddp, the dry run's per-rank bytes of parameters,
   gradients and optimizer state, and the kind, count and bytes of one step's collectives,
   equal what a real gloo run of ``DistributedTrainer.train`` measures on each rank, counted
   by the same dispatch-mode counter (the third step: DDP's second rebuilds its buckets).
2. A 3.2-billion-parameter model (12.9 GB of fp32 weights) dry-runs at world 64 without
   allocating it, and a too-small device gets "does not fit" naming the biggest item.
3. Bad input is a ``DryRunError`` before anything is built.
4. The command line on the example script: exit status 1 and the verdict when it does not fit.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmdgt.train import DDPConfig, ParallelismConfig, TrainConfig, TrainingConfig
from spmdgt.train._dryrun import (
    CollectiveCounter,
    DryRunError,
    dry_run,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)
from tests._dist import run_ranks
from tests.train._models import IN, OUT, make_dataset, make_optimizer, make_stack

ROOT = Path(__file__).resolve().parents[2]
MICRO_BATCH = 4
STEPS = 3  # the last is compared: DDP rebuilds its buckets (two broadcasts) in the second


def _config(strategy: str, accum: int, name: str = "") -> TrainConfig:
    training = TrainingConfig(gradient_accumulation_steps=accum, max_grad_norm=1.0)
    placements = _example_plan() if strategy == "placements" else {}
    if strategy == "placements" and name.startswith("hf"):
        placements = "auto"  # Llama's plan, its LM head split for the loss (loss_parallel)
    ddp = DDPConfig(bucket_cap_mb=0.04)  # 40 KiB: the example's 137 KiB of gradients in 3 buckets
    # hf-sp: the residual stream split over the sequence too
    parallelism = ParallelismConfig(sequence_parallel=name == "hf-sp")
    return TrainConfig(
        strategy=strategy,
        log_every=100,
        training=training,
        placements=placements,
        ddp=ddp,
        parallelism=parallelism,
    )


def _example():
    """examples/train_transformer.py as a module (loaded once; forked ranks inherit it)."""
    import importlib.util
    import sys

    if "train_transformer" not in sys.modules:
        path = ROOT / "examples" / "train_transformer.py"
        spec = importlib.util.spec_from_file_location("train_transformer", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_transformer"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_transformer"]


def _example_plan() -> dict[str, str]:
    from spmdgt.train import load_train_config

    return load_train_config(ROOT / "examples" / "train_transformer.yaml").placements


SEQ = 16


def _model(name: str) -> tuple[nn.Module, object]:
    """A model and its loss function: the tests' ``Stack`` (FSDP shards of 11 rows: uneven),
    or the example's decoder, small (its rotary tables are buffers: DDP broadcasts them)."""
    if name == "stack":
        return make_stack(), F.mse_loss
    if name.startswith("hf"):  # its own loss over the step's label tokens (a world all-reduce)
        from tests._hf import tiny_llama

        return tiny_llama(), None
    ex = _example()
    torch.manual_seed(0)
    args = ex.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
    return ex.Transformer(args), ex.lm_loss


def _hf_rows(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` token rows, each padded (``-100`` labels) to its own length: HF's label-token
    count differs between ranks and micro-steps."""
    g = torch.Generator().manual_seed(n)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 128, (SEQ,), generator=g)
        labels = ids.clone()
        labels[SEQ - 1 - i % 5 :] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long),
                     "labels": labels})  # fmt: skip
    return rows


def _dataset(name: str, n: int):
    if name == "stack":
        return make_dataset(n=n)
    if name.startswith("hf"):
        return _hf_rows(n)
    ex = _example()
    return ex.TokenDataset(ex.load_tokens(None, n * SEQ + 1, 256, 0), SEQ)


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _real(rank: int, world: int, strategy: str, accum: int, name: str) -> dict:
    """One rank of a real run: the trainer's own loop for STEPS steps, its collectives
    counted per step, its local bytes measured (gradients just before each optimizer step)."""
    from spmdgt.train import DistributedTrainer, OptimizedDataLoader

    model, loss_fn = _model(name)
    optimizer = make_optimizer(model)
    trainer = DistributedTrainer(
        model, optimizer, loss_fn=loss_fn, config=_config(strategy, accum, name)
    )

    class PerStep(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.step = trainer.global_step  # the step in progress (0-based)
            return super().__torch_dispatch__(func, types, args, kwargs)

    grads: list[int] = []

    def grad_bytes(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grads.append(sum(_local_bytes(p.grad) for p in params))

    optimizer.register_step_pre_hook(grad_bytes)
    shard = strategy != "placements"
    data = _dataset(name, MICRO_BATCH * (world if shard else 1) * accum * STEPS)
    loader = OptimizedDataLoader.create(
        data, MICRO_BATCH, shuffle=False, shard=shard, num_workers=0
    )
    counter = PerStep()
    with counter:
        trainer.train(loader, max_steps=STEPS)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": sum(_local_bytes(p) for p in trainer.model.parameters()),
        "grads": grads[-1],
        "optimizer": sum(_local_bytes(v) for v in state),
        "collectives": counter.totals(step=STEPS - 1),
    }


def _builder(name: str):
    def build() -> tuple[nn.Module, torch.optim.Optimizer, tuple]:
        model, _ = _model(name)
        if name == "stack":
            batch = (torch.randn(MICRO_BATCH, IN), torch.randn(MICRO_BATCH, OUT))
        elif name.startswith("hf"):
            rows = _hf_rows(MICRO_BATCH)
            batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        else:
            tokens = torch.randint(0, 256, (MICRO_BATCH, SEQ))
            batch = (tokens, tokens)
        return model, make_optimizer(model), batch

    return build


@pytest.mark.parametrize(
    "strategy,world,accum,name",
    [
        # slow: fsdp at 4 ranks with accumulation and 2-rank transformers stand for them
        pytest.param("fsdp", 2, 1, "stack", marks=pytest.mark.slow),
        ("fsdp", 4, 2, "stack"),
        ("ddp", 2, 2, "stack"),
        ("ddp", 4, 1, "stack"),
        ("fsdp", 4, 1, "transformer"),
        pytest.param("ddp", 2, 1, "transformer", marks=pytest.mark.slow),
        ("placements", 2, 1, "transformer"),
        # HF's label-token count: one world all-reduce per step (before: 10 predicted, 11 real)
        ("fsdp", 2, 1, "hf"),
        ("ddp", 3, 2, "hf"),
        # TP with the LM head split: loss_parallel's all-reduces and the split logits (slow:
        # the next case splits the head too, and the residual stream over the sequence: its
        # gathers and scatters per sub-block)
        pytest.param("placements", 2, 2, "hf", marks=pytest.mark.slow),
        ("placements", 2, 2, "hf-sp"),
    ],
)
def test_dry_run_equals_a_real_run(strategy, world, accum, name, tmp_path):
    real = run_ranks(_real, world, tmp_path, strategy, accum, name)
    loss_fn = _model(name)[1]
    report = dry_run(_builder(name), world, _config(strategy, accum, name), loss_fn=loss_fn)
    assert report.params == [r["params"] for r in real]
    assert report.grads == [r["grads"] for r in real]
    assert report.optimizer == [r["optimizer"] for r in real]
    dry = {row.kind: {"count": row.count, "bytes": row.buffer_bytes} for row in report.collectives}
    for rank, r in enumerate(real):
        assert dry == r["collectives"], f"rank {rank}"
    kinds = {
        "fsdp": {"all_gather", "reduce_scatter", "all_reduce"},  # all_reduce: the clip's norm
        "ddp": {"all_reduce", "broadcast"} if name != "stack" else {"all_reduce"},
        "placements": {"all_reduce"},
    }[strategy]
    if name == "hf-sp":
        kinds = {"all_reduce", "all_gather", "reduce_scatter"}
    assert set(dry) == kinds
    if (strategy, name) == ("fsdp", "stack"):  # 11 rows over the ranks: uneven shards
        assert len(set(report.params)) == 2
    if name.startswith("hf"):  # the label-token count's all-reduce is in the step, as in a real one
        assert report.collectives_by_dim()["world"]["all_reduce"]["count"] >= 1


class _Deep(nn.Module):
    """16 small blocks in a ``layers`` list: FSDP's units, checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)) for _ in range(16)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_peak_equals_the_tracker_on_real_tensors():
    """The dry run's memory is what torch's tracker measures when the same wrapped model runs
    the same step on real tensors (the fake process group only: garbage values, real
    memory): faking the tensors changes no number. World 64, activation checkpointing, and
    the clip's norm over DTensor gradients, whose shape propagation must not count as memory
    (it would: a phantom copy of every full gradient, 4 MiB here against a 1.3 MiB peak)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from spmdgt.train._dryrun import fake_world
    from spmdgt.train._layout import Layout
    from spmdgt.train._strategies import clip_grad_norm, wrap_model

    cfg = TrainConfig(strategy="fsdp", activation_checkpointing=True)
    cfg.training.max_grad_norm = 1.0

    def build():
        torch.manual_seed(0)
        model = _Deep()
        return model, torch.optim.AdamW(model.parameters()), (torch.randn(8, 256),) * 2

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # F.mse_loss on real CPU tensors keeps its (out - y) for backward, its fake (and CUDA)
        # kernel does not: 8 KiB here. Spelled out, both keep the same tensors.
        return (out - y).pow(2).mean()

    report = dry_run(build, 64, cfg, loss_fn=loss_fn)
    with fake_world(64) as mesh:
        model, optimizer, (x, y) = build()
        layout = Layout("fsdp", 64, 0, torch.device("cpu"), "gloo", (1, 64, 1), dp_mesh=mesh)
        wrapped = wrap_model(model, cfg, layout)
        optimizer.param_groups[0]["params"] = list(wrapped.module.parameters())
        peaks = []
        for _ in range(2):  # a tracker per step, the batch counted as inputs: a real run's meter
            tracker = FSDPMemTracker(wrapped.module, optimizer)
            with tracker:
                tracker.track_inputs((x, y))
                loss_fn(wrapped.module(x), y).backward()
                clip_grad_norm(list(wrapped.module.parameters()), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
        peak = max(peaks, key=lambda snap: snap["Total"])
    assert report.peak == peak["Total"]
    assert report.peak_breakdown.get("activations", 0) == peak["Activation"]
    assert report.peak_breakdown["unsharded params"] == peak["Unsharded Param"]


class _Big(nn.Module):
    """12 layers of 16384 x 16384: 3.2 B parameters, 12.9 GB of fp32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16384, 16384, bias=False) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build_big() -> tuple[nn.Module, torch.optim.Optimizer, tuple]:
    model = _Big()
    return model, torch.optim.AdamW(model.parameters()), (torch.randn(2, 16384),) * 2


def test_a_model_too_big_for_this_machine_at_world_64():
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    report = dry_run(
        _build_big,
        64,
        TrainConfig(strategy="fsdp"),
        loss_fn=F.mse_loss,
        device="h100",
        interconnect="ib-ndr",
    )
    took = time.perf_counter() - t0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown < 1 << 20, f"the dry run grew this process by {grown / 1024:.0f} MiB"
    assert took < 30, took
    assert report.parameters == 12 * 16384**2
    shard = 12 * 16384**2 * 4 // 64
    assert report.params == [shard] * 64 and report.grads == [shard] * 64
    assert report.optimizer == [2 * shard + 12 * 4] * 64  # exp_avg, exp_avg_sq, step
    counts = {row.kind: row.count for row in report.collectives}
    assert counts == {"all_gather": 24, "reduce_scatter": 12}  # 12 units, resharded
    assert report.fits and report.verdict().startswith("fits in 79.65 GiB per device")
    assert all(row.seconds > 0 for row in report.collectives)

    small = dataclasses.replace(report, device_memory=parse_bytes("2GB"), device=None)
    name, size = small.biggest_item()
    assert size == max(small.peak_breakdown.values())
    assert small.fits is False
    assert small.verdict().startswith("does not fit in 1.86 GiB per device")
    assert f"the biggest item is {name}" in small.verdict()
    assert "does not fit" in str(small)


def _never_called():
    raise AssertionError("bad input must be refused before the model is built")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"world": 0}, "world size must be an integer >= 1, got 0"),
        ({"world": 2.5}, "world size must be an integer"),
        (
            {"world": 4, "interconnect": "nvlink9"},
            "unknown interconnect 'nvlink9'; known: .*nvlink4",
        ),
        ({"world": 4, "device": "h1000"}, "unknown device 'h1000'; known: .*h100"),
        ({"world": 4, "bandwidth": "fast"}, "not a bandwidth: 'fast'"),
        ({"world": 4, "device_memory": "-1GB"}, "not a memory size"),
        ({"world": 4, "headroom": 1.5}, "headroom must be a fraction"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    with pytest.raises(DryRunError, match=match):
        dry_run(_never_called, **kwargs)


def test_units():
    assert parse_bandwidth("400Gb/s") == parse_bandwidth("50GB/s") == 50e9
    assert parse_bandwidth("12.5 GB/s") == 12.5e9
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80e9
    assert parse_seconds("20us") == pytest.approx(2e-5)


def test_command_line_on_the_example(capsys):
    from spmdgt.scripts.dryrun import main

    script = str(ROOT / "examples" / "train_transformer.py")
    args = ["--world", "64", "--device-memory", "1MB", "--interconnect", "nvlink4", script]
    status = main([*args, "--strategy", "fsdp", "--dim", "32", "--layers", "2", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "dry run: fsdp on 64 rank(s)" in out
    assert "does not fit in 976.56 KiB per device" in out
    assert "all_gather" in out and "reduce_scatter" in out


def test_command_line_models_the_backend(tmp_path):
    # gloo runs FSDP's reduce-scatter on a full copy of its input (NCCL and the fake group do
    # not): --backend gloo adds that copy, so its peak is never below nccl's and the JSON says
    import json

    from spmdgt.scripts.dryrun import main

    script = str(ROOT / "examples" / "train_transformer.py")
    peaks = {}
    for backend in ("nccl", "gloo"):
        out = tmp_path / f"{backend}.json"
        args = ["--world", "2", "--backend", backend, "--json", str(out), script]
        # wide and short: parameters, not activations, make the peak (at the reduce-scatter)
        shape = ["--dim", "256", "--layers", "1", "--seq-len", "4", "--batch-size", "2"]
        assert main([*args, "--strategy", "fsdp", *shape]) == 0
        peaks[backend] = json.loads(out.read_text())["peak"]
    assert peaks["gloo"] > peaks["nccl"] > 0, peaks
    with pytest.raises(SystemExit):
        main(["--world", "2", "--backend", "mpi", script])


def test_a_script_that_never_trains(tmp_path, capsys):
    from spmdgt.scripts.dryrun import main

    script = tmp_path / "idle.py"
    script.write_text("import torch\nx = torch.ones(3)\n")
    assert main(["--world", "8", str(script)]) == 2
    assert "without calling DistributedTrainer(...).train(loader)" in capsys.readouterr().err
