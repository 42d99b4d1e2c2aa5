"""A dry run is the trainer itself on a fake world: ``DrySession`` is that setting.

Inside a session (a context manager) this process is rank 0 of torch's fake process group of
``world`` ranks (torchtitan's ``comm.mode = "fake_backend"``), torchrun's variables say so and
every tensor the model is built from is fake. A ``DistributedTrainer`` built there sees the
``fake`` backend and asks ``active_session()`` for the few things a fake world changes:

* ``replace``/``eager``: the dry run's ``config``/``strategy`` replace the ones given, and the
  step runs eagerly (``compile`` off, noted);
* ``meshes``: the layout's meshes are built outside the fake mode (they hold real ranks);
* ``wrapping``: ``wrap_model`` runs on the fake parameters (``_fake._wrappable``);
* ``after_forward``: the activations a forward saved;
* ``train(trainer, loader)``: two of the trainer's own ``_train_step``s on the loader's first
  batch, measured by a real run's ``MemoryMeter`` (the memory of ``backend``'s collectives
  modelled: ``_fake._backend_memory``), the second's collectives counted; the result goes to
  ``on_report`` (a script's session ends the script there).

Everything else (the layout, the loss and its HF label-token count, the data-parallel scaling,
the ``sharded_input`` sum, the GradScaler, the clip, the optimizer, the scheduler) is the
trainer's code, run as it runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from spmdgt.train._config import TrainConfig, override
from spmdgt.train._dryrun._counting import CollectiveCounter, _bytes_per_rank, _optimizer_tensors
from spmdgt.train._dryrun._fake import (
    _backend_memory,
    _dtensor_metadata_apart,
    _fake_mode,
    _hf_masks_unpadded,
    _mesh_ranks_real,
    _rebuild_ddp_buckets,
    _wrappable,
    fake_world,
)
from spmdgt.train._memory import MemoryMeter

__all__ = ["DrySession", "active_session", "first_batch"]

_ACTIVE: list[DrySession] = []


def active_session() -> DrySession | None:
    """The dry run in progress in this process (``None``: none)."""
    return _ACTIVE[-1] if _ACTIVE else None


class DrySession:
    """One dry run's world and what it measures (see the module docstring)."""

    def __init__(
        self,
        world: int,
        *,
        config: TrainConfig | str | os.PathLike | None = None,
        strategy: str | None = None,
        on_report: Callable[[dict, TrainConfig, list[str]], object] | None = None,
        backend: str = "nccl",
    ) -> None:
        self.world = world
        self.backend = backend
        """The backend whose collectives' memory is modelled (``_fake.BACKENDS``)."""
        self.fake = _fake_mode()
        self.config, self.strategy = config, strategy
        self.on_report = on_report
        self.notes: list[str] = []
        self._after: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def world_of_ranks(self) -> Iterator[DrySession]:
        """Rank 0 of the fake world for the duration (torchrun's variables, the fake group,
        spmdgt's runtime forgotten before and after: it adopts the fake group)."""
        _forget_runtime()
        _ACTIVE.append(self)
        try:
            with (
                _launcher_env(self.world),
                fake_world(self.world),
                _dtensor_metadata_apart(),
                _mesh_ranks_real(),
            ):
                yield self
        finally:
            _ACTIVE.remove(self)
            _forget_runtime()

    # ---------------------------------------------------------------- asked by the trainer

    def replace(
        self, config: TrainConfig | str | os.PathLike | None, strategy: str | None
    ) -> tuple[object, str | None]:
        """The trainer's ``config`` and ``strategy`` arguments, the dry run's where given."""
        return (
            self.config if self.config is not None else config,
            self.strategy if self.strategy is not None else strategy,
        )

    def eager(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with ``compile`` off (a dry run steps eagerly), noted when it was on."""
        if cfg.compile:
            self.notes.append("compile=True is not dry-run: the step ran eagerly (eager memory)")
            return override(cfg, compile=False)
        return cfg

    def meshes(self) -> contextlib.AbstractContextManager:
        """Where the layout's meshes are built: outside the fake mode (real rank numbers)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()

    @contextlib.contextmanager
    def wrapping(self, model: nn.Module) -> Iterator[None]:
        """Where ``wrap_model`` runs: the fake mode, ``model`` made wrappable."""
        with self.fake, _wrappable(model):
            yield

    def after_forward(self) -> None:
        self._after()

    def train(self, trainer: object, loader: object) -> object:
        """The trainer's ``train(loader)``: measure two steps on the loader's first batch."""

        return self.report(trainer, first_batch(loader))

    def report(self, trainer: object, batch: object) -> object:
        """Measure two of ``trainer``'s steps on ``batch`` and hand the result to
        ``on_report`` (its return value is returned)."""
        raw = self.measure(trainer, batch)
        assert self.on_report is not None
        return self.on_report(raw, trainer.config, self.notes)

    # ---------------------------------------------------------------- the measurement

    def measure(self, trainer: object, batch: object) -> dict:
        """Two of the trainer's own optimizer steps (``_train_step``) on ``batch`` (every
        micro-step takes it), each measured as a real run on a CPU measures it (the same
        ``MemoryMeter``: torch's tracker entered afresh for each step, the peak the larger of
        the two), the second step's collectives counted (DDP's first step runs one all-reduce
        over all gradients and rebuilds its buckets in gradient order at the second forward).
        Returns the raw measurements."""
        wrapped, optimizer, layout = trainer.wrapped, trainer.optimizer, trainer.layout
        world = layout.world
        grads: list[int] = []

        step_peak: dict[str, int] = {}

        def probe(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            tensors = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads[:] = _bytes_per_rank(tensors, world)
            # the peak of this step's forwards and backwards, before the optimizer's own
            snap = _by_category(meter.tracker.get_tracker_snapshot("peak"))  # type: ignore[attr-defined]
            if snap.get("total", 0) > step_peak.get("total", 0):
                step_peak.clear()
                step_peak.update(snap)

        activations = [0]

        def saved_activations() -> None:
            """The activations the forward saved, read at its end (their most)."""
            snap = meter.tracker.get_tracker_snapshot("current")  # type: ignore[attr-defined]
            for per_device in snap.values():
                activations[0] = max(activations[0], int(per_device.get("Activation", 0)))

        accum = trainer.accum
        run = trainer._start_run(override(trainer.config, profile=False), None)
        # the real run's meter on its CPU path (the fake tensors are the CPU's): it resets the
        # tracker's per-module statistics at each forward of the root, as a real run's does
        meter = run.memory = MemoryMeter(torch.device("cpu"), wrapped.module, optimizer)
        counter = CollectiveCounter()
        hook = optimizer.register_step_pre_hook(probe)
        self._after = saved_activations
        wrapped.module.train()
        try:
            for step in range(2):
                buckets = _rebuild_ddp_buckets(wrapped.module, self.fake) if step == 1 else []
                counter.step = step
                with (
                    self.fake,
                    _hf_masks_unpadded(self.notes),
                    meter.step(),
                    counter,
                    _backend_memory(self.backend),
                ):
                    # made outside the tracker: DDP's rebuilt buckets, which a real run
                    # rebuilds at this step's forward, under its tracker (the batch the
                    # trainer's _pull counts, as in a real run)
                    meter.tracker.track_external(*buckets)  # type: ignore[attr-defined]
                    trainer._train_step(run, iter([batch] * accum), accum)
        finally:
            hook.remove()
            self._after = lambda: None
            run.metrics.close()
        breakdown = {_CATEGORY.get(k, k.lower()): v for k, v in meter.breakdown.items()}
        # MemTracker's "Other" is what it was given: the micro-batch and DDP's buckets
        if "other" in breakdown:
            breakdown["DDP gradient buckets"] = bucket_bytes = _nbytes(buckets)
            breakdown["inputs"] = breakdown.pop("other") - bucket_bytes
        return {
            "parameters": sum(p.numel() for p in wrapped.module.parameters()),
            "params": _bytes_per_rank(list(wrapped.module.parameters()), world),
            "grads": grads or [0] * world,
            "optimizer": _bytes_per_rank(_optimizer_tensors(optimizer), world),
            "activations": activations[0],
            "peak": meter.peak() or 0,
            "breakdown": {k: v for k, v in breakdown.items() if v},
            "collectives": counter.totals_by_dim(step=1),
            "sizes": layout.dim_sizes(),
            "tracker": meter.tracker_name,
            "before_backward": _before_backward(meter.last_tracker),
            "backward_peaks": _backward_peaks(meter.last_tracker),
            "step_peak": step_peak,
        }


def _before_backward(tracker: object) -> dict[str, int]:
    """FSDPMemTracker's activations and backward temporaries just before each FSDP unit's
    backward starts, by the unit's name (the last tracked step's; empty for other trackers).
    Under activation checkpointing they grow with each block whose backward is done: the
    planner reads the bytes a finished block leaves behind from them (``_plan._calibrate``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState

    out: dict[str, int] = {}
    for name, snap in _unit_snapshots(tracker, _FSDPModState.BEF_PRE_BW).items():
        out[name] = snap.get("backward temporaries", 0) + snap.get("activations", 0)
    return out


def _backward_peaks(tracker: object) -> dict[str, dict[str, int]]:
    """FSDPMemTracker's peak in each FSDP unit's backward, by category as the report names
    them, by the unit's name (the last tracked step's; empty for other trackers)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState

    return _unit_snapshots(tracker, _FSDPModState.PEAK_BW)


def _unit_snapshots(tracker: object, state: object) -> dict[str, dict[str, int]]:
    tracking = getattr(tracker, "memory_tracking", None)
    if not tracking or type(tracker).__name__ != "FSDPMemTracker":
        return {}
    out: dict[str, dict[str, int]] = {}
    for stats in tracking.values():
        snaps = stats.snapshots.get(state) or []
        if snaps and snaps[-1]:
            out[stats.mod_fqn] = _by_category(snaps[-1])
    return out


def _by_category(snap: dict) -> dict[str, int]:
    """A tracker snapshot (device -> category -> bytes) as the report names the categories,
    of the device with the most bytes, with ``total``; empty for an empty snapshot."""
    if not snap:
        return {}
    dev = max(snap.values(), key=lambda d: d.get("Total", 0))
    out = {
        _CATEGORY.get(str(getattr(k, "value", k)), str(getattr(k, "value", k)).lower()): int(v)
        for k, v in dev.items()
        if v and k != "Total"
    }
    out["total"] = int(dev.get("Total", 0))
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@contextlib.contextmanager
def _launcher_env(world: int) -> Iterator[None]:
    """torchrun's variables for rank 0 of ``world``, for scripts that read them, and
    ``GT_DEVICE=cpu``: the fake tensors stand for any device, and stay on the CPU's."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GT_DEVICE")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", GT_DEVICE="cpu")
    os.environ["LOCAL_WORLD_SIZE"] = str(min(world, 8))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forget_runtime() -> None:
    """spmdgt's runtime adopted the fake group: forget it (the group itself is gone)."""
    from spmdgt._core.session import session

    parts = [p for p in ("meshes", "runtime") if p in session.parts()]
    if parts:
        session.reset(*parts)


# The trackers' category names, as the report says them.
_CATEGORY = {
    "Sharded Param": "sharded params",
    "Unsharded Param": "unsharded params",
    "Parameter": "params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded grads",
    "Unsharded Grad": "unsharded grads",
    "Gradient": "grads",
    "Activation": "activations",
    "Temp": "backward temporaries",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Inputs": "inputs",
    "Other": "other",
}


def first_batch(loader: object) -> object:
    """The loader's first batch, read in this process: a ``DataLoader``'s first indices from
    its batch sampler, collated (no worker processes for fake tensors); any other iterable's
    first item."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and loader.batch_sampler is not None:
        with _disable_current_modes():  # a sampler draws real indices (randperm().tolist())
            indices = next(iter(loader.batch_sampler))
        return loader.collate_fn([loader.dataset[i] for i in indices])
    inner = getattr(loader, "loader", None)  # a wrapper around a DataLoader
    if isinstance(inner, DataLoader):
        return first_batch(inner)
    try:
        return next(iter(loader))  # type: ignore[call-overload]
    except StopIteration:
        raise ValueError("the training loader is empty: nothing to dry-run") from None
