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
  (``warmup_steps_excluded`` is at least ``TRACKED_STEPS``). Each micro-batch counts from
  when it leaves the loader (``loading``/``count_inputs``: what the loader makes on the way,
  a dataset's token tensor that windows are sliced from, is not a step's). Tensors made
  before the step that no op touches are not counted (DDP's gradient bucket counts from its
  first all-reduce, which returns it, and from its rebuild at the second step's forward),
  nor memory that is not a tensor's. A dry run measures with this meter too. Under
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
        return _pausable(FSDPMemTracker)(module, optimizer), "FSDPMemTracker"
    tracker = _pausable(MemTracker)()
    tracker.track_external(module, optimizer)
    return tracker, "MemTracker"


_PAUSABLE: dict[type, type] = {}


def _pausable(cls: type) -> type:
    """``cls`` (a torch tracker) with a ``paused`` flag: while set, ops run untracked (what a
    data loader makes on its way to a batch)."""
    if cls not in _PAUSABLE:

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(self, "paused", False):
                if any(issubclass(t, _dtensor_type()) for t in types):
                    return NotImplemented  # DTensor desugars first, as the tracker lets it
                return func(*args, **(kwargs or {}))
            return cls.__torch_dispatch__(self, func, types, args, kwargs)

        _PAUSABLE[cls] = type(cls.__name__, (cls,), {"__torch_dispatch__": __torch_dispatch__})
    return _PAUSABLE[cls]


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


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
        """The tracker's categories at the peak, by its names ("Parameter", "Gradient",
        "OptState", FSDP's "Unsharded Param", "All Gather"...)."""
        self.tracker_name = ""
        """``FSDPMemTracker`` or ``MemTracker``, once a step was tracked."""
        self.tracker: object | None = None
        """The tracker of the step in progress (``None`` between steps and untracked): a dry
        run reads the activations it counts and tells it of tensors made outside it."""
        self.last_tracker: object | None = None
        """The last tracked step's tracker: a dry run reads its per-module snapshots."""
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
        self.tracker_name = name
        self.kind = f"tensors ({name}, steps 1-{TRACKED_STEPS})"
        hook = nn.modules.module.register_module_forward_pre_hook(self._new_forward(tracker))
        try:
            with tracker:
                self.tracker = tracker
                yield
        finally:
            self.tracker = None
            self.last_tracker = tracker
            hook.remove()
        for snap in tracker.get_tracker_snapshot("peak").values():  # type: ignore[attr-defined]
            if snap.get("Total", 0) > (self._peak or 0):
                self._peak = snap["Total"]
                # the categories are str enums: their values are the tracker's own names
                self.breakdown = {
                    str(getattr(k, "value", k)): v for k, v in snap.items() if k != "Total" and v
                }

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Where the loader makes the next batch: not counted. Its dataset's tensors are no
        step's (a window sliced from a token tensor would count the whole token tensor's
        storage, which a GPU run keeps on the host), and the batch is counted as it comes out
        (``count_inputs``), on every device as on CUDA, where its copy to the device is."""
        tracker = self.tracker
        if tracker is None:
            yield
            return
        tracker.paused = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            tracker.paused = False  # type: ignore[attr-defined]

    def count_inputs(self, batch: object) -> None:
        """Count the tensors of a batch just loaded, from now until they are freed (the
        tracker's "Inputs" under FSDP, its "Other" otherwise)."""
        tracker = self.tracker
        if tracker is None:
            return
        from torch.utils._pytree import tree_flatten

        tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        if hasattr(tracker, "track_inputs"):  # FSDPMemTracker: its track_external is a no-op
            tracker.track_inputs(tuple(tensors))
        else:
            tracker.track_external(*tensors)  # type: ignore[attr-defined]

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
