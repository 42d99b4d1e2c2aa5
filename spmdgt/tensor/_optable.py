"""Which way an op on ``gt.Tensor``s goes: DTensor's own path, or an exact fallback.

The decision is made by op, never by an error's wording, and the same way on every rank (it
reads only the op and global metadata: shapes, placements, mesh sizes). ``route(func)`` is
computed once per torch function and cached, so the per-op cost is one dict lookup.

=================  ==========================================================================
route              why
=================  ==========================================================================
``DTENSOR``        DTensor has a rule; if its sharding propagation finds none for this layout
                   (``NoRule``, raised by the hook below before any data moves), the op is
                   re-run exactly on the global values.
``VIEW``           a view op: DTensor's path, then outputs that had to be redistributed (so
                   are copies, not views) are tagged so writes through them reach the base.
``INPLACE``        mutates its first argument. Pointwise in-place ops (DTensor's pointwise
                   table, ``torch.Tag.pointwise``) keep self's placement and run in DTensor;
                   every other one (``index_fill_``, ``scatter_``, ``__setitem__``...) is
                   computed on global values and written back into each rank's shard.
``GLOBAL``         output shape depends on data (``nonzero``, ``unique``, boolean-mask reads)
                   or the op draws random numbers (``dropout``, ``bernoulli``...): run on the
                   global values on every rank, which is exactly one process's computation
                   (the ranks' generators agree, see ``runtime/_seed``).
``EMPTY_SENSITIVE`` reductions whose kernels reject an empty input (``max``, ``argmin``...):
                   global values when some rank's shard is empty, DTensor's path otherwise.
=================  ==========================================================================
"""

from __future__ import annotations

import torch

__all__ = [
    "DTENSOR",
    "EMPTY_SENSITIVE",
    "GLOBAL",
    "INPLACE",
    "NoRule",
    "VIEW",
    "has_empty_shard",
    "install_propagation_hook",
    "is_pointwise_inplace",
    "route",
]

DTENSOR, VIEW, INPLACE, GLOBAL, EMPTY_SENSITIVE = range(5)

# Output shape depends on the values: DTensor cannot say it without running the op.
_DATA_DEPENDENT = frozenset(
    {
        "nonzero",
        "nonzero_static",
        "argwhere",
        "unique",
        "unique_consecutive",
        "_unique",
        "_unique2",
        "masked_select",
        "bincount",
        "histc",
        "histogram",
        "repeat_interleave",
    }
)

# Draw random numbers: DTensor's sharded RNG draws other numbers than one process would.
_RANDOM = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "bernoulli",
        "multinomial",
        "normal",
        "poisson",
        "rand_like",
        "randn_like",
        "randint_like",
        "rrelu",
        "bernoulli_",
        "normal_",
        "uniform_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "rrelu_",
    }
)

# Reductions whose local kernel raises on an empty shard (torch: "Expected reduction dim to be
# specified for input.numel() == 0"), which would leave the other ranks waiting.
_EMPTY_SENSITIVE = frozenset(
    {
        "max",
        "min",
        "amax",
        "amin",
        "aminmax",
        "argmax",
        "argmin",
        "median",
        "nanmedian",
        "mode",
        "kthvalue",
        "topk",
        "cummax",
        "cummin",
        "logcumsumexp",
        "std",
        "var",
        "std_mean",
        "var_mean",
        "quantile",
        "nanquantile",
    }
)

# Views: their outputs may need tagging as detached copies (see module docstring).
_VIEWS = frozenset(
    {
        "__getitem__",
        "select",
        "narrow",
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "T",
        "mT",
        "permute",
        "movedim",
        "moveaxis",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "diagonal",
        "split",
        "chunk",
        "unbind",
        "tensor_split",
        "unfold",
        "as_strided",
        "real",
        "imag",
    }
)

# Ends in ``_`` but changes no values (or is not an op at all).
_NOT_MUTATING = frozenset(
    {"requires_grad_", "share_memory_", "retain_grad_", "detach_", "record_stream_"}
)
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)
# Python's in-place operators, named by the aten op they run.
_DUNDER_ATEN = {
    "__iadd__": "add_",
    "__isub__": "sub_",
    "__imul__": "mul_",
    "__itruediv__": "div_",
    "__ifloordiv__": "floor_divide_",
    "__imod__": "remainder_",
    "__ipow__": "pow_",
    "__iand__": "bitwise_and_",
    "__ior__": "bitwise_or_",
    "__ixor__": "bitwise_xor_",
    "__ilshift__": "bitwise_left_shift_",
    "__irshift__": "bitwise_right_shift_",
}

_routes: dict[object, int] = {}


def _name(func) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property's getter (``x.T``) reaches __torch_function__ as __get__
        name = getattr(getattr(func, "__self__", None), "__name__", "") or ""
    return name


def _classify(func) -> int:
    name = _name(func)
    if name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.endswith("__") and name not in _NOT_MUTATING
    ):
        return INPLACE  # random in-place ops too: not in the pointwise table, so exact
    if name in _RANDOM or name in _DATA_DEPENDENT:
        return GLOBAL
    if name in _EMPTY_SENSITIVE:
        return EMPTY_SENSITIVE
    if name in _VIEWS:
        return VIEW
    return DTENSOR


def route(func) -> int:
    """The route of torch function ``func`` (cached; see the module docstring)."""
    r = _routes.get(func)
    if r is None:
        r = _routes[func] = _classify(func)
    return r


_pointwise: dict[object, bool] = {}


def is_pointwise_inplace(func) -> bool:
    """An in-place op in DTensor's pointwise table: it keeps self's placement, so DTensor runs
    it in place on each shard (other operands are redistributed to match)."""
    r = _pointwise.get(func)
    if r is None:
        name = _name(func)
        name = _DUNDER_ATEN.get(name, name)
        inplace = name.endswith("_") and name not in _RANDOM
        packet = getattr(torch.ops.aten, name, None) if inplace else None
        r = False
        if packet is not None:
            for overload in packet.overloads():
                if torch.Tag.pointwise in getattr(packet, overload).tags:
                    r = True
                    break
        _pointwise[func] = r
    return r


def has_empty_shard(a) -> bool:
    """True when some rank's shard of DTensor ``a`` is empty (torch.chunk rule), decided from
    the global shape and placements alone, so every rank answers alike."""
    from torch.distributed.tensor import Shard

    spec = a._spec
    shape = spec.shape
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            n, m = shape[p.dim], spec.mesh.size(i)
            if n < m or -(-n // m) * (m - 1) >= n:
                return True
    return False


class NoRule(RuntimeError):
    """DTensor's sharding propagation found no rule for an op on this layout.

    Raised before any data moves, from global metadata alone, so every rank raises it at the
    same op; spmdgt then runs the op exactly on global values instead."""

    def __init__(self, op, cause: BaseException) -> None:
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"{op}: no sharding rule for this layout ({first})")
        self.op = op


# Set while spmdgt's own __torch_function__ runs an op: only then does a propagation failure
# become NoRule. DTensor used directly (the trainer's FSDP/TP tensors) is left as DTensor has it.
active = [False]
_installed = [False]


def install_propagation_hook() -> None:
    """Wrap DTensor's sharding-propagation entry (called from its C++ dispatcher on a cache
    miss) so that, inside spmdgt's calls, a failure to find a rule raises ``NoRule``."""
    if _installed[0]:
        return
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    original = dispatcher._propagate_op_sharding_dispatch_slow_path

    def propagate(op_call, *args, **kwargs):
        try:
            return original(op_call, *args, **kwargs)
        except NoRule:
            raise
        except Exception as e:
            if active[0]:
                raise NoRule(op_call, e) from e
            raise

    dispatcher._propagate_op_sharding_dispatch_slow_path = propagate
    _installed[0] = True
