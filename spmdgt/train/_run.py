"""One ``train()`` call's measurement: what it carries from step to step and what it reports.

``DistributedTrainer.train`` opens a :class:`Run` per call (fresh statistics, the TensorBoard
writer and progress bar on rank 0, the profiler, the collective sink), then per step records
into it, and at the end attributes the logged collectives to steps and builds the summary.
These functions hold the measurement side of that; the loop itself is ``_trainer``'s.
Nothing here decides a collective: every function reads what the loop measured.

On a 2-D mesh each logged collective carries the mesh dim it ran on (``tp``, ``dp_shard``,
``dp_replicate``; ``world`` on the 1-D world): the run reads the mesh from its own parameters
(DTensors on the mesh), names the mesh's groups for the interceptor (``register_mesh``), and
reports count, bytes and seconds per dim and step (``comm_by_dim``, TensorBoard's
``comm/<dim>/*``, ``comm_dim_summary``). Under FSDP2 or DDP over the data dims with a ``tp``
dim, or HSDP, the hooks see only the gathers, reduce-scatters and DDP buckets; TP's
collectives (DTensor's redistributions inside ``tp``) and HSDP's replica all-reduce come from
the interceptor's stream, read beside them when measurement is on (``profile=True`` or the
interceptor enabled); otherwise the summary says which dims were not measured.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spmdgt import interceptor
from spmdgt.interceptor._groups import WORLD, register_mesh
from spmdgt.train._comm import CollectiveLog, InterceptorCollectiveSink
from spmdgt.train._config import TrainConfig
from spmdgt.train._memory import MemoryMeter
from spmdgt.train._summary import MetricsLogger, ProgressBar, RunStats
from spmdgt.train._throughput import Throughput

__all__ = [
    "Run",
    "attach_comm_sink",
    "attribute_collectives",
    "comm_dim_summary",
    "detach_comm_sink",
    "param_meshes",
    "make_profiler",
    "step_scalars",
    "window",
]


@dataclass
class Run:
    """What one ``train()`` call carries from step to step: its config (the trainer's, with
    the call's ``epochs``/``profile``/``max_steps``), the measurements and the open loggers. A
    fresh one per call, so a second ``train()`` starts its statistics clean."""

    cfg: TrainConfig
    stats: RunStats
    metrics: MetricsLogger
    bar: ProgressBar
    prof: torch.profiler.profile | None
    sink: InterceptorCollectiveSink | None
    own_interceptor: bool
    params: list[nn.Parameter]
    dp: int
    """Data-parallel ranks: samples per step are this x each rank's."""
    compile_at_start: float
    checked_batch: bool
    """Placements: whether the first batch was checked to be the same on every rank."""
    windows: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, start, end) per step: placements' collectives are attributed to steps by time."""
    val_loss: float | None = None
    t0: float = 0.0
    """When the current step's clock started (after the last step's checkpoint write)."""
    c0: float = 0.0
    """Compile seconds so far when the clock started: compile time is taken out of the step."""
    comm_by_dim: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Per mesh dim: ``collectives``, ``bytes`` (of their buffers) and ``sec`` per step, by
    step index as ``stats.step_times`` (filled by ``attribute_collectives``)."""
    memory: MemoryMeter | None = None
    """The tensor peak's meter (``_memory``): the trainer runs each step in its ``step()``."""

    def __post_init__(self) -> None:
        meshes = param_meshes(self.params)
        for mesh in meshes:
            register_mesh(mesh)  # the interceptor names these groups after their dims
        unhooked = _unhooked_dims(meshes)
        if self.cfg.strategy != "fsdp" and "dp_replicate" in unhooked:
            unhooked.remove("dp_replicate")  # DDP's hook logs its buckets on any data dim
        if self.sink is None and unhooked and (self.cfg.profile or interceptor.is_enabled()):
            # FSDP2/DDP over the data dims beside a ``tp`` dim, or HSDP: the hooks log the
            # gathers, reduce-scatters and DDP buckets; the op stream adds TP's collectives
            # and HSDP's replica all-reduce (``InterceptorCollectiveSink(api_dims)``).
            own = not interceptor.is_enabled()
            if own:
                interceptor.enable(stats=False, hotpath=False)
            self.sink = interceptor.add_sink(InterceptorCollectiveSink(set(unhooked)))
            self.own_interceptor = own

    @property
    def warmup_steps(self) -> int:
        """Steps the timing statistics leave out: the config's warm-up, and at least the
        steps ``MemoryMeter`` tracked (a dispatch mode slows them)."""
        tracked = self.memory.tracked_steps if self.memory is not None else 0
        return max(self.cfg.training.warmup_steps, tracked)

    def unmeasured_dims(self) -> list[str]:
        """Mesh dims whose collectives neither torch's hooks nor a sink measure."""
        if self.sink is not None:
            return []
        missed = _unhooked_dims(param_meshes(self.params))
        return [d for d in missed if not (d == "dp_replicate" and self.cfg.strategy != "fsdp")]


def param_meshes(params: list[nn.Parameter]) -> list[Any]:
    """The distinct device meshes of the DTensor parameters (FSDP2's, TP's), in first-seen
    order; ``[]`` for plain parameters."""
    out: dict[int, Any] = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and id(mesh) not in out:
            out[id(mesh)] = mesh
    return list(out.values())


# Mesh dims whose collectives torch's hooks do not see: DTensor's inside ``tp``, and FSDP2's
# replica all-reduce on ``dp_replicate`` (a plain ``dist.all_reduce``, no custom-comm hook).
_UNHOOKED = ("tp", "dp_replicate")


def _unhooked_dims(meshes: list[Any]) -> list[str]:
    """The dims of ``meshes`` (size > 1) whose collectives only the op stream can see."""
    out: list[str] = []
    for mesh in meshes:
        names = getattr(mesh, "mesh_dim_names", None) or ()
        out += [d for d in _UNHOOKED if d in names and d not in out and mesh[d].size() > 1]
    return out


def attribute_collectives(run: Run, log: CollectiveLog, comm_source: str | None) -> str | None:
    """Give each step its logged collectives (count and seconds) and return what logged
    them: a torch hook (``comm_source``), or the interceptor's stream (placements, read into
    ``log`` by step windows), or ``None`` when nothing measured them."""
    stats = run.stats
    if run.sink is not None:
        run.sink.fill(log, run.windows)
        comm_source = f"{comm_source}+interceptor" if run.sink.hooked else "interceptor"
    elif comm_source is not None and (missed := run.unmeasured_dims()):
        comm_source = f"{comm_source} ({'/'.join(missed)} not measured: use profile=True)"
    if comm_source is not None:
        counts, secs = log.step_counts(), log.step_seconds()
        for i in range(len(stats.step_times)):
            stats.collectives.append(counts.get(stats.first_step + i, 0))
            stats.comm_sec.append(secs.get(stats.first_step + i, 0.0))
        _per_dim(run, log)
    return comm_source


def _per_dim(run: Run, log: CollectiveLog) -> None:
    """Fill ``run.comm_by_dim`` from ``log`` and write TensorBoard's ``comm/<dim>/*`` scalars
    (rank 0 with a logdir): collectives, MB of buffers and seconds per step, per mesh dim."""
    stats = run.stats
    figures = log.step_figures_by_dim()
    for dim in sorted(figures):
        steps = figures[dim]
        rows = [steps.get(stats.first_step + i, (0, 0, 0.0)) for i in range(len(stats.step_times))]
        run.comm_by_dim[dim] = {
            "collectives": [float(r[0]) for r in rows],
            "bytes": [float(r[1]) for r in rows],
            "sec": [r[2] for r in rows],
        }
    if run.metrics.writer is None or not _named_dims(run):
        return
    for dim, fig in run.comm_by_dim.items():
        for i in range(len(stats.step_times)):
            run.metrics.scalars(
                stats.first_step + i + 1,
                {
                    f"comm/{dim}/collectives": fig["collectives"][i],
                    f"comm/{dim}/mb": fig["bytes"][i] / 1e6,
                    f"comm/{dim}/sec": fig["sec"][i],
                },
            )


def _named_dims(run: Run) -> bool:
    """Whether any collective ran on a named mesh dim (not only the 1-D world group)."""
    return any(dim != WORLD for dim in run.comm_by_dim)


def comm_dim_summary(run: Run) -> dict[str, float]:
    """The summary's per-mesh-dim communication after ``attribute_collectives``: per dim,
    ``comm_<dim>_collectives_per_step``, ``comm_<dim>_mb_per_step`` (buffer MB) and
    ``comm_<dim>_ms_per_step`` over the steps after warm-up. ``{}`` on the 1-D world (its
    summary stays what it was) or when nothing measured the collectives."""
    if not _named_dims(run):
        return {}
    n = len(run.stats.step_times)
    warm = min(run.warmup_steps, max(n - 1, 0))
    steps = max(n - warm, 1)
    out: dict[str, float] = {}
    for dim, fig in run.comm_by_dim.items():
        out[f"comm_{dim}_collectives_per_step"] = sum(fig["collectives"][warm:]) / steps
        out[f"comm_{dim}_mb_per_step"] = sum(fig["bytes"][warm:]) / steps / 1e6
        out[f"comm_{dim}_ms_per_step"] = sum(fig["sec"][warm:]) / steps * 1e3
    return out


def attach_comm_sink(
    comm_source: str | None, profile: bool
) -> tuple[InterceptorCollectiveSink | None, bool]:
    """For placements (``comm_source`` None), when measurement is asked for: a sink on the
    interceptor's stream.

    DTensor's collectives have no hook, and the project has one interception point per
    rank, so their bytes and times come from ``spmdgt.interceptor``: when it is already on
    (GT_* variables, ``spmdgt.interceptor.enable``) or ``profile=True`` turns it on for the
    run. Otherwise nothing is traced and the summary says comm time was not measured.
    Returns the sink and whether this run enabled the interceptor (and must disable it).
    """
    if comm_source is not None:
        return None, False
    own = False
    if not interceptor.is_enabled():
        if not profile:
            return None, False
        interceptor.enable(stats=False, hotpath=False)
        own = True
    return interceptor.add_sink(InterceptorCollectiveSink()), own


def detach_comm_sink(sink: InterceptorCollectiveSink | None, own: bool) -> None:
    """Undo :func:`attach_comm_sink` (delivering what is still buffered first)."""
    if sink is None:
        return
    interceptor.remove_sink(sink)
    if own:
        interceptor.disable()


def step_scalars(
    stats: RunStats, start: int, throughput: Throughput
) -> Iterator[tuple[int, dict[str, float | None]]]:
    """TensorBoard's scalars for the steps whose losses were reduced from index ``start`` on:
    ``(global step, {tag: value})``, the tags ``train/*`` and ``perf/*``."""
    memory = dict(zip(stats.memory_steps, stats.memory)) if stats.memory else {}
    rss = dict(zip(stats.memory_steps, stats.rss))
    for i in range(start, len(stats.global_losses)):
        dt = stats.step_times[i]
        mem, res = memory.get(i), rss.get(i)
        rates = throughput.figures(stats.samples[i], stats.tokens[i], dt)
        yield (
            stats.first_step + i + 1,
            {
                "train/loss": stats.global_losses[i],
                "train/lr": stats.lrs[i],
                "perf/step_time_sec": dt,
                "perf/throughput_samples_per_sec": stats.samples[i] / dt if dt else None,
                "perf/tokens_per_sec_per_device": rates["tokens_per_sec_per_device"],
                "perf/tflops_per_device": rates["tflops_per_device"],
                "perf/mfu": rates["mfu"],
                "perf/data_wait_share": stats.data_sec[i] / dt if dt else None,
                "perf/memory_allocated_gb": mem / 1e9 if mem is not None else None,
                "perf/rss_gb": res / 1e9 if res is not None else None,
            },
        )


def window(stats: RunStats, n: int, throughput: Throughput) -> dict[str, float | None]:
    """The last ``n`` steps' time per step, throughput, MFU and data-wait share, and the
    last memory sample's tensor peak so far (``memory_peak``) and RSS (``rss``), bytes: what
    a progress line and the bar print."""
    seconds = sum(stats.step_times[-n:])
    out = throughput.figures(sum(stats.samples[-n:]), sum(stats.tokens[-n:]), seconds)
    out["step_time"] = seconds / n if n else None
    out["data_wait_share"] = sum(stats.data_sec[-n:]) / seconds if seconds > 0 else None
    out["memory_peak"] = stats.peak_memory
    out["rss"] = stats.rss[-1] if stats.rss else None
    return out


def make_profiler(logdir: str | None, device: torch.device, rank: int) -> torch.profiler.profile:
    """Per-rank ``torch.profiler`` traces under ``<logdir>/profile`` (``./profiles``)."""
    from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

    out = os.path.join(logdir, "profile") if logdir else "./profiles"
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=acts,
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}"),
        profile_memory=True,
    )
