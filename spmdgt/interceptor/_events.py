"""The op event record every observability tool consumes, and the sink protocol.

One ``OpEvent`` per intercepted op (see ``_mode.py`` for where they come from). The interceptor
hands sinks events in *batches* (a list, in sequence order) instead of one call per op, because a
Python call per sink per op would double the tracing cost of a small-op loop. A sink that needs
to react before the op runs (the compile-and-batch pass, later) is a different hook; everything
that only observes is a ``Sink``.

Where related code lives: ``_mode.py`` (interception), ``_instruction_log.py`` (text log),
``_stats.py`` (counters, hot paths, tape), ``_publish.py`` (top / trace files).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "COLLECTIVE_KINDS",
    "OpEvent",
    "Sink",
    "TensorSpec",
    "classify",
    "op_name",
]


class TensorSpec(NamedTuple):
    """What an event remembers of a tensor argument: never the tensor itself (no memory kept).

    Events carry these as plain ``(shape, dtype, placements)`` triples (a NamedTuple per tensor
    per op costs ~1 us); ``TensorSpec._make(triple)`` gives the named view.
    """

    shape: tuple[int, ...]  # torch.Size; global shape for a DTensor
    dtype: Any  # torch.dtype
    placements: tuple | None  # DTensor placements, None for a plain tensor


class OpEvent(NamedTuple):
    """One intercepted op on this rank.

    ``t0_ns`` is ``time.perf_counter_ns()`` at entry; ``level`` is 0 for a torch-level call
    (``torch.mul``, ``Tensor.__mul__``, ``dist.all_reduce``) and 1 for an ATen op seen inside an
    escalated region (DTensor ops, backward) or in ``level="aten"`` mode. ``phase`` is ``fwd``,
    ``bwd`` or ``opt``. ``nbytes`` is the payload a collective moves on this rank (0 otherwise).
    """

    seq: int
    t0_ns: int
    dur_ns: int
    op: str
    kind: str
    level: int
    phase: str
    signal: str | None
    inputs: tuple[tuple, ...]  # (shape, dtype, placements) per tensor arg: see TensorSpec
    output: tuple[tuple, ...]
    nbytes: int


@runtime_checkable
class Sink(Protocol):
    """Something that consumes the op stream of this rank.

    ``on_events`` gets each batch once, in order; it must not keep the list (the interceptor
    reuses it) but may keep the events. ``flush`` is called when someone asks for current
    numbers (``get_worker_stats``, ``disable``, the ~1 s publisher tick); ``close`` once at
    ``disable``. Sinks run on the rank's own thread, between user ops: keep them cheap.
    """

    def on_events(self, events: list[OpEvent]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


# Op kinds: used for top's time shares, timeline colours and stats. Names are lower-case base
# names (no namespace, no overload, no trailing underscore).
_MATMUL = {
    "mm", "bmm", "matmul", "addmm", "addbmm", "baddbmm", "linear", "einsum", "dot", "mv",
    "convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention", "_scaled_dot_product_efficient_attention", "addmv",
}  # fmt: skip
_REDUCE = {
    "sum", "mean", "max", "min", "amax", "amin", "prod", "norm", "var", "std", "softmax",
    "_softmax", "log_softmax", "_log_softmax", "argmax", "argmin", "cumsum", "logsumexp",
    "linalg_vector_norm", "cross_entropy", "nll_loss", "nll_loss_forward", "mse_loss",
    "_foreach_norm", "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
}  # fmt: skip
_MEMORY = {
    "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "expand", "squeeze",
    "unsqueeze", "contiguous", "clone", "copy", "to", "_to_copy", "cat", "stack", "split",
    "chunk", "narrow", "slice", "select", "index", "zeros", "ones", "empty", "full", "randn",
    "rand", "zeros_like", "ones_like", "empty_like", "full_like", "detach", "alias",
    "new_empty", "new_zeros", "new_ones", "empty_strided", "as_strided", "fill", "zero",
    "tensor", "arange", "split_with_sizes", "unbind", "flatten", "view_as", "lift_fresh",
    "_local_scalar_dense", "item", "cpu", "cuda", "numpy",
}  # fmt: skip
COLLECTIVE_KINDS = frozenset({"comm", "wait"})
_COMM = {
    "all_reduce", "allreduce", "all_gather", "allgather", "all_gather_into_tensor",
    "_allgather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "broadcast", "all_to_all", "alltoall", "all_to_all_single", "alltoall_base", "reduce",
    "gather", "scatter", "send", "recv", "barrier", "all_reduce_coalesced",
    "allreduce_coalesced", "all_gather_into_tensor_coalesced", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_gather_object",
    "broadcast_object_list", "isend", "irecv", "all_gather_single", "reduce_scatter_single",
}  # fmt: skip


def base_name(op: str) -> str:
    """``aten.mul_.Tensor`` -> ``mul``; ``_c10d_functional.all_reduce`` -> ``all_reduce``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] in _NAMESPACES else parts[0]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


_NAMESPACES = {"aten", "c10d", "_c10d_functional", "c10d_functional", "prims", "dist"}


def classify(op: str) -> str:
    """The kind of an op name: matmul, elementwise, reduce, memory, comm, wait, backward."""
    if op.endswith("wait_tensor") or op.endswith(".wait"):
        return "wait"
    name = base_name(op)
    if name in _COMM:
        return "comm"
    if name in _MATMUL:
        return "matmul"
    if name in _REDUCE:
        return "reduce"
    if name in _MEMORY:
        return "memory"
    if name in ("backward", "grad"):
        return "backward"
    return "elementwise"


def op_name(func: object) -> str:
    """A stable, greppable name for an intercepted callable.

    ATen overloads keep their namespace and overload (``aten.mul.Tensor``); torch-level calls
    drop the Python dunders (``Tensor.__mul__`` -> ``mul``, ``__iadd__`` -> ``add_``) and
    c10d's Python API gets a ``dist.`` prefix so it is never mistaken for an ATen op.
    """
    schema = getattr(func, "_schema", None)
    if schema is not None:  # OpOverload
        return str(func)
    name = getattr(func, "__name__", None) or type(func).__name__
    module = getattr(func, "__module__", "") or ""
    if name.startswith("__i") and name.endswith("__") and name[3:-2] in _INPLACE_DUNDERS:
        return name[3:-2] + "_"
    if name.startswith("__r") and name.endswith("__") and name[3:-2] in _INPLACE_DUNDERS:
        return name[3:-2]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    if module.startswith("torch.distributed"):
        return "dist." + name
    return name


_INPLACE_DUNDERS = {
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift", "div",
}  # fmt: skip
