"""``TrainConfig(compile=True)``: per-block ``torch.compile`` in torchtitan's order.

``wrap_model`` applies, block by block: tensor parallelism (``parallelize_module``), then
activation checkpointing (``checkpoint_wrapper``, when configured), then ``torch.compile`` of
each block, then FSDP2 (``fully_shard`` per block, then the root) or DDP around the model.

What a *block* is: ``_units.find_blocks``, the one rule FSDP2's units use too (the elements
of the model's ``ModuleList`` of layers, torchtitan's ``model.layers``; HF's
``model.model.layers``). Repeated blocks share one compiled graph (dynamo guards on their
structure, not their identity), so the cost is one compile, not one per layer. A model without
such a list is compiled whole (one ``GT_VERBOSE`` line says so).

How a block is compiled: its ``forward`` is replaced by ``torch.compile(forward)`` on the
module itself, so module names, ``state_dict`` keys and checkpoints are the same as eager, and
the hooks FSDP2 and DDP put on the module run eagerly around the compiled forward (as they do
around torchtitan's compiled blocks).

A compile failure never gives a wrong number. The backend is wrapped: it compiles forward and
backward at once (``force_non_lazy_backward_lowering``), so a failure surfaces on the first
call, never inside ``backward()``.

* ``ddp``/``fsdp`` (no collective inside a block): the failing block's captured graph runs
  eagerly on this rank (the same ops, the same collectives around it), the failure is
  recorded, and at the trainer's next loss flush (a collective every rank runs anyway) every
  rank learns whether any rank failed; if one did, every rank turns compilation off for every
  block and rank 0 prints one line naming the block and the error.
* ``placements`` (DTensor collectives inside the blocks): ranks running the same block
  compiled on one rank and eagerly on another could issue collectives in different orders, so
  a failure is a ``CompileError`` naming the block.

``GT_COMPILE=0`` turns it all off (rank 0 says so once). Compile time (dynamo's start/end
callbacks: tracing and the backend, forward and backward) is counted apart from step times.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from spmdgt._core import env as _env
from spmdgt.compile._refusals import wrong_when_compiled
from spmdgt.train._units import find_blocks

__all__ = [
    "CompileError",
    "CompileState",
    "apply_activation_checkpointing",
    "compile_blocks",
    "compile_disabled_by_env",
    "compile_seconds",
    "find_blocks",
]


class CompileError(RuntimeError):
    """``torch.compile`` of a block failed where falling back on one rank is unsafe."""


def compile_disabled_by_env() -> bool:
    """``GT_COMPILE=0`` (or false/no/off): no compilation, whatever the config says; the same
    answer as the compile pass's (one reading of the variable: ``spmdgt._core.env``)."""
    return not _env.flag("GT_COMPILE")


# --------------------------------------------------------------------------- compile time

_lock = threading.Lock()
_seconds = 0.0
_events = 0
_started: list[float] = []


def _on_start(_args: object) -> None:
    _started.append(time.perf_counter())


def _on_end(_args: object) -> None:
    global _seconds, _events
    if _started:
        with _lock:
            _seconds += time.perf_counter() - _started.pop()
            _events += 1


def compile_seconds() -> tuple[float, int]:
    """(seconds, compilations) torch.compile spent compiling in this process so far.

    Counted from dynamo's compile start/end callbacks (outermost compile only: tracing, the
    backend, and with the trainer's backend the backward too), installed on first use and
    again after ``torch._dynamo.reset()``, which clears every callback."""
    from torch._dynamo.callback import callback_handler

    if _on_end not in callback_handler.end_callbacks:
        _started.clear()
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)
    return _seconds, _events


# --------------------------------------------------------------------------- blocks


def apply_activation_checkpointing(model: nn.Module) -> list[str]:
    """Wrap each block in ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``):
    activations inside a block are recomputed in backward instead of kept. State-dict keys are
    unchanged (the wrapper strips its prefix). Returns the wrapped blocks' names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    found = find_blocks(model)
    if found is None:
        raise ValueError(
            "activation_checkpointing needs a ModuleList of blocks (e.g. model.layers); "
            f"{type(model).__name__} has none"
        )
    list_name, blocks = found
    parent = model.get_submodule(list_name)
    for i, (_, block) in enumerate(blocks):
        parent[i] = checkpoint_wrapper(block)
    return [n for n, _ in blocks]


# --------------------------------------------------------------------------- compile


@dataclass
class CompileState:
    """What compilation did to a wrapped model, for the trainer and its summary."""

    backend: str
    blocks: list[str] = field(default_factory=list)
    """Compiled units by name (``"<model>"`` when the whole model was compiled)."""
    fallback_on_rank: bool = True
    """True: a failure runs that block eagerly here and is agreed at the next loss flush;
    False (collectives inside blocks): a failure raises ``CompileError``."""
    failures: list[str] = field(default_factory=list)
    """This rank's failures not yet agreed: ``"<block>: <error>"``."""
    disabled_reason: str | None = None
    """Set (on every rank alike) once compilation was turned off after a failure."""
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        """Blocks are compiled and compilation has not been turned off."""
        return bool(self.blocks) and self.disabled_reason is None

    def turn_off(self, reason: str) -> None:
        """Every block back to its eager ``forward`` (called on every rank alike)."""
        for undo in self._restore:
            undo()
        self._restore.clear()
        self.disabled_reason = reason
        self.failures.clear()


def _backend_fn(name: str) -> Callable:
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


def check_backend(name: str) -> None:
    """``ValueError`` naming ``name`` unless dynamo knows the backend."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(
            f"unknown torch.compile backend {name!r}; torch knows: {', '.join(sorted(known))}"
        )


class _GuardedBackend:
    """The configured backend, compiling backward with forward, catching failures.

    One per backend name for the whole process: dynamo guards a compiled graph on the backend
    object, so a shared object lets every block (and every trainer) reuse one graph where the
    blocks are alike. Which trainer and block asked is read from ``_calling``, set around each
    compiled block's call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.real = _backend_fn(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        import torch._functorch.config as functorch_config

        if wrong_when_compiled(gm) is not None:
            return gm.forward  # torch.compile would compute it wrongly: run as traced
        try:
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                return self.real(gm, example_inputs)
        except Exception as e:  # any failure of the backend: never a wrong number
            state, block = getattr(_calling, "who", (None, "<outside a trainer block>"))
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
            if state is None or not state.fallback_on_rank:
                raise CompileError(
                    f"torch.compile (backend {self.name!r}) failed on block {block!r}: "
                    f"{why}; set compile=False (or GT_COMPILE=0) to train eagerly"
                ) from e
            state.failures.append(f"{block}: {why}")
            return gm.forward  # this rank runs the captured graph eagerly until the ranks agree


_calling = threading.local()
_guarded: dict[str, _GuardedBackend] = {}


def _guarded_backend(name: str) -> _GuardedBackend:
    if name not in _guarded:
        _guarded[name] = _GuardedBackend(name)
    return _guarded[name]


def _compile_forward(module: nn.Module, name: str, state: CompileState) -> None:
    eager = module.forward
    compiled = torch.compile(eager, backend=_guarded_backend(state.backend))
    who = (state, name)

    @functools.wraps(eager)
    def forward(*args: object, **kwargs: object) -> object:
        before = getattr(_calling, "who", None)
        _calling.who = who
        try:
            return compiled(*args, **kwargs)
        except CompileError:
            raise
        except Exception as e:
            cause = e.__cause__ or e.__context__
            while cause is not None and not isinstance(cause, CompileError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:  # dynamo wraps the backend's error: surface ours
                raise CompileError(str(cause)) from e
            raise
        finally:
            _calling.who = before

    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first

    def undo() -> None:
        module.__dict__.pop("forward", None)

    state._restore.append(undo)


def compile_blocks(
    model: nn.Module,
    backend: str,
    *,
    collectives_in_blocks: bool,
    fallback_units: list[tuple[str, nn.Module]] | None = None,
) -> CompileState:
    """``torch.compile`` each block's ``forward`` in place; without a block list, each of
    ``fallback_units`` (FSDP's units) or else the whole model. See the module docstring for
    what a failure does."""
    check_backend(backend)
    compile_seconds()  # install the timing callbacks before the first compile
    state = CompileState(backend=backend, fallback_on_rank=not collectives_in_blocks)
    found = find_blocks(model)
    if found is None:
        units = fallback_units or [("<model>", model)]
        if _env.flag("GT_VERBOSE"):
            from spmdgt import runtime

            runtime.print0(
                f"spmdgt.train: compile: {type(model).__name__} has no ModuleList of blocks "
                f"(e.g. model.layers); compiling {', '.join(n for n, _ in units)}"
            )
        for name, unit in units:
            _compile_forward(unit, name, state)
            state.blocks.append(name)
        return state
    for name, block in found[1]:
        _compile_forward(block, name, state)
        state.blocks.append(name)
    return state
