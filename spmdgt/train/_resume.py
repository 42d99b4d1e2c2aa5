"""The trainer's checkpoints: what it saves, what it loads and when it resumes.

``CheckpointMixin`` is ``DistributedTrainer``'s checkpoint half: the state beside the model
and optimizer (step, epoch, data position, scheduler, scaler, the mesh it was written on),
``save_checkpoint``/``load_checkpoint`` through ``_checkpoint`` (atomic DCP checkpoints) and
the resume ``train`` starts with when ``checkpoint.resume`` is set.
"""

from __future__ import annotations

import os

from spmdgt import runtime
from spmdgt.train._checkpoint import (
    find_latest,
    load_checkpoint,
    on_rank0,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    """Checkpoint methods; ``DistributedTrainer`` holds what they read and restore."""

    def _trainer_state(self) -> dict:
        return {
            "step": self.global_step,
            "epoch": self._epoch,
            "samples_in_epoch": self._samples_in_epoch,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "world_size": self.rt.world_size,
            # the mesh it was written on: a resume on another says so (weights, optimizer and
            # data position carry over, see load_checkpoint)
            "mesh": list(self.layout.shape),
            "data_parallel_size": self.data_parallel_size,
        }

    def save_checkpoint(self, directory: str | os.PathLike | None = None) -> str:
        """Write a checkpoint of everything needed to resume (collective: all ranks call it)."""
        directory = directory or self.config.checkpoint.dir
        if directory is None:
            raise ValueError("no checkpoint directory: pass one or set checkpoint.dir")
        path = save_checkpoint(
            directory,
            self.global_step,
            self.model,
            self.optimizer,
            self._trainer_state(),
            keep_last=self.config.checkpoint.keep_last,
        )
        return str(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, scaler, RNG and data position from ``path``.

        ``path`` is one ``step_<n>`` checkpoint or a checkpoint directory (its newest, as its
        ``latest`` names it, confined to the directory). Collective: rank 0 resolves the path
        and every rank loads that one, or raises rank 0's error."""
        found = on_rank0(lambda: resolve_checkpoint(path))
        extra = load_checkpoint(found, self.model, self.optimizer)
        self.global_step = extra["step"]
        self._epoch = extra["epoch"]
        self._samples_in_epoch = extra["samples_in_epoch"]
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.scaler is not None and extra["scaler"] is not None:
            self.scaler.load_state_dict(extra["scaler"])
        self._resumed_from = str(found)
        saved = extra.get("mesh")
        layout = self.layout
        if saved is not None and tuple(saved) != layout.shape:
            runtime.print0(
                f"spmdgt.train: {found} was written on mesh dp_replicate x dp_shard x tp = "
                f"{'x'.join(map(str, saved))} ({extra.get('world_size')} rank(s)); resuming on "
                f"{layout.describe()}: weights and optimizer state resharded, data from "
                f"global sample {self._samples_in_epoch} of epoch {self._epoch}"
            )

    def _resume_if_asked(self) -> None:
        """Load the newest checkpoint of ``checkpoint.dir`` when ``checkpoint.resume`` is set
        and nothing was loaded yet. Rank 0 reads the directory for everyone: whether to load
        is a collective decision."""
        ck = self.config.checkpoint
        if ck.dir and ck.resume and self._resumed_from is None:
            found = on_rank0(lambda: find_latest(ck.dir))
            if found is not None:
                self.load_checkpoint(found)
                runtime.print0(f"resumed from {found} at step {self.global_step}")
