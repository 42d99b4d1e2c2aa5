"""The learning-rate schedule a config asks for (``training.scheduler``): warm-up, then
constant, linear or cosine decay, as one ``LambdaLR``."""

from __future__ import annotations

import math

import torch

from spmdgt.train._config import SchedulerConfig

__all__ = ["build_scheduler"]


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A ``LambdaLR`` for ``cfg`` (None for ``constant``): warm-up, then linear or cosine decay."""
    if cfg.type == "constant" and cfg.warmup_steps == 0:
        return None
    warm, total = cfg.warmup_steps, cfg.total_steps or 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.type == "constant":
            return 1.0
        progress = min((step - warm) / max(total - warm, 1), 1.0)
        if cfg.type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
