"""The price of one candidate: bytes per rank at the peak, and seconds per optimizer step.

Memory (per rank, the peak): parameters, optimizer state and gradients by what each rank
holds (DDP all; FSDP its ``1/dp_shard`` shard, and TP's split layers ``1/tp`` of that; a
``no_sync`` accumulation keeps FSDP2's gradients unsharded until the last micro-step), plus
the step's dynamic bytes from the calibrated ``MemoryModel`` (activations and backward
temporaries per row and per block, TP's share, FSDP's gathered units), plus DDP's gradient
buckets. Gradients of earlier micro-steps are alive during the next forward (accumulation);
without accumulation the peak is the larger of the forward's activations and the gradients.

Time (per optimizer step, per rank):

* compute: ``6N + 12LdT`` FLOPs per token (``_throughput.FlopModel``) of the rank's rows, the
  TP-split share of them over ``tp``, a recomputed forward under activation checkpointing
  (``+ 2N`` per token), over ``peak x efficiency`` in the step's dtype; plus the op cost
  (ops of a forward x 3 for forward and backward x the device's seconds per op) per
  micro-step; plus the optimizer (memory-bound: its bytes over the memory bandwidth).
* communication, each collective ``latency + ring bytes / bandwidth`` by
  ``CommunicationProfiler.estimate_counted`` on its mesh dim's link (inside a node when
  the dim's group fits in one, across nodes otherwise): FSDP's all-gather per unit per
  micro-step (twice when resharding after forward) and reduce-scatter per unit per step on
  ``dp_shard``, HSDP's all-reduce on ``dp_replicate``, DDP's bucketed all-reduce, TP's
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
from spmdgt.train._plan._calibrate import MemoryModel
from spmdgt.train._plan._device import DeviceSpec, Link
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


def _link(dev: DeviceSpec, group: int, stride: int) -> Link:
    """The link a mesh dim's group runs on: inside a node when its ranks (``group`` of them,
    ``stride`` apart, row-major) all sit on one."""
    return dev.intra if group * stride <= dev.per_node else dev.inter


def _comm(link: Link, n: int, totals: dict[str, dict[str, float]]) -> float:
    """Seconds of ``totals`` (kind -> count, buffer bytes) on a ring of ``n`` over ``link``."""
    if n <= 1 or not totals:
        return 0.0
    prof = CommunicationProfiler(bandwidth=link.bandwidth, latency=link.latency)
    return prof.estimate_counted(totals, n)["estimated_sec"]


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
    r, s, t = c.dp_replicate, c.dp_shard, c.tp
    half = 2 if c.amp else 4  # bytes of a compute-dtype element
    # ---- memory
    P, P_tp = float(facts.param_bytes), float(facts.tp_bytes if t > 1 else 0)
    local = P - P_tp + P_tp / t  # after TP
    shard = s if c.strategy == "fsdp" else 1
    params = local / shard
    opt = params * mem.opt_ratio
    grads_step = params  # sharded (FSDP) or whole (DDP), at the step
    grads_accum = local if c.accumulation > 1 else 0.0  # FSDP2 no_sync keeps them unsharded
    if c.strategy != "fsdp":
        grads_accum = grads_step if c.accumulation > 1 else 0.0
    dyn = mem.dynamic(c.micro_batch, c.ac, c.amp, facts.blocks, t)
    extra = 0.0
    if c.strategy == "fsdp":
        block = facts.block_bytes - facts.tp_block_bytes * (1 - 1 / t)
        extra = mem.fsdp_extra * (facts.root_bytes + block) * (half / 4)
    buckets = grads_step if c.strategy == "ddp" and c.world > 1 else 0.0
    # the gradients held beside the step's dynamic bytes: earlier micro-steps' (FSDP2's
    # unsharded under no_sync) through the next forward, else this step's, taken whole at
    # the peak (under AC the peak is late in the backward, when most of them exist)
    live = (grads_accum if c.accumulation > 1 else grads_step) + dyn + extra
    parts = {
        "params": params,
        "optimizer": opt,
        "buffers": float(mem.buffers),
        "step (activations, temporaries, gathered units, grads)": live,
        "DDP buckets": buckets,
    }
    memory = sum(parts.values())
    # ---- compute
    rows = c.micro_batch
    tokens = rows * seq
    fm = facts.flops
    flops = fm.per_step(rows, tokens) if fm is not None else 0.0
    split = facts.tp_flop_share if t > 1 else 0.0
    attn = 0.0
    if tokens and fm is not None and fm.layers and fm.width:
        attn = tokens * 12 * fm.layers * fm.width * seq
    dense = flops - attn
    per_rank = dense * (1 - split) + dense * split / t + attn / t
    if c.ac:
        per_rank *= 4 / 3  # the forward again (2 of the 6 FLOPs per parameter per token)
    rate = dev.peak(c.amp) * dev.efficiency
    compute = c.accumulation * per_rank / rate
    ops = facts.ops_forward * (3 + (1 if c.ac else 0))
    overhead = c.accumulation * ops * dev.op_seconds
    optimizer = (params * (2 + 2 * mem.opt_ratio) + grads_step) / dev.memory_bandwidth
    optimizer += facts.param_tensors * 12 * dev.op_seconds  # a for-loop AdamW's ops
    # ---- communication
    k = c.accumulation
    comm: dict[str, float] = {}
    if c.strategy == "fsdp":
        units = facts.blocks + (1 if facts.root_bytes else 0)
        gathers = (2 if reshard_after_forward else 1) * k
        link = _link(dev, s, t)
        comm["fsdp all-gather"] = _comm(
            link, s, {"all_gather": {"count": gathers * units, "bytes": gathers * local * half / 4}}
        )
        comm["fsdp reduce-scatter"] = _comm(
            link, s, {"reduce_scatter": {"count": units, "bytes": local}}
        )
        if r > 1:
            comm["hsdp all-reduce"] = _comm(
                _link(dev, r, s * t), r, {"all_reduce": {"count": units, "bytes": local / s}}
            )
    elif c.strategy == "ddp" and c.world > 1:
        grad = P
        comm["ddp all-reduce"] = _comm(
            _link(dev, c.world, 1),
            c.world,
            {"all_reduce": {"count": max(1, math.ceil(grad / DDP_BUCKET)), "bytes": grad}},
        )
    if t > 1:
        act = tokens * half / 4
        fwd = 2 if c.ac else 1
        calls = k * (fwd * facts.tp_row_calls + facts.tp_col_calls) + (
            1 if facts.tp_sharded_input else 0
        )
        nbytes = k * act * (fwd * facts.tp_row_bytes + facts.tp_col_bytes)
        comm["tp all-reduce"] = _comm(
            _link(dev, t, 1), t, {"all_reduce": {"count": calls, "bytes": nbytes}}
        )
    if clip and c.world > 1:
        comm["clip norm"] = _comm(
            _link(dev, c.world, 1), c.world, {"all_reduce": {"count": 1, "bytes": 4}}
        )
    total_comm = sum(comm.values())
    exposed = total_comm
    if dev.overlap:
        tp_part = comm.get("tp all-reduce", 0.0) + comm.get("clip norm", 0.0)
        hidden = total_comm - tp_part
        units = max(facts.blocks + 1, 1)
        first = hidden / units  # the first unit's gather waits for nothing to overlap
        exposed = tp_part + first + max(0.0, hidden - first - compute)
    step = compute + overhead + optimizer + exposed
    global_tokens = seq * c.micro_batch * c.accumulation * c.data_parallel
    model_flops = (
        fm.per_step(c.micro_batch * c.accumulation * c.data_parallel, global_tokens) if fm else 0.0
    )
    mfu = model_flops / (step * c.world * dev.peak(c.amp)) if step > 0 else 0.0
    return Estimate(
        candidate=c,
        memory=memory,
        memory_parts=parts,
        compute=compute,
        overhead=overhead,
        optimizer=optimizer,
        comm=total_comm,
        exposed=exposed,
        comm_parts=comm,
        step=step,
        tokens_per_s=global_tokens / step if global_tokens and step > 0 else None,
        mfu=mfu,
    )
