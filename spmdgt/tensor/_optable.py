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
``ASSIGN``         ``aten.set_.source_Tensor`` (``Tensor.set_`` offers no ``__torch_function__``:
                   ``gt.Tensor.__torch_dispatch__`` asks): self takes the source's values,
                   shape, dtype and layout, sharing a DTensor source's shards as torch shares
                   memory (as ``.data =`` does); DTensor has no rule, and the in-place
                   fallback cannot change a shape. A plain self: the in-place fallback.
``GLOBAL``         output shape depends on data (``nonzero``, ``unique``, boolean-mask reads)
                   or the op draws random numbers (``dropout``, and every op whose aten
                   schema takes a ``Generator``: ``bernoulli``, ``normal``...): run on the
                   global values on every rank, which is exactly one process's computation
                   (the ranks' generators agree, see ``runtime/_seed``), each in its own
                   memory layout (a fill follows it). A composite that draws inside
                   (``F.gumbel_softmax``) is caught at the aten level (``_random``). A
                   dropout that draws nothing (``p=0``, or not training;
                   ``is_identity_dropout``) returns its input as torch does: DTensor's
                   path, no gather.
``GUARDED``        DTensor's rule is wrong for some inputs, told apart by dtype, dim and layout
                   (``guard``): ``argmax/argmin`` on a bool input (torch rejects it; DTensor
                   computes through ``max`` and answers), without a dim where the shards
                   are not in flat order (a dim before the sharded one is longer than 1:
                   DTensor picks the first *rank* holding the extreme, not the first flat
                   index, so ties differ), or with an empty shard;
                   ``prod`` of complex values over a sharded dim (no collective has a complex
                   product); ``embedding`` whose weight has one dim sharded over several mesh
                   dims (DTensor's masked-partial rule shares one mask among them: ranks
                   disagree). Global values there, DTensor's path otherwise.
``EMPTY_SENSITIVE`` reductions whose kernels reject an empty input (``max``, ``median``,
                   ``norm``...): global values when some rank's shard is empty (a rank
                   outside a sub-mesh holds an empty one too), DTensor's path otherwise.
                   ``amax/amin/max/min`` also when a gradient is needed: torch splits it
                   evenly among tied maxima, which one shard cannot see.
``BATCH_ONLY``     convolutions and adaptive pooling: DTensor's path for an input sharded
                   evenly on the batch dim over one mesh dim (or replicated), global values
                   otherwise.
``ATTENTION``      ``scaled_dot_product_attention``: DTensor's path, each rank on its own rows
                   or heads, for inputs sharded on a batch dim or the head dim with the mask
                   laid out alike or broadcast (``_attention.why_not_local``, uneven shards
                   too); global values for other layouts and for ``dropout_p > 0``.
``AUTOGRAD``       ``backward()`` / ``torch.autograd.grad``: run as they are. A backward op
                   with no rule for its layout takes the exact fallback at the aten level
                   (``gt.Tensor.__torch_dispatch__``), never the whole backward again.
``IRREGULAR``      DTensor's rules for these assume even shards on every rank (seen giving
                   wrong values or shapes by the parity sweep: losses whose mean averages
                   per-rank means, ``*_copy`` views): global values when
                   a shard is uneven or empty or the mesh is a sub-mesh.
=================  ==========================================================================

Every decision reads the op and the inputs' global metadata before DTensor runs: never the
output's placements, which a rank outside a sub-mesh may see otherwise than its members.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from spmdgt.tensor import _attention, _fallback, _overlap, _random
from spmdgt.tensor._assign import assign
from spmdgt.tensor._fallback import op_name
from spmdgt.tensor._hook import NoRule, running_backward
from spmdgt.tensor._shards import shard_shapes

__all__ = [
    "DTENSOR",
    "EMPTY_SENSITIVE",
    "GLOBAL",
    "GUARDED",
    "ASSIGN",
    "ATTENTION",
    "AUTOGRAD",
    "BATCH_ONLY",
    "IRREGULAR",
    "INPLACE",
    "TIES",
    "VIEW",
    "has_empty_shard",
    "check_supported",
    "guard",
    "is_irregular",
    "ties_matter",
    "is_pointwise_inplace",
    "route",
    "run",
    "HANDLERS",
]

(
    DTENSOR,
    VIEW,
    INPLACE,
    GLOBAL,
    EMPTY_SENSITIVE,
    IRREGULAR,
    TIES,
    BATCH_ONLY,
    AUTOGRAD,
    GUARDED,
    ASSIGN,
    ATTENTION,
) = range(12)

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
    }
)

# Draw random numbers: DTensor's sharded RNG draws other numbers than one process would. An
# op whose aten schema takes a Generator (bernoulli, normal, multinomial, poisson, rand_like,
# rrelu, uniform_...) is found by ``_random.always_draws``; these draw without one: the
# dropouts (``is_identity_dropout``: none when p == 0 or not training), and the fractional
# max pools, which draw their samples on a plain tensor before the op that may lack a rule
# (run again from the start on global values, they would draw twice).
_RANDOM = frozenset(
    {
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
    }
)

# DTensor's rule is wrong for some inputs of these, which ``guard`` tells apart by metadata.
_GUARDED = frozenset({"argmax", "argmin", "prod", "embedding"})

# Tied maxima share the gradient evenly in torch; a shard sees only its own ties (the
# infinity norms are maxima too).
_NORMS = frozenset({"norm", "linalg_norm", "linalg_vector_norm"})
_TIES = frozenset({"max", "min", "amax", "amin"}) | _NORMS

# DTensor's rules here hold for a batch-sharded input only (parity sweep: a channel-sharded
# convolution comes out with the wrong number of channels, pooling's backward is wrong).
_BATCH_ONLY = frozenset(
    {
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
    }
)

# Attention: local on batch or head shards (``_attention.why_not_local``), global otherwise.
_ATTENTION = frozenset({"scaled_dot_product_attention"})

# DTensor's rules assume even shards here (parity sweep: wrong values or shapes otherwise).
_IRREGULAR = frozenset(
    {
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "soft_margin_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "cosine_embedding_loss",
        "gaussian_nll_loss",
        "poisson_nll_loss",
        "kl_div",
        "margin_ranking_loss",
        "hinge_embedding_loss",
        "multilabel_soft_margin_loss",
        "multilabel_margin_loss",
        "multi_margin_loss",
        "triplet_margin_loss",
        "triplet_margin_with_distance_loss",
        "nll_loss",
        "cross_entropy",
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


def _classify(func) -> int:
    name = op_name(func)
    if name in ("backward", "grad"):  # the engine: its ops take their own fallbacks
        return AUTOGRAD
    if name == "set_.source_Tensor":  # aten's: Tensor.set_ offers no __torch_function__
        return ASSIGN
    if name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.endswith("__") and name not in _NOT_MUTATING
    ):
        return INPLACE  # random in-place ops too: not in the pointwise table, so exact
    if name in _DATA_DEPENDENT or draws(func):
        return GLOBAL
    if name.startswith("fft_") or name == "chalf":  # complex results: gradients diverged
        return GLOBAL
    if name in _GUARDED:
        return GUARDED
    if name in _TIES:
        return TIES
    if name in _EMPTY_SENSITIVE:
        return EMPTY_SENSITIVE
    if name in _IRREGULAR or name.endswith("_copy"):  # squeeze_copy & co: even shards only
        return IRREGULAR
    if name in _BATCH_ONLY:
        return BATCH_ONLY
    if name in _ATTENTION:
        return ATTENTION
    if name in _VIEWS:
        return VIEW
    return DTENSOR


def draws(func) -> bool:
    """Does torch function ``func`` draw random numbers (a dropout, ``rrelu``, or an op whose
    aten schema takes a ``Generator``: ``_random.always_draws``)?"""
    name = op_name(func)
    return name in _RANDOM or _random.always_draws(name)


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
        name = op_name(func)
        name = _DUNDER_ATEN.get(name, name)
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


def has_empty_shard(a) -> bool:
    """True when some rank holds none of DTensor ``a``: a shard left empty by the torch.chunk
    rule (on any mesh dim, nested shards of one tensor dim included), or a rank outside
    ``a``'s (sub-)mesh. Decided from global metadata alone, so every rank answers alike."""
    spec = a._spec
    if spec.mesh.size() != _world_size():
        return True
    shapes = shard_shapes(spec)
    if shapes is None:
        return True
    dims = {p.dim for p in spec.placements if isinstance(p, Shard)}
    return any(s[d] == 0 for s in shapes for d in dims)


def is_irregular(a) -> bool:
    """True when DTensor ``a`` is unevenly sharded (the ranks' shards differ in shape, on any
    mesh dim), has an empty shard, or lives on a sub-mesh: the layouts DTensor's rules for
    ``IRREGULAR`` ops get wrong."""
    if has_empty_shard(a):
        return True
    shapes = shard_shapes(a._spec)
    return shapes is None or len(set(shapes)) > 1


def check_supported(func, args) -> None:
    """Raise, on every rank, for what cannot be exact: complex32 on a sub-mesh. torch lacks
    most complex32 kernels, and DTensor runs no kernel on ranks outside a sub-mesh, so such an
    error would reach the mesh's ranks only while the others wait in the next collective."""
    if op_name(func) != "chalf":
        return
    for a in args:
        if isinstance(a, DTensor) and a._spec.mesh.size() != _world_size():
            raise NotImplementedError(
                "chalf: complex32 values on a sub-mesh are not supported (torch lacks most "
                "complex32 kernels, and ranks outside the mesh would not see their errors); "
                "use .to(torch.complex64)"
            )


def ties_matter(func, args, kwargs) -> bool:
    """For a ``TIES`` op: is it a maximum (always for max/min/amax/amin; for a norm, only the
    infinity norms)?"""
    if op_name(func) not in _NORMS:
        return True
    p = kwargs.get("p", kwargs.get("ord", args[1] if len(args) > 1 else None))
    return isinstance(p, (int, float)) and abs(p) == float("inf")


def guard(func, args, kwargs) -> str | None:
    """For a ``GUARDED`` op: why its input needs the exact fallback (None: DTensor's path is
    right). Reads dtypes, dims, shapes and placements only, so every rank answers alike."""
    if op_name(func) == "embedding":
        w = kwargs.get("weight", args[1] if len(args) > 1 else None)
        if isinstance(w, DTensor):
            rows = [p.dim for p in w._spec.placements if isinstance(p, Shard)]
            if len(rows) != len(set(rows)):
                return (
                    "embedding weight with one dim sharded over several mesh dims (DTensor's "
                    "masked-partial rule keeps one mask for all of them)"
                )
        return None
    a = args[0] if args else kwargs.get("input")
    if not isinstance(a, DTensor):
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, int) and dim < 0:
        dim += max(a.dim(), 1)
    shards = [p.dim for p in a._spec.placements if isinstance(p, Shard)]
    if op_name(func) == "prod":
        dtype = kwargs.get("dtype") or a.dtype
        if dtype.is_complex and any(dim is None or d == dim for d in shards):
            return "complex product over a sharded dim (no collective multiplies complex values)"
        return None
    if a.dtype is torch.bool:
        return "bool input (torch rejects it; DTensor's rule goes through max, which accepts it)"
    if has_empty_shard(a):
        return "reduction over an empty shard"
    # without a dim, DTensor takes the extreme of the first rank holding it: the first flat
    # index only when the shards follow one another in flat order
    if dim is None and (len(shards) > 1 or any(math.prod(a.shape[:d]) > 1 for d in shards)):
        return "ties: the first flat index is not on the first rank holding the extreme"
    return None


# Dropouts that draw nothing when ``p == 0`` or not training: torch returns the input itself
# (``aten::dropout``'s ``p == 0 || !train`` early return), so each rank's shard is exactly its
# part of the result. name -> the default of ``training`` (``F.alpha_dropout``'s is False).
_DROPOUTS = {
    "dropout": True,
    "dropout1d": True,
    "dropout2d": True,
    "dropout3d": True,
    "feature_dropout": True,
    "alpha_dropout": False,
    "feature_alpha_dropout": False,
}


def is_identity_dropout(func, args, kwargs) -> bool:
    """A dropout that changes nothing and draws no number: ``p == 0``, or ``training`` False
    (``F.dropout(x, p, training, inplace)``, ``torch.dropout(x, p, train)`` and the feature
    and alpha variants), out of place. Reads the arguments only, alike on every rank."""
    name = op_name(func)
    if name not in _DROPOUTS:
        return False
    if kwargs.get("inplace", args[3] if len(args) > 3 else False):
        return False  # F.dropout3d(x, inplace=True) views x in place (unsqueeze_): a mutation
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else None))
    if train is None:
        train = _DROPOUTS[name]
    if isinstance(p, torch.Tensor) or isinstance(train, torch.Tensor):
        return False
    return p == 0 or not train


def batch_sharded_evenly(a) -> bool:
    """True when DTensor ``a`` is replicated or sharded evenly on dim 0 only, over the world,
    and over one mesh dim (DTensor's convolution rules raise on ``(Shard(0), Shard(0))``)."""
    if is_irregular(a):
        return False
    dims = [p.dim for p in a._spec.placements if isinstance(p, Shard)]
    # dim 0 over one mesh dim: DTensor's convolution rules refuse (Shard(0), Shard(0))
    return len(dims) <= 1 and all(d == 0 for d in dims)


def _world_size() -> int:
    from spmdgt.runtime._state import get_runtime

    return get_runtime().world_size


# -- the route -> handler map: how each route runs an op (``run``) -------------------------
# One function a route; a newcomer changes how an op falls back here. Each reads only the op
# and global metadata before DTensor or the fallback runs, so every rank takes the same one.


def _dtensor(func, args, kwargs, inplace: bool = False):
    """DTensor's path; where its sharding propagation has no rule for this layout (decided
    from metadata, on every rank alike, before any data moves), the exact fallback."""
    try:
        return func(*args, **kwargs)
    except NoRule as e:
        if inplace:
            return _fallback.run_inplace(func, args, kwargs, e.reason())
        return _fallback.run_global(func, args, kwargs, e.reason())


def _on_autograd(func, args, kwargs):
    with running_backward():
        return func(*args, **kwargs)


def _on_view(func, args, kwargs):
    out = _dtensor(func, args, kwargs)
    src = args[0] if args else None
    if isinstance(src, DTensor) and out is not src:
        _fallback.tag_views(func, args, kwargs, out, src)
    return out


def _on_inplace(func, args, kwargs):
    self = args[0] if args else None
    if isinstance(self, DTensor):
        out = _overlap.through_model(func, args, kwargs)  # an operand aliases self: torch's way
        if out is not NotImplemented:
            return out
        if getattr(self, "_gt_view", None) is not None:
            out = _fallback.write_through(func, args, kwargs, self)
            if out is not NotImplemented:
                return out
        if is_pointwise_inplace(func):
            return _dtensor(func, args, kwargs, inplace=True)
    return _fallback.run_inplace(func, args, kwargs, "in-place op outside the pointwise table")


def _on_global(func, args, kwargs):
    check_supported(func, args)
    if is_identity_dropout(func, args, kwargs):  # draws nothing: each rank's shard as it is
        return _dtensor(func, args, kwargs)
    if kwargs.get("inplace") is True:  # F.dropout(x, inplace=True): a mutation of x
        return _fallback.run_inplace(func, args, kwargs, "random op in place")
    if draws(func):  # one process's numbers, where one process's layout puts them
        return _fallback.run_global(func, args, kwargs, "random op", strided=True)
    return _fallback.run_global(func, args, kwargs, "data-dependent shape or random op")


def _on_irregular(func, args, kwargs):
    if any(isinstance(a, DTensor) and is_irregular(a) for a in args):
        return _fallback.run_global(func, args, kwargs, "DTensor's rule needs even shards")
    return _dtensor(func, args, kwargs)


def _on_guarded(func, args, kwargs):
    why = guard(func, args, kwargs)
    if why is not None:
        return _fallback.run_global(func, args, kwargs, why)
    return _dtensor(func, args, kwargs)


def _on_batch_only(func, args, kwargs):
    if any(isinstance(a, DTensor) and not batch_sharded_evenly(a) for a in args):
        return _fallback.run_global(func, args, kwargs, "DTensor's rule needs batch shards")
    return _dtensor(func, args, kwargs)


def _on_attention(func, args, kwargs):
    """``ATTENTION``: each rank's own rows (or heads) through DTensor's strategies where the
    layout allows it exactly (``_attention.why_not_local``), global values otherwise."""
    why = _attention.why_not_local(args, kwargs, _world_size())
    if why is not None:
        return _fallback.run_global(func, args, kwargs, why)
    return _dtensor(func, args, kwargs)


def _on_reduction(func, args, kwargs):
    """``EMPTY_SENSITIVE`` and ``TIES``: global values over an empty shard, and for a maximum
    whose gradient torch shares among tied values."""
    if any(isinstance(a, DTensor) and has_empty_shard(a) for a in args):
        return _fallback.run_global(func, args, kwargs, "reduction over an empty shard")
    if (
        route(func) == TIES
        and torch.is_grad_enabled()
        and any(isinstance(a, DTensor) and a.requires_grad for a in args)
        and ties_matter(func, args, kwargs)
    ):
        return _fallback.run_global(func, args, kwargs, "gradient shared among tied values")
    out = _dtensor(func, args, kwargs)
    if op_name(func) in _NAN_REDUCTIONS:
        return _keep_nan(func, args, kwargs, out)
    return out


# Maxima and minima of a whole tensor or over dims (``max()``, ``amax``, ``aminmax``...):
# DTensor combines the ranks' results with a max/min all-reduce, which drops NaN where torch
# propagates it. ``max``/``min`` with a dim return indices and are exact already.
_NAN_REDUCTIONS = frozenset({"max", "min", "amax", "amin", "aminmax"})


def _keep_nan(func, args, kwargs, out):
    """``out`` with NaN wherever what it reduces holds a NaN, as torch gives: one more
    reduction of ``isnan`` over the same dims (a collective only where a sharded dim is
    reduced), decided from dtype, dims and placements alike on every rank."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor) or not x.dtype.is_floating_point:
        return out
    if not any(isinstance(p, Shard) for p in x._spec.placements):
        return out  # each rank's kernel sees the whole tensor
    name = op_name(func)
    if name in ("max", "min") and not isinstance(out, torch.Tensor):
        return out  # (values, indices), or with dim: DTensor's rule keeps NaN
    if name in ("max", "min") and len(args) > 1:
        return out  # the elementwise max(x, y): no reduction
    dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else None))
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if isinstance(dim, int):
        dim = (dim,)
    nan = torch.isnan(x)
    nan = nan.any() if not dim else nan.any(dim=tuple(dim), keepdim=keepdim)
    fill = torch.full((), float("nan"), dtype=x.dtype)
    if name == "aminmax":
        return torch.return_types.aminmax(
            (torch.where(nan, fill, out[0]), torch.where(nan, fill, out[1]))
        )
    return torch.where(nan, fill, out)


HANDLERS = {
    DTENSOR: _dtensor,
    VIEW: _on_view,
    INPLACE: _on_inplace,
    ASSIGN: assign,
    GLOBAL: _on_global,
    EMPTY_SENSITIVE: _on_reduction,
    TIES: _on_reduction,
    GUARDED: _on_guarded,
    IRREGULAR: _on_irregular,
    BATCH_ONLY: _on_batch_only,
    AUTOGRAD: _on_autograd,
    ATTENTION: _on_attention,
}


def run(func, args, kwargs, r: int):
    """Run ``func`` the way its route ``r`` (``route``) says: ``HANDLERS[r]``. An ``out=``
    on a sharded operand is a mutation of it, whatever the op: the in-place fallback."""
    if r != AUTOGRAD and kwargs.get("out") is not None:
        out = _overlap.through_model(func, args, kwargs)  # an input aliases out=: torch's way
        if out is not NotImplemented:
            return out
        return _fallback.run_inplace(func, args, kwargs, "out= on a sharded operand")
    return HANDLERS[r](func, args, kwargs)
