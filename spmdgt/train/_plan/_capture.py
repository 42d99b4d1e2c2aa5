"""The model and micro-batch of a training script, read without training it.

The script runs under the dry run's public entry point (``dry_run_script``, a world of one:
its tensors fake, nothing allocated) until its trainer calls the model for the first time; a
global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) takes
the root module and its arguments there and stops the script. Nothing of the trainer is
patched here, so the planner reads whatever the script builds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
from torch import nn

from spmdgt.train._dryrun import DryRunError, dry_run_script

__all__ = ["capture_script"]


class _Captured(BaseException):
    """Stops the script at its model's first forward (a BaseException: a script's own
    ``except Exception`` does not swallow it)."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.model, self.args, self.kwargs = model, args, kwargs


def capture_script(path: str | os.PathLike, argv: Sequence[str] = ()) -> tuple[nn.Module, object]:
    """``(model, batch)`` of the script at ``path`` run with ``argv``: the module its trainer
    calls and one micro-batch as the trainer's loop takes it (a dict of keywords, or
    ``(token ids, token ids)`` for a model called on one tensor of token ids: a language
    model's next-token targets have its input's shape)."""

    def hook(module: nn.Module, args: tuple) -> None:
        if any(True for _ in module.parameters()):
            # A global pre-hook is given no keywords; the module call's own frame holds them
            # (``model(**batch)``, as the trainer calls Hugging Face models).
            caller = sys._getframe(1).f_locals.get("kwargs")
            raise _Captured(module, args, dict(caller) if isinstance(caller, dict) else {})

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        dry_run_script(path, argv, 1)
    except _Captured as got:
        model, args, kwargs = got.model, got.args, got.kwargs
    else:
        raise DryRunError(f"{path} never called its model: nothing to plan")
    finally:
        handle.remove()
    if kwargs and not args:
        return model, dict(kwargs)
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        x = args[0]
        if not x.is_floating_point() and x.ndim == 2:
            return model, (x, x)
    raise DryRunError(
        f"{path}: the model is called with {len(args)} positional and {len(kwargs)} keyword "
        "arguments; the command line plans models called on token ids or on keywords (Hugging "
        "Face): call spmdgt.train.plan(model, batch, loss_fn=...) from Python for others"
    )
