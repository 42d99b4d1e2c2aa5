"""Training steps as the hot-function pass's agreement points (more than one rank).

Hotness is observed per rank (op counts may differ) and settled at an agreement point, where
every rank takes the union of the ranks' hot functions (``runtime._agree.propose``). A
training loop on plain tensors, or one that never reads a value on the host, reaches no
creation or host read, so its proposals would wait forever. Every rank does reach the end of
each optimizer step, in the same order, with no collective in flight: ``StepPoints`` counts
them (a global ``torch.optim`` step post-hook, plus ``spmdgt.compile.step()`` for loops
without a ``torch.optim`` optimizer) and makes some of them agreement points, by count only:

    steps 1-8, then 16, 32, 64, 128, 256, then every 256th step

The schedule is a function of the count, which is the same on every rank running the same
program, so every rank exchanges at the same steps (one small gloo round trip on the side
group, ~0.3 ms on a CPU box) and receives the same proposals there. Nothing is read from the
clock, the rank or a logger before the exchange. A world of one decides at once and never
exchanges here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepPoints", "due", "eager"]


def eager(fn: Any) -> Any:
    """``fn``, run eagerly where dynamo traces a caller (a hot step function that calls
    ``opt.step()``): dynamo would otherwise trace the hook and replay its effects, the exchange
    included. Non-recursive: ``torch.compiler.disable``'s recursive wrapper turns the frame
    hook off for the call and sets back, at its end, the hook it found at its start, which
    would undo a hook the agreement installs inside it."""
    import torch

    return torch.compiler.disable(fn, recursive=False)


def due(n: int) -> bool:
    """Whether step ``n`` (1-based) is an agreement point (see the module docstring)."""
    if n <= 8:
        return True
    if n <= 256:
        return n & (n - 1) == 0  # a power of two
    return n % 256 == 0


class StepPoints:
    """Counts this rank's training steps; at the steps ``due`` names, an agreement point."""

    def __init__(self) -> None:
        self.count = 0  # steps seen (optimizer steps and ``spmdgt.compile.step()`` calls)
        self.points = 0  # agreement points held here
        self._handle: Any = None
        self.step_eagerly = eager(self.step)  # ``spmdgt.compile.step()``

    def start(self) -> None:
        """Count every ``torch.optim`` optimizer's steps from now on."""
        if self._handle is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(eager(self._after_optimizer_step))

    def stop(self) -> None:
        """Stop counting (the hook goes)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step(f"{type(optimizer).__name__}.step")

    def step(self, what: str = "spmdgt.compile.step()") -> None:
        """One training step ended on this rank (``what`` ended it)."""
        from spmdgt.runtime import _agree

        self.count += 1
        n = self.count
        if due(n) and _agree.active():
            self.points += 1
            # the same description on every rank: the count and what ended the step
            _agree.agree(f"the compile pass's point at training step #{n} ({what})")
