"""What a run reports: per-step measurements, the Training Summary, TensorBoard, progress bar.

Every number is measured on this run: step times by ``perf_counter`` around each optimizer step
(on CUDA after a device synchronise); losses kept on the device (no ``.item()`` per step) and
all-reduced across ranks in batches (one small collective every ``log_every`` steps on every
rank, whoever logs, and at the end); memory (``_memory``): the tensor peak, from CUDA's
allocator or, elsewhere, torch's ``MemTracker`` on the first steps, and the process's RSS apart,
sampled on the first step, every ``log_every`` steps and the last (a CPU RSS read costs ~60 us);
and the communication share from the collectives the wrapped model actually issued, or
``None`` where nothing measured them (placements without ``profile=True`` or the interceptor
on). The first ``warmup_steps`` steps are left out of the timing statistics and the summary
says how many.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from spmdgt.train._memory import MemoryMeter, peak_rss_bytes, rss_bytes
from spmdgt.train._strategies import all_reduce_mean
from spmdgt.train._throughput import Throughput

__all__ = ["MetricsLogger", "ProgressBar", "RunStats", "format_summary"]


@dataclass
class RunStats:
    """Raw per-optimizer-step measurements on this rank."""

    step_times: list[float] = field(default_factory=list)
    data_sec: list[float] = field(default_factory=list)
    """Seconds each step waited for its batches (the loader's ``next`` and the copy to the
    device): inside its step time."""
    local_losses: list[float] = field(default_factory=list)  # this rank's means, once flushed
    pending_losses: list[torch.Tensor] = field(default_factory=list)
    """Steps not reduced yet: this rank's summed micro-step losses, 0-d fp32 on the device."""
    pending_micro_steps: list[int] = field(default_factory=list)  # micro-steps in each sum
    global_losses: list[float] = field(default_factory=list)  # all-reduced means, by step
    lrs: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # global samples per step
    tokens: list[int] = field(default_factory=list)  # global tokens per step (0: unknown)
    memory: list[int] = field(default_factory=list)
    """Bytes tensors held at each sample, where an allocator says (CUDA); else empty."""
    rss: list[int] = field(default_factory=list)  # the process's RSS at each sample, bytes
    memory_steps: list[int] = field(default_factory=list)  # step index of each memory sample
    peak_memory: int | None = None
    """The tensor peak so far at the last sample (``MemoryMeter.peak``), bytes."""
    comm_sec: list[float] = field(default_factory=list)  # empty when comm was not measured
    compile_sec: list[float] = field(default_factory=list)
    """torch.compile seconds inside each step (taken out of its step time), 0 when none."""
    flag_anywhere: bool = False
    """The last flush's ``flag``: set on any rank (e.g. a compile failure to agree on)."""
    collectives: list[int] = field(default_factory=list)
    first_step: int = 0  # global step number of the first entry (after a resume)

    def sample_memory(self, meter: MemoryMeter) -> None:
        """Record a memory sample for the latest step: the RSS, the bytes tensors hold (where
        the allocator says) and the tensor peak so far."""
        allocated = meter.allocated()
        if allocated is not None:
            self.memory.append(allocated)
        self.rss.append(rss_bytes())
        self.memory_steps.append(len(self.step_times) - 1)
        self.peak_memory = meter.peak()

    def flush_losses(
        self, device: torch.device | str = "cpu", flag: bool | None = None
    ) -> list[float]:
        """All-reduce the not-yet-reduced local losses in one collective; return the new ones.

        Each step's loss is its fp32 micro-step sum divided by the micro-step count in float64,
        then the mean over ranks: the same numbers a per-step ``.item()`` would have given.
        ``flag`` (given alike on every rank, or by none) rides along as one more number:
        ``flag_anywhere`` says whether any rank set it (no extra collective).
        """
        self.flag_anywhere = False
        if not self.pending_losses:
            return []
        sums = torch.stack(self.pending_losses).to(device=device, dtype=torch.float64)
        counts = torch.tensor(self.pending_micro_steps, dtype=torch.float64, device=device)
        local = sums / counts
        if flag is None:
            new = all_reduce_mean(local).tolist()
        else:
            extra = torch.tensor([float(flag)], dtype=torch.float64, device=device)
            reduced = all_reduce_mean(torch.cat([local, extra])).tolist()
            new, self.flag_anywhere = reduced[:-1], reduced[-1] > 0
        self.local_losses.extend(local.tolist())
        self.global_losses.extend(new)
        self.pending_losses.clear()
        self.pending_micro_steps.clear()
        return new


def build_summary(
    stats: RunStats,
    *,
    warmup_steps: int,
    peak_memory: int | None,
    memory_kind: str,
    world_size: int,
    strategy: str,
    val_loss: float | None,
    comm_source: str | None = "no_collectives",
    throughput: Throughput | None = None,
) -> dict:
    """The Training Summary dict (seed 004's keys plus warm-up, tokens/s, comm share, and
    with ``throughput`` torchtitan's per-device figures: tokens/s, TFLOP/s, MFU, with the
    FLOP rule and the peak's source; and the share of step time spent waiting for data).

    ``comm_source`` names what measured the collectives (``None``: nothing did, and
    ``comm_time_share`` / ``collectives_per_step`` are ``None`` rather than a guess).

    Memory: ``peak_memory_allocated_gb`` is the tensor peak ``peak_memory`` (``None`` where
    nothing measured it; ``memory_kind`` says what did), ``avg_memory_allocated_gb`` the
    sampled allocator count (CUDA; ``None`` elsewhere), ``peak_rss_gb`` the process's peak
    resident set since it started and ``avg_rss_gb`` the sampled RSS: tensors or not."""
    n = len(stats.step_times)
    warm = min(warmup_steps, max(n - 1, 0))
    times = stats.step_times[warm:]
    total_time = sum(times)
    avg = total_time / len(times) if times else 0.0
    samples = sum(stats.samples[warm:])
    tokens = sum(stats.tokens[warm:])
    measured = comm_source is not None
    comm = sum(stats.comm_sec[warm:]) if measured else 0.0
    losses = stats.global_losses
    out = {
        "num_steps": n,
        "warmup_steps_excluded": warm,
        "avg_step_time": avg,
        "min_step_time": min(times) if times else 0.0,
        "max_step_time": max(times) if times else 0.0,
        "throughput_samples_per_sec": samples / total_time if total_time > 0 else 0.0,
        "throughput_tokens_per_sec": (tokens / total_time if total_time > 0 else 0.0)
        if tokens
        else None,
        "avg_loss": sum(losses) / len(losses) if losses else float("nan"),
        "final_loss": losses[-1] if losses else float("nan"),
        "losses": list(losses),
        "peak_memory_allocated_gb": peak_memory / 1e9 if peak_memory is not None else None,
        "avg_memory_allocated_gb": _mean(stats.memory) / 1e9 if stats.memory else None,
        "memory_kind": memory_kind,
        "peak_rss_gb": peak_rss_bytes() / 1e9,
        "avg_rss_gb": _mean(stats.rss) / 1e9 if stats.rss else None,
        "comm_time_share": (comm / total_time if total_time > 0 else 0.0) if measured else None,
        "collectives_per_step": (
            (sum(stats.collectives[warm:]) / len(times) if times else 0.0) if measured else None
        ),
        "comm_measured_by": comm_source if measured else "not measured (use profile=True)",
        "world_size": world_size,
        "strategy": strategy,
    }
    out["data_wait_share"] = (
        sum(stats.data_sec[warm:]) / total_time if total_time > 0 and stats.data_sec else None
    )
    if throughput is not None:
        samples_all, tokens_all = sum(stats.samples[warm:]), sum(stats.tokens[warm:])
        out.update(throughput.figures(samples_all, tokens_all, total_time))
        peak, source = throughput.peak
        out["flops_estimate"] = throughput.flops.describe(samples_all, tokens_all)
        out["peak_tflops_per_device"] = peak / 1e12
        out["peak_flops_source"] = source
    if val_loss is not None:
        out["val_loss"] = val_loss
    return out


def _mean(values: list[int]) -> float:
    return sum(values) / len(values)


def format_summary(summary: dict) -> str:
    """Seed 004's layout: a title, a rule, one ``key: value`` per line (the per-step
    ``losses`` stay in the dict: the progress lines and TensorBoard show them)."""
    lines = ["Training Summary", "=" * 50]
    for k, v in summary.items():
        if k == "losses":
            continue
        if isinstance(v, float):
            v = f"{v:.4f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
        lines.append(f"{k}: {v}")
    return "\n".join(lines)


class MetricsLogger:
    """TensorBoard scalars, written by rank 0 only (other ranks hold no writer)."""

    def __init__(self, logdir: str | None, is_main: bool) -> None:
        self.writer = None
        if logdir and is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=logdir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if v is not None:
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class ProgressBar:
    """Progress on rank 0: a one-line bar on an interactive terminal, else a line per flush.

    A job whose stdout is a file or a pipe shows life through ``report``: one line every
    ``log_every`` steps, printed after the loss flush that every rank runs at that step
    anyway, with the numbers it brought back. Nothing here decides a collective: whether a
    terminal is attached (rank 0 only) changes what is printed, never what is communicated.
    """

    def __init__(self, total: int | None, is_main: bool, stream=None) -> None:
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        tty = bool(isatty()) if callable(isatty) else False
        self.active = is_main and tty  # the bar
        self.lines = is_main and not tty  # progress lines at flushes
        self.total = total
        self._t0 = time.perf_counter()

    def report(self, step: int, losses: list[float], window: dict[str, float | None]) -> None:
        """A progress line after a flush: step, last loss, mean loss, then the flushed steps'
        time per step, tokens/s per device, TFLOP/s per device, MFU and data-wait share
        (``_run.window``), the tensor peak and the RSS (``mem``, ``rss``), and elapsed time.
        Printed by rank 0 when no bar is drawn."""
        if not self.lines or not losses:
            return
        head = f"step {step}/{self.total}" if self.total else f"step {step}"
        mean = sum(losses) / len(losses)
        ms = (window.get("step_time") or float("nan")) * 1e3
        elapsed = time.perf_counter() - self._t0
        self.stream.write(
            f"{head} loss {losses[-1]:.4f} (mean of last {len(losses)}: {mean:.4f}) "
            f"{ms:.1f} ms/step{_figures(window)} elapsed {_clock(elapsed)}\n"
        )
        self.stream.flush()

    def update(self, step: int, loss: float, window: dict[str, float | None]) -> None:
        """Redraw the bar (rank 0 on a terminal) after a step: the step's loss, time, the
        same rates, memory and RSS as a progress line (``_run.window`` of that one step)."""
        if not self.active:
            return
        if self.total:
            frac = min(step / self.total, 1.0)
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            head = f"[{bar}] {step}/{self.total}"
        else:
            head = f"step {step}"
        ms = (window.get("step_time") or float("nan")) * 1e3
        self.stream.write(f"\r{head} loss {loss:.4f} {ms:.1f} ms/step{_figures(window)}")
        self.stream.flush()

    def close(self) -> None:
        if self.active:
            self.stream.write("\n")
            self.stream.flush()


def _figures(window: dict[str, float | None]) -> str:
    """The rates and memory of a progress line or the bar, each where it was measured:
    `` 3,012 tok/s/dev 0.00163 TFLOP/s/dev MFU 7.3% data 1% mem 0.012 GB rss 0.41 GB``
    (``mem``: the tensor peak so far; ``rss``: the process's resident set)."""
    out = ""
    if window.get("tokens_per_sec_per_device") is not None:
        out += f" {window['tokens_per_sec_per_device']:,.0f} tok/s/dev"
    if window.get("tflops_per_device") is not None:
        out += f" {window['tflops_per_device']:.3g} TFLOP/s/dev MFU {window['mfu']:.1%}"
    if window.get("data_wait_share") is not None:
        out += f" data {window['data_wait_share']:.0%}"
    if window.get("memory_peak") is not None:
        out += f" mem {window['memory_peak'] / 1e9:.3g} GB"
    if window.get("rss") is not None:
        out += f" rss {window['rss'] / 1e9:.3g} GB"
    return out


def _clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: elapsed wall time for a progress line."""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
