"""The op event record every observability tool consumes, the sink protocol, and THE table.

One ``OpEvent`` per intercepted op (see ``_mode.py`` for where they come from). The interceptor
hands sinks events in *batches* (a list, in sequence order) instead of one call per op, because a
Python call per sink per op would double the tracing cost of a small-op loop. A sink that needs
to react before the op runs (the compile-and-batch pass, later) is a different hook; everything
that only observes is a ``Sink``.

This module also holds the one table every level classifies with: op kinds (``KINDS``,
``NAMESPACE_KINDS``), the event word per kind (``EVENTS``), the log's columns (``COLUMNS``) and
dtype short names (``DTYPE_SHORT``). The Python levels read it directly; the C++ observer
(``csrc/observer.cpp``) is handed the same table at load (``_native._init``) and keeps no copy
of its own, so an op is one kind whichever level saw it (``_c10d_functional.wait_tensor`` was
``elementwise`` in Python and ``wait`` in C++, which under-counted communication time).

Where related code lives: ``_mode.py`` (interception), ``_instruction_log.py`` (text log),
``_stats.py`` (counters, hot paths, tape), ``_publish.py`` (top / trace files), ``_native.py``
(the C++ level).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "COLLECTIVE_KINDS",
    "COLUMNS",
    "COLUMNS_V1",
    "COMM",
    "DEFAULT_KIND",
    "DTYPE_SHORT",
    "EVENTS",
    "KINDS",
    "NAMESPACES",
    "NAMESPACE_KINDS",
    "OVERHEAD",
    "OpEvent",
    "Sink",
    "TensorSpec",
    "WAIT",
    "base_name",
    "classify",
    "dtype_short",
    "event_of",
    "kind_table",
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
    ``bwd`` or ``opt``. ``nbytes`` is a collective's buffer on this rank, the larger of its input
    and output (an all-gather's gathered output, a reduce-scatter's whole input, an
    all-reduce's tensor: nccl-tests' ``size``; a ring sends ``(n-1)/n`` of it per rank, twice
    for an all-reduce); 0 for other ops.
    ``group`` is the mesh dim a collective ran on (``tp``, ``dp_shard``, ``world`` for the
    default group: ``_groups.group_label``); ``None`` for other ops and at the native level,
    whose observer sees no process group.
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
    group: str | None = None


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


# ---- the table ------------------------------------------------------------------------------
# Op kinds: top's time shares, timeline colours, stats, the log's $6. Each kind lists base
# names: no namespace, no overload, no trailing underscore (``base_name``). A name no kind
# lists is DEFAULT_KIND; a name in two kinds takes the first.
KINDS: dict[str, frozenset[str]] = {
    "matmul": frozenset({
        "mm", "bmm", "matmul", "addmm", "addbmm", "baddbmm", "linear", "einsum", "dot", "mv",
        "convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention", "_scaled_dot_product_efficient_attention", "addmv",
    }),
    "reduce": frozenset({
        "sum", "mean", "max", "min", "amax", "amin", "prod", "norm", "var", "std", "softmax",
        "_softmax", "log_softmax", "_log_softmax", "argmax", "argmin", "cumsum", "logsumexp",
        "linalg_vector_norm", "cross_entropy", "nll_loss", "nll_loss_forward", "mse_loss",
        "_foreach_norm", "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
    }),
    "memory": frozenset({
        "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "expand", "squeeze",
        "unsqueeze", "contiguous", "clone", "copy", "to", "_to_copy", "cat", "stack", "split",
        "chunk", "narrow", "slice", "select", "index", "zeros", "ones", "empty", "full",
        "randn", "rand", "zeros_like", "ones_like", "empty_like", "full_like", "detach",
        "alias", "new_empty", "new_zeros", "new_ones", "empty_strided", "as_strided", "fill",
        "zero", "tensor", "arange", "split_with_sizes", "unbind", "flatten", "view_as",
        "lift_fresh", "_local_scalar_dense", "item", "cpu", "cuda", "numpy",
    }),
    # a collective issued (the c10d call, DTensor's functional collective, dist.*)
    "comm": frozenset({
        "all_reduce", "allreduce", "all_gather", "allgather", "all_gather_into_tensor",
        "_allgather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
        "broadcast", "all_to_all", "alltoall", "all_to_all_single", "alltoall_base", "reduce",
        "gather", "scatter", "send", "recv", "barrier", "all_reduce_coalesced",
        "allreduce_coalesced", "all_gather_into_tensor_coalesced", "allgather_coalesced",
        "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
        "all_gather_object", "broadcast_object_list", "isend", "irecv", "all_gather_single",
        "reduce_scatter_single",
    }),
    # waiting for an asynchronous collective: communication time too (``COLLECTIVE_KINDS``)
    "wait": frozenset({"wait_tensor", "wait"}),
    "backward": frozenset({"backward", "grad"}),
    # Records the dispatcher or the profiler make around real ops, not ops a user ran: the
    # Python-key kernels (``PythonSubclass`` runs DTensor's __torch_dispatch__, whose ops are
    # recorded themselves; ``PythonDispatchMode`` a dispatch mode's) and record_function's own
    # ops. No level records them: they are in no log, stats or timeline.
    "overhead": frozenset({
        "PythonDispatchMode", "PythonSubclass", "PythonTLSSnapshot", "_record_function_enter",
        "_record_function_enter_new", "_record_function_exit", "_record_function",
    }),
}  # fmt: skip
# Every name of these namespaces is this kind, whatever its base name: autograd engine nodes
# (``autograd.MulBackward0``, native level) and record_function's ops.
NAMESPACE_KINDS: dict[str, str] = {"autograd": "backward", "profiler": "overhead"}
# Namespaces dropped by ``base_name`` (``aten.mul_.Tensor`` -> ``mul``).
NAMESPACES = (
    "aten", "c10d", "_c10d_functional", "c10d_functional", "prims", "dist", "autograd",
    "profiler",
)  # fmt: skip
DEFAULT_KIND = "elementwise"  # what no table names: pointwise math, mostly
OVERHEAD = "overhead"
COMM, WAIT = "comm", "wait"  # a collective's transfer (it has bytes), a wait on one
COLLECTIVE_KINDS = frozenset({COMM, WAIT})  # communication time
EVENTS: dict[str, str] = {"comm": "COMM", "wait": "WAIT"}  # the log's $4; any other kind: OP

# The instruction log's columns, in order (``_instruction_log`` documents each; the C++ writer
# renders them in the order given here).
COLUMNS = (
    "elapsed", "rank", "seq", "event", "phase", "kind", "op", "bytes", "dur", "level", "signal",
    "inputs", "outputs", "placements", "group",
)  # fmt: skip
# Logs written before the ``group`` column have the first 14 (readers accept both).
COLUMNS_V1 = COLUMNS[:14]

# ``str(torch.float32)`` without ``torch.`` -> the log's short form; other dtypes keep that name.
DTYPE_SHORT: dict[str, str] = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
    "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b1",
    "complex64": "c64", "complex128": "c128",
}  # fmt: skip

_KIND_OF: dict[str, str] = {}
for _kind, _names in KINDS.items():
    for _name in _names:
        _KIND_OF.setdefault(_name, _kind)
_NAMESPACE_SET = frozenset(NAMESPACES)


def kind_table() -> dict[str, str]:
    """Base name -> kind, flattened from ``KINDS`` (what the C++ observer is given)."""
    return dict(_KIND_OF)


def base_name(op: str) -> str:
    """``aten.mul_.Tensor`` -> ``mul``; ``_c10d_functional.all_reduce`` -> ``all_reduce``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] in _NAMESPACE_SET else parts[0]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def classify(op: str) -> str:
    """The kind of an op name (``KINDS``, ``NAMESPACE_KINDS``, else ``DEFAULT_KIND``).

    The one rule every level uses (the C++ observer implements it over the same table): a
    namespace in ``NAMESPACE_KINDS`` decides, else the base name's entry in ``KINDS``.
    """
    dot = op.find(".")
    if dot > 0:
        ns_kind = NAMESPACE_KINDS.get(op[:dot])
        if ns_kind is not None:
            return ns_kind
    return _KIND_OF.get(base_name(op), DEFAULT_KIND)


def event_of(kind: str) -> str:
    """The log's event word ($4) for a kind: COMM, WAIT or OP."""
    return EVENTS.get(kind, "OP")


def dtype_short(dtype: Any) -> str:
    """The log's name for a dtype: ``torch.float32`` -> ``f32`` (``DTYPE_SHORT``)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_SHORT.get(name, name)


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
