"""Memory per rank, calibrated by a few dry runs and scaled, so a plan needs no dry run per
candidate.

The dry runs (``spmdgt.train._dryrun.dry_run``, its public entry point) run on a copy of the
model cut to one and two blocks, at the micro-batch given, so they take seconds at any size:

===========================  ===========================================================
run                           what it pins down
===========================  ===========================================================
world 1, 1 block and 2 blocks the step's dynamic peak (activations, backward temporaries) as
                              a part outside the blocks plus a part per block
world 1, 1 and 2 blocks, AC   a block's part with activation checkpointing (its input)
                              and the one block recomputed at a time
world 1, 1 and 2 blocks, AMP  the same two lines under autocast, with and without AC: AMP
(with and without AC)         moves them apart (a Llama's blocks shrink, its loss's part
                              grows: the logits in bf16 and again in fp32), so no one ratio
                              of fp32's will do (a Llama-3-70B shape's loss part under
                              AC and AMP read 8.5 GiB a row that way, 12.9 measured)
world 2 fsdp, 2 blocks        FSDP's step at its peak: the gathered units and collective
                              buffers, the activations and temporaries, and which block's
                              backward the peak is in (from the sharded gradients held)
world 2 fsdp, 2 blocks, AC    the same under activation checkpointing (its peak is in the
                              backward, beside a recomputed block and the gradients so far),
                              and its peak inside the first block's backward with the bytes
                              each finished block leaves to the backward's end
world 2 fsdp, 2 blocks, AMP   the two above under FSDP's AMP (MixedPrecisionPolicy: bf16
(with and without AC)         compute, fp32 reduce-scatter), not world 1's autocast
world 2 placements, 2 blocks  the share of a block's activations TP does not split
===========================  ===========================================================

"Dynamic" is the tracker's peak less parameters, buffers, optimizer state and gradients (what
``DryRunReport.peak_breakdown`` names so): what grows with the micro-batch. It scales
linearly with the micro-batch's rows and with the blocks; the static part is computed from
the parameters per rank (``_cost``). FSDP's peak is not the world-1 peak plus its gathered
units: under checkpointing it comes in the backward, where the recomputed block, the
prefetched and reduce-scattered blocks' buffers and the gradients reduced so far sit
together. Its runs are kept split (``FsdpPeak``) so ``_cost`` can walk a candidate's
blocks and take the largest.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spmdgt.train._config import ParallelismConfig, TrainConfig, TrainingConfig
from spmdgt.train._dryrun import DryRunError, DryRunReport, dry_run
from spmdgt.train._plan._fsdp_peaks import (
    FsdpPeak,
    _block_peak,
    _dynamic,
    _fsdp_peak,
    _late_peak,
    _Measured,
    _start_peak,
    _step_per_block,
)
from spmdgt.train._plan._model import ModelFacts, meta_copy, truncated

__all__ = [
    "FsdpPeak",
    "MemoryModel",
    "calibrate",
    "dry_run_peak",
    "guess_loss_fn",
    "tp_share",
]


@dataclass
class MemoryModel:
    """Bytes per rank of a step's dynamic peak, at ``rows`` rows per micro-batch."""

    rows: int
    opt_ratio: float
    """Optimizer state bytes per parameter byte (AdamW: 2)."""
    buffers: int
    rest: dict[tuple[bool, bool], float]
    """Dynamic bytes outside the blocks, by (activation checkpointing, AMP)."""
    block: dict[tuple[bool, bool], float]
    """Dynamic bytes per block, by (activation checkpointing, AMP)."""
    tp_keep: float = 1.0
    """Share of a block's dynamic bytes that tensor parallelism leaves whole on every rank."""
    tp_keep_ac: float | None = None
    """The same of a checkpointed step's bytes (its recomputed block, what finished blocks
    leave), from a TP run under checkpointing; ``None``: ``tp_keep``."""
    sequence_parallel: bool = False
    """The TP runs split the residual stream over the sequence (``tp_keep`` is theirs): a
    checkpointed block's saved input, the stream, is then ``1/tp`` a rank too."""
    rest_tp2: float | None = None
    """The bytes outside the blocks a rank holds at TP 2 over world 1's (``rest_share``),
    under ``loss_parallel`` (from two TP runs at 1 and 2 blocks); ``None``: the loss's
    logits whole on every rank, nothing outside the blocks split."""
    fsdp: dict[bool, FsdpPeak] = field(default_factory=dict)
    """FSDP's peak by activation checkpointing (empty, or without ``True``, where FSDP, or
    FSDP with checkpointing, was not calibrated)."""
    fsdp_second: dict[bool, FsdpPeak] = field(default_factory=dict)
    """A second peak of FSDP's run, walked like ``fsdp``'s and the larger taken. Under
    checkpointing the first block's backward (the last reached), beside what the finished
    blocks left (``FsdpPeak.left``): deep models peak there (the leavings grow with depth)
    even where the calibration copy's peak is at the loss. Without it the last block's
    backward (the first reached), where the run's own peak fell later: its temporaries are
    those of every block but block 0."""
    fsdp_amp: dict[bool, FsdpPeak] = field(default_factory=dict)
    """``fsdp`` and ``fsdp_second`` calibrated under FSDP's AMP (``FsdpPeak.amp``), where AMP
    is searched: its reduce-scatter stays fp32 while the rest is bf16, and the world-1 AMP
    run (autocast: fp32 weights cast per op) is no measure of it."""
    fsdp_second_amp: dict[bool, FsdpPeak] = field(default_factory=dict)
    amp_ratio: float = 1.0
    """The ratio AMP's bf16 makes of the dynamic bytes."""
    optimizer_step: float = 0.0
    """Bytes over the parameters, gradients, state and buffers at the optimizer step, per
    parameter byte, where a world-1 calibration run peaked there (``_optimizer_step``): a
    candidate's peak is the larger of its step's and its optimizer step's (``_cost``)."""
    runs: list[str] = field(default_factory=list)
    """Each dry run: what it was and its seconds."""

    def dynamic(self, rows: int, ac: bool, amp: bool, blocks: int, tp: int) -> float:
        if (ac, amp) not in self.block:
            raise ValueError(
                f"this memory model was calibrated without {'AMP' if amp else 'activation'}"
                f"{'' if amp else ' checkpointing'}: plan without memory_model= (or with one "
                "calibrated for the whole search)"
            )
        block = self.block[(ac, amp)] * tp_share(self, ac, tp)
        rest = self.rest[(ac, amp)] * rest_share(self, tp)
        return (rest + blocks * block) * rows / self.rows


def rest_share(mem: MemoryModel, tp: int) -> float:
    """The share of the bytes outside the blocks a rank holds under TP of degree ``tp``: all
    of them unless the output layer is split for the loss (``loss_parallel``), whose logits,
    log-probabilities and their gradients are then ``1/tp`` of a row's: the share measured
    at TP 2 (``rest_tp2``), halved again each time the degree doubles. (A line through the
    world-1 run and TP 2 read TP 4 20-30% over its dry runs: world 1 computes the loss
    unsplit, by other temporaries than ``loss_parallel``'s.)"""
    if tp == 1 or mem.rest_tp2 is None:
        return 1.0
    return min(1.0, mem.rest_tp2 * 2 / tp)


def tp_share(mem: MemoryModel, ac: bool, tp: int) -> float:
    """The share of a block's saved bytes a rank holds under TP of degree ``tp``. Under
    activation checkpointing a block saves its input alone: the residual stream, which TP
    without sequence parallelism holds whole on every rank (splitting it as the whole
    block's activations read a Llama-3-70B shape's 80 inputs at TP 2 as 13.1 GiB where its
    dry run held 20) and sequence parallelism splits over the ranks."""
    if tp == 1:
        return 1.0
    if ac:
        return 1 / tp if mem.sequence_parallel else 1.0
    return mem.tp_keep + (1 - mem.tp_keep) / tp


def _step_parts(r: DryRunReport) -> dict[str, int]:
    """The peak of the forwards and backwards by category (``DryRunReport.step_peak``), not
    the optimizer step's: what grows with the micro-batch is measured there (a 70B-shaped
    Llama's one-block copy peaks in its optimizer step, where no activation lives, and
    read 0 bytes of activations). The whole step's peak for reports without it."""
    return dict(r.step_peak) or {**r.peak_breakdown, "total": r.peak}


def _optimizer_step(r: DryRunReport) -> float:
    """Bytes at the step's peak over the parameters, buffers, gradients and optimizer state,
    per parameter byte, where that peak is the optimizer step's (its update's temporaries:
    AdamW's foreach works on a whole group at once); 0 where the forwards and backwards
    peak higher."""
    if not r.step_peak or r.peak <= r.step_peak.get("total", 0) or not r.params[0]:
        return 0.0
    held = r.params[0] + r.grads[0] + r.optimizer[0] + r.peak_breakdown.get("buffers", 0)
    return max(0.0, (r.peak - held) / r.params[0])


def guess_loss_fn(batch: object) -> Callable | None:
    """A loss for ``(inputs, targets)`` batches when none is given: cross-entropy over the
    last dim for integer targets (a language model's), else mean squared error; ``None``
    for other batches (the model returns its loss, as Hugging Face models do)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return None
    if not batch[1].is_floating_point():
        return lambda out, y: F.cross_entropy(out.flatten(0, -2).float(), y.flatten())
    return F.mse_loss


def _fake_batch(batch: object, rows: int | None = None) -> object:
    """The batch's shapes and dtypes as tensors made now (fake under the dry run's mode),
    with ``rows`` rows (dim 0) when given."""
    if isinstance(batch, torch.Tensor):
        shape = (rows, *batch.shape[1:]) if rows is not None and batch.ndim else batch.shape
        return torch.zeros(shape, dtype=batch.dtype)
    if isinstance(batch, dict):
        return {k: _fake_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(v, rows) for v in batch)
    return batch


def _materialize(model: nn.Module) -> nn.Module:
    """``model`` (a meta copy) with every parameter and buffer made anew by ``torch.empty``:
    fake tensors under the dry run's ``FakeTensorMode`` (no meta tensor reaches it), tied
    parameters still tied."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=p.dtype)
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[name] = made[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                mod._buffers[name] = made[id(b)]
    return model


def _builder(
    model: nn.Module, batch: object, optimizer: Callable, rows: int | None = None
) -> Callable:
    """``dry_run``'s ``build``: a fresh meta copy made here, filled in under its mode (the
    batch at ``rows`` rows when given)."""
    copy_ = meta_copy(model)

    def build():
        m = _materialize(copy_)
        return m, optimizer(m.parameters()), _fake_batch(batch, rows)

    return build


def dry_run_peak(
    model: nn.Module,
    batch: object,
    candidate,
    *,
    loss_fn: Callable | None,
    optimizer: Callable | None = None,
    base: TrainConfig | None = None,
    backend: str = "nccl",
) -> int:
    """The peak per rank of one candidate's own dry run (its config on its world, ``batch``
    at its micro-batch's rows): what the planner's composed prediction is checked against
    (``benchmarks/plan_memory.py``, ``tests/train/test_plan_memory.py``); the planner
    itself runs none per candidate."""
    opt = optimizer or (lambda params: torch.optim.AdamW(params))
    build = _builder(model, batch, opt, candidate.micro_batch)
    try:
        cfg = candidate.config(base)
        return dry_run(build, candidate.world, cfg, loss_fn=loss_fn, backend=backend).peak
    finally:
        _forget_runtime()


@dataclass(frozen=True)
class _Run:
    key: str
    label: str
    blocks: int | None
    world: int
    config: TrainConfig


def _plan_runs(facts: ModelFacts, needs: tuple[bool, bool, bool]) -> list[_Run]:
    """The dry runs the search needs (``needs``: activation checkpointing, AMP, FSDP are in
    it), slowest first (a worker pool finishes sooner). Each is independent of the others."""
    ac, amp, fsdp = needs
    cut = facts.blocks >= 2
    two = 2 if cut else None
    plain = TrainConfig(log_every=1000)
    ac_cfg = TrainConfig(activation_checkpointing=True)
    runs = []
    if cut and 2 in facts.tp_degrees(2):
        # the TP runs as the candidates run: with the stream split where the model allows it
        sp = ParallelismConfig(sequence_parallel=facts.sequence_parallel)
        tp_cfg = TrainConfig(strategy="placements", placements="auto", parallelism=sp)
        label = "placements: auto" + " + sequence_parallel" * facts.sequence_parallel
        runs.append(_Run("tp", f"{label}, world 2", two, 2, tp_cfg))
        if facts.loss_parallel:  # the split loss's bytes: a line in the blocks, as world 1's
            runs.append(_Run("tp1", f"{label}, world 2, 1 block", 1, 2, tp_cfg))
        if ac:  # what TP splits of a checkpointed step (its recomputed block, its loss)
            tp_ac = TrainConfig(
                strategy="placements",
                placements="auto",
                parallelism=sp,
                activation_checkpointing=True,
            )
            runs.append(_Run("tp_ac", f"{label} + checkpointing, world 2", two, 2, tp_ac))
    runs.append(_Run("base2", "world 1, 2 blocks" if cut else "world 1", two, 1, plain))
    on = TrainingConfig(use_amp=True)
    if amp:
        runs.append(_Run("amp", "AMP", two, 1, TrainConfig(training=on)))
    if amp and ac:
        both = TrainConfig(activation_checkpointing=True, training=on)
        runs.append(_Run("ac_amp2", "checkpointing + AMP, 2 blocks", two, 1, both))
    if fsdp:
        runs.append(_Run("fsdp", "fsdp, world 2", two, 2, TrainConfig(strategy="fsdp")))
    if fsdp and ac:
        fsdp_ac = TrainConfig(strategy="fsdp", activation_checkpointing=True)
        runs.append(_Run("fsdp_ac", "fsdp + checkpointing, world 2", two, 2, fsdp_ac))
    if fsdp and amp:
        # FSDP's AMP is its MixedPrecisionPolicy (bf16 parameters and compute, fp32
        # reduce-scatter), not world 1's autocast: its own runs, its own peaks
        runs.append(
            _Run(
                "fsdp_amp", "fsdp + AMP, world 2", two, 2, TrainConfig(strategy="fsdp", training=on)
            )
        )
        if ac:
            both = TrainConfig(strategy="fsdp", activation_checkpointing=True, training=on)
            runs.append(_Run("fsdp_ac_amp", "fsdp + checkpointing + AMP, world 2", two, 2, both))
    if ac:
        runs.append(_Run("ac2", "activation checkpointing, 2 blocks", two, 1, ac_cfg))
    if cut:
        runs.append(_Run("base1", "world 1, 1 block", 1, 1, plain))
        if ac:
            runs.append(_Run("ac1", "activation checkpointing, 1 block", 1, 1, ac_cfg))
        if amp:
            runs.append(_Run("amp1", "AMP, 1 block", 1, 1, TrainConfig(training=on)))
        if amp and ac:
            both = TrainConfig(activation_checkpointing=True, training=on)
            runs.append(_Run("ac_amp1", "checkpointing + AMP, 1 block", 1, 1, both))
    return runs


def _measure(model: nn.Module, batch: object, optimizer: Callable, loss_fn, run: _Run) -> _Measured:
    t0 = time.perf_counter()
    m = truncated(model, run.blocks) if run.blocks else model
    try:
        # the trainer's own lines (a derived table printed per run) are not the plan's output
        with contextlib.redirect_stdout(io.StringIO()):
            r = dry_run(_builder(m, batch, optimizer), run.world, run.config, loss_fn=loss_fn)
    finally:
        _forget_runtime()
    parts = _step_parts(r)
    return _Measured(
        dynamic=_dynamic(parts),
        parts=parts,
        before_backward=dict(r.before_backward),
        block_peak=_block_peak(r.backward_peaks, first=True),
        start_peak=_block_peak(r.backward_peaks, first=False),
        optimizer=r.optimizer[0],
        params=r.params[0],
        buffers=r.peak_breakdown.get("buffers", 0),
        seconds=time.perf_counter() - t0,
        optimizer_step=_optimizer_step(r),
    )


def _worker(conn, model, batch, optimizer, loss_fn, run: _Run) -> None:
    """A forked worker: one dry run, its result (or its error's text) sent back."""
    try:
        torch.set_num_threads(1)  # fake tensors: nothing to compute; the workers share cores
        conn.send(_measure(model, batch, optimizer, loss_fn, run))
    except BaseException as e:  # the parent raises it, with the run named
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers of the parent's state in the copy


def _execute(
    model: nn.Module,
    batch: object,
    optimizer: Callable,
    loss_fn,
    runs: list[_Run],
    jobs: int,
    log: Callable[[str], None],
) -> dict[str, _Measured]:
    """Every run's measurement: in this process when ``jobs`` is 1, else in up to ``jobs``
    forked workers at once (each dry run is a fresh trainer on its own fake world; a fork
    takes the model and batch as they are, nothing is pickled but the result)."""
    out: dict[str, _Measured] = {}
    t0 = time.perf_counter()

    def done(run: _Run, got: _Measured) -> None:
        out[run.key] = got
        log(
            f"calibrating memory: dry run {len(out)}/{len(runs)} ({run.label}) done in "
            f"{got.seconds:.1f}s ({time.perf_counter() - t0:.1f}s in)"
        )

    if jobs <= 1 or len(runs) == 1:
        for run in runs:
            done(run, _measure(model, batch, optimizer, loss_fn, run))
        return out
    ctx = mp.get_context("fork")
    waiting, busy = list(runs), {}
    log(f"calibrating memory: {len(runs)} dry runs, {jobs} at a time")
    while waiting or busy:
        while waiting and len(busy) < jobs:
            run = waiting.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(send, model, batch, optimizer, loss_fn, run))
            proc.start()
            send.close()
            busy[recv] = (run, proc)
        for recv in mp_connection.wait(list(busy)):
            run, proc = busy.pop(recv)
            try:
                got = recv.recv()
            except EOFError:
                got = f"the worker died (exit code {proc.exitcode})"
            proc.join()
            if isinstance(got, str):
                for _, other in busy.values():
                    other.kill()
                raise DryRunError(f"the planner's calibration dry run ({run.label}) failed: {got}")
            done(run, got)
    return out


def calibrate(
    model: nn.Module,
    batch: object,
    facts: ModelFacts,
    *,
    loss_fn: Callable | None,
    optimizer: Callable,
    log: Callable[[str], None] = lambda _: None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    jobs: int = 1,
) -> MemoryModel:
    """The memory model of ``model`` from its dry runs (see the module's table). ``needs``:
    whether activation checkpointing, AMP and FSDP are searched (runs for what is not are
    skipped, and the model refuses to price them); ``jobs``: dry runs at once."""
    runs = _plan_runs(facts, needs)
    got = _execute(model, batch, optimizer, loss_fn, runs, jobs, log)
    mem = _fit(
        model, facts, got, _rows(batch), [f"{r.label}: {got[r.key].seconds:.1f}s" for r in runs]
    )
    # under checkpointing a block keeps at least its input (a row's tokens x the width, in
    # the parameters' dtype): the world-1 line can read less (0 on the example decoder,
    # whose 1- and 2-block peaks are the recompute's)
    width = facts.flops.width if facts.flops else None
    tokens = _tokens(batch)
    if width and tokens and facts.parameters:
        element = facts.param_bytes / facts.parameters
        floor = mem.rows * tokens * width * element
        # the world-1 line too: its two runs may peak at different places (a 70B-shaped
        # Llama's 2-block copy in block 0's backward, its 1-block one at the loss: 0)
        for amp_on in (False, True):
            if (True, amp_on) in mem.block:
                low = floor / 2 if amp_on else floor
                mem.block[(True, amp_on)] = max(mem.block[(True, amp_on)], low)
        for peaks in (mem.fsdp, mem.fsdp_second, mem.fsdp_amp, mem.fsdp_second_amp):
            if True in peaks:
                low = floor / 2 if peaks[True].amp else floor
                peaks[True].saved = max(peaks[True].saved, low)
    return mem


def _line(two: float, one: float | None) -> tuple[float, float]:
    """(outside the blocks, per block) from the dynamic bytes at 2 blocks and at 1 (None:
    no blocks to cut, all of it outside)."""
    if one is None:
        return two, 0.0
    blk = max(0.0, two - one)
    return max(0.0, one - blk), blk


def _fit(
    model: nn.Module, facts: ModelFacts, got: dict[str, _Measured], rows: int, runs: list[str]
) -> MemoryModel:
    """The memory model from the runs' dynamic bytes (a line in the blocks per setting)."""
    base2 = got["base2"]
    d2 = base2.dynamic
    rest, blk = _line(d2, got["base1"].dynamic if "base1" in got else None)
    mem = MemoryModel(
        rows=rows,
        opt_ratio=base2.optimizer / max(base2.params, 1),
        buffers=base2.buffers,
        rest={(False, False): rest},
        block={(False, False): blk},
        runs=runs,
        sequence_parallel=facts.sequence_parallel,
        optimizer_step=max(m.optimizer_step for k, m in got.items() if k in ("base1", "base2")),
    )
    if "ac2" in got:
        # Under AC a block keeps its input, and the one block being recomputed holds its
        # whole activations at the peak: a part per block plus a constant.
        one = got["ac1"].dynamic if "ac1" in got else None
        mem.rest[(True, False)], mem.block[(True, False)] = _line(got["ac2"].dynamic, one)
    if "amp" in got:
        # AMP's own lines, measured: its ratio to fp32's differs between the blocks and the
        # loss (8B-shaped Llama: 0.76 a block, 1.08 outside), so one ratio read the loss low
        mem.amp_ratio = got["amp"].dynamic / d2 if d2 else 1.0
        lines = (("amp", "amp1", False), ("ac_amp2", "ac_amp1", True))
        for two_key, one_key, ac_on in lines:
            if two_key in got and (ac_on, False) in mem.rest:
                one = got[one_key].dynamic if one_key in got else None
                mem.rest[(ac_on, True)], mem.block[(ac_on, True)] = _line(got[two_key].dynamic, one)
    blocks = min(facts.blocks, 2)
    units = _unit_bytes(model, 2 if facts.blocks >= 2 else None)
    fsdp_runs = (
        ("fsdp", False, False),
        ("fsdp_ac", True, False),
        ("fsdp_amp", False, True),
        ("fsdp_ac_amp", True, True),
    )
    for key, ac_on, amp_on in fsdp_runs:
        if key in got and (ac_on, False) in mem.block:
            peak = _fsdp_peak(got[key], blocks, facts.block_bytes, units, ac_on, amp_on)
            peak.saved = mem.block[(ac_on, False)]
            if amp_on:
                # under FSDP's AMP a block's saved bytes are mostly bf16, not all (HF's
                # RMSNorm computes in fp32): without checkpointing they are what each
                # block's backward frees, read from the run itself (0.56 of fp32's on
                # HF's Llama); under it that step is what a finished block leaves (0.83
                # of fp32's), no measure of a block's input, so half the fp32 line
                step = _step_per_block(got[key].before_backward) if not ac_on else 0.0
                peak.saved = step or peak.saved * 0.5
            second = None
            if ac_on and got[key].block_peak:
                second = _late_peak(got, key, blocks, facts, units, peak.saved, amp_on)
            elif not ac_on and got[key].start_peak and peak.block != blocks - 1:
                # the run's peak fell after the backward's start (under FSDP's AMP its
                # fp32 reduce-scatter beside a bf16 gather makes block 0's the larger on
                # 2 blocks), where the temporaries are smaller than in the blocks before
                # it (HF's Llama: 0.06 MiB against 0.31): the start walked too
                fp32_saved = mem.block[(False, False)]
                second = _start_peak(got, key, blocks, facts, units, peak, fp32_saved)
            if second is not None:
                (mem.fsdp_second_amp if amp_on else mem.fsdp_second)[ac_on] = second
            (mem.fsdp_amp if amp_on else mem.fsdp)[ac_on] = peak
    if "tp" in got and blk:
        rest_tp, per_block = rest, (got["tp"].dynamic - rest) / 2
        if "tp1" in got:  # loss_parallel: the bytes outside the blocks split too
            rest_tp, per_block = _line(got["tp"].dynamic, got["tp1"].dynamic)
            ratio = rest_tp / rest if rest else 1.0
            # none of it split at TP 2 (the loss's temporaries a small share): whole at any
            # degree, the safe side
            mem.rest_tp2 = max(0.0, ratio) if ratio < 1 else None
        mem.tp_keep = min(1.0, max(0.0, 2 * per_block / blk - 1))
    if "tp_ac" in got and "ac2" in got and got["ac2"].dynamic:
        # at TP 2: keep + (1 - keep) / 2 of the whole step's bytes, its loss's included: a
        # large vocabulary's split loss reads it low (Llama-3-70B's), so never under
        # tp_keep (a tiny Llama's checkpointed FSDP x TP 4 read -5.7% on tp_keep, -4.6% so)
        ratio = got["tp_ac"].dynamic / got["ac2"].dynamic
        mem.tp_keep_ac = min(1.0, max(mem.tp_keep, 2 * ratio - 1))
    return mem


def _forget_runtime() -> None:
    """Forget the spmdgt runtime a dry run's trainer wrapping adopted (its fake group is
    gone): without this a ``DistributedTrainer`` built later in this process, in a world of
    one, still saw the fake world and called a collective (what ``dry_run_call`` does after
    a script; ``dry_run`` itself leaves it)."""
    from spmdgt._core.session import session

    parts = [p for p in ("meshes", "runtime") if p in session.parts()]
    if parts:
        session.reset(*parts)


def _unit_bytes(model: nn.Module, blocks: int | None) -> float:
    """One block's parameters plus the root's, in the calibration model (what FSDP holds
    gathered at its peak, in proportion)."""
    from spmdgt.train._plan._model import read_model_bytes

    return read_model_bytes(truncated(model, blocks) if blocks else model)


def _tokens(batch: object) -> int:
    """Tokens per row when the batch holds token ids (a 2-D integer tensor, first found),
    else 0."""
    items = batch.values() if isinstance(batch, dict) else batch
    for v in items if isinstance(batch, (dict, list, tuple)) else (batch,):
        if isinstance(v, torch.Tensor) and v.ndim == 2 and not v.is_floating_point():
            return int(v.shape[1])
    return 0


def _rows(batch: object) -> int:
    """Rows of the micro-batch: dim 0 of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    items = batch.values() if isinstance(batch, dict) else batch
    for v in items if isinstance(batch, (dict, list, tuple)) else ():
        if isinstance(v, torch.Tensor) and v.ndim:
            return int(v.shape[0])
    raise ValueError(
        "the batch holds no tensor with a row dim: give the micro-batch as the trainer takes it"
    )
