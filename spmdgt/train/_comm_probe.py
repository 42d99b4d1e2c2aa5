"""Probes of the links: the time of one collective of each kind on a process group.

The cost model (``_comm_cost``) and the per-mesh-dim probes (``_comm_mesh``) both time the
same three kinds with ``_probe_seconds``: the slowest rank's median, so every rank plans with
one number. Every function here is collective over its group.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["KINDS", "measure_bandwidth", "measure_latency"]

# Bytes each rank sends per byte of its buffer, for a ring over n ranks.
_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


KINDS = tuple(_RING_FACTOR)  # the collective kinds the cost model knows


# torch 2.13 renamed the flat-tensor collectives (the old names warn); either works.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _probe_seconds(
    kind: str, nbytes: int, iters: int, group: dist.ProcessGroup | None, warmup: int = 2
) -> float:
    """Median seconds of one ``kind`` collective on a ``nbytes`` buffer (the full buffer: the
    all-reduced one, the all-gather output, the reduce-scatter input), the slowest rank's
    median so every rank plans with one number. Collective: every rank of ``group`` calls it."""
    n = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(group) else None
    numel = max(nbytes // 4, n)
    numel -= numel % n  # gathered / scattered buffers split evenly over the ranks
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":

        def op() -> None:
            dist.all_reduce(full, group=group)
    elif kind == "all_gather":

        def op() -> None:
            _ALL_GATHER(full, part, group=group)
    elif kind == "reduce_scatter":

        def op() -> None:
            _REDUCE_SCATTER(part, full, group=group)
    else:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")
    for _ in range(warmup):
        op()
    times = []
    for _ in range(iters):
        if device is not None:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        op()
        if device is not None:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    t = torch.tensor([times[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_latency(
    kinds: tuple[str, ...] = KINDS,
    nbytes: int = 8,
    iters: int = 20,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Seconds of one small collective per kind: the fixed cost each collective pays whatever
    its size (nccl-tests' small-message time). ``{}`` in a world of one, where nothing is
    sent. Collective: every rank of ``group`` must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return {}
    return {k: _probe_seconds(k, nbytes, iters, group) for k in kinds}


def measure_bandwidth(
    nbytes: int = 8 << 20,
    iters: int = 5,
    group: dist.ProcessGroup | None = None,
    latency: float = 0.0,
    kind: str = "all_reduce",
) -> float:
    """Bus bandwidth in bytes/s of a ``kind`` collective on a ``nbytes`` buffer on ``group``
    (0 in a world of one).

    Bus bandwidth = bytes each rank moves by the ring algebra (``2(n-1)/n`` of the buffer for
    an all-reduce, ``(n-1)/n`` for an all-gather or reduce-scatter) / time, as nccl-tests'
    busbw, so it plugs straight into the ring cost formulas; a backend that implements a kind
    less efficiently (gloo's reduce-scatter) shows a lower bus bandwidth for it. ``latency``
    (seconds, e.g. that kind's ``measure_latency``) is taken off the time first, so that
    ``latency + bytes / bandwidth`` reproduces both probes; 0 gives nccl-tests' number. Two
    untimed warm-ups, then the slowest rank's median of ``iters`` timed calls. Collective:
    every rank of ``group`` must call it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    n = dist.get_world_size(group)
    if n == 1:
        return 0.0
    dt = _probe_seconds(kind, nbytes, iters, group)
    moved = _RING_FACTOR[kind](n) * (max(nbytes // 4, n) // n * n) * 4
    if latency >= dt:
        raise ValueError(
            f"latency {latency * 1e6:.1f} us is not below the {nbytes}-byte {kind} time "
            f"({dt * 1e6:.1f} us): probe bandwidth with a larger message"
        )
    return moved / (dt - latency)


def _is_nccl(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"
