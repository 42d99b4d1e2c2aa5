"""The ``cpu`` device profile, measured by the ranks that will train: small probes, run once,
whose numbers the planner prices CPU candidates with.

Every rank of the default process group calls ``probe_cpu`` at once, so each probe runs under
the sharing the training will see (ranks on fewer cores than ranks, gloo's threads on the
same cores, whatever else loads the machine). Each probe is timed ``repeats`` times and the
median kept: the ranks share cores as in training, and the median leaves out a try
that another job's burst slowed.

=========================  ================================================================
probe                       what it prices
=========================  ================================================================
small collectives per       each collective's fixed cost on a group of that size, after a
group size (2, 4, ...)      burst of work as in a step (gloo's ring takes ``n - 1`` steps,
                            and each waits for a peer to be scheduled): ``Link.by_size``
1 MiB all-reduce per size   the bus bandwidth per group size
a 512^3 fp32 matmul         the compute peak per rank
one small op, fwd + bwd     the per-op cost (``op_seconds``)
FSDP2 on a one-rank mesh    a unit's hooks and copies per micro-step (``unit_seconds``)
TP pair vs plain            a TP module's DTensor cost per fwd + bwd (``tp_module_seconds``)
checkpointed vs plain       a checkpointed block's fixed cost (``ac_block_seconds``)
=========================  ================================================================

Nothing here is fitted to a benchmark's step times: the planner's ranking is checked against
those (``benchmarks/plan.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from spmdgt.train._plan._device import DeviceSpec, Link, _cpu

__all__ = ["cpu_spec", "probe_cpu"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _best(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over ``repeats`` tries of the mean seconds of ``iters`` calls of ``fn`` (one
    warm-up): the ranks share cores, as in training, so a try's mean carries that sharing;
    the median leaves out a try that another job's burst slowed."""
    fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        means.append((time.perf_counter() - t0) / iters)
    return sorted(means)[len(means) // 2]


def _groups(size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``size`` consecutive ranks (every rank makes every group, as
    ``new_group`` requires); ``None`` for the whole world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == world:
        return None
    mine = None
    for start in range(0, world - world % size, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return mine


def _collective(kind: str, group: dist.ProcessGroup | None) -> Callable[[], None]:
    """One smallest ``kind`` collective on ``group`` (one element per rank)."""
    from spmdgt.train._comm_probe import _ALL_GATHER, _REDUCE_SCATTER

    n = dist.get_world_size(group)
    full, part = torch.ones(n), torch.ones(1)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, part, group=group)
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(part, full, group=group)
    return lambda: dist.all_reduce(full, group=group)


def _between_work(kind: str, group: dist.ProcessGroup | None, repeats: int) -> float:
    """Seconds one small collective adds when it comes after a burst of work (a step's ops
    between two of FSDP's collectives): the median over ``repeats`` of the loop's time with
    the collective less the same loop without. Back to back, the ranks stay in step; after
    work each arrives when the scheduler lets it, and the collective waits for the last of
    its group, so on ranks that share cores it costs more, the more ranks it waits for."""
    a = torch.ones(64, 64)
    op = _collective(kind, group)

    def work() -> None:
        for _ in range(40):
            a @ a

    def loop(with_op: bool, iters: int = 20) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            work()
            if with_op:
                op()
        return (time.perf_counter() - t0) / iters

    op()
    extra = [loop(True) - loop(False) for _ in range(repeats)]
    return max(0.0, sorted(extra)[len(extra) // 2])


def _links(sizes: tuple[int, ...], repeats: int) -> list[tuple[int, float, float]]:
    from spmdgt.train._comm_probe import measure_bandwidth, measure_latency

    out = []
    for n in sizes:
        g = _groups(n)
        # the mean over kinds (FSDP gathers and reduce-scatters, HSDP, DDP and TP
        # all-reduce), each at least what it costs back to back
        alone = measure_latency(_KINDS, iters=20, group=g)
        lat = sum(max(alone[k], _between_work(k, g, repeats)) for k in _KINDS) / len(_KINDS)
        bws = [measure_bandwidth(1 << 20, iters=5, group=g) for _ in range(repeats)]
        out.append((n, lat, sorted(bws)[len(bws) // 2]))
    # every rank prices with the same numbers: the slowest rank's
    t = torch.tensor([[lat, -bw] for _, lat, bw in out], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [(n, float(t[i, 0]), float(-t[i, 1])) for i, (n, _, _) in enumerate(out)]


def _mlp(blocks: int, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x).sum().backward()

    return run


def _unit_seconds(repeats: int) -> float:
    """FSDP2 on each rank's own one-rank mesh (its hooks and copies, no peer to wait for)
    against the same blocks plain, per unit per forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("others", "one"))["one"]
    blocks = 4
    x = torch.ones(4, 16)
    plain = _best(_step(_mlp(blocks), x), 10, repeats)
    m = _mlp(blocks)
    for b in m:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    sharded = _best(_step(m, x), 10, repeats)
    return max(0.0, (sharded - plain) / (blocks + 1))


def _tp_module_seconds(repeats: int, pair_latency: float) -> float:
    """A colwise and a rowwise linear on a 2-rank TP mesh against the same plain, per module
    per forward and backward, less their two all-reduces (priced as communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    if world < 2 or world % 2:
        return 0.0
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("others", "tp"))["tp"]
    x = torch.ones(4, 16)
    plain = _best(_step(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)), x), 10, repeats)
    m = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    tp = _best(_step(m, x), 10, repeats)
    return max(0.0, (tp - plain - 2 * pair_latency) / 2)


def _ac_block_seconds(repeats: int, op_seconds: float) -> float:
    """Blocks under ``checkpoint_wrapper`` (the trainer's) against the same plain, per block
    per forward and backward, less the recomputed linear's op."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = 4
    x = torch.ones(4, 16, requires_grad=True)
    plain = _best(_step(_mlp(blocks), x), 10, repeats)
    wrapped = nn.Sequential(*[checkpoint_wrapper(b) for b in _mlp(blocks)])
    ac = _best(_step(wrapped, x), 10, repeats)
    return max(0.0, (ac - plain) / blocks - op_seconds)


def probe_cpu(sizes: tuple[int, ...] | None = None, repeats: int = 5) -> dict:
    """This machine's ``cpu`` profile, measured by every rank of the default group at once
    (a collective: every rank calls it). ``sizes``: the group sizes whose collectives are
    timed (default 2 and the world). Returns a plain dict (``cpu_spec`` makes the device)."""
    from spmdgt.train._plan._device import _op_seconds
    from spmdgt.train._throughput import peak_flops

    world = dist.get_world_size()
    sizes = sizes or tuple(sorted({n for n in (2, world) if 1 < n <= world}))
    links = _links(sizes, repeats)
    _op_seconds.cache_clear()
    op = _op_seconds(torch.get_num_threads())
    peak = peak_flops(torch.device("cpu"), torch.float32)[0]
    pair = next((lat for n, lat, _ in links if n == 2), 0.0)
    vals = torch.tensor(
        [
            op,
            -peak,
            _unit_seconds(repeats),
            _tp_module_seconds(repeats, pair),
            _ac_block_seconds(repeats, op),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the slowest rank's, on every rank
    return {
        "ranks": world,
        "threads": torch.get_num_threads(),
        "links": [list(x) for x in links],
        "op_seconds": float(vals[0]),
        "peak_fp32": float(-vals[1]),
        "unit_seconds": float(vals[2]),
        "tp_module_seconds": float(vals[3]),
        "ac_block_seconds": float(vals[4]),
    }


def cpu_spec(profile: dict) -> DeviceSpec:
    """The ``cpu`` device priced with ``profile`` (``probe_cpu``'s): its links per group size,
    per-op, per-unit, per-TP-module and per-checkpointed-block costs and its peak."""
    links = tuple((int(n), float(lat), float(bw)) for n, lat, bw in profile["links"])
    _, lat, bw = links[-1]
    text = ", ".join(f"{k} ranks {v * 1e6:.0f} us {b / 1e9:.2f} GB/s" for k, v, b in links)
    link = Link(bw, lat, f"gloo on one host, measured per group: {text}", by_size=links)
    base = _cpu()
    scale = profile["peak_fp32"] / base.peak_full if base.peak_full else 1.0
    return replace(
        base,
        label=f"this CPU, {profile['ranks']} ranks x {profile['threads']} threads (measured)",
        peak_full=profile["peak_fp32"],
        peak_half=base.peak_half * scale,
        op_seconds=profile["op_seconds"],
        unit_seconds=profile["unit_seconds"],
        tp_module_seconds=profile["tp_module_seconds"],
        ac_block_seconds=profile["ac_block_seconds"],
        intra=link,
        inter=link,
        source=f"measured by {profile['ranks']} ranks at once (probe_cpu)",
    )
