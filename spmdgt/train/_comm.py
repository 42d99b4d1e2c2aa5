"""Communication measured in a run: which collectives a wrapped model issued, on which mesh dim.

* ``CollectiveLog`` records every gradient/parameter collective a wrapped model issues, with
  bytes and issue-to-completion time. It is fed by torch's own extension points, never by
  guessing: a DDP communication hook (DDP's reducer calls C++ collectives that Python patches
  cannot see) and FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Each hook
  appends one record at issue and stamps its end in the completion callback it needs anyway:
  no synchronisation, no extra wait. Tensor-parallel placements have no such hook; their
  collectives come from the project's single op stream (``spmdgt.interceptor``) through
  ``InterceptorCollectiveSink``, and only when the user asked for measurement: the trainer
  traces nothing on its own.
* On a 2-D mesh every record carries the mesh dim its group belongs to (``tp``, ``dp_shard``,
  ``dp_replicate``; ``world`` for the default group: ``interceptor._groups.group_label``);
  the sink, beside the hooks, adds what they cannot see (TP's collectives, HSDP's replica
  all-reduce).

The cost model that prices these (``CommunicationProfiler``, the latency and bandwidth probes)
is ``_comm_cost``'s, re-exported here; per mesh dim, ``_comm_mesh``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from spmdgt.interceptor._groups import WORLD, group_label
from spmdgt.train._comm_cost import (
    KINDS,
    CommunicationProfiler,
    measure_bandwidth,
    measure_latency,
)

__all__ = [
    "KINDS",
    "CollectiveLog",
    "CommunicationProfiler",
    "InterceptorCollectiveSink",
    "measure_bandwidth",
    "measure_latency",
]


@dataclass(slots=True)
class _Record:
    kind: str
    nbytes: int  # bytes of the full (unsharded) buffer the collective works on
    start: float
    step: int
    end: float | None = None
    dim: str = WORLD  # the mesh dim whose group ran it (``_groups.group_label``)


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
        self._dims: dict[int, str] = {}  # id(process group) -> mesh dim name

    def dim_of(self, group: object) -> str:
        """The mesh dim name of ``group`` (``None``: the world), looked up once per group."""
        key = id(group)
        got = self._dims.get(key)
        if got is None:
            got = self._dims[key] = group_label(group)
        return got

    def start(self, kind: str, nbytes: int, group: object = None) -> _Record | None:
        """Record one collective issued now on ``group`` (``None``: the default group)."""
        if not self.enabled:
            return None
        rec = _Record(kind, int(nbytes), time.perf_counter(), self.step, None, self.dim_of(group))
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
        self._dims.clear()

    def dims(self) -> list[str]:
        """The mesh dims the records ran on, in first-seen order."""
        return list(dict.fromkeys(r.dim for r in self.records))

    def totals_by_dim(
        self, records: list[_Record] | None = None
    ) -> dict[str, dict[str, dict[str, float]]]:
        """``totals`` per mesh dim: ``{dim: {kind: {count, bytes, sec}}}``."""
        by: dict[str, list[_Record]] = defaultdict(list)
        for r in self.records if records is None else records:
            by[r.dim].append(r)
        return {dim: self.totals(recs) for dim, recs in by.items()}

    def step_figures_by_dim(self) -> dict[str, dict[int, tuple[int, int, float]]]:
        """Per mesh dim, per optimizer step: (collectives, bytes of their buffers, seconds of
        the completed ones)."""
        out: dict[str, dict[int, list]] = defaultdict(dict)
        for r in self.records:
            t = out[r.dim].setdefault(r.step, [0, 0, 0.0])
            t[0] += 1
            t[1] += r.nbytes
            if r.end is not None:
                t[2] += r.end - r.start
        return {d: {s: tuple(v) for s, v in steps.items()} for d, steps in out.items()}

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


def _reduced(f: torch.futures.Future, buf: torch.Tensor) -> torch.Tensor:
    """The all-reduced bucket: the future's tensor, ``buf`` itself (reduced in place) when the
    future carries none (torch's fake process group, which a dry run uses)."""
    value = f.value()
    return value[0] if value else buf


def ddp_counting_hook(log: CollectiveLog):
    """A DDP comm hook: record the bucket, then do DDP's own mean all-reduce.

    Same arithmetic as ``default_hooks.allreduce_hook`` (divide by world, all-reduce SUM), so
    SUM-then-divide is what runs on gloo too.
    """

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else dist.group.WORLD
        world = dist.get_world_size(group)
        buf = bucket.buffer()
        rec = log.start("all_reduce", buf.numel() * buf.element_size(), group)
        buf.div_(world)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        if rec is None:
            return fut.then(lambda f: _reduced(f, buf))

        # One callback, as torch's own Python allreduce_hook has: it unwraps the result and
        # stamps the completion time. DDP waits on this future, so the stamp is written first.
        def done(f: torch.futures.Future, rec: _Record = rec) -> torch.Tensor:
            rec.end = time.perf_counter()
            return _reduced(f, buf)

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
        nbytes = output_tensor.numel() * output_tensor.element_size()
        rec = self.log.start("all_gather", nbytes, group)
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
        nbytes = input_tensor.numel() * input_tensor.element_size()
        rec = self.log.start("reduce_scatter", nbytes, group)
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
        if work is None:
            if rec is not None:
                rec.end = time.perf_counter()
            return work
        return self.log.finish_on(rec, work)


# Base names of collectives (functional, c10d ops, torch.distributed's API) -> the kinds
# ``_comm_cost._RING_FACTOR`` and the estimates use.
_KIND = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base": "all_to_all",
    "broadcast": "broadcast",
}


def _collective_kind(op: str) -> str:
    """``_c10d_functional.all_gather_into_tensor.default`` -> ``all_gather`` (also
    ``c10d._allgather_base_.default``, ``dist.all_gather_single``)."""
    parts = op.split(".")
    spaces = ("_c10d_functional", "c10d_functional", "c10d", "dist")
    name = parts[1] if len(parts) > 1 and parts[0] in spaces else parts[0]
    name = name.rstrip("_") if not name.startswith("_") else "_" + name[1:].rstrip("_")
    return _KIND.get(name, name)


class InterceptorCollectiveSink:
    """A sink on the interceptor's op stream that keeps the model's collective events.

    Keeps ``(t0_ns, dur_ns, kind, nbytes, dim)`` for every ``comm`` event except the
    ``dist.*`` / ``c10d.*`` calls of the torch.distributed Python API: the model's collectives
    under DTensor are functional collectives (``_c10d_functional``), while the trainer's own
    bookkeeping (loader-length check, loss reduction) goes through ``dist.*`` on the world
    group and must not count as the model's communication. ``dim`` is the mesh dim the event
    ran on (``OpEvent.group``). ``fill`` assigns the kept events to optimizer steps by
    timestamp (events are delivered in batches, long after the step that issued them).

    ``api_dims`` makes it the sink beside torch's hooks (FSDP2 or DDP over the data dims of a
    2-D mesh): the hooks log the data dims' gathers, reduce-scatters and bucket all-reduces,
    this sink adds what they cannot see: DTensor's collectives (TP's redistributions inside
    ``tp``, the clip's norm) and the torch.distributed all-reduces on the dims named in
    ``api_dims`` (HSDP's replica all-reduce on ``dp_replicate``, the trainer's sum of
    sharded-input gradients over ``tp``): never the world's, never a dim the hooks log.
    Without ``api_dims`` (tensor parallelism alone: no hook logs anything) it also keeps the
    torch.distributed all-reduces that run in backward (the ``sharded_input`` gradient hooks'
    sums, on the world group when TP spans it): the trainer's bookkeeping never runs there.

    The duration is what the interceptor timed: the call that issues the collective. An
    ``AsyncCollectiveTensor``'s later wait happens inside a tensor subclass, which the stream
    does not show, so time spent waiting there is not included.
    """

    def __init__(self, api_dims: frozenset[str] | set[str] | None = None) -> None:
        self.events: list[tuple[int, int, str, int, str]] = []
        self.api_dims = frozenset(api_dims or ())

    @property
    def hooked(self) -> bool:
        """Whether this sink reads beside torch's hooks (it has ``api_dims``)."""
        return bool(self.api_dims)

    def on_events(self, events: list) -> None:
        keep = self.events.append
        api_dims = self.api_dims
        unhooked = not api_dims  # no torch hook logs anything (placements)
        for e in events:
            if e.kind != "comm":
                continue
            dim = getattr(e, "group", None) or WORLD
            kind = _collective_kind(e.op)
            # torch.distributed's API: ``dist.*`` at the torch level, ``c10d.*`` inside backward
            if e.op.startswith(("dist.", "c10d.")) and not (
                kind == "all_reduce" and (dim in api_dims or (unhooked and e.phase == "bwd"))
            ):
                continue
            keep((e.t0_ns, e.dur_ns, kind, e.nbytes, dim))

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
                t0, dur, kind, nbytes, dim = events[i]
                log.records.append(_Record(kind, nbytes, t0 * 1e-9, step, (t0 + dur) * 1e-9, dim))
                i += 1
