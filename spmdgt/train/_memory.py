"""A run's memory: the tensor peak (what a dry run predicts) and the process's RSS, apart.

The tensor peak is the most bytes live tensors held at once on this rank, the figure a dry
run's trackers estimate, so a real run and its dry run compare on every device:

* CUDA: the caching allocator's own count, ``torch.cuda.max_memory_allocated`` (reset when
  the run starts, so a second ``train()`` reports its own peak). Free: the allocator keeps it.
* Any other device (CPU): there is no allocator count to read (torch's CPU allocator keeps
  none unless its profiler is recording), so torch's tracker, the one the dry run uses
  (``memory_tracker``: ``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise), watches the
  first ``TRACKED_STEPS`` optimizer steps: every tensor an op makes, the model's parameters
  and buffers, the gradients and the optimizer state, until each is freed. Two steps, as the
  dry run: the second is the first with optimizer state alive through forward and backward.
  It is a ``TorchDispatchMode`` (a Python call per op: about 2x a step's time on the example
  decoder on CPU), so it runs on those steps only, which the timing statistics leave out
  (``warmup_steps_excluded`` is at least ``TRACKED_STEPS``). Tensors made before the step and
  no op touches are not counted (a batch a loader's worker built; DDP's gradient bucket counts
  from its first all-reduce, which returns it), nor memory that is not a tensor's. Under
  ``torch.compile`` a dispatch mode makes dynamo skip the frame, which would change what runs,
  so compiled runs report no tensor peak on CPU (``memory_kind`` says so).

RSS (``peak_rss_gb``) is the process's resident set, tensors or not (the Python heap, the
libraries, the allocator's cached pages): what the machine must have, never called
"allocated". Read on every device from ``getrusage`` (peak) and ``/proc/self/statm`` (now).

Nothing here communicates: each rank measures itself.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["TRACKED_STEPS", "MemoryMeter", "memory_tracker", "peak_rss_bytes", "rss_bytes"]

TRACKED_STEPS = 2
"""Optimizer steps ``MemTracker`` watches on devices without an allocator count."""


def memory_tracker(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[object, str]:
    """torch's tensor tracker for a wrapped model and its name: ``FSDPMemTracker`` for an
    FSDP2 root (it sees FSDP's unsharded parameters and gathers as FSDP frees and refills
    them), ``MemTracker`` told the model and optimizer otherwise. The one choice a dry run
    and a real run both make, so their peaks count the same tensors."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return FSDPMemTracker(module, optimizer), "FSDPMemTracker"
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    return tracker, "MemTracker"


def rss_bytes() -> int:
    """The process's resident set size now (``/proc/self/statm``; the peak where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set size since it started (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class MemoryMeter:
    """One run's tensor peak on this rank, and its RSS samples.

    ``with meter.step():`` around each optimizer step; ``peak()`` the tensor peak so far
    (``None`` before any tracked step, or when nothing can measure it); ``kind`` says what
    measured it."""

    def __init__(
        self,
        device: torch.device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        compiled: bool = False,
    ) -> None:
        self.device = device
        self.model, self.optimizer = model, optimizer
        self.steps = 0
        self._peak: int | None = None
        self.breakdown: dict[str, int] = {}
        """The tracker's categories at the peak (parameters, gradients, optimizer state...)."""
        self.allocator = device.type == "cuda"
        if self.allocator:
            torch.cuda.reset_peak_memory_stats(device)
            self.kind = "cuda_allocated"
        elif compiled:
            self.kind = (
                "not measured (torch.compile: MemTracker's dispatch mode would make dynamo skip "
                "the compiled frames; see peak_rss_gb, or dry-run the job)"
            )
        else:
            self.kind = f"tensors (a tracker, steps 1-{TRACKED_STEPS}; none ran yet)"
        self.tracks = not self.allocator and not compiled
        self.tracked_steps = TRACKED_STEPS if self.tracks else 0
        """Steps run under the tracker (slower: the timing statistics leave them out)."""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one optimizer step, under ``MemTracker`` when it is one of the tracked ones."""
        self.steps += 1
        if not self.tracks or self.steps > TRACKED_STEPS:
            yield
            return
        tracker, name = memory_tracker(self.model, self.optimizer)
        self.kind = f"tensors ({name}, steps 1-{TRACKED_STEPS})"
        hook = nn.modules.module.register_module_forward_pre_hook(self._new_forward(tracker))
        try:
            with tracker:
                yield
        finally:
            hook.remove()
        for snap in tracker.get_tracker_snapshot("peak").values():  # type: ignore[attr-defined]
            if snap.get("Total", 0) > (self._peak or 0):
                self._peak = snap["Total"]
                self.breakdown = {str(k): v for k, v in snap.items() if k != "Total" and v}

    def _new_forward(self, tracker: object):
        """A global forward pre-hook, registered before the tracker's own (so it runs first):
        when the model's root is called again (the next micro-step of an accumulating step),
        clear the tracker's per-module statistics, which refuse a second top-level forward.
        The peak and the live tensors stay counted."""

        def hook(module: nn.Module, args: object) -> None:
            if module is self.model:
                tracker.reset_mod_stats()  # type: ignore[attr-defined]

        return hook

    def peak(self) -> int | None:
        """The tensor peak in bytes so far (this run's steps), or ``None`` when unmeasured."""
        if self.allocator:
            return torch.cuda.max_memory_allocated(self.device)
        return self._peak

    def allocated(self) -> int | None:
        """Bytes tensors hold now, where the allocator says (CUDA); ``None`` elsewhere."""
        return torch.cuda.memory_allocated(self.device) if self.allocator else None
