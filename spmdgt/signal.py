"""Signals: named scopes whose YAML placement applies to the tensors made inside them.

    with gt.signal.context("forward_layer1"):
        x = gt.randn(100, 64)          # placed as 'forward_layer1' says
    w = gt.signal.tensor(w, "model")   # place an existing tensor

A signal the config does not define is ignored: every annotation can be removed and the
program computes the same numbers (only placement and speed change).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spmdgt._core import scope as _scope
from spmdgt.config._signals import lookup
from spmdgt.runtime._state import get_runtime
from spmdgt.tensor._creation import agree_on_creation
from spmdgt.tensor._placement import describe, signal_target

__all__ = ["context", "current_signal", "enter", "exit", "tensor"]


def _push(name: str, backward: str | None) -> None:
    # the config says whether the scope compiles (``compile: true``); the first such scope
    # brings in the compile pass's lazy regions, which see every scope change from then on
    cfg = lookup(name) if isinstance(name, str) and name else None
    compiles = bool(cfg is not None and cfg.compile)
    if compiles:
        from spmdgt import compile as gt_compile

        gt_compile.compile_scope_entered()
    _scope.push(name, backward, compiles)


@contextmanager
def context(name: str, backward: str | None = None) -> Iterator[None]:
    """Scope ``name``; ``backward`` overrides the config's backward signal for the scope."""
    _push(name, backward)
    try:
        yield
    finally:
        _scope.pop(name)


def enter(name: str, backward: str | None = None) -> None:
    """Enter scope ``name`` (pair with ``exit``); prefer ``context``."""
    _push(name, backward)


def exit(name: str | None = None) -> None:
    """Leave the innermost scope (``name``, if given, must match it)."""
    _scope.pop(name)


def current_signal() -> str | None:
    """The innermost active signal's name, or None."""
    return _scope.current()


def tensor(t: torch.Tensor, name: str) -> torch.Tensor:
    """Place an existing tensor as signal ``name`` says (differentiable; unknown: unchanged).

    Every rank must pass the same global value, as for any SPMD tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gt.signal.tensor expects a tensor, got {type(t).__name__}")
    if get_runtime().world_size == 1:
        return t
    cfg = lookup(name)
    if cfg is None or cfg.shard is None:
        where = f"signal {name!r} ({'not in the config' if cfg is None else 'no placement'})"
    else:
        where = f"signal {name!r} ({describe(cfg, t.shape)})"
    agree_on_creation(f"gt.signal.tensor(..., {name!r})", t.shape, t.dtype, where=where)
    if cfg is None or cfg.shard is None:
        return t
    from spmdgt.tensor._tensor import move

    return move(t, signal_target(cfg, t.shape))
