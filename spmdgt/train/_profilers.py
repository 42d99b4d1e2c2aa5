"""``PerformanceProfiler``: named wall-clock sections and memory samples, per rank.

Usage (any number of ranks; each rank profiles itself)::

    profiler = PerformanceProfiler()
    for batch in loader:
        with profiler.profile("step"):
            with profiler.profile("forward"):
                loss = model(batch)
            ...
        profiler.record_memory()
    profiler.print_summary()   # time per section and percent of "step"

On CUDA each section synchronises the device at its edges so kernel time lands in the section
that launched it (that costs overlap: use it to find bottlenecks, not in production runs).
Memory is ``torch.cuda.memory_allocated`` on CUDA and the process's resident set size on CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from spmdgt.train._memory import peak_rss_bytes, rss_bytes

__all__ = ["PerformanceProfiler", "cuda_peaks", "current_memory_bytes", "peak_memory_bytes"]


def current_memory_bytes(device: torch.device | None = None) -> int:
    """Bytes allocated by tensors on CUDA, or the process's resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return rss_bytes()


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak CUDA allocation, or the process's peak resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def cuda_peaks(device: torch.device) -> dict[str, float]:
    """On CUDA, the caching allocator's peaks in GB: ``peak_memory_reserved_gb`` (what the
    process holds from the driver: what must fit) and ``peak_memory_active_gb`` (live blocks);
    nothing on CPU (the summary's tensor peak comes from ``MemoryMeter``)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
        "peak_memory_active_gb": stats.get("active_bytes.all.peak", 0) / 1e9,
    }


class PerformanceProfiler:
    """Wall-clock time per named section and memory samples; ``print_summary`` reports both.

    Sections may nest; the percent column is relative to the section named ``step`` (or the
    longest section when there is none).
    """

    def __init__(self, device: torch.device | None = None, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self.times: dict[str, list[float]] = defaultdict(list)
        self.memory: list[int] = []

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def profile(self, name: str) -> Iterator[None]:
        """Time the block under ``name``."""
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[name].append(time.perf_counter() - t0)

    def record_memory(self) -> int:
        """Sample current memory (CUDA allocated or CPU RSS); return the bytes."""
        mem = current_memory_bytes(self.device)
        if self.enabled:
            self.memory.append(mem)
        return mem

    # The seed's spelling; on CPU it records RSS.
    record_gpu_memory = record_memory

    def summary(self) -> dict[str, dict[str, float]]:
        """Per section: count, mean/total seconds and percent of the step section."""
        totals = {k: sum(v) for k, v in self.times.items()}
        ref_name = "step" if "step" in totals else max(totals, key=totals.get, default=None)
        ref = totals.get(ref_name, 0.0) if ref_name else 0.0
        out = {
            name: {
                "count": len(v),
                "mean_sec": totals[name] / len(v),
                "total_sec": totals[name],
                "percent_of_step": 100.0 * totals[name] / ref if ref > 0 else 0.0,
            }
            for name, v in self.times.items()
        }
        if self.memory:
            out["memory"] = {
                "peak_gb": max(self.memory) / 1e9,
                "avg_gb": sum(self.memory) / len(self.memory) / 1e9,
                "samples": len(self.memory),
            }
        return out

    def print_summary(self, file=None) -> None:
        """Print time per section (ms), share of the step, and memory."""
        s = self.summary()
        print("Performance Profile", file=file)
        print("=" * 50, file=file)
        print(f"{'section':<20}{'count':>7}{'mean ms':>11}{'% of step':>12}", file=file)
        for name, row in s.items():
            if name == "memory":
                continue
            print(
                f"{name:<20}{row['count']:>7}{row['mean_sec'] * 1e3:>11.2f}"
                f"{row['percent_of_step']:>11.1f}%",
                file=file,
            )
        if "step" in s:
            inner = sum(r["total_sec"] for n, r in s.items() if n not in ("step", "memory"))
            other = s["step"]["total_sec"] - inner
            if other > 0 and inner > 0:
                pct = 100 * other / s["step"]["total_sec"]
                print(f"{'(unaccounted)':<20}{'':>7}{'':>11}{pct:>11.1f}%", file=file)
        if "memory" in s:
            kind = "CUDA allocated" if self.device and self.device.type == "cuda" else "CPU RSS"
            m = s["memory"]
            print(
                f"memory ({kind}): peak {m['peak_gb']:.3f} GB, avg {m['avg_gb']:.3f} GB", file=file
            )
