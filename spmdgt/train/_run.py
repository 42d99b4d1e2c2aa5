"""One ``train()`` call's measurement: what it carries from step to step and what it reports.

``DistributedTrainer.train`` opens a :class:`Run` per call (fresh statistics, the TensorBoard
writer and progress bar on rank 0, the profiler, the collective sink), then per step records
into it, and at the end attributes the logged collectives to steps and builds the summary.
These functions hold the measurement side of that; the loop itself is ``_trainer``'s.
Nothing here decides a collective: every function reads what the loop measured.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from spmdgt import interceptor
from spmdgt.train._comm import CollectiveLog, InterceptorCollectiveSink
from spmdgt.train._config import TrainConfig
from spmdgt.train._summary import MetricsLogger, ProgressBar, RunStats
from spmdgt.train._throughput import Throughput

__all__ = [
    "Run",
    "attach_comm_sink",
    "attribute_collectives",
    "detach_comm_sink",
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


def attribute_collectives(run: Run, log: CollectiveLog, comm_source: str | None) -> str | None:
    """Give each step its logged collectives (count and seconds) and return what logged
    them: a torch hook (``comm_source``), or the interceptor's stream (placements, read into
    ``log`` by step windows), or ``None`` when nothing measured them."""
    stats = run.stats
    if run.sink is not None:
        run.sink.fill(log, run.windows)
        comm_source = "interceptor"
    if comm_source is not None:
        counts, secs = log.step_counts(), log.step_seconds()
        for i in range(len(stats.step_times)):
            stats.collectives.append(counts.get(stats.first_step + i, 0))
            stats.comm_sec.append(secs.get(stats.first_step + i, 0.0))
    return comm_source


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
    memory = dict(zip(stats.memory_steps, stats.memory))
    for i in range(start, len(stats.global_losses)):
        dt = stats.step_times[i]
        mem = memory.get(i)
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
                "perf/memory_gb": mem / 1e9 if mem is not None else None,
            },
        )


def window(stats: RunStats, n: int, throughput: Throughput) -> dict[str, float | None]:
    """The last ``n`` steps' time per step, throughput, MFU and data-wait share: what a
    progress line prints."""
    seconds = sum(stats.step_times[-n:])
    out = throughput.figures(sum(stats.samples[-n:]), sum(stats.tokens[-n:]), seconds)
    out["step_time"] = seconds / n if n else None
    out["data_wait_share"] = sum(stats.data_sec[-n:]) / seconds if seconds > 0 else None
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
