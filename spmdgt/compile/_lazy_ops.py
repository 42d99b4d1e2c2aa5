"""Which torch-level calls a lazy region may record, and the shape of their results.

Only calls that are *pure* (a fresh result, no mutation, no aliasing of an input) and return
one tensor, or a tuple of fresh tensors (``max(dim)``, ``sort``, ``topk``, ``var_mean``...),
are capturable: running them later, inside a compiled graph, gives what running them now would.
Their tensor arguments may come in a list (``cat``, ``stack``). Calls whose results are views
of their input, returned as a tuple (``split``, ``chunk``, ``unbind``: ``VIEWS``), run eagerly
on real tensors without ending the region (they neither read nor write what it holds); of a
pending plain result they are recorded, their results eager's views of its placeholder
(``Region.record_views``). Dropout is
capturable too (``RANDOM``): its draws are eager's when the region runs them in order from the
generator state the first one was recorded at (``_region``, ``_graphs``). Everything else
reaching the region (in-place ops, views, ``out=``, other random ops, host reads, collectives,
calls this table does not know) is a sync point: the region runs first, then the call runs
eagerly. ``SAFE`` calls read metadata a placeholder already has (shape, dtype, device) and
need no sync.

Result metadata (shape, dtype, strides) comes from running the call on meta tensors once per
(call, input metadata, constants) and is cached (``out_meta``), so a placeholder costs one
``empty_strided``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CAPTURE",
    "DYNAMIC_FLOAT",
    "OTHER",
    "RANDOM",
    "SAFE",
    "TABLE",
    "VIEWS",
    "out_meta",
    "verdict",
]

CAPTURE, SAFE, OTHER, VIEWS = 0, 1, 2, 3

_T = torch.Tensor
_POINTWISE = [
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "neg",
    "abs",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sigmoid",
    "erf",
    "erfc",
    "reciprocal",
    "square",
    "pow",
    "maximum",
    "minimum",
    "clamp",
    "clip",
    "where",
    "lerp",
    "addcmul",
    "addcdiv",
    "floor",
    "ceil",
    "trunc",
    "frac",
    "sign",
    "relu",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "fmod",
    "remainder",
    "hypot",
    "rsub",
]
# reductions: fused by inductor (the order of a float sum may change: see the tolerance)
_REDUCE = ["sum", "mean", "amax", "amin", "softmax", "log_softmax"]
# a tuple of fresh tensors (``max``/``min`` with a dim; without one, or of two tensors, one)
_TUPLES = ["max", "min", "sort", "topk", "kthvalue", "median", "nanmedian", "mode", "var_mean",
           "std_mean", "aminmax", "cummax", "cummin", "frexp"]  # fmt: skip
# a tuple of views of the input: run eagerly on real tensors, the region goes on
_VIEW_TUPLES = ["split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit",
                "split_with_sizes", "unsafe_split"]  # fmt: skip
# tensors in a list: a fresh result of their values
_LISTS = ["cat", "concat", "concatenate", "stack", "hstack", "vstack"]
# matrix products: not fused themselves, but the pointwise ops around them are (a bias and an
# activation ride along); on sharded tensors DTensor's collectives come into the graph
_MATMUL = ["matmul", "mm", "bmm", "addmm"]
_FUNCTIONAL = (F.gelu, F.silu, F.relu, F.softplus, F.leaky_relu, F.elu, F.mish, F.softmax,
               F.log_softmax, F.hardtanh, F.sigmoid, F.tanh, F.linear)  # fmt: skip
# Tensor-only spellings of the operators (``x * 2`` arrives as ``Tensor.mul``)
_DUNDER = (
    "__rsub__ __rdiv__ __rtruediv__ __rpow__ __pow__ __mod__ __rmod__ __and__ __or__ __xor__ "
    "__matmul__ __rmatmul__"
)


def _build() -> dict[Any, int]:
    table: dict[Any, int] = {}
    for names, verdict in ((_POINTWISE + _REDUCE + _MATMUL + _LISTS + _TUPLES, CAPTURE),
                           (_VIEW_TUPLES, VIEWS)):  # fmt: skip
        for name in names:
            for owner in (torch, _T):
                fn = getattr(owner, name, None)
                if fn is not None:
                    table[fn] = verdict
    for name in _DUNDER.split():
        fn = getattr(_T, name, None)
        if fn is not None:
            table[fn] = CAPTURE
    for fn in _FUNCTIONAL:
        table[fn] = CAPTURE
    for fn in (_T.size, _T.dim, _T.numel, _T.__len__, _T.ndimension, _T.nelement,
               _T.is_floating_point, _T.is_complex, _T.element_size, _T.get_device,
               _T._is_view):  # fmt: skip
        table[fn] = SAFE
    # ``_base``: a recorded view's base is its base's placeholder already, as eager's
    for attr in ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "is_sparse", "_base"):
        table[getattr(_T, attr).__get__] = SAFE
    return table


_TABLE = _build()
TABLE = _TABLE  # func -> verdict (``verdict`` without kwargs: ``TABLE.get(func, OTHER)``)
# calls that draw from torch's generator (dropout: a fresh result only when it drops, see
# ``verdict``); recorded in plain regions, which run them in order from the recorded state
RANDOM = frozenset({F.dropout})
for _fn in RANDOM:
    _TABLE[_fn] = CAPTURE
# add/sub/mul/div: a Python float argument becomes a graph input (a 0-d tensor of the result's
# dtype) once its value changes, as dynamo's automatic dynamic does. The arithmetic is the
# same: eager casts the scalar to the result's dtype (float32/float64) before the kernel too.
DYNAMIC_FLOAT = frozenset(
    getattr(o, n) for o in (torch, _T) for n in ("add", "sub", "mul", "div") if hasattr(o, n)
) | {_T.__rsub__, _T.__rdiv__, _T.__rtruediv__}


def verdict(func: Any, kwargs: dict | None) -> int:
    """CAPTURE, SAFE, VIEWS or OTHER for this call (``out=``/``inplace=True`` make it
    OTHER)."""
    try:
        v = _TABLE.get(func, OTHER)
    except TypeError:  # an unhashable callable
        return OTHER
    # "is not None"/"is True", never truth: an out= tensor's truth is ambiguous (a sharded
    # one's is even a host read, an agreement point on one rank's branch)
    if v != SAFE and kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
        return OTHER
    return v


def drops(args: tuple, kwargs: dict) -> bool:
    """Whether ``F.dropout(*args, **kwargs)`` draws and returns a fresh tensor: training, not
    in place, ``0 < p``; else eager returns its input itself (or mutates it), which a recorded
    result would not."""
    names = ("input", "p", "training", "inplace")
    got = dict(zip(names, args)) | kwargs
    p, training, inplace = got.get("p", 0.5), got.get("training", True), got.get("inplace", False)
    return type(p) in (int, float) and p > 0 and training is True and inplace is False


_META_CAP = 4096
_MISSING = object()
_meta: OrderedDict[Any, Any] = OrderedDict()


def out_meta(key: Any, func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """``(shape, stride, dtype)`` of ``func``'s result on these inputs (tensors in ``args`` /
    ``kwargs`` are plain tensors; ``key`` names the call, its input metadata and constants);
    for a tuple of tensors ``(None, its type, (shape, stride, dtype) of each)``; None for any
    other result. Run on meta tensors; raises what the call raises."""
    got = _meta.get(key, _MISSING)
    if got is not _MISSING:
        _meta.move_to_end(key)
        return got

    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if type(a) in (list, tuple):
            return [meta(x) for x in a]
        return a

    with torch._C.DisableTorchFunction():
        out = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    if type(out) is _T:
        got: Any = _meta_of(out)
    elif isinstance(out, tuple) and out and all(type(o) is _T for o in out):
        got = (None, type(out), tuple(_meta_of(o) for o in out))  # a structseq keeps its type
    else:
        got = None
    _meta[key] = got
    if len(_meta) > _META_CAP:
        _meta.popitem(last=False)
    return got


def _meta_of(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)
