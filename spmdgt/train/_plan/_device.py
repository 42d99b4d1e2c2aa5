"""What a planned step runs on: one device's memory, peak FLOP/s and per-op cost, and the links
between devices (inside a node and across nodes).

The GPU figures are datasheet ones (memory from the dry run's ``DEVICES``, dense peaks from
``_throughput``'s table, links from ``INTERCONNECTS``); ``efficiency`` is the share of the dense
peak a large transformer matmul reaches (an assumption, stated in every plan). ``cpu`` measures
this machine instead: its matmul peak in each dtype (``_throughput.peak_flops``, the probe the
trainer's MFU uses) and the fixed cost of one small op with autograd, so a plan made here can be
checked here. Nothing here communicates.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass, replace

import torch

from spmdgt.train._dryrun import (
    DEVICES,
    INTERCONNECTS,
    DryRunError,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)
from spmdgt.train._throughput import _PEAKS, peak_flops

__all__ = ["DeviceSpec", "Link", "device_spec"]


@dataclass(frozen=True)
class Link:
    """One link: bus bandwidth per device (bytes/s), latency per collective (s), a label.

    ``by_size``: numbers measured per group size, ``(ranks, latency, bus bandwidth)`` in
    ascending ranks (``_cpuprobe``). A collective's fixed cost grows with its group (a ring
    of ``n`` takes ``n - 1`` steps, and on a shared CPU every step waits for one more process
    to be scheduled), so where they are given a group's latency comes from them: linear in
    the group size between two measured sizes and beyond the last two, never below the
    smallest measured; its bandwidth is the nearest measured size's. Without them the
    latency is the same whatever the group (datasheet links, where it is small)."""

    bandwidth: float
    latency: float
    label: str
    by_size: tuple[tuple[int, float, float], ...] = ()

    def at(self, n: int) -> tuple[float, float]:
        """``(latency, bandwidth)`` of one collective on a group of ``n`` ranks."""
        pts = self.by_size
        if not pts:
            return self.latency, self.bandwidth
        if len(pts) == 1:
            return pts[0][1], pts[0][2]
        lo, hi = pts[0], pts[1]
        for a, b in itertools.pairwise(pts):
            lo, hi = a, b
            if n <= b[0]:
                break
        lat = lo[1] + (n - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
        lat = max(lat, min(p[1] for p in pts))
        bw = min(pts, key=lambda p: (abs(p[0] - n), p[0]))[2]
        return lat, bw


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of device and how a cluster of them is wired."""

    name: str
    label: str
    memory: float
    """Bytes of memory per device (the default budget)."""
    peak_half: float
    """Dense FLOP/s in bf16 (AMP)."""
    peak_full: float
    """Dense FLOP/s in fp32 (torch's default matmul precision, ``highest``)."""
    efficiency: float
    """Share of the peak a training step's matmuls reach."""
    op_seconds: float
    """Fixed cost of one op of the forward, with its backward (launch or Python dispatch);
    0 where launches are asynchronous and hidden behind the previous kernel."""
    memory_bandwidth: float
    """Bytes/s of device memory: prices the optimizer step (memory-bound)."""
    per_node: int
    """Devices per node: a mesh dim whose group fits in one node uses ``intra``."""
    intra: Link
    inter: Link
    overlap: bool
    """Whether FSDP's gathers and DDP's reductions overlap compute (separate CUDA streams)."""
    source: str = ""
    """Where the peak comes from (datasheet or measured)."""
    unit_seconds: float = 0.0
    """Fixed cost of one FSDP2 unit per micro-step beyond its collectives and its model's
    ops (its hooks, the copy-in and copy-out of the gathers, the gradients' reduce-scatter
    preparation): 0 where the host runs ahead of the device (GPUs), measured on ``cpu``."""
    tp_module_seconds: float = 0.0
    """Fixed cost of one tensor-parallel module's forward and backward beyond its
    all-reduces (DTensor's dispatch and the input/output redistribution hooks)."""
    ac_block_seconds: float = 0.0
    """Fixed cost of one checkpointed block per micro-step beyond the recomputed ops (the
    saved-tensor hooks, the recompute's bookkeeping)."""

    def peak(self, amp: bool) -> float:
        return self.peak_half if amp else self.peak_full


def _link(name: str) -> Link:
    bw, lat, label = INTERCONNECTS[name]
    return Link(float(bw), float(lat), label)


def _gpu(name: str, table_key: str, intra: str, per_node: int, hbm: float) -> DeviceSpec:
    size, label = DEVICES[name]
    half, tf32, fp32 = next(v for k, v in _PEAKS if k == table_key)
    full = fp32 if torch.get_float32_matmul_precision() == "highest" else tf32
    return DeviceSpec(
        name=name,
        label=label,
        memory=float(size),
        peak_half=half,
        peak_full=full,
        efficiency=0.6,
        op_seconds=0.0,
        memory_bandwidth=hbm,
        per_node=per_node,
        intra=_link(intra),
        inter=_link("ib-ndr"),
        overlap=True,
        source=f"datasheet: {label}, dense",
    )


_GPUS = {
    "h100": lambda: _gpu("h100", "H100", "nvlink4", 8, 3.35e12),
    "h200": lambda: _gpu("h200", "H200", "nvlink4", 8, 4.8e12),
    "a100": lambda: _gpu("a100", "A100", "nvlink3", 8, 2.0e12),
}

# gloo between processes of one machine (loopback TCP): a few hundred microseconds per
# collective and about a GB/s; pass --bandwidth/--latency for what this machine measures.
CPU_LINK = Link(1e9, 300e-6, "gloo on one host (assumed; measure with measure_bandwidth)")


@functools.cache
def _op_seconds(threads: int) -> float:
    """Best time of one small op's forward and backward on this CPU (dispatch and autograd,
    no arithmetic to speak of): what each op of a tiny model costs beyond its FLOPs."""
    del threads  # the cache key: the cost depends on the thread count
    x = torch.ones(4, 8, requires_grad=True)
    w = torch.ones(8, 8, requires_grad=True)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            (x @ w).sum().backward()
        best = min(best, (time.perf_counter() - t0) / 50)
    return best / 3  # three ops forward (matmul, sum, and the loss's seed), one each back


def _cpu() -> DeviceSpec:
    half, half_src = peak_flops(torch.device("cpu"), torch.bfloat16)
    full, full_src = peak_flops(torch.device("cpu"), torch.float32)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceSpec(
        name="cpu",
        label=f"this CPU ({torch.get_num_threads()} threads)",
        memory=float(pages),
        peak_half=half,
        peak_full=full,
        efficiency=1.0,  # the peak is what a matmul measured here reaches
        op_seconds=_op_seconds(torch.get_num_threads()),
        memory_bandwidth=10e9,
        per_node=1 << 30,  # one host: every group is inside it
        intra=CPU_LINK,
        inter=CPU_LINK,
        overlap=False,  # gloo's thread and the step share the same cores
        source=f"{full_src}; {half_src}",
    )


DEVICE_NAMES = ("cpu", *_GPUS)


def device_spec(
    device: str,
    *,
    interconnect: str | None = None,
    intra: str | None = None,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    per_node: int | None = None,
) -> DeviceSpec:
    """The named device (``h100``, ``h200``, ``a100``, ``cpu``) with its links:
    ``interconnect`` (an ``INTERCONNECTS`` name) between nodes, ``intra`` inside one,
    ``bandwidth``/``latency`` for every link (a fabric not in the table; ``cpu``: what
    ``measure_bandwidth`` found here)."""
    key = device.lower()
    if key == "cpu":
        spec = _cpu()
    elif key in _GPUS:
        spec = _GPUS[key]()
    else:
        raise DryRunError(f"unknown device {device!r} for a plan; known: {', '.join(DEVICE_NAMES)}")
    for name in (interconnect, intra):
        if name is not None and name not in INTERCONNECTS:
            raise DryRunError(f"unknown interconnect {name!r}; known: {', '.join(INTERCONNECTS)}")
    if interconnect is not None:
        spec = replace(spec, inter=_link(interconnect))
    if intra is not None:
        spec = replace(spec, intra=_link(intra))
    if bandwidth is not None or latency is not None:
        bw = parse_bandwidth(bandwidth) if bandwidth is not None else spec.inter.bandwidth
        lat = parse_seconds(latency) if latency is not None else spec.inter.latency
        given = Link(bw, lat, f"{bw / 1e9:g} GB/s, {lat * 1e6:g} us (given)")
        spec = replace(spec, intra=given, inter=given)
    if per_node is not None:
        spec = replace(spec, per_node=int(per_node))
    return spec


def budget_bytes(spec: DeviceSpec, memory: float | str | None) -> float:
    """The memory budget per device: ``memory`` given (``"40GB"``), else the device's."""
    return parse_bytes(memory) if memory is not None else spec.memory
