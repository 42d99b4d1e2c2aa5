"""Exact rewrites for partial values: where DTensor's rule keeps a ``Partial`` placement
through an op that is not linear in it.

DTensor holds a value summed over a sharded dim (a sum of column shards, a row-parallel
product, a loss) as ``Partial``: each rank a part, reduced when something needs the value.
Its rules keep the placement through an op they take for linear, and where that is wrong the
result is a wrong number with no error. Each rewrite here runs in the propagation hook
(``_hook``), on the op's record (its ``partial`` field), eager and traced alike, on every
DTensor op of the process: inside spmdgt's calls and outside them, where the trainer's
models hold DTensors of their own (TP and FSDP parameters; a loss that sums the row norms of
a row-parallel weight got DTensor's wrong number there):

- ``fill_`` of a partial value: the value on the first rank of each ``sum`` mesh dim, the
  reduction's identity elsewhere (DTensor fills every part: ``1 - cos`` compiled gave
  ``world - cos``);
- ``_to_copy`` into a dtype that rounds: the parts reduced first (DTensor rounds each part);
- ``sum`` of a partial p-norm: reduced first (DTensor's ``_NormPartial`` calls its reduction
  ``sum``).
- ``convolution`` (and its backward) of a partial input: reduced first, in a wrap of
  DTensor's own convolution handlers, which run before its propagation (``install``).

Found by the parity sweep's ``partial`` audit layouts (``tests/parity/layouts.py``) and the
both-halves compile sweep; ``docs/exactness.md``, "Partial values".
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from spmdgt.tensor._fallback import NoRule
from spmdgt.tensor._registry import register_aten

__all__: list[str] = []  # registrations only (on the ops' records)


def _partial_self(args) -> bool:
    """Is ``fill_``'s tensor a partial value (and its fill value a number, a plain 0-d tensor or
    a replicated one)?"""
    x, value = args[0], args[1]
    if not isinstance(x, DTensor) or not any(p.is_partial() for p in x._spec.placements):
        return False
    if isinstance(value, DTensor):
        return all(p.is_replicate() for p in value._spec.placements)
    return not isinstance(value, torch.Tensor) or value.dim() == 0  # a plain one: replicated


def _fill_partial(op_call, args, kwargs):
    """``fill_`` of a partial value, exactly: the rank that is first on every ``sum`` (or
    ``product``) mesh dim holds the value, the other ranks that reduction's identity (-0.0, or 1);
    under ``avg``, ``max`` and ``min`` every rank holds it. DTensor's rule fills every rank's
    part with the value, which a ``sum`` reduces to the value times the ranks: torch's
    ``Scalar - Tensor`` is ``empty_like(t).fill_(s).sub_(t)`` in C++, and ``empty_like`` keeps a
    partial placement, so a composite traced by ``torch.compile`` (``cosine_embedding_loss``'s
    ``1 - cos`` over a sharded feature dim) gave ``world - cos``. No data moves. A partial
    p-norm holds no negative value that way (its parts' p-th powers are summed and rooted:
    ``-2.5`` came back as ``2.5``, or NaN for p = 3): the exact fallback (``NoRule``)."""
    x, value = args[0], args[1]
    if isinstance(value, DTensor):
        value = value._local_tensor
    ops = {p.reduce_op for p in x._spec.placements if p.is_partial()}
    if {"sum", "product"} <= ops:
        raise NoRule(op_call, RuntimeError("a fill of a value partial as a sum and a product"))
    norm = any(_is_norm_partial(p) and p.reduce_op == "sum" for p in x._spec.placements)
    if norm and not _norm_holds(value):
        raise NoRule(op_call, RuntimeError(f"a fill of a partial p-norm with {value!r}"))
    coord = x.device_mesh.get_coordinate()
    first = coord is not None and all(
        coord[i] == 0
        for i, p in enumerate(x._spec.placements)
        if p.is_partial() and p.reduce_op in ("sum", "product")
    )
    if first or not ops & {"sum", "product"}:
        x._local_tensor.fill_(value)
    else:
        # -0.0, the sum's identity for every value (0.0 + -0.0 is 0.0, -0.0 + 0.0 too)
        x._local_tensor.fill_(-0.0 if "sum" in ops else 1)
    return x


def _norm_holds(value) -> bool:
    """Can a partial p-norm (p other than 0 and 1: the parts' p-th powers summed, then the p-th
    root) hold ``value`` as the value on one rank and 0 on the others? Only a number that is not
    negative (-0.0 included): the root of a p-th power is its absolute value, or NaN. A tensor
    value is not read (under ``torch.compile`` it has no data): the exact fallback takes it."""
    if isinstance(value, (torch.Tensor, complex)):
        return False
    return math.isnan(value) or math.copysign(1.0, value) > 0


# ``fill_`` of a partial value (DTensor's rule keeps the placement and fills every part).
register_aten(
    (torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor),
    "partial",
    (_partial_self, _fill_partial),
)


_ROUNDING_REDUCES = ("sum", "avg", "product")


def _rounds(p) -> bool:
    """Is placement ``p`` a partial whose reduction a cast of each part would not commute with?"""
    return p.is_partial() and p.reduce_op in _ROUNDING_REDUCES


def _first_holds(args, which) -> bool:
    """Is the op's first argument a DTensor with a placement ``which`` picks?"""
    x = args[0]
    return isinstance(x, DTensor) and any(which(p) for p in x._spec.placements)


def _on_reduced(op_call, args, kwargs, which):
    """``op_call`` on its first argument with the partial placements ``which`` picks reduced
    (to ``Replicate``) first; the other arguments as they are."""
    return op_call(_reduce(args[0], which), *args[1:], **kwargs)


def _reduce(x: DTensor, which) -> DTensor:
    """``x`` with the partial placements ``which`` picks reduced (to ``Replicate``)."""
    return x.redistribute(x.device_mesh, [Replicate() if which(p) else p for p in x.placements])


def _partial_sum(args) -> bool:
    """Is the op's tensor a value partial as a sum, a mean or a product?"""
    return _first_holds(args, _rounds)


# casts that keep every value of the source exactly: a partial value's parts cast alone add up
# to the cast of their sum (in the wider dtype, more closely than one process rounds it)
_WIDER = {
    torch.float16: (torch.float32, torch.float64, torch.complex64, torch.complex128),
    torch.bfloat16: (torch.float32, torch.float64, torch.complex64, torch.complex128),
    torch.float32: (torch.float64, torch.complex64, torch.complex128),
    torch.float64: (torch.complex128,),
    torch.complex64: (torch.complex128,),
}


def _cast_reduced(op_call, args, kwargs):
    """``_to_copy`` (``.to``, ``.half()``, autocast's casts) of a partial value into a dtype
    that rounds: the parts are reduced first, in the value's own dtype, then cast, as one
    process casts its value. DTensor's rule keeps a ``sum`` partial through a cast between
    float dtypes, so each rank rounds its part and the ranks add the rounded parts: parts
    that cancel (a sum of values of both signs) lose every digit the cast keeps (the parity
    sweep's ``partial`` audit: ``half`` 8e-3 off on a value of 2). A copy into the same or a
    wider dtype is DTensor's (``NotImplemented``)."""
    x = args[0]
    dtype = kwargs.get("dtype")
    if dtype is None or dtype == x.dtype or dtype in _WIDER.get(x.dtype, ()):
        return NotImplemented
    return _on_reduced(op_call, args, kwargs, _rounds)


# a cast of a partial value (DTensor's rule casts each rank's part)
register_aten((torch.ops.aten._to_copy.default,), "partial", (_partial_sum, _cast_reduced))


def _norm_partial(args) -> bool:
    """Is the op's tensor a partial p-norm with p other than 1 (``x.norm(dim=...)`` over a
    sharded dim: each rank's norm of its part, reduced as the p-th root of the sum of p-th
    powers)?"""
    return _first_holds(args, _is_norm_partial)


def _is_norm_partial(p) -> bool:
    return p.is_partial() and getattr(p, "norm_type", 1) != 1


def _sum_of_norms(op_call, args, kwargs):
    """A sum of a partial p-norm, reduced first. DTensor's ``_NormPartial`` calls its reduction
    ``sum``, so DTensor's sum rule keeps it as if the sum were linear in it: each rank summed
    its parts' norms and the ranks took the norm of those sums (``x.norm(dim=1).sum()`` of
    column shards: 7.135 for torch's 7.395, the parity audit's cousin). With ``p = 1`` the
    parts add, and DTensor's rule is right."""
    return _on_reduced(op_call, args, kwargs, _is_norm_partial)


# a sum of a partial p-norm (DTensor's sum rule keeps the norm's placement)
register_aten(
    (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.nansum.default),
    "partial",
    (_norm_partial, _sum_of_norms),
)


# -- DTensor's convolution handlers, which run before its propagation ----------------------
# DTensor runs ``convolution`` and ``convolution_backward`` through handlers of their own
# (``OpDispatcher._custom_op_handlers``), before the propagation entry the hook wraps. Its
# forward handler runs the kernel on each rank's part of a partial input, without the
# redistribution its own propagation asks for, and calls the result replicated: a raw
# DTensor ``conv1d`` of a ``Partial`` input came out 4.37 off on 2 ranks, silently (spmdgt's
# own calls take the batch-only route, ``_guards.batch_sharded_evenly``, and never get here
# with one). Its backward handler refuses a partial input ("Can not redistribute from R to
# P(sum)"). The wrap reduces a partial input or weight first, exact in both; a partial
# gradient (the backward's first argument) is linear there and DTensor's handler is right.
_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_handlers: dict = {}  # DTensor's own handlers, while ours are in


def _reduced(a):
    """``a`` with its partial placements reduced (to ``Replicate``), else ``a`` itself."""
    if not isinstance(a, DTensor) or not any(p.is_partial() for p in a._spec.placements):
        return a
    return _reduce(a, lambda p: p.is_partial())


def _convolution_reduced(op_call, args, kwargs):
    """DTensor's convolution handler on the input and weight with partial placements reduced
    (``convolution``: arguments 0 and 1; ``convolution_backward``: 1 and 2)."""
    first = 1 if op_call is torch.ops.aten.convolution_backward.default else 0
    args = tuple(_reduced(a) if first <= i < first + 2 else a for i, a in enumerate(args))
    return _handlers[op_call](op_call, args, kwargs)


def install() -> None:
    """Wrap DTensor's convolution handlers (the hook's ``install``)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op in _CONVOLUTIONS:
        if op in table and op not in _handlers:
            _handlers[op] = table[op]
            table[op] = _convolution_reduced


def uninstall() -> None:
    """Put DTensor's convolution handlers back."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _handlers.items():
        table[op] = handler
    _handlers.clear()
