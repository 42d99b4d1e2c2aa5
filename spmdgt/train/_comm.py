"""Communication: cost models from the collective algebra, a measured bandwidth, a live log.

Three pieces:

* ``CollectiveLog`` records every gradient/parameter collective a wrapped model issues, with
  bytes and issue-to-completion time. It is fed by torch's own extension points, never by
  guessing: a DDP communication hook (DDP's reducer calls C++ collectives that Python patches
  cannot see) and FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Each hook
  appends one record at issue and stamps its end in the completion callback it needs anyway:
  no synchronisation, no extra wait. Tensor-parallel placements have no such hook; their
  collectives come from the project's single op stream (``spmdgt.interceptor``) through
  ``InterceptorCollectiveSink``, and only when the user asked for measurement: the trainer
  traces nothing on its own.
* ``measure_bandwidth`` times a short all-reduce probe on the current process group and returns
  the *bus* bandwidth (bytes each rank moves per second, ring algebra applied).
* ``CommunicationProfiler.estimate_ddp_comm_cost`` / ``estimate_fsdp_comm_cost`` apply the ring
  algebra to a model's parameter bytes: all-reduce moves ``2(n-1)/n`` of the buffer per rank,
  all-gather and reduce-scatter ``(n-1)/n`` each; FSDP all-gathers parameters in forward *and*
  again in backward (when resharding after forward) and reduce-scatters gradients.

Works in a world of one (its own costs are 0; estimates for N ranks need ``bandwidth=``).
Under ``torchrun --nproc_per_node=N`` the probe runs on the default group, so every rank must
call it together.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

__all__ = [
    "CollectiveLog",
    "CommunicationProfiler",
    "InterceptorCollectiveSink",
    "measure_bandwidth",
]

# Bytes each rank sends per byte of its buffer, for a ring over n ranks.
_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(slots=True)
class _Record:
    kind: str
    nbytes: int  # bytes of the full (unsharded) buffer the collective works on
    start: float
    step: int
    end: float | None = None


class CollectiveLog:
    """Collectives issued by a wrapped model: kind, bytes and issue-to-completion seconds.

    The trainer sets ``log.step`` to the optimizer step in progress so records can be grouped
    per step; time is wall time from issue to completion of the work, so collectives
    that overlap compute count in full (the share is an upper bound on exposed communication).
    """

    def __init__(self) -> None:
        self.records: list[_Record] = []
        self.enabled = True
        self.step = 0  # optimizer step the next records belong to

    def start(self, kind: str, nbytes: int) -> _Record | None:
        if not self.enabled:
            return None
        rec = _Record(kind, int(nbytes), time.perf_counter(), self.step)
        self.records.append(rec)
        return rec

    def finish_on(self, rec: _Record | None, work: object) -> object:
        """Stamp ``rec`` when ``work`` (a ``Work`` or ``Future``) completes.

        Returns a future chained after the stamp for a ``Future`` (wait on that one so the
        stamp is known to be written), ``work`` itself for a ``Work``.
        """
        if rec is None:
            return work
        is_work = hasattr(work, "get_future")
        fut = work.get_future() if is_work else work

        def _done(f, rec=rec):
            rec.end = time.perf_counter()
            return f.value()

        chained = fut.then(_done)
        return work if is_work else chained

    def step_seconds(self) -> dict[int, float]:
        """Issue-to-completion seconds per optimizer step (completed collectives)."""
        out: dict[int, float] = defaultdict(float)
        for r in self.records:
            if r.end is not None:
                out[r.step] += r.end - r.start
        return dict(out)

    def step_counts(self) -> dict[int, int]:
        """Collectives issued per optimizer step."""
        out: dict[int, int] = defaultdict(int)
        for r in self.records:
            out[r.step] += 1
        return dict(out)

    def clear(self) -> None:
        self.records.clear()

    def totals(self, records: list[_Record] | None = None) -> dict[str, dict[str, float]]:
        """Per kind: count, bytes and seconds (completed collectives only for seconds)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "sec": 0})
        for r in self.records if records is None else records:
            t = out[r.kind]
            t["count"] += 1
            t["bytes"] += r.nbytes
            if r.end is not None:
                t["sec"] += r.end - r.start
        return dict(out)


def _first(f: torch.futures.Future) -> torch.Tensor:
    return f.value()[0]


def ddp_counting_hook(log: CollectiveLog):
    """A DDP comm hook: record the bucket, then do DDP's own mean all-reduce.

    Same arithmetic as ``default_hooks.allreduce_hook`` (divide by world, all-reduce SUM), so
    SUM-then-divide is what runs on gloo too.
    """

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else dist.group.WORLD
        world = dist.get_world_size(group)
        buf = bucket.buffer()
        rec = log.start("all_reduce", buf.numel() * buf.element_size())
        buf.div_(world)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        if rec is None:
            return fut.then(_first)

        # One callback, as torch's own Python allreduce_hook has: it unwraps the result and
        # stamps the completion time. DDP waits on this future, so the stamp is written first.
        def done(f: torch.futures.Future, rec: _Record = rec) -> torch.Tensor:
            rec.end = time.perf_counter()
            return f.value()[0]

        return fut.then(done)

    # DDP checks the annotations as objects; this module's are strings (future annotations).
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


class LoggedAllGather(DefaultAllGather):
    """FSDP2's default all-gather, recorded in a ``CollectiveLog``."""

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rec = self.log.start("all_gather", output_tensor.numel() * output_tensor.element_size())
        work = super().__call__(output_tensor, input_tensor, group, async_op=async_op)
        if work is None:
            if rec is not None:
                rec.end = time.perf_counter()
            return work
        return self.log.finish_on(rec, work)


class LoggedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, recorded in a ``CollectiveLog``."""

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        rec = self.log.start("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
        if work is None:
            if rec is not None:
                rec.end = time.perf_counter()
            return work
        return self.log.finish_on(rec, work)


# Base names of functional collectives -> the kinds ``_RING_FACTOR`` and the estimates use.
_KIND = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _collective_kind(op: str) -> str:
    """``_c10d_functional.all_gather_into_tensor.default`` -> ``all_gather``."""
    parts = op.split(".")
    name = parts[1] if parts[0] in ("_c10d_functional", "c10d_functional") else parts[0]
    name = name.rstrip("_")
    return _KIND.get(name, name)


class InterceptorCollectiveSink:
    """A sink on the interceptor's op stream that keeps the model's collective events.

    Keeps ``(t0_ns, dur_ns, kind, nbytes)`` for every ``comm`` event except the ``dist.*`` /
    ``c10d.*`` calls of the torch.distributed Python API: the model's collectives under DTensor
    are functional collectives (``_c10d_functional``), while the trainer's own bookkeeping
    (loader-length check, loss reduction) goes through ``dist.*`` and must not count as the
    model's communication. ``fill`` assigns the kept events to optimizer steps by timestamp
    (events are delivered in batches, long after the step that issued them).

    The duration is what the interceptor timed: the call that issues the collective. An
    ``AsyncCollectiveTensor``'s later wait happens inside a tensor subclass, which the stream
    does not show, so time spent waiting there is not included.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str, int]] = []

    def on_events(self, events: list) -> None:
        keep = self.events.append
        for e in events:
            if e.kind == "comm" and not e.op.startswith(("dist.", "c10d.")):
                keep((e.t0_ns, e.dur_ns, _collective_kind(e.op), e.nbytes))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def fill(self, log: CollectiveLog, windows: list[tuple[int, float, float]]) -> None:
        """Add the kept events that started inside a ``(step, start_s, end_s)`` window to ``log``.

        Windows are ``time.perf_counter`` seconds (the interceptor stamps ``perf_counter_ns``,
        the same clock). Events outside every window (before training, between steps) are not
        the model's step communication and are dropped.
        """
        events = sorted(self.events)
        i = 0
        for step, lo, hi in sorted(windows, key=lambda w: w[1]):
            lo_ns, hi_ns = int(lo * 1e9), int(hi * 1e9)
            while i < len(events) and events[i][0] < lo_ns:
                i += 1
            while i < len(events) and events[i][0] <= hi_ns:
                t0, dur, kind, nbytes = events[i]
                log.records.append(_Record(kind, nbytes, t0 * 1e-9, step, (t0 + dur) * 1e-9))
                i += 1


def measure_bandwidth(
    nbytes: int = 8 << 20, iters: int = 5, group: dist.ProcessGroup | None = None
) -> float:
    """Bus bandwidth in bytes/s of an all-reduce of ``nbytes`` on ``group`` (0 in a world of 1).

    Bus bandwidth = bytes each rank moves (``2(n-1)/n * nbytes``) / time, so it plugs straight
    into the ring cost formulas. One untimed warm-up, then the median of ``iters`` timed calls.
    Collective: every rank of ``group`` must call it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    n = dist.get_world_size(group)
    if n == 1:
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(group) else "cpu"
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)
    times = []
    for _ in range(iters):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    dt = times[len(times) // 2]
    # Ranks can measure different medians; use the slowest so every rank plans with one number.
    t = torch.tensor([dt], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return _RING_FACTOR["all_reduce"](n) * buf.numel() * 4 / float(t.item())


def _is_nccl(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"


def _param_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None, pad_to: int = 1) -> int:
    """Bytes of the trainable parameters; ``pad_to`` rounds dim 0 up to a multiple (FSDP2
    pads every parameter's dim 0 to the world size so all shards are equal)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        numel = p.numel()  # a DTensor reports its global numel
        if pad_to > 1 and p.ndim > 0 and p.shape[0] % pad_to:
            numel = numel // p.shape[0] * (-(-p.shape[0] // pad_to) * pad_to)
        size = torch.empty((), dtype=dtype).element_size() if dtype else p.element_size()
        total += numel * size
    return total


class CommunicationProfiler:
    """Communication cost per optimizer step: estimated from algebra, measured in a run.

    ``bandwidth`` (bytes/s, bus bandwidth) is measured with ``measure_bandwidth`` on first use
    unless given; estimates are bytes each rank moves per step and seconds at that bandwidth
    (``nan`` when estimating for N ranks from a world of one, where there is nothing to probe:
    pass ``bandwidth=`` then).
    """

    def __init__(self, enabled: bool = True, bandwidth: float | None = None) -> None:
        self.enabled = enabled
        self._bandwidth = bandwidth

    @property
    def bandwidth(self) -> float:
        """Measured bus bandwidth of the current group in bytes/s (0 in a world of one)."""
        if self._bandwidth is None:
            self._bandwidth = measure_bandwidth() if self.enabled else 0.0
        return self._bandwidth

    def _cost(self, parts: dict[str, float], world_size: int) -> dict[str, float]:
        total = sum(parts.values())
        bw = self.bandwidth if world_size > 1 else 0.0
        out = {f"{k}_bytes": v for k, v in parts.items()}
        if world_size <= 1:
            seconds = 0.0  # nothing moves
        elif bw > 0:
            seconds = total / bw
        else:
            # No peer to probe (a world of one estimating for N ranks): say "unknown", never
            # a made-up 0. Pass ``bandwidth=`` to the profiler to plan for another machine.
            seconds = math.nan
        out.update(
            world_size=world_size,
            bytes_per_rank=total,
            bandwidth_bytes_per_sec=bw,
            estimated_sec=seconds,
        )
        return out

    def estimate_ddp_comm_cost(
        self, model: torch.nn.Module, world_size: int, grad_dtype: torch.dtype | None = None
    ) -> dict[str, float]:
        """DDP: one all-reduce of every gradient: ``2(n-1)/n * grad_bytes`` per rank."""
        n = world_size
        grad_bytes = _param_bytes(model, grad_dtype)
        return self._cost({"all_reduce": _RING_FACTOR["all_reduce"](n) * grad_bytes}, n)

    def estimate_fsdp_comm_cost(
        self,
        model: torch.nn.Module,
        world_size: int,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> dict[str, float]:
        """FSDP: all-gather params in forward, again in backward (when resharded after
        forward), reduce-scatter grads; ``(n-1)/n`` of the buffer per rank each. Buffers are
        the parameters with dim 0 padded to a multiple of ``n``, as FSDP2 lays them out."""
        n = world_size
        gathers = 2 if reshard_after_forward else 1
        ag = gathers * _RING_FACTOR["all_gather"](n) * _param_bytes(model, param_dtype, n)
        rs = _RING_FACTOR["reduce_scatter"](n) * _param_bytes(model, reduce_dtype, n)
        return self._cost({"all_gather": ag, "reduce_scatter": rs}, n)

    @staticmethod
    def measured_bytes_per_rank(
        totals: dict[str, dict[str, float]], world_size: int
    ) -> dict[str, float]:
        """Ring bytes per rank moved by the logged collectives (buffer bytes x ring factor)."""
        out = {}
        for kind, t in totals.items():
            factor = _RING_FACTOR.get(kind, lambda n: (n - 1) / n)(world_size)
            out[f"{kind}_bytes"] = factor * t["bytes"]
        out["bytes_per_rank"] = sum(out.values())
        return out

    def compare(
        self,
        estimate: dict[str, float],
        totals: dict[str, dict[str, float]],
        num_steps: int,
        world_size: int,
    ) -> str:
        """A side-by-side table: estimated vs measured bytes and seconds per optimizer step."""
        measured = self.measured_bytes_per_rank(totals, world_size)
        lines = [f"{'collective':<16}{'est MB/step':>14}{'meas MB/step':>14}{'meas ms/step':>14}"]
        kinds = sorted({k[:-6] for k in estimate if k.endswith("_bytes")} | set(totals))
        kinds = [k for k in kinds if k != "bytes_per"]
        steps = max(num_steps, 1)
        for k in kinds:
            est = estimate.get(f"{k}_bytes", 0.0) / 1e6
            meas = measured.get(f"{k}_bytes", 0.0) / steps / 1e6
            ms = totals.get(k, {}).get("sec", 0.0) / steps * 1e3
            lines.append(f"{k:<16}{est:>14.3f}{meas:>14.3f}{ms:>14.2f}")
        gbps = estimate["bandwidth_bytes_per_sec"] / 1e9
        lines.append(
            f"bandwidth (measured all-reduce probe): {gbps:.2f} GB/s; "
            f"estimated {estimate['estimated_sec'] * 1e3:.2f} ms/step"
        )
        return "\n".join(lines)
