"""What an op's route reads per call, from the op and the inputs' global metadata alone (so
every rank answers alike): empty, uneven or batch-only layouts, the ``GUARDED`` ops' guards,
tied maxima, dropouts that draw nothing, NaN kept through a max/min all-reduce. Each per-op
predicate is registered on its ops' records (``_registry``) here, next to its code."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from spmdgt.tensor._fallback import op_name
from spmdgt.tensor._meshes import spans_world
from spmdgt.tensor._registry import GUARDED, TIES, record, register
from spmdgt.tensor._shards import shard_shapes

__all__ = [
    "batch_sharded_evenly",
    "check_supported",
    "guard",
    "has_empty_shard",
    "is_identity_dropout",
    "is_irregular",
    "keep_nan",
    "ties_matter",
]


def has_empty_shard(a) -> bool:
    """True when some rank holds none of DTensor ``a``: a shard left empty by the torch.chunk
    rule (on any mesh dim, nested shards of one tensor dim included), or a rank outside
    ``a``'s (sub-)mesh. Decided from global metadata alone, so every rank answers alike."""
    spec = a._spec
    if not spans_world(spec.mesh):
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


def batch_sharded_evenly(a) -> bool:
    """True when DTensor ``a`` is replicated or sharded evenly on dim 0 only, over the world,
    and over one mesh dim (DTensor's convolution rules raise on ``(Shard(0), Shard(0))``).

    A partial value is not: DTensor's convolution handler runs the kernel on each rank's part
    without the redistribution its own propagation asks for, and labels the result
    replicated (each rank a different wrong value; the parity sweep's ``partial`` audit)."""
    if is_irregular(a) or any(p.is_partial() for p in a._spec.placements):
        return False
    dims = [p.dim for p in a._spec.placements if isinstance(p, Shard)]
    # dim 0 over one mesh dim: DTensor's convolution rules refuse (Shard(0), Shard(0))
    return len(dims) <= 1 and all(d == 0 for d in dims)


def world_size() -> int:
    from spmdgt.runtime._state import get_runtime

    return get_runtime().world_size


def check_supported(func, args) -> None:
    """Raise, on every rank, for what cannot be exact: complex32 on a sub-mesh. torch lacks
    most complex32 kernels, and DTensor runs no kernel on ranks outside a sub-mesh, so such an
    error would reach the mesh's ranks only while the others wait in the next collective."""
    if op_name(func) != "chalf":
        return
    for a in args:
        if isinstance(a, DTensor) and not spans_world(a._spec.mesh):
            raise NotImplementedError(
                "chalf: complex32 values on a sub-mesh are not supported (torch lacks most "
                "complex32 kernels, and ranks outside the mesh would not see their errors); "
                "use .to(torch.complex64)"
            )


# -- GUARDED: DTensor's rule is wrong for some inputs, told apart by metadata ---------------


def guard(func, args, kwargs) -> str | None:
    """For a ``GUARDED`` op: why its input needs the exact fallback (None: DTensor's path is
    right): its record's guard. Reads dtypes, dims, shapes and placements only."""
    return record(op_name(func)).guard(func, args, kwargs)


def _guards(*names: str):
    def deco(fn):
        register(names, route=GUARDED, guard=fn)
        return fn

    return deco


def _input_and_dim(args, kwargs):
    a = args[0] if args else kwargs.get("input")
    if not isinstance(a, DTensor):
        return None, None, None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, int) and dim < 0:
        dim += max(a.dim(), 1)
    return a, dim, [p.dim for p in a._spec.placements if isinstance(p, Shard)]


@_guards("embedding")
def _embedding_weight(func, args, kwargs) -> str | None:
    """A weight with one dim sharded over several mesh dims: DTensor's masked-partial rule
    shares one mask among them, and the ranks disagree. With ``max_norm``, ids on a sub-mesh:
    the rows looked up are renormalised in place in a plain weight, which DTensor does on the
    mesh's ranks only (the others keep the old rows)."""
    w = kwargs.get("weight", args[1] if len(args) > 1 else None)
    if kwargs.get("max_norm", args[3] if len(args) > 3 else None) is not None and any(
        isinstance(a, DTensor) and not spans_world(a._spec.mesh) for a in (*args[:2], w)
    ):
        return "embedding with max_norm on a sub-mesh (the weight's rows renormalised in place)"
    if isinstance(w, DTensor):
        rows = [p.dim for p in w._spec.placements if isinstance(p, Shard)]
        if len(rows) != len(set(rows)):
            return (
                "embedding weight with one dim sharded over several mesh dims (DTensor's "
                "masked-partial rule keeps one mask for all of them)"
            )
    return None


# (functional form?, op) -> where running_mean, running_var and the training flag sit, the
# flag's name and its default: the functional forms take the statistics second, the torch
# ones after weight and bias (and take every argument)
_NORM_ARGS = {
    (True, "batch_norm"): (1, 2, 5, "training", False),
    (False, "batch_norm"): (3, 4, 5, "training", None),
    (True, "instance_norm"): (1, 2, 5, "use_input_stats", True),
    (False, "instance_norm"): (3, 4, 5, "use_input_stats", None),
}


@_guards("batch_norm", "instance_norm")
def _running_stats(func, args, kwargs) -> str | None:
    """Training with running statistics: the kernel updates them in place, outside its
    schema (``native_batch_norm`` marks no argument written). DTensor's rule for a
    feature-sharded input redistributes the plain statistics to shards and the update lands
    in those copies: the statistics never move (raw DTensor too). On global values the
    kernel writes them (sharded ones are written back: ``_fallback``)."""
    name = op_name(func)
    at_mean, at_var, at_flag, flag, default = _NORM_ARGS[
        func.__module__ == "torch.nn.functional", name
    ]
    training = kwargs.get(flag, args[at_flag] if len(args) > at_flag else default)
    mean = kwargs.get("running_mean", args[at_mean] if len(args) > at_mean else None)
    var = kwargs.get("running_var", args[at_var] if len(args) > at_var else None)
    if training and (mean is not None or var is not None):
        return f"{name} updating running statistics in place"
    return None


@_guards("prod")
def _complex_prod(func, args, kwargs) -> str | None:
    """Complex values over a sharded dim: no collective multiplies complex values."""
    a, dim, shards = _input_and_dim(args, kwargs)
    if a is None:
        return None
    dtype = kwargs.get("dtype") or a.dtype
    if dtype.is_complex and any(dim is None or d == dim for d in shards):
        return "complex product over a sharded dim (no collective multiplies complex values)"
    return None


@_guards("argmax", "argmin")
def _arg_extreme(func, args, kwargs) -> str | None:
    """A bool input (torch rejects it; DTensor goes through ``max``), an empty shard, or no
    dim where the shards are not in flat order (DTensor picks the first *rank* holding the
    extreme, not the first flat index, so ties differ)."""
    a, dim, shards = _input_and_dim(args, kwargs)
    if a is None:
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


# -- TIES: torch shares a maximum's gradient among tied values ------------------------------


def ties_matter(func, args, kwargs) -> bool:
    """For a ``TIES`` op: is it a maximum (always for max/min/amax/amin; for a norm, only the
    infinity norms)? Its record's ``ties``."""
    return record(op_name(func)).ties(func, args, kwargs)


def _always(func, args, kwargs) -> bool:
    return True


def _infinity_norm(func, args, kwargs) -> bool:
    p = kwargs.get("p", kwargs.get("ord", args[1] if len(args) > 1 else None))
    return isinstance(p, (int, float)) and abs(p) == float("inf")


# Tied maxima share the gradient evenly in torch; a shard sees only its own ties.
register(("max", "min", "amax", "amin"), route=TIES, ties=_always)
register(("norm", "linalg_norm", "linalg_vector_norm"), route=TIES, ties=_infinity_norm)


# -- dropouts that draw nothing ----------------------------------------------------------------

# Dropouts that draw nothing when ``p == 0`` or not training: torch returns the input itself
# (``aten::dropout``'s ``p == 0 || !train`` early return), so each rank's shard is exactly its
# part of the result. ``dropout_training``: the default of ``training``
# (``F.alpha_dropout``'s is False).
register(
    ("dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout"), dropout_training=True
)
register(("alpha_dropout", "feature_alpha_dropout"), dropout_training=False)


def is_identity_dropout(func, args, kwargs) -> bool:
    """A dropout that changes nothing and draws no number: ``p == 0``, or ``training`` False
    (``F.dropout(x, p, training, inplace)``, ``torch.dropout(x, p, train)`` and the feature
    and alpha variants), out of place. Reads the arguments only, alike on every rank."""
    rec = record(op_name(func))
    if rec is None or rec.dropout_training is None:
        return False
    if kwargs.get("inplace", args[3] if len(args) > 3 else False):
        return False  # F.dropout3d(x, inplace=True) views x in place (unsqueeze_): a mutation
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else None))
    if train is None:
        train = rec.dropout_training
    if isinstance(p, torch.Tensor) or isinstance(train, torch.Tensor):
        return False
    return p == 0 or not train


# -- NaN through a max/min all-reduce ----------------------------------------------------------

# Maxima and minima of a whole tensor or over dims (``max()``, ``amax``, ``aminmax``...):
# DTensor combines the ranks' results with a max/min all-reduce, which drops NaN where torch
# propagates it. ``max``/``min`` with a dim return indices and are exact already.
register(("max", "min", "amax", "amin", "aminmax"), keep_nan=True)


def keep_nan(func, args, kwargs, out):
    """``out`` with NaN wherever what it reduces holds a NaN, as torch gives, for an op whose
    record says ``keep_nan``: one more reduction of ``isnan`` over the same dims (a collective
    only where a sharded dim is reduced), decided from dtype, dims and placements alike on
    every rank."""
    name = op_name(func)
    rec = record(name)
    if rec is None or not rec.keep_nan:
        return out
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor) or not x.dtype.is_floating_point:
        return out
    if not any(isinstance(p, Shard) for p in x._spec.placements):
        return out  # each rank's kernel sees the whole tensor
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
