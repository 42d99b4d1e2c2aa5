"""The price of one candidate: bytes per rank at the peak, and seconds per optimizer step.

Memory (per rank, the peak): parameters and optimizer state by what each rank holds (DDP
all; FSDP its ``1/dp_shard`` shard, and TP's split layers ``1/tp`` of that), plus the step's
part. DDP and TP alone: the calibrated world-1 dynamic bytes (activations and backward
temporaries per row and per block, TP's share) plus the gradients, taken whole at the peak,
plus DDP's gradient buckets. FSDP: its own calibrated peak (``FsdpPeak``) walked over the
candidate's blocks (``_fsdp_step``: which block's backward holds the peak depends on the
blocks, the rows and ``dp_shard``), with the gradients reduced so far (FSDP2's ``no_sync``
holds them unsharded under accumulation, until the last micro-step; with
``accumulate_sharded`` every micro-step reduces its own, and earlier micro-steps' are
held sharded); under checkpointing
a second calibrated peak, in a block's backward, is walked too with what each finished
block leaves alive to the backward's end (``FsdpPeak.left``), and the larger taken.

Time (per optimizer step, per rank):

* compute: ``6N + 12LdT`` FLOPs per token (``_throughput.FlopModel``) of the rank's rows, the
  TP-split share of them over ``tp``, a recomputed forward under activation checkpointing
  (``+ 2N`` per token), over ``peak x efficiency`` in the step's dtype; plus the op cost
  (ops of a forward x 3 for forward and backward x the device's seconds per op) per
  micro-step; plus the optimizer (memory-bound: its bytes over the memory bandwidth).
* communication, each collective ``latency + ring bytes / bandwidth`` by
  ``CommunicationProfiler.estimate_counted`` on its mesh dim's link (inside a node when
  the dim's group fits in one, across nodes otherwise): FSDP's all-gather per unit per
  micro-step (twice when resharding after forward) and reduce-scatter per unit per step
  (per micro-step with ``accumulate_sharded``) on ``dp_shard``, HSDP's all-reduce on
  ``dp_replicate``, DDP's bucketed all-reduce, TP's
  activation all-reduces per micro-step on ``tp`` (again in the recomputed forward), the
  clip's norm.
* overlap: on a device that overlaps (CUDA streams) FSDP2 prefetches the next unit's gather
  during this unit's compute, and its reduce-scatters and DDP's buckets run under the
  backward, so only the first unit's gather and what exceeds the compute is exposed; TP's
  all-reduces sit on the critical path. A CPU (gloo) overlaps nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spmdgt.train._comm_cost import CommunicationProfiler
from spmdgt.train._plan._calibrate import MemoryModel, rest_share, tp_share
from spmdgt.train._plan._device import DeviceSpec, Link
from spmdgt.train._plan._fsdp_peaks import FsdpPeak
from spmdgt.train._plan._model import ModelFacts
from spmdgt.train._plan._space import Candidate

__all__ = ["Estimate", "price"]

DDP_BUCKET = 25 * 2**20


@dataclass
class Estimate:
    candidate: Candidate
    memory: float
    """Peak bytes per rank."""
    memory_parts: dict[str, float]
    compute: float
    """Seconds of arithmetic per step (recompute included)."""
    overhead: float
    """Seconds of per-op cost per step (launch or dispatch)."""
    optimizer: float
    comm: float
    """Seconds of communication per step, before overlap."""
    exposed: float
    """Seconds of communication not hidden under compute."""
    comm_parts: dict[str, float] = field(default_factory=dict)
    step: float = 0.0
    tokens_per_s: float | None = None
    mfu: float = 0.0
    fits: bool = True
    why: str = ""
    """Why it loses to the winner (or was dropped)."""


TP, TP_SP = "tp all-reduce", "tp all-gather/reduce-scatter"  # the step's TP collectives


def _link(dev: DeviceSpec, group: int, stride: int) -> Link:
    """The link a mesh dim's group runs on: inside a node when its ranks (``group`` of them,
    ``stride`` apart, row-major) all sit on one."""
    return dev.intra if group * stride <= dev.per_node else dev.inter


def _comm(link: Link, n: int, totals: dict[str, dict[str, float]]) -> float:
    """Seconds of ``totals`` (kind -> count, buffer bytes) on a ring of ``n`` over ``link``
    (its latency and bandwidth for a group of ``n``)."""
    if n <= 1 or not totals:
        return 0.0
    latency, bandwidth = link.at(n)
    prof = CommunicationProfiler(bandwidth=bandwidth, latency=latency)
    return prof.estimate_counted(totals, n)["estimated_sec"]


def _local_bytes(c: Candidate, facts: ModelFacts) -> float:
    """Parameter bytes per rank after TP (before FSDP's sharding)."""
    P, P_tp = float(facts.param_bytes), float(facts.tp_bytes if c.tp > 1 else 0)
    return P - P_tp + P_tp / c.tp


def _memory(c: Candidate, facts: ModelFacts, mem: MemoryModel) -> dict[str, float]:
    """Bytes per rank at the peak, by part."""
    local = _local_bytes(c, facts)
    params = local / (c.dp_shard if c.strategy == "fsdp" else 1)
    if c.strategy == "fsdp":
        live = _fsdp_step(c, facts, mem, local)
    else:
        # the gradients held beside the step's dynamic bytes: earlier micro-steps' through
        # the next forward, else this step's, taken whole at the peak (under AC the peak is
        # late in the backward, when most of them exist)
        live = params + mem.dynamic(c.micro_batch, c.ac, c.amp, facts.blocks, c.tp)
    parts = {
        "params": params,
        "optimizer": params * mem.opt_ratio,
        "buffers": float(mem.buffers),
        "step (activations, temporaries, gathered units, grads)": live,
        "DDP buckets": params if c.strategy == "ddp" and c.world > 1 else 0.0,
    }
    # the optimizer step holds the gradients (sharded as the parameters are) and its
    # update's temporaries beside the state: where that is more, it is the peak
    over = params * (1 + mem.optimizer_step) - live
    parts["optimizer step, over the step"] = max(0.0, over) if mem.optimizer_step else 0.0
    return parts


def _fsdp_step(c: Candidate, facts: ModelFacts, mem: MemoryModel, local: float) -> float:
    """FSDP's step bytes per rank at its peak (activations, temporaries, gathered units,
    collective buffers, gradients): the calibrated peak (``FsdpPeak``) moved to each block's
    backward of this candidate in turn, the largest taken. Going back one block adds its
    reduced gradients (``1/dp_shard`` of its bytes; under accumulation FSDP2's ``no_sync``
    holds every gradient unsharded until the last micro-step's reduce-scatters, and with
    ``sharded_accumulation`` the earlier micro-steps' are all held sharded) and, without
    checkpointing, frees its activations; the first block of the backward has no
    reduce-scatter under way and block 0 no prefetch. Without checkpointing the peak is at
    the backward's start, with every block's activations and no gradient reduced yet."""
    amp = c.amp and c.ac in mem.fsdp_amp  # FSDP's AMP calibrated as itself
    peak = (mem.fsdp_amp if amp else mem.fsdp).get(c.ac)
    if peak is None:
        raise ValueError(
            f"this memory model was calibrated without FSDP{' + checkpointing' if c.ac else ''}"
            ": plan without memory_model= (or with one calibrated for the whole search)"
        )
    mem.dynamic(c.micro_batch, c.ac, c.amp, facts.blocks, c.tp)  # refuses what is not calibrated
    second = (mem.fsdp_second_amp if amp else mem.fsdp_second).get(c.ac)
    if second is None:
        return _walk(c, facts, mem, local, peak)
    # under checkpointing a peak at the backward's start (the loss's, before any block's
    # backward) is that moment's alone: the blocks after it are the second peak's walk
    start = c.ac and peak.block == peak.blocks - 1
    return max(_walk(c, facts, mem, local, peak, start), _walk(c, facts, mem, local, second))


def _kept(mem: MemoryModel, ac: bool, t: int) -> float:
    """The share of a step's TP-split bytes a rank holds at degree ``t``: what TP leaves
    whole plus the rest over ``t``, as measured at TP 2 (under checkpointing from its own
    run where there is one: its recomputed block reads the split stream's gathers too)."""
    keep = mem.tp_keep_ac if ac and mem.tp_keep_ac is not None else mem.tp_keep
    return keep + (1 - keep) / t


def _walk(
    c: Candidate,
    facts: ModelFacts,
    mem: MemoryModel,
    local: float,
    peak: FsdpPeak,
    start_only: bool = False,
) -> float:
    """``_fsdp_step`` from one calibrated peak (``FsdpPeak``), moved to each block's
    backward (``start_only``: the backward's first block only)."""
    t, s, n = c.tp, c.dp_shard, facts.blocks
    # bytes of a compute-dtype element, and AMP's ratio of the rows' bytes: from the world-1
    # AMP run unless the peak was calibrated under FSDP's AMP itself
    half = 2 if c.amp and not peak.amp else 4
    scale = c.micro_batch / mem.rows * (mem.amp_ratio if c.amp and not peak.amp else 1.0)
    saved = peak.saved  # a block's saved activations, at the calibration's rows
    per_block = saved * scale * tp_share(mem, c.ac, t)
    block = facts.block_bytes - facts.tp_block_bytes * (1 - 1 / t)  # before FSDP's sharding
    units = peak.units * (facts.root_bytes + block) * half / 4
    # what the calibrated peak held besides its blocks' saved activations: the loss's
    # (outside the blocks: whole on every rank) and, under checkpointing, the recomputed
    # block's activations and temporaries (TP splits them as a block's). Under
    # checkpointing every block's saved bytes stay through the backward (HF's GPT-2 and
    # Llama at 2, 3, 4 and 6 blocks hold them all at the same block of the backward);
    # without it a block's activations go at the end of its backward.
    kept = (peak.blocks if c.ac else peak.block + 1) if peak.blocks else 0
    # and what the calibration's finished blocks left (``FsdpPeak.left``: under
    # checkpointing each finished block's backward leaves tensors alive to the backward's end)
    finished = max(0, peak.blocks - 1 - peak.block)
    rest = (peak.rows - kept * saved - finished * peak.left) * scale
    share = rest_share(mem, t)  # the loss's bytes: split under loss_parallel, else whole
    if t > 1 and not c.ac:
        rest *= share
    if c.ac and t > 1:
        # a checkpointed step peaks at its largest transient: a recomputed block (TP splits
        # it) or, where the calibration's peak came before any gradient was reduced and the
        # world-1 run's bytes outside the blocks are more than a block's, the loss (a large
        # vocabulary's logits and their gradient, whole on every rank: splitting them read
        # a Llama-3-8B shape at TP 4 37% under its dry run)
        outside = mem.rest[(False, c.amp)]
        at_loss = peak.block == peak.blocks - 1 and outside > mem.block[(False, c.amp)]
        whole = min(rest, outside * c.micro_batch / mem.rows) if at_loss else 0.0
        rest = whole * share + (rest - whole) * _kept(mem, True, t)
    gather = peak.gather * block * half / 4  # a block's all-gather buffer, in every block
    scatter = peak.scatter * block  # a reduce-scatter under way, in all blocks but the first
    # the block's new gradients, beside those held (under accumulation too: FSDP2 adds them
    # in only once they exist)
    unsharded = c.accumulation > 1 and not c.sharded_accumulation
    fresh = peak.fresh * block * half / 4
    best = 0.0
    left = peak.left * scale * _kept(mem, c.ac, t)
    for j in [max(n - 1, 0)] if start_only else range(max(n, 1)):
        acts = rest + (n if c.ac else j + 1) * per_block if n else peak.rows * scale
        acts += max(0, n - 1 - j) * left
        buffers = gather + (j < n - 1) * scatter
        done = max(0, n - 1 - j) * block  # blocks whose gradients are reduced
        if unsharded:
            # the last micro-step reduces each finished block's (from every gradient held
            # whole); the first holds its finished blocks' whole, unreduced (it is the larger
            # late in a checkpointed backward); a middle one holds them all
            last = local - done * (1 - 1 / s)
            grads = local if c.accumulation > 2 else max(last, done)
        elif c.accumulation > 1:
            # every gradient held sharded since the first micro-step, and this micro-step's
            # reduced ones beside them until they are added in (the decoder's checkpointed
            # candidates at world 4 read -3.0% to 0.0% of their dry runs so, -6.0% to -4.7%
            # without this micro-step's)
            grads = (local + done + peak.grads) / s
        else:
            grads = (done + peak.grads) / s
        best = max(best, acts + units + buffers + grads + fresh)
    return best


def _flops_per_rank(c: Candidate, facts: ModelFacts, seq: int) -> float:
    """FLOPs of one micro-step on one rank: the TP-split share and attention over ``tp``,
    the forward again under activation checkpointing."""
    fm = facts.flops
    if fm is None:
        return 0.0
    tokens = c.micro_batch * seq
    flops = fm.per_step(c.micro_batch, tokens)
    split = facts.tp_flop_share if c.tp > 1 else 0.0
    attn = tokens * 12 * fm.layers * fm.width * seq if tokens and fm.layers and fm.width else 0.0
    dense = flops - attn
    per_rank = dense * (1 - split) + dense * split / c.tp + attn / c.tp
    return per_rank * (4 / 3 if c.ac else 1)  # AC: the forward again (2 of the 6 per token)


def _overhead(c: Candidate, facts: ModelFacts, dev: DeviceSpec) -> float:
    """Seconds per step of fixed costs that do not scale with the arithmetic, per micro-step:
    the model's ops (``op_seconds`` is one op's forward and backward; a third more under AC,
    the forward again), each FSDP unit's hooks and copies, each TP module's DTensor dispatch
    (again in the recomputed forward), each checkpointed block's bookkeeping. All 0 on GPUs,
    where the host runs ahead."""
    ops = facts.ops_forward * (4 / 3 if c.ac else 1) * dev.op_seconds
    units = facts.blocks + (1 if facts.root_bytes else 0)
    fsdp = units * dev.unit_seconds if c.strategy == "fsdp" else 0.0
    tp_modules = facts.tp_row_calls + facts.tp_col_calls if c.tp > 1 else 0
    if c.sequence_parallel:  # the norms on split tokens, the sub-blocks' gathers
        tp_modules += facts.sp_modules
    tp = tp_modules * dev.tp_module_seconds * (4 / 3 if c.ac else 1)
    ac = facts.blocks * dev.ac_block_seconds if c.ac else 0.0
    return c.accumulation * (ops + fsdp + tp + ac)


def _optimizer_seconds(c: Candidate, facts: ModelFacts, mem: MemoryModel, dev: DeviceSpec) -> float:
    """The optimizer step: memory-bound over the state each rank holds, plus a for-loop
    AdamW's ops per parameter tensor."""
    params = _local_bytes(c, facts) / (c.dp_shard if c.strategy == "fsdp" else 1)
    seconds = (params * (2 + 2 * mem.opt_ratio) + params) / dev.memory_bandwidth
    return seconds + facts.param_tensors * 12 * dev.op_seconds


def _communication(
    c: Candidate, facts: ModelFacts, dev: DeviceSpec, seq: int, clip: bool, reshard: bool
) -> dict[str, float]:
    """Seconds per step of each kind of collective, on its mesh dim's link and group size."""
    r, s, t, k = c.dp_replicate, c.dp_shard, c.tp, c.accumulation
    half = 2 if c.amp else 4
    local = _local_bytes(c, facts)
    comm: dict[str, float] = {}
    if c.strategy == "fsdp":
        units = facts.blocks + (1 if facts.root_bytes else 0)
        gathers = (2 if reshard else 1) * k
        link = _link(dev, s, t)
        comm["fsdp all-gather"] = _comm(
            link, s, {"all_gather": {"count": gathers * units, "bytes": gathers * local * half / 4}}
        )
        scatters = k if c.sharded_accumulation else 1
        comm["fsdp reduce-scatter"] = _comm(
            link, s, {"reduce_scatter": {"count": scatters * units, "bytes": scatters * local}}
        )
        if r > 1:
            comm["hsdp all-reduce"] = _comm(
                _link(dev, r, s * t), r, {"all_reduce": {"count": units, "bytes": local / s}}
            )
    elif c.strategy == "ddp" and c.world > 1:
        grad = float(facts.param_bytes)
        comm["ddp all-reduce"] = _comm(
            _link(dev, c.world, 1),
            c.world,
            {"all_reduce": {"count": max(1, math.ceil(grad / DDP_BUCKET)), "bytes": grad}},
        )
    if t > 1:
        act = c.micro_batch * seq * half / 4
        fwd = 2 if c.ac else 1
        calls = k * (fwd * facts.tp_row_calls + facts.tp_col_calls) + (
            1 if facts.tp_sharded_input else 0
        )
        nbytes = k * act * (fwd * facts.tp_row_bytes + facts.tp_col_bytes)
        totals = {"all_reduce": {"count": calls, "bytes": nbytes}}
        if c.sequence_parallel:
            # each split sub-block all-gathers its input and reduce-scatters its output, in
            # every forward and once each in the backward: a rowwise layer's bytes twice
            # (together one all-reduce's ring bytes), the colwise inputs' gradients met once
            n = k * (fwd + 1) * facts.tp_row_calls
            moved = k * act * (fwd + 1) * facts.tp_row_bytes
            totals = {
                "all_gather": {"count": n, "bytes": moved},
                "reduce_scatter": {"count": n, "bytes": moved},
            }
            if facts.tp_sharded_input:
                totals["all_reduce"] = {"count": 1, "bytes": 0}
        comm[TP_SP if c.sequence_parallel else TP] = _comm(_link(dev, t, 1), t, totals)
    if clip and c.world > 1:
        comm["clip norm"] = _comm(
            _link(dev, c.world, 1), c.world, {"all_reduce": {"count": 1, "bytes": 4}}
        )
    return comm


def _exposed(comm: dict[str, float], compute: float, facts: ModelFacts, dev: DeviceSpec) -> float:
    """Communication left on the critical path: all of it where nothing overlaps (gloo on
    the step's own cores); on GPUs TP's all-reduces and the clip, the first unit's gather,
    and whatever of the rest exceeds the compute (FSDP2's prefetch, DDP's buckets)."""
    total = sum(comm.values())
    if not dev.overlap:
        return total
    tp_part = comm.get(TP, 0.0) + comm.get(TP_SP, 0.0) + comm.get("clip norm", 0.0)
    hidden = total - tp_part
    first = hidden / max(facts.blocks + 1, 1)  # the first unit's gather overlaps nothing
    return tp_part + first + max(0.0, hidden - first - compute)


def price(
    c: Candidate,
    facts: ModelFacts,
    mem: MemoryModel,
    dev: DeviceSpec,
    *,
    seq: int,
    clip: bool = True,
    reshard_after_forward: bool = True,
) -> Estimate:
    """The candidate's memory and step time on ``dev`` (``seq``: tokens per row, 0 when the
    batch is not token ids)."""
    parts = _memory(c, facts, mem)
    compute = c.accumulation * _flops_per_rank(c, facts, seq) / (dev.peak(c.amp) * dev.efficiency)
    overhead = _overhead(c, facts, dev)
    optimizer = _optimizer_seconds(c, facts, mem, dev)
    comm = _communication(c, facts, dev, seq, clip, reshard_after_forward)
    exposed = _exposed(comm, compute, facts, dev)
    step = compute + overhead + optimizer + exposed
    rows = c.micro_batch * c.accumulation * c.data_parallel
    global_tokens = seq * rows
    fm = facts.flops
    model_flops = fm.per_step(rows, global_tokens) if fm else 0.0
    return Estimate(
        candidate=c,
        memory=sum(parts.values()),
        memory_parts=parts,
        compute=compute,
        overhead=overhead,
        optimizer=optimizer,
        comm=sum(comm.values()),
        exposed=exposed,
        comm_parts=comm,
        step=step,
        tokens_per_s=global_tokens / step if global_tokens and step > 0 else None,
        mfu=model_flops / (step * c.world * dev.peak(c.amp)) if step > 0 else 0.0,
    )
