"""``torch.compile`` of user code that takes ``gt.Tensor``s.

A ``gt.Tensor`` is a DTensor whose ``__torch_function__`` adds spmdgt's contract (plain tensors
as replicated values, exact fallbacks). Dynamo cannot trace that Python (it swaps classes), and
it need not: while dynamo or AOTAutograd traces (between torch's compile-start and compile-end
callbacks, the lazy backward compile included), ``gt.Tensor`` behaves as the DTensor it is:

- its ``__torch_function__`` is DTensor's (disabled), so dynamo traces DTensor's own rules;
- DTensor's implicit replication is on, so plain tensors (an ``nn.Linear``'s weight) mix in as
  replicated values, as they do in eager spmdgt.

``__tensor_unflatten__`` rebuilds a ``gt.Tensor``, so the fake inputs, the compiled graph's
input checks and its outputs all keep spmdgt's class: what comes out answers ``.numpy()``.
A compiled region runs DTensor's propagation and spmdgt's propagation hook: an op without a
DTensor rule takes the exact fallback inside the graph where the graph can hold it (an
out-of-place op over the whole world: DTensor's all-gather is a functional collective), and
raises ``NotTraceable`` at compile time on every rank where it cannot (a write into a view the
fallback made as a copy, a write-back into a sharded tensor, a sub-mesh's broadcast:
``_fallback``), rather than diverging.

Known limit: a plain tensor that needs a gradient (an ``nn.Linear`` weight) used with
``gt.Tensor``s inside a compiled region gets its gradient as a replicated ``gt.Tensor`` (the
exact value) rather than a plain tensor, since the compiled graph treats it as DTensor's
implicit replication does. Optimizers accept it; a *new* compile while such a ``.grad`` is set
fails in torch's fake-tensor conversion, so clear gradients with ``zero_grad()`` (which sets
them to None) before the first call of a compiled function.
"""

from __future__ import annotations

import torch

__all__ = ["install"]

_installed = False


def install(cls) -> None:
    """Register the compile-start/end callbacks that switch ``cls`` to plain DTensor behaviour
    while torch traces (once per process, and again after every ``torch._dynamo.reset()``)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._dynamo.callback import callback_handler

    ours = cls.__dict__["__torch_function__"]
    saved: list[bool] = []

    def start(_args) -> None:
        saved.append(torch._C._get_dtensor_allow_implicit_replication())
        torch._C._set_dtensor_allow_implicit_replication(True)
        cls.__torch_function__ = torch._C._disabled_torch_function_impl

    def end(_args) -> None:
        cls.__torch_function__ = ours
        torch._C._set_dtensor_allow_implicit_replication(saved.pop() if saved else False)

    def register() -> None:
        callback_handler.register_start_callback(start)
        callback_handler.register_end_callback(end)

    # ``torch._dynamo.reset()`` clears every callback. Without ours, dynamo traces spmdgt's
    # own ``__torch_function__`` into the graph, and a hot function on a 2-D mesh came out
    # with a doubled loss (a test's reset before forking its ranks; a notebook's reset alike).
    clear = callback_handler.clear

    def clear_then_register() -> None:
        clear()
        saved.clear()
        register()

    callback_handler.clear = clear_then_register
    register()
    _coerce_tangents_to(cls)


def _coerce_tangents_to(cls) -> None:
    """A compiled backward expects each gradient with the metadata (placements) and type it
    guessed; DTensor's own coercion redistributes but declines a change of type, and
    gradients the autograd engine builds outside spmdgt's calls are plain DTensors, while
    those built inside are ``cls``. Let it coerce between DTensor and ``cls`` (a
    redistribute, then the expected class)."""
    from torch.distributed.tensor import DTensor

    original = DTensor.__coerce_same_metadata_as_tangent__

    def coerce(self, flatten_spec, expected_type=None):
        if expected_type is cls or (expected_type is DTensor and type(self) is cls):
            out = original(self, flatten_spec)
            if type(out) in (DTensor, cls):
                out.__class__ = expected_type
            return out
        return original(self, flatten_spec, expected_type)

    DTensor.__coerce_same_metadata_as_tangent__ = coerce
