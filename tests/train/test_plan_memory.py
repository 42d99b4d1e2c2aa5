"""The planner's predicted peak per rank of every FSDP candidate (HSDP and FSDP x TP among
them, with and without activation checkpointing, with and without accumulation, FSDP's
gradients held whole or sharded between micro-steps) against a dry run of that same
candidate at world 4: within 5% (GPT-2 under accumulation: 6%).

The planner prices each candidate from a few calibration dry runs of a one- and two-block
copy (``_plan/_calibrate.py``); the candidate's own dry run is the reference (it matches a
real run's tracked peak: ``tests/train/test_dryrun_peak.py``). Composing the world-1
checkpointing run with FSDP's extra measured without checkpointing under-predicted FSDP
with checkpointing by up to 15% (the peak is in the backward there, beside the recomputed
block and the gradients reduced so far).
"""

from __future__ import annotations

import pytest
import torch

from spmdgt.train._plan import plan
from spmdgt.train._plan._calibrate import dry_run_peak
from tests.train.test_plan import _example

WORLD, GLOBAL_BATCH, TOLERANCE = 4, 16, 0.05


def _errors(model, batch, loss_fn, micro_batches, global_batch=GLOBAL_BATCH) -> dict[str, float]:
    """Each FSDP candidate's (predicted - dry run) / dry run."""
    got = plan(
        model,
        batch,
        world=WORLD,
        device="h100",
        global_batch=global_batch,
        loss_fn=loss_fn,
        micro_batches=micro_batches,
        amp=(False,),
        strategies=("fsdp",),
        jobs=1,
    )
    out = {}
    for e in got.ranked + got.dropped:
        peak = dry_run_peak(model, batch, e.candidate, loss_fn=loss_fn)
        out[e.candidate.label()] = (e.memory - peak) / peak
    return out


def _check(errors: dict[str, float], meshes: set[str], tolerance: float = TOLERANCE) -> None:
    assert {" AC " in k for k in errors} == {True, False}
    assert {k.split()[1] for k in errors} == meshes
    far = {k: f"{v:+.1%}" for k, v in errors.items() if abs(v) > tolerance}
    assert not far, f"predicted peaks off their dry runs by more than {tolerance:.0%}: {far}"


@pytest.mark.slow  # 13 dry runs, the TP ones slowest (~40 s); the GPT-2 test stands for it
def test_the_decoders_fsdp_peaks_are_its_dry_runs():
    """Three blocks (one more than the calibration's copy), TP 2 allowed: FSDP over 4,
    HSDP 2x2, FSDP 2 x TP 2 (2 accumulation steps)."""
    ex = _example()
    args = ["--dim", "32", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--seq-len", "16"]
    model = ex.build_model(ex.parse_args(args))
    x = torch.zeros(4, 16, dtype=torch.long)
    errors = _errors(model, (x, x), ex.lm_loss, [4])
    _check(errors, {"1x4x1", "2x2x1", "1x2x2"})


def test_gpt2s_fsdp_peaks_are_its_dry_runs():
    """Hugging Face GPT-2 on its own loss (no TP: Conv1D): FSDP over 4 and HSDP 2x2, with
    and without checkpointing (10 dry runs, ~20 s)."""
    from tests._hf import tiny_gpt2

    model = tiny_gpt2()
    ids = torch.zeros(4, 16, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    errors = _errors(model, batch, None, [4])
    _check(errors, {"1x4x1", "2x2x1"})


@pytest.mark.slow  # 8 dry runs and a calibration (~25 s)
def test_gpt2s_accumulation_peaks_both_ways_are_its_dry_runs():
    """GPT-2 under 2 accumulation steps, FSDP's gradients held whole between micro-steps or
    sharded (``accumulate_sharded``), with and without checkpointing. Checkpointed and held
    whole, the peak is at the last micro-step's loss with every gradient whole beside the
    new ones: priced without those new ones it read -15.8% (FSDP over 4) and -11.2% (HSDP);
    now -5.3% and -2.2%, the others within 4.1%. Within 6% (the first is the worst)."""
    from tests._hf import tiny_gpt2

    model = tiny_gpt2()
    ids = torch.zeros(4, 16, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    errors = _errors(model, batch, None, [4], global_batch=2 * GLOBAL_BATCH)
    assert {k.split()[4] for k in errors} == {"x2", "x2s"}
    _check(errors, {"1x4x1", "2x2x1"}, tolerance=0.06)


@pytest.mark.slow  # a calibration and a dry run (~10 s idle, 19 s loaded): the suite's time
def test_a_peak_in_the_optimizer_step_is_priced():
    """A wide decoder on 4-token rows: its largest moment is AdamW's update (foreach: the
    temporaries of a whole group at once), not the forward or backward. The calibration
    reads those bytes per parameter byte (``MemoryModel.optimizer_step``), and DDP's
    candidate, whose every rank holds all of AdamW's state, is priced by them: within 5% of
    its dry run, where without them it is read under it."""
    ex = _example()
    args = ["--dim", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "4"]
    model = ex.build_model(ex.parse_args(args))
    x = torch.zeros(4, 4, dtype=torch.long)
    got = plan(
        model,
        (x, x),
        world=WORLD,
        device="h100",
        global_batch=GLOBAL_BATCH,
        loss_fn=ex.lm_loss,
        micro_batches=[4],
        ac=(False,),
        amp=(False,),
        strategies=("ddp",),
        jobs=1,
    )
    assert got.memory_model.optimizer_step > 0
    (e,) = got.ranked + got.dropped
    over = e.memory_parts["optimizer step, over the step"]
    assert over > 0  # the optimizer step is this candidate's peak
    peak = dry_run_peak(model, (x, x), e.candidate, loss_fn=ex.lm_loss)
    assert abs(e.memory - peak) / peak <= TOLERANCE, (e.memory, peak)
    assert e.memory - over < peak  # without the optimizer step's bytes: under its dry run


def _meta_llama(blocks: int, width: int, ffn: int, vocab: int, seq: int):
    """A Llama shape on the meta device (nothing allocated; the dry runs fill it in)."""
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=seq,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return T.LlamaForCausalLM(cfg)


def _llama_plan(model, batch, **kw):
    """The planner's FSDP candidates for a meta Llama on its own loss, H100s, global batch 8."""
    fixed = dict(device="h100", global_batch=8, loss_fn=None, strategies=("fsdp",), jobs=1)
    return plan(model, batch, **fixed, **kw)


def test_finished_checkpointed_blocks_leave_nothing_behind():
    """What the planner reads a finished block's leavings from (``_left_behind``): a world-2
    FSDP + checkpointing dry run of a 3-block Llama reports the activations and temporaries
    at each block's backward start; each block whose backward is done frees its saved input
    (tokens x width, fp32) and leaves nothing. With HF's key/value cache on (the trainer
    turns it off: ``_batches.call_model``) the cache held each recomputed block's keys,
    values and the graph behind them to the backward's end, 3 x tokens x width more per
    block. ~3 s."""
    from spmdgt.train import TrainConfig
    from spmdgt.train._dryrun import dry_run
    from spmdgt.train._plan._calibrate import _builder, _forget_runtime
    from spmdgt.train._plan._fsdp_peaks import _left_behind

    seq, width = 256, 64
    model = _meta_llama(3, width, 128, 256, seq)
    ids = torch.zeros(1, seq, dtype=torch.long)
    build = _builder(model, {"input_ids": ids, "labels": ids}, torch.optim.AdamW)
    cfg = TrainConfig(strategy="fsdp", activation_checkpointing=True)
    try:
        report = dry_run(build, 2, cfg, loss_fn=None, backend="gloo")
    finally:
        _forget_runtime()
    units = report.before_backward
    at = {int(k.rpartition(".")[2]): v for k, v in units.items() if k[-1].isdigit()}
    assert sorted(at) == [0, 1, 2], report.before_backward
    first, second = at[1] - at[2], at[0] - at[1]  # block 2 is reached first
    assert first == second == -seq * width * 4, (first, second)
    assert _left_behind(report.before_backward) == 0


@pytest.mark.slow  # ~10 calibration dry runs and a 10-block one at world 8 (~60 s)
def test_a_deep_checkpointed_llamas_fsdp_peak_is_its_dry_run():
    """Ten blocks, FSDP over 8 with checkpointing, a vocabulary large enough that the
    calibration's 2-block peaks are at the loss (as at the Llama-3-8B shape): the deep
    candidate's peak is late in the backward, beside every finished block's leavings.
    Without them (the code before) it read 9.7% under its dry run."""
    seq = 1024
    model = _meta_llama(10, 256, 896, 4096, seq)
    ids = torch.zeros(1, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    got = _llama_plan(model, batch, world=8, micro_batches=[1], ac=(True,), amp=(False,))
    e = next(e for e in got.ranked + got.dropped if e.candidate.label().split()[1] == "1x8x1")
    peak = dry_run_peak(model, batch, e.candidate, loss_fn=None)
    assert abs(e.memory - peak) / peak <= TOLERANCE, (e.memory, peak)


@pytest.mark.slow  # ~12 calibration dry runs and the candidates' own at 24 blocks (~90 s)
def test_tp_under_checkpointing_keeps_each_blocks_input_whole():
    """FSDP 2 x TP 2 with checkpointing and AMP on a deep, long-sequence Llama (the blocks'
    saved inputs are a large share of the peak): within 2% of its dry run. A checkpointed
    block saves its input, the residual stream, which TP without sequence parallelism holds
    whole on every rank (``_calibrate.tp_share``); split as a whole block's activations it
    read 4.3% under here, and a Llama-3-70B shape's pick at TP 2 16% under."""
    seq = 2048
    model = _meta_llama(24, 64, 128, 2048, seq)
    ids = torch.zeros(4, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    got = _llama_plan(model, batch, world=WORLD, micro_batches=[2], amp=(True,))
    errors = {}
    for e in got.ranked + got.dropped:
        c = e.candidate
        if c.tp > 1 and c.ac:
            peak = dry_run_peak(model, batch, c, loss_fn=None)
            errors[c.label()] = (e.memory - peak) / peak
    assert errors
    far = {k: f"{v:+.1%}" for k, v in errors.items() if abs(v) > 0.02}
    assert not far, f"predicted peaks off their dry runs by more than 2%: {far}"
