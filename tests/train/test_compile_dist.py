"""``TrainConfig(compile=True)`` on 2 ranks against one-process eager torch.

Each strategy trains ``Stack`` (a ``layers`` ModuleList of residual blocks; FSDP shards uneven,
6/5) with its blocks compiled, in torchtitan's order (tensor parallel, activation
checkpointing, compile, FSDP), and must reproduce one eager process on the same data: every
step's loss, the final weights, and the gradients of one more step.

Backend ``aot_eager``: dynamo's graph capture, AOT autograd's joint graph and decompositions,
compiled backward included, without inductor's code generation (seconds instead of tens of
seconds per compile; inductor's speed is the benchmark's business). Tolerance 1e-5 absolute,
as the eager distributed tests: the per-rank means are summed in another order (~1e-7), and the
decomposed ops round like the eager ones.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.distributed.tensor.parallel
import torch.nn.functional as F
from torch._dynamo.utils import counters

from spmdgt.config import ConfigError
from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig
from spmdgt.train._compile import CompileError
from tests._dist import run_ranks
from tests.train._models import (
    full_state,
    make_dataset,
    make_model,
    make_optimizer,
    make_stack,
    reference_stack,
    reference_train,
)

GLOBAL_BATCH, STEPS, CLIP = 8, 4, 0.5
TP_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise", "layers.*.norm": "replicate"}
TOL = {"atol": 1e-5, "rtol": 0}


def _register_failing_backend(fail_ranks: tuple[int, ...], rank: int) -> str:
    """A backend that raises on ``fail_ranks`` and is ``aot_eager`` elsewhere."""
    from torch._dynamo import lookup_backend, register_backend

    real = lookup_backend("aot_eager")

    def fails_here(gm, example_inputs):
        if rank in fail_ranks:
            raise RuntimeError("injected compile failure")
        return real(gm, example_inputs)

    name = "gt_test_fails_on_" + "_".join(map(str, fail_ranks))
    register_backend(fails_here, name=name)
    return name


def _clean(name: str) -> str:
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def _train(rank, world, strategy, compile, ac, backend, log_every):
    model = make_stack()
    cfg = TrainConfig(
        strategy=strategy,
        placements=TP_PLAN if strategy == "placements" else {},
        compile=compile,
        compile_backend=backend,
        activation_checkpointing=ac,
    )
    trainer = DistributedTrainer(
        model,
        make_optimizer(model),
        loss_fn=F.mse_loss,
        max_grad_norm=CLIP,
        config=cfg,
        log_every=log_every,
    )
    shard = strategy != "placements"
    per_rank = GLOBAL_BATCH // (world if shard else 1)
    loader = OptimizedDataLoader.create(make_dataset(), per_rank, shuffle=False, shard=shard)
    return trainer, trainer.train(loader, max_steps=STEPS)


def _run(rank, world, strategy, compile=True, ac=False, fail_ranks=None, log_every=10):
    backend = "aot_eager" if fail_ranks is None else _register_failing_backend(fail_ranks, rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer, summary = _train(rank, world, strategy, compile, ac, backend, log_every)
    shard = strategy != "placements"
    state = full_state(trainer.model)
    # One more forward/backward on the first global batch (this rank's part of it, as the
    # sampler deals it: rank, rank + world, ...), gradients synchronised by the strategy.
    x, y = make_dataset().tensors
    xs, ys = (x[rank:GLOBAL_BATCH:world], y[rank:GLOBAL_BATCH:world]) if shard else (x[:8], y[:8])
    F.mse_loss(trainer.model(xs), ys).backward()
    grads = {}
    for n, p in trainer.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[_clean(n)] = g.detach().clone()
    blocks = trainer.model.module.layers if strategy == "ddp" else trainer.model.layers
    comp = trainer.wrapped.compiled
    return {
        "state": state,
        "losses": trainer.last_stats.global_losses,
        "grads": grads,
        "summary": summary,
        "stdout": out.getvalue(),
        "compiled": comp.blocks if comp is not None else None,
        "forward_replaced": ["forward" in b.__dict__ for b in blocks],
        "graphs": counters["stats"]["unique_graphs"],
    }


def _check_numbers(results):
    ref_state, ref_losses, ref_grads = reference_stack(make_dataset(), GLOBAL_BATCH, STEPS, CLIP)
    for r in results:
        assert r["summary"]["num_steps"] == STEPS
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
        assert set(r["grads"]) == set(ref_grads)
        for k, v in ref_grads.items():
            torch.testing.assert_close(r["grads"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(("strategy", "ac"), [("ddp", False), ("fsdp", True), ("placements", True)])
def test_compiled_blocks_match_eager(tmp_path, strategy, ac):
    """Per-block compile (with activation checkpointing for fsdp and placements: the whole
    TP -> AC -> compile -> FSDP order) equals one eager process within 1e-5."""
    results = run_ranks(_run, 2, tmp_path, strategy, True, ac, timeout=240)
    _check_numbers(results)
    for r in results:
        assert r["compiled"] == ["layers.0", "layers.1"]
        assert r["forward_replaced"] == [True, True]
        assert r["graphs"] >= 1  # dynamo captured the blocks
        s = r["summary"]
        assert s["compile_backend"] == "aot_eager" and s["compiled_blocks"] == 2
        assert s["compile_steps"] >= 1 and s["compile_time_sec"] > 0
        assert s["compile_fallback"] == "none"


def test_gt_compile_0_trains_eagerly(tmp_path):
    """GT_COMPILE=0 vetoes compile=True: nothing compiled, one line on rank 0, eager numbers."""
    results = run_ranks(_run, 2, tmp_path, "fsdp", env={"GT_COMPILE": "0"})
    _check_numbers(results)
    for r in results:
        assert r["compiled"] is None
        assert r["forward_replaced"] == [False, False]
        assert r["summary"]["compile_backend"] == "off (GT_COMPILE=0)"
    assert "GT_COMPILE=0: compile=True ignored, training eagerly" in results[0]["stdout"]
    assert "compile_backend: off (GT_COMPILE=0)" in results[0]["stdout"]
    assert results[1]["stdout"] == ""


def test_compile_failure_on_one_rank_falls_back_on_every_rank(tmp_path):
    """A backend failing on rank 1 only: rank 1 runs that block eagerly, the next loss flush
    tells every rank, every rank turns compilation off; the numbers stay eager's."""
    results = run_ranks(_run, 2, tmp_path, "fsdp", True, False, (1,), 2, timeout=240)
    _check_numbers(results)
    for r in results:
        reason = r["summary"]["compile_fallback"]
        assert reason.startswith("rank 1: layers.0: RuntimeError: injected compile failure")
        assert "rank 0" not in reason
        assert r["forward_replaced"] == [False, False]  # every block eager again
    assert "torch.compile failed (rank 1: layers.0" in results[0]["stdout"]


def _placements_failure(rank, world):
    with pytest.raises(CompileError, match=r"block 'layers\.0'.*injected compile failure"):
        _run(rank, world, "placements", True, False, (0, 1))
    return True


def test_compile_failure_with_collectives_in_blocks_is_an_error(tmp_path):
    """Tensor parallel blocks hold collectives: a compile failure raises CompileError naming
    the block (an eager block on one rank could order them differently)."""
    assert run_ranks(_placements_failure, 2, tmp_path) == [True, True]


def _disagree(rank, world):
    if rank == 1:
        os.environ["GT_COMPILE"] = "0"
    model = make_stack()
    with pytest.raises(ConfigError, match=r"rank 0: compile, rank 1: eager \(GT_COMPILE=0\)"):
        DistributedTrainer(
            model, make_optimizer(model), loss_fn=F.mse_loss, config=TrainConfig(compile=True)
        )
    return True


def test_ranks_disagreeing_on_compile_is_an_error_on_every_rank(tmp_path):
    assert run_ranks(_disagree, 2, tmp_path) == [True, True]


def test_compile_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compile: true\ncompile_backend: no_such_backend\n")
    from spmdgt.train import load_train_config

    with pytest.raises(ConfigError, match=r"compile_backend.*no_such_backend"):
        load_train_config(bad)
    with pytest.raises(ConfigError, match="compile"):
        TrainConfig(compile="yes")
    ok = tmp_path / "ok.yaml"
    ok.write_text("compile: true\ncompile_backend: aot_eager\nactivation_checkpointing: true\n")
    cfg = load_train_config(ok)
    assert cfg.compile and cfg.compile_backend == "aot_eager" and cfg.activation_checkpointing


def _mlp_fsdp(rank, world):
    """No block list: FSDP's units (up, down, norm) are compiled one by one."""
    model = make_model()
    trainer = DistributedTrainer(
        model,
        make_optimizer(model),
        strategy="fsdp",
        loss_fn=F.mse_loss,
        max_grad_norm=CLIP,
        config=TrainConfig(compile=True, compile_backend="aot_eager"),
    )
    per_rank = GLOBAL_BATCH // world
    loader = OptimizedDataLoader.create(make_dataset(), per_rank, shuffle=False)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(loader, max_steps=STEPS)
    blocks = trainer.wrapped.compiled.blocks
    return full_state(trainer.model), trainer.last_stats.global_losses, blocks


def test_model_without_block_list_compiles_fsdp_units(tmp_path):
    results = run_ranks(_mlp_fsdp, 2, tmp_path, timeout=240)
    ref, ref_losses = reference_train(make_dataset(), GLOBAL_BATCH, STEPS, max_grad_norm=CLIP)
    for state, losses, compiled in results:
        assert compiled == ["up", "down", "norm"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
