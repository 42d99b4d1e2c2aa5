"""Which way an op on ``gt.Tensor``s goes (its route), and the function that runs each route.

The routes, the ops each takes and why are in docs/design.md ("An op on a ``gt.Tensor``"),
a table generated from the op registry (``_registry``; ``python -m spmdgt.tensor._routedoc
--markdown``). Each handler below registers its route and the ops it takes by name; the
per-call predicates they read are ``_guards``'.

The decision is made by op, never by an error's wording, and the same way on every rank (it
reads only the op and global metadata: shapes, placements, mesh sizes, never the output's
placements, which a rank outside a sub-mesh may see otherwise than its members).
``route(func)`` is computed once per torch function and cached, so the per-op cost is one
dict lookup.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from spmdgt.tensor import (
    _attention,
    _fallback,
    _inplace_views,
    _losses,  # noqa: F401 - registers the losses' guard
    _overlap,
    _registry,
    _views,
)
from spmdgt.tensor._assign import assign
from spmdgt.tensor._fallback import op_name
from spmdgt.tensor._guards import (
    batch_sharded_evenly,
    check_supported,
    guard,
    has_empty_shard,
    is_identity_dropout,
    is_irregular,
    keep_nan,
    ties_matter,
    world_size,
)
from spmdgt.tensor._hook import NoRule, running_backward
from spmdgt.tensor._registry import (
    ASSIGN,
    ATTENTION,
    AUTOGRAD,
    BATCH_ONLY,
    DTENSOR,
    EMPTY_SENSITIVE,
    GLOBAL,
    GUARDED,
    INPLACE,
    IRREGULAR,
    TIES,
    VIEW,
    register,
    register_route,
)

__all__ = [
    "ASSIGN",
    "ATTENTION",
    "AUTOGRAD",
    "BATCH_ONLY",
    "DTENSOR",
    "EMPTY_SENSITIVE",
    "GLOBAL",
    "GUARDED",
    "HANDLERS",
    "INPLACE",
    "IRREGULAR",
    "TIES",
    "VIEW",
    "draws",
    "dtensor_path",
    "fall_back",
    "is_pointwise_inplace",
    "route",
    "run",
]

_routes = _registry._routes  # torch function -> route; read on every op (gt.Tensor)


def route(func) -> int:
    """The route of torch function ``func`` (cached; ``_registry.classify``). Also notes a
    function whose record says ``rows_at_rows`` (``_registry.rows_at_rows_funcs``), so the
    per-call test reads the same cache's outcome."""
    r = _routes.get(func)
    if r is None:
        name = op_name(func)
        rec = _registry.record(name)
        if rec is not None and rec.rows_at_rows:
            _registry.rows_at_rows_funcs.add(func)
        r = _routes[func] = _registry.classify(name)
    return r


def draws(func) -> bool:
    """Does torch function ``func`` draw random numbers (a dropout, ``rrelu``, or an op whose
    aten schema takes a ``Generator``: ``_random.always_draws``)?"""
    return _registry.draws(op_name(func))


_pointwise: dict[object, bool] = {}


def is_pointwise_inplace(func) -> bool:
    """An in-place op in DTensor's pointwise table: it keeps self's placement, so DTensor runs
    it in place on each shard (other operands are redistributed to match)."""
    r = _pointwise.get(func)
    if r is None:
        name = op_name(func)
        rec = _registry.record(name)
        if rec is not None and rec.inplace_as is not None:
            name = rec.inplace_as
        inplace = name.endswith("_") and not draws(func)
        packet = getattr(torch.ops.aten, name, None) if inplace else None
        r = False
        if packet is not None:
            for overload in packet.overloads():
                if torch.Tag.pointwise in getattr(packet, overload).tags:
                    r = True
                    break
        _pointwise[func] = r
    return r


# -- the routes: each handler registers its route and the ops it takes by name --------------
# One function a route; a newcomer changes how an op falls back here. Each reads only the op
# and global metadata before DTensor or the fallback runs, so every rank takes the same one.


def fall_back(func, args, kwargs, e: NoRule, inplace: bool = False):
    """The exact fallback of an op DTensor has no rule for on this layout (``NoRule``): the
    in-place one for a mutation, else on global values."""
    if inplace:
        return _fallback.run_inplace(func, args, kwargs, e.reason())
    return _fallback.run_global(func, args, kwargs, e.reason())


@register_route(
    DTENSOR,
    "DTensor",
    patterns="everything else",
    how="DTensor's propagation, redistribution and collectives; where its propagation finds "
    "no rule for this layout, a hook on DTensor's propagation entry raises `NoRule` (from "
    "metadata only, before any data moves, so on every rank alike) and the op takes the "
    "exact fallback",
)
def dtensor_path(func, args, kwargs, inplace: bool = False, call=None):
    """DTensor's path (``func``, or ``call(func, args, kwargs)``); where its sharding
    propagation has no rule for this layout (decided from metadata, on every rank alike,
    before any data moves), the exact fallback (``fall_back``). Both of ``gt.Tensor``'s hooks
    and every route that takes DTensor's path come here: the one ``NoRule`` catch."""
    try:
        if call is not None:
            return call(func, args, kwargs)
        return func(*args, **kwargs)
    except NoRule as e:
        # an aten overload called by name (``torch.ops.aten.fill_.Scalar(x, v)``) is routed
        # by its overload's name, which names no mutation: its schema does
        mutable = isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable
        return fall_back(func, args, kwargs, e, inplace or mutable)


@register_route(
    AUTOGRAD,
    "autograd",
    how="run as they are, their tensors too (no lift, no mesh move: a lifted copy of a "
    "parameter is not the tensor asked about); a backward op with no rule for its layout "
    "takes the exact fallback at the aten level in `__torch_dispatch__`; `torch.func` "
    "transforms and forward AD are refused (`_transforms.py`)",
    names=("backward", "grad"),  # the engine: its ops take their own fallbacks
)
def _on_autograd(func, args, kwargs):
    with running_backward():
        return func(*args, **kwargs)


@register_route(
    VIEW,
    "view",
    how="DTensor's path; an output that DTensor had to redistribute (its local memory is not "
    "the input's) is a copy, so it is tagged with how to rebuild it from its base",
    names=(
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
        "view_as_real",
        "view_as_complex",
        "adjoint",
        "H",
        "mH",
        "hsplit",
        "vsplit",
        "dsplit",
        "split_with_sizes",
        "ravel",
        "detach",
    ),
)
def _on_view(func, args, kwargs):
    if func in _AS_STRIDED:
        out = _as_strided_view(args, kwargs)
        if out is not None:
            return out
    out = dtensor_path(func, args, kwargs)
    src = args[0] if args else None
    if isinstance(src, DTensor) and out is not src:
        _views.tag_views(func, args, kwargs, out, src)
    return out


_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)


def _as_strided_view(args, kwargs):
    """``as_strided`` that is a reshape of a contiguous tensor at its own storage offset,
    then a permutation of the result's dims (the strides are a permutation of a contiguous
    shape's, the elements as many; the identity, ``x.permute``, or any reshape of a
    replicated value): ``view(shape).permute(dims)``, which DTensor runs. DTensor refuses
    ``as_strided`` outright, and AOTAutograd regenerates an output that aliases an input
    with it (a compiled function returning ``x.unflatten`` or ``x.permute``) where the
    input's metadata differ from the traced one's, which a DTensor's storage offset (its
    local tensor's) can on some ranks only. Anything else: None (DTensor's error)."""
    kwargs = kwargs or {}
    x, size, stride = [*args, kwargs.get("size"), kwargs.get("stride")][:3]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if not isinstance(x, DTensor) or size is None or stride is None:
        return None
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or (offset is not None and offset != x.storage_offset()):
        return None
    if not x.is_contiguous() or math.prod(size) != x.numel():
        return None
    # the dims from the outermost (largest stride) in; a size-1 dim's stride says nothing
    order = sorted(range(len(size)), key=lambda d: (size[d] == 1, -stride[d]))
    shape = tuple(size[d] for d in order)
    step = 1
    for d in reversed(order):
        if size[d] != 1 and stride[d] != step:
            return None
        step *= max(size[d], 1)  # torch's contiguous strides treat an empty dim as 1
    # a view DTensor runs locally on every rank whatever ranks call it: a permutation, or
    # any reshape of a replicated value (a sharded one's could need a collective, and a
    # rank that regenerates an alias may be the only one calling)
    if shape != tuple(x.shape) and not all(p.is_replicate() for p in x.placements):
        return None
    out = x.view(shape)
    dims = [order.index(d) for d in range(len(size))]
    return out if dims == sorted(dims) else out.permute(dims)


# Python's in-place operators, named by the aten op they run (``is_pointwise_inplace``).
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
for _dunder, _aten in _DUNDER_ATEN.items():
    register((_dunder,), inplace_as=_aten)
# Ends in ``_`` but changes no values (or is not an op at all).
register(
    ("requires_grad_", "share_memory_", "retain_grad_", "detach_", "record_stream_"),
    mutates=False,
)


@register_route(
    INPLACE,
    "in-place",
    patterns="`*_` but those changing no values (below), any `out=`, a functional called "
    "with `inplace=True` on DTensor's route (`F.relu`)",
    how=(
        "DTensor's pointwise table (`torch.Tag.pointwise`: they keep self's placement) and "
        "the `inplace=True` functionals run in DTensor; the in-place views (`t_`, "
        "`transpose_`, `squeeze_`, `unsqueeze_`) change each rank's local tensor and the "
        "placements (`_inplace_views`); every other mutation, and any mutation of a tagged "
        "view, takes the exact fallback and is written back"
    ),
    names=("__setitem__", "__imatmul__", *_DUNDER_ATEN),
)
def _on_inplace(func, args, kwargs):
    out = _inplace(func, args, kwargs)
    if torch.is_grad_enabled():
        _views.keep_grad_layout(func, args, kwargs)
    return out


def _inplace(func, args, kwargs):
    self = args[0] if args else None
    if isinstance(self, DTensor):
        out = _overlap.through_model(func, args, kwargs)  # an operand aliases self: torch's way
        if type(out) is _overlap.Copies:  # autograd records: on copies of the aliased operands
            args, kwargs = out
        elif out is not NotImplemented:
            return out
        if op_name(func) in _inplace_views.NAMES:  # the shape changes, the values stay
            return dtensor_path(func, args, kwargs, inplace=True)
        if getattr(self, "_gt_view", None) is not None:
            out = _views.write_through(func, args, kwargs, self)
            if out is not NotImplemented:
                return out
        if is_pointwise_inplace(func) or kwargs.get("inplace") is True:
            # F.relu(x, inplace=True) as before it was a mutation: DTensor's own rule, with
            # the in-place fallback where it has none
            return dtensor_path(func, args, kwargs, inplace=True)
    return _fallback.run_inplace(func, args, kwargs, "in-place op outside the pointwise table")


register_route(
    ASSIGN,
    "assign",
    patterns="at the aten level: `Tensor.set_` offers no `__torch_function__`",
    how="self takes the source's values, shape, dtype and layout, sharing a sharded source's "
    "shards as torch shares memory (as `.data =` does); DTensor has no rule, and the in-place "
    "fallback cannot change a shape. A plain self: the in-place fallback",
    names=("set_.source_Tensor",),
)(assign)

# Draw without a Generator argument (an op whose aten schema takes one is found by
# ``_random.always_draws``): the dropouts (``is_identity_dropout``: none when p == 0 or not
# training), and the fractional max pools, which draw their samples on a plain tensor before
# the op that may lack a rule (run again from the start on global values, they would draw
# twice).
register(
    (
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "fractional_max_pool2d_with_indices",
        "fractional_max_pool3d_with_indices",
    ),
    draws=True,
)


@register_route(
    GLOBAL,
    "global",
    patterns="any function whose aten op takes a `Generator` (`bernoulli`, `rand_like`, "
    "`normal_`...); `fft_*`",
    how="output shape depends on data, or DTensor's sharded RNG would draw other numbers than "
    "one process (the ranks' generators agree, see `runtime/_seed`), or complex results "
    "(`fft_*`, `chalf`): the exact fallback, each in one process's memory layout. A dropout "
    "that draws nothing (`p=0` or not training) is the identity and stays local. A composite "
    "that draws inside (`gumbel_softmax`, `rrelu`, dropout inside a module) is caught at the "
    "aten level by `_random.py`",
    names=(
        # output shape depends on the values: DTensor cannot say it without running the op
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
        # a packed sequence's sizes come from the lengths' values; its batch sizes stay a
        # plain CPU tensor, which RNN kernels read on the host (_fallback._HOST_OUTPUTS)
        "_pack_padded_sequence",
        "_pad_packed_sequence",
        "quantile",  # DTensor gives a scalar q's result shape (1,) instead of ()
        "nanquantile",
        # host reads through torch.Tensor.item(x): the global value, never a rank's shard
        "item",
        "tolist",
        # DTensor's path gives other values (parity sweep) whatever the layout: attention's
        # packed projections, eig's gauge check in backward, ldl_solve's right-hand side
        "multi_head_attention_forward",
        "linalg_eig",
        "linalg_ldl_solve",
        "chalf",  # complex results: gradients diverged
    ),
)
def _on_global(func, args, kwargs):
    check_supported(func, args)
    if is_identity_dropout(func, args, kwargs):  # draws nothing: each rank's shard as it is
        return dtensor_path(func, args, kwargs)
    if kwargs.get("inplace") is True:  # F.dropout(x, inplace=True): a mutation of x
        return _fallback.run_inplace(func, args, kwargs, "random op in place")
    if draws(func):  # one process's numbers, where one process's layout puts them
        return _fallback.run_global(func, args, kwargs, "random op", strided=True)
    return _fallback.run_global(func, args, kwargs, "data-dependent shape or random op")


@register_route(
    IRREGULAR,
    "irregular",
    patterns="`*_copy` views",
    how="DTensor's rules assume even shards on every rank (the parity sweep saw wrong values "
    "or shapes): the exact fallback when a shard is uneven or empty, or on a sub-mesh",
)
def _on_irregular(func, args, kwargs):
    bad = any(isinstance(a, DTensor) and is_irregular(a) for a in args)
    return _global_if("DTensor's rule needs even shards" if bad else None, func, args, kwargs)


def _global_if(why: str | None, func, args, kwargs):
    """Global values for the reason ``why`` (read from the op and global metadata, alike on
    every rank); DTensor's path where it is None."""
    if why is not None:
        return _fallback.run_global(func, args, kwargs, why)
    return dtensor_path(func, args, kwargs)


@register_route(
    GUARDED,
    "guarded",
    how="DTensor's path, except for inputs a per-op guard (`_guards.py`) tells apart by "
    "dtype, dim and layout: `argmax/argmin` of a bool tensor (torch raises; DTensor's rule "
    "goes through `max` and answers), without a dim where the shards are not in flat order "
    "(DTensor takes the first *rank* holding the extreme, which is not the first flat index "
    "when ties span ranks), or with an empty shard; `prod` of complex values over a sharded "
    "dim (no collective multiplies complex numbers); `embedding` whose weight has one dim "
    "sharded over several mesh dims (DTensor's masked-partial rule shares one mask among "
    "them), or `max_norm` with ids on a sub-mesh (the rows renormalised in place in a plain "
    "weight on the mesh's ranks alone); `batch_norm`/`instance_norm` in training with "
    "running statistics (the kernel updates them outside its schema, and DTensor's rule for "
    "a feature-sharded input writes the update into redistributed copies); the losses on "
    "uneven, empty or sub-mesh shards outside what their sweep proved exact (`_losses.py`: "
    "float32, one 1-D mesh, the input's Shard(0), Shard(1) or "
    "Replicate for every sharded argument, replicated class weights)",
)
def _on_guarded(func, args, kwargs):
    return _global_if(guard(func, args, kwargs), func, args, kwargs)


@register_route(
    BATCH_ONLY,
    "batch-only",
    how="DTensor's path for an input sharded evenly on the batch dim over one mesh dim (or "
    "replicated), the exact fallback otherwise (parity sweep: a channel-sharded convolution "
    "comes out with the wrong number of channels, pooling's backward is wrong)",
    names=(
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "adaptive_max_pool1d_with_indices",
        "adaptive_max_pool2d_with_indices",
        "adaptive_max_pool3d_with_indices",
    ),
)
def _on_batch_only(func, args, kwargs):
    bad = any(isinstance(a, DTensor) and not batch_sharded_evenly(a) for a in args)
    return _global_if("DTensor's rule needs batch shards" if bad else None, func, args, kwargs)


@register_route(
    ATTENTION,
    "attention",
    how="local on each rank's rows (batch dims sharded) or heads (head dim sharded, "
    "grouped-query heads aligned per rank), uneven shards too, with sharding rules spmdgt "
    "registers with DTensor for its kernels (CPU flash, math; torch has the CUDA ones) and a "
    "mask kept with its rows (`_attention.py`); sequence or head-size sharding, empty shards, "
    "misaligned grouped-query heads and `dropout_p > 0`: the exact fallback",
    names=("scaled_dot_product_attention",),
)
def _on_attention(func, args, kwargs):
    """``ATTENTION``: each rank's own rows (or heads) through DTensor's strategies where the
    layout allows it exactly (``_attention.why_not_local``), global values otherwise."""
    return _global_if(_attention.why_not_local(args, kwargs, world_size()), func, args, kwargs)


@register_route(
    EMPTY_SENSITIVE,
    "empty-sensitive",
    how="the exact fallback when some rank holds nothing (an empty shard, or a rank outside a "
    'sub-mesh), since their kernels reject empty input (torch: "Expected reduction dim to be '
    'specified for input.numel() == 0") and the other ranks would wait',
    names=(
        "aminmax",
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
    ),
)
@register_route(
    TIES,
    "ties",
    how="as empty-sensitive, and also when a gradient is needed: torch splits it among tied "
    "maxima, which one shard cannot see (the infinity norms are maxima too: `_guards.py`)",
)
def _on_reduction(func, args, kwargs):
    """``EMPTY_SENSITIVE`` and ``TIES``: global values over an empty shard, and for a maximum
    whose gradient torch shares among tied values; NaN kept where DTensor's all-reduce drops
    it (``_guards.keep_nan``)."""
    if any(isinstance(a, DTensor) and has_empty_shard(a) for a in args):
        return _fallback.run_global(func, args, kwargs, "reduction over an empty shard")
    if (
        route(func) == TIES
        and torch.is_grad_enabled()
        and any(isinstance(a, DTensor) and a.requires_grad for a in args)
        and ties_matter(func, args, kwargs)
    ):
        return _fallback.run_global(func, args, kwargs, "gradient shared among tied values")
    return keep_nan(func, args, kwargs, dtensor_path(func, args, kwargs))


HANDLERS = {r: info.handler for r, info in _registry.ROUTES.items()}


def run(func, args, kwargs, r: int):
    """Run ``func`` the way its route ``r`` (``route``) says: ``HANDLERS[r]``. An ``out=``
    on a sharded operand is a mutation of it, whatever the op: the in-place fallback."""
    if r != AUTOGRAD and kwargs.get("out") is not None:
        out = _overlap.through_model(func, args, kwargs)  # an input aliases out=: torch's way
        if type(out) is _overlap.Copies:  # autograd records: on copies of the aliased operands
            args, kwargs = out
        elif out is not NotImplemented:
            return out
        return _fallback.run_inplace(func, args, kwargs, "out= on a sharded operand")
    return HANDLERS[r](func, args, kwargs)
