"""Benchmark results as files: one JSON layout for every script in ``benchmarks/``.

Every benchmark takes ``--json PATH`` and calls :func:`write` once at its end with its figures.
The file holds what is needed to compare two runs (the same layout for every script)::

    {
      "format": "spmdgt-benchmark/1",
      "benchmark": "scaling",                 # which script wrote it
      "context": {                            # where and how it ran
        "date": "2025-01-01T12:00:00+00:00",  # UTC, when the file was written
        "command": "benchmarks/scaling.py --quick ...",
        "machine": {"cpu_model": ..., "cores": ..., "cores_usable": ..., "gpu": ...,
                    "hostname": ..., "platform": ...},
        "python": ..., "torch": ..., "spmdgt": ...,
        "git": {"revision": ..., "dirty": ...},
        "device": "cpu", "world_size": 2, "threads": {...}, ...   # the benchmark's own
      },
      "results": {...}                        # the benchmark's figures (its docstring says)
    }

``python -m spmdgt.scripts.plot results/*.json`` reads these files (and only these: it never
imports ``benchmarks/``). :class:`Progress` is the progress line a benchmark that runs for more
than ~10 s prints as it goes.

Nothing here starts CUDA: the context is taken at the end of a run, after any forked ranks
have finished, and asks for a GPU name only where torch already sees one.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMAT = "spmdgt-benchmark/1"
ROOT = Path(__file__).resolve().parents[1]

__all__ = ["FORMAT", "Progress", "context", "write"]


def _cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo`` (Linux), else ``platform``'s answer."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _gpu_name() -> str | None:
    """The first CUDA device's name, or None (no CUDA, or a CPU-only torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return f"{n} x {name}" if n > 1 else name
    except Exception:  # a broken driver must not lose a finished run's figures
        return None
    return None


def _git() -> dict[str, Any]:
    """The checkout's revision and whether it had uncommitted changes (read-only git calls)."""

    def run(*cmd: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    rev = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no") if rev else None
    return {"revision": rev, "dirty": bool(status) if status is not None else None}


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def context(**extra: Any) -> dict[str, Any]:
    """Where and how this run happened, plus the benchmark's own ``extra`` keys (``device``,
    ``world_size``, ``threads``, ... as the benchmark ran them)."""
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    spmdgt_version = _version("spmdgt")
    if spmdgt_version is None and "spmdgt" in sys.modules:
        spmdgt_version = getattr(sys.modules["spmdgt"], "__version__", None)
    ctx: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
        if sys.argv and sys.argv[0]
        else None,
        "machine": {
            "cpu_model": _cpu_model(),
            "cores": os.cpu_count(),
            "cores_usable": usable,
            "gpu": _gpu_name(),
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "spmdgt": spmdgt_version,
        "git": _git(),
    }
    ctx.update(extra)
    return ctx


def _clean(obj: Any) -> Any:
    """JSON-safe: tuples to lists, non-string keys to strings, NaN/inf to None (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def write(path: str | os.PathLike, benchmark: str, results: Any, **ctx: Any) -> Path:
    """Write ``results`` with this run's context to ``path`` (folders made, replaced whole:
    a reader never sees half a file). Returns the path; prints where it went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "benchmark": benchmark,
        "context": _clean(context(**ctx)),
        "results": _clean(results),
    }
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, out)
    print(f"results written to {out}", flush=True)
    return out


class Progress:
    """Progress lines for a run longer than ~10 s: ``[name 0:12] message``, flushed at once
    (the elapsed time is since this object was made)."""

    def __init__(self, name: str, stream=None) -> None:
        self.name = name
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, message: str) -> None:
        m, s = divmod(int(self.elapsed()), 60)
        self.stream.write(f"[{self.name} {m}:{s:02d}] {message}\n")
        self.stream.flush()
