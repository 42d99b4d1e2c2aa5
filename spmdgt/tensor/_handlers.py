"""spmdgt's wraps of DTensor's custom op handlers: the one owner of that table.

DTensor runs a few ops through handlers of its own (``OpDispatcher._custom_op_handlers``),
before the sharding-propagation entry the hook (``_hook``) wraps, so the hook's rewrites never
see them. Where such a handler is not exact, a module registers a wrap here (``wrap``); the
hook's ``install`` puts every wrap in, ``uninstall`` puts DTensor's handlers back. A wrap is
called as ``wrap(original, op_call, args, kwargs)``, ``original`` being DTensor's handler.
Wraps act on every DTensor op of the process, inside spmdgt's calls and outside them (the
trainer's TP and FSDP tensors), as the hook's ``partial`` rewrites do.

The wraps: ``_partials`` (``convolution`` and its backward of a partial input) and
``_extremes`` (``argmax``/``argmin`` over a sharded dim: ties and empty shards).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.tensor import DTensor

__all__: list[str] = []  # machinery for the hook

_wraps: dict = {}  # OpOverload -> our wrap
_originals: dict = {}  # OpOverload -> DTensor's handler, while ours is in


def wrap(*ops) -> Callable:
    """Register the decorated ``fn(original, op_call, args, kwargs)`` for ``ops``."""

    def register(fn: Callable) -> Callable:
        for op in ops:
            if op in _wraps:
                raise AssertionError(f"{op} has a handler wrap already ({_wraps[op].__name__})")
            _wraps[op] = fn
        return fn

    return register


def install() -> None:
    """Put every registered wrap in front of DTensor's handler for its op (where DTensor has
    one: a torch without it keeps its own path)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, fn in _wraps.items():
        if op in table and op not in _originals:
            original = _originals[op] = table[op]
            table[op] = _bound(fn, original)


def _bound(fn: Callable, original: Callable) -> Callable:
    def handler(op_call, args, kwargs):
        return fn(original, op_call, args, kwargs)

    handler.__name__ = fn.__name__
    return handler


def uninstall() -> None:
    """Put DTensor's own handlers back."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _originals.items():
        table[op] = handler
    _originals.clear()
