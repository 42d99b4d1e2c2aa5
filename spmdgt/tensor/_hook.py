"""The one place spmdgt reaches into DTensor's machinery: a wrapper around its private
sharding-propagation entry (``OpDispatcher._propagate_op_sharding_dispatch_slow_path``, called
from DTensor's C++ dispatcher on a cache miss).

Inside spmdgt's calls it (1) runs, on the DTensors, the decomposition of an op whose
strategy DTensor derives from that decomposition when the decomposition reads a size (the
losses' ``mean``, the statistics): DTensor traces it at the global shape but runs the op on
local shards, so a ``2 / numel`` became ``2 / local numel``; (2) runs an exact rewrite of an op
whose registered rule is wrong for some arguments (``nll_loss``'s weighted mean); (3) turns
"no rule for this layout" into ``NoRule``, on which the op takes the exact fallback; (4) slices
a replicated attention mask to match batch- or head-sharded inputs for the CPU attention
kernels, which take the mask as a keyword argument DTensor never redistributes
(``_attention.place_mask``); (5) runs an op that draws random numbers on global values, so a
composite draws one process's numbers (``_random``). ``install()`` also registers the
attention strategies DTensor lacks (``_attention.install``) and bounds DTensor's
decomposition-based strategy search inside spmdgt's calls (``MAX_DECOMP_CANDIDATES``);
``uninstall()`` undoes all of it. ``check_torch()`` runs at import and names torch's version if
the private entry moved.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from spmdgt.tensor._shards import nested_uneven

__all__ = [
    "NoRule",
    "check_torch",
    "counts",
    "install",
    "installed",
    "intervenes",
    "running_backward",
    "uninstall",
]


class NoRule(RuntimeError):
    """DTensor's sharding propagation found no rule for an op on this layout.

    Raised before any data moves, from global metadata alone, so every rank raises it at the
    same op; spmdgt then runs the op exactly on global values instead."""

    def __init__(self, op, cause: BaseException) -> None:
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"{op}: no sharding rule for this layout ({first})")
        self.op = op

    def reason(self) -> str:
        """Why the op took the exact fallback, for the fallback's counters and warning."""
        return f"no DTensor rule for {self.op} on this layout"


# aten op name -> times spmdgt ran its exact rewrite or its decomposition on DTensors in
# place of DTensor's rule, on this rank (read by ``_paths``: the ``rewrite`` path)
counts: dict[str, int] = {}

# op -> its decomposition, where DTensor has no strategy of its own for it (None otherwise)
_decomps: dict[object, object] = {}


# Ops whose decomposition reads a size of a possibly sharded input (a mean's divisor, the
# ``2 / numel`` of a squared error's gradient, a variance's ``N - 1``): the losses with a
# ``mean`` reduction and the statistics. Each is checked by the training-pattern sweep or the
# OpInfo sweep. Not every op with a decomposition belongs here: running it on the DTensors
# would be exact in principle, but its outputs need not have the strides of the op's own
# kernel (attention's), which later views rely on, and one decomposition
# (``multilabel_margin_loss_forward``) computed other values on DTensors than its kernel
# does on the shards, which DTensor's own derived strategy gets right.
_SIZE_READING = frozenset(
    {
        "mse_loss",
        "mse_loss_backward",
        "smooth_l1_loss",
        "smooth_l1_loss_backward",
        "huber_loss",
        "huber_loss_backward",
        "soft_margin_loss",
        "soft_margin_loss_backward",
        "binary_cross_entropy",
        "binary_cross_entropy_backward",
        "binary_cross_entropy_with_logits",
        "hinge_embedding_loss",
        "margin_ranking_loss",
        "multi_margin_loss",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "batch_norm_backward",
        "native_group_norm_backward",
        "_batch_norm_no_update",
        "cudnn_batch_norm",
        "cudnn_batch_norm_backward",
        "miopen_batch_norm_backward",
    }
)


def _reads_sizes(op_call) -> bool:
    """Does ``op_call``'s decomposition read a size (see ``_SIZE_READING``)?"""
    return op_call._schema.name.split("::")[-1] in _SIZE_READING


def _registered(op_call) -> bool:
    """Does DTensor have a sharding strategy or rule registered for ``op_call``?"""
    prop = DTensor._op_dispatcher.sharding_propagator
    return (
        op_call in prop.op_strategy_funcs
        or op_call in prop.op_single_dim_strategy_funcs
        or op_call in prop.op_to_rules
    )


def _own_decomposition(op_call):
    """The decomposition DTensor would derive ``op_call``'s sharding from, when DTensor has no
    strategy registered for it; None when it has one.

    DTensor derives such an op's strategy by tracing the decomposition on meta tensors at the
    *global* shape, then runs the op itself on each rank's *local* shard. Where the
    decomposition reads a size (``mse_loss_backward``'s ``2 / numel``, a mean's divisor, a
    variance's ``N - 1``), the local kernel divides by the shard's size: gradients off by the
    world size, weighted means normalised per rank. Running the decomposition itself on the
    DTensors computes every size globally, so spmdgt does that."""
    r = _decomps.get(op_call, False)
    if r is False:
        from torch._decomp import decomposition_table

        r = None
        if not _registered(op_call) and _reads_sizes(op_call):
            r = decomposition_table.get(op_call)
        _decomps[op_call] = r
    return r


def _nll_mean(op_call, args, kwargs):
    """``nll_loss`` with ``reduction="mean"`` as one process computes it: the sum of the
    weighted losses over the global sum of the weights. DTensor's rule averages each rank's
    own weighted mean, which differs as soon as class weights or ignored targets make the
    ranks' weight sums unequal."""
    self, target, weight, _, ignore_index = args
    total, total_weight = op_call(self, target, weight, 2, ignore_index)  # 2: sum
    return total / total_weight, total_weight


# Ops whose DTensor rule is wrong on sharded inputs for some arguments: op -> (does this call
# need the rewrite?, the exact rewrite). Each rewrite runs DTensor ops whose rules hold.
_REWRITES = {
    torch.ops.aten.nll_loss_forward.default: (lambda args: args[3] == 1, _nll_mean),
    torch.ops.aten.nll_loss2d_forward.default: (lambda args: args[3] == 1, _nll_mean),
}


def _sharded(spec_args) -> bool:
    """Does any DTensor argument hold other than a full replica on each rank?"""
    for spec in spec_args:
        for p in getattr(spec, "placements", ()):
            if not p.is_replicate():
                return True
    return False


# The private entry point wrapped, and the parameters it must take (torch 2.13). Checked when
# this module is imported: if torch moved it, spmdgt says so by name and version instead of
# breaking somewhere else.
_ENTRY = "_propagate_op_sharding_dispatch_slow_path"
_PARAMS = ("op_call", "args", "kwargs", "op_info", "try_cache")
_original: list = []  # the entry point as torch had it, while ours is in


def check_torch() -> None:
    """Raise ``ImportError`` naming the entry point and torch's version if DTensor's private
    sharding-propagation entry is not where, or not what, spmdgt wraps."""
    import inspect

    fn = getattr(type(DTensor._op_dispatcher), _ENTRY, None)
    params = tuple(inspect.signature(fn).parameters)[1:] if fn is not None else ()
    if params != _PARAMS:
        found = f"({', '.join(params)})" if fn is not None else "no such method"
        raise ImportError(
            f"spmdgt wraps DTensor's private OpDispatcher.{_ENTRY}({', '.join(_PARAMS)}) to run "
            "ops its "
            f"sharding rules get wrong exactly; torch {torch.__version__} has {found}. Use a "
            "torch release spmdgt supports (setup.cfg's install_requires)"
        )


# DTensor derives a strategy for an op that has none by tracing the op's decomposition once
# for every combination of candidate placements of its inputs (each input: replicated, or
# sharded on any of its dims): 5 ** n traces for n 4-dim inputs, uncached while torch.compile
# traces. CPU attention's backward (7 inputs: 78,125 traces) once sat there for minutes, "a
# hang". Inside spmdgt's calls, and while torch.compile traces, a search larger than this tries
# two candidates only: the inputs' own placements and full replication. DTensor still finds
# the op's rule for the layout it has where one holds, and replicates (exact) otherwise.
MAX_DECOMP_CANDIDATES = 256


def _candidate_bound(op_schema) -> int:
    """An upper bound of the number of candidates DTensor's decomposition search would try
    (``DecompShardingStrategy._get_candidate_placements``), from the input specs alone."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves

    specs = [
        s
        for s in tree_leaves(list(op_schema.args_schema) + list(op_schema.kwargs_schema.values()))
        if isinstance(s, DTensorSpec)
    ]
    kinds = {Replicate()}
    for s in specs:
        kinds.update(s.placements)
    shards = any(isinstance(p, Shard) for p in kinds)
    n = 1
    for s in specs:
        n *= len(kinds) + (s.ndim if shards else 0)
    return n


def _own_and_replicated(op_schema) -> list[tuple]:
    """The two kinds of candidates a bounded search tries: each mesh dim's placements of the
    inputs as they are, and every input replicated (None for a non-tensor argument, as
    DTensor's own candidates have it)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves

    flat = tree_leaves(list(op_schema.args_schema) + list(op_schema.kwargs_schema.values()))
    ndim = max((s.mesh.ndim for s in flat if isinstance(s, DTensorSpec)), default=1)
    out = [tuple(Replicate() if isinstance(s, DTensorSpec) else None for s in flat)]
    for i in range(ndim):
        own = tuple(s.placements[i] if isinstance(s, DTensorSpec) else None for s in flat)
        if own not in out:
            out.append(own)
    return out


def _bound_decomp_search(search) -> None:
    """Wrap ``search._get_candidate_placements`` (DTensor's decomposition-based strategy
    search) so a search over more than ``MAX_DECOMP_CANDIDATES`` candidates, inside spmdgt's
    calls, tries the inputs' own placements and full replication only."""
    original = search._get_candidate_placements

    def candidates(op_schema):
        if torch._C._get_dtensor_allow_implicit_replication():
            n = _candidate_bound(op_schema)
            if n > MAX_DECOMP_CANDIDATES:
                from spmdgt._core import debuglog as _debuglog

                if _debuglog.SHARDING:
                    _debuglog.debug(
                        "sharding",
                        f"{op_schema.op}: no sharding strategy; {n} candidate layouts for "
                        "DTensor's decomposition search, trying the inputs' own and replicated",
                    )
                return _own_and_replicated(op_schema)
        return original(op_schema)

    search._get_candidate_placements = candidates


# DTensor's reshaping view rules (``_view_ops``): they check a flattened or split dim's
# evenness against the first mesh dim that shards it only (see ``_shards.nested_uneven``).
_RESHAPES = frozenset(
    {
        torch.ops.aten.view.default,
        torch.ops.aten.view_copy.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default,
    }
)


def _check_reshape(op_call, specs) -> None:
    """Raise (so the op takes the exact fallback) where a reshape's input has one tensor dim
    sharded unevenly over several mesh dims, which DTensor's view rule would view at sizes
    the ranks' pieces do not have: an error on some ranks, or wrong values."""
    for spec in specs:
        if nested_uneven(spec):
            raise RuntimeError(
                f"{op_call} on a dim sharded unevenly over several mesh dims "
                f"({tuple(spec.placements)}, shape {tuple(spec.shape)})"
            )


def _check_nesting(op_call, specs, result) -> None:
    """Raise (so the op takes the exact fallback) where the strategy DTensor derived from an
    op's decomposition (no rule registered for the op) lays an input or an output out with one
    tensor dim sharded unevenly over several mesh dims while no input came in so: a layout
    DTensor invented, on a mesh of 2+ dims only, through the view rules that misjudge it
    (``_check_reshape``): ``pixel_unshuffle`` on ``(Replicate(), Shard(1))`` had its 6 rows
    redistributed as ``(Shard(2), Shard(2))``, pieces 2/1/2/1, and each rank's kernel refused
    its own height. Registered rules (pointwise ``where``, say) redistribute such layouts
    exactly, and inputs that already come in nested keep DTensor's path."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves

    mine = [s for s in specs if isinstance(s, DTensorSpec)]
    if not mine or all(s.mesh.ndim == 1 for s in mine) or _registered(op_call):
        return
    if any(nested_uneven(s) for s in mine):
        return
    chosen = list(tree_leaves(getattr(result, "output_spec", None)))
    schema = getattr(result, "redistribute_schema", None)
    if schema is not None:
        chosen += list(schema.args_spec)
    for spec in chosen:
        if isinstance(spec, DTensorSpec) and nested_uneven(spec):
            raise RuntimeError(
                f"{op_call}: DTensor's strategy shards a dim unevenly over several mesh dims "
                f"({tuple(spec.placements)}, shape {tuple(spec.shape)})"
            )


def _check_mask_partial(op_call, result) -> None:
    """Raise (so the op takes the exact fallback) where DTensor's strategy, on a mesh of 2+
    dims, uses a ``_MaskPartial`` (a gather or an embedding on a dim sharded over one mesh
    dim). Its ``MaskBuffer`` is one object shared by every use of the cached strategy, with a
    reference count: on 2x2, ``multi_margin_loss``'s gather on ``(Replicate(), Shard(1))``
    materialised it twice with different masks ("MaskBuffer has been materialized with
    conflicting data"), and a count left behind by one op made later, unrelated ops raise or
    not depending on what ran before. 1-D meshes keep DTensor's path (the sweep's rows there
    are equal)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import _MaskPartial
    from torch.utils._pytree import tree_leaves

    chosen = list(tree_leaves(getattr(result, "output_spec", None)))
    schema = getattr(result, "redistribute_schema", None)
    if schema is not None:
        chosen += list(schema.args_spec)
    for spec in chosen:
        if (
            isinstance(spec, DTensorSpec)
            and spec.mesh.ndim > 1
            and any(isinstance(p, _MaskPartial) for p in spec.placements)
        ):
            raise RuntimeError(
                f"{op_call}: DTensor's strategy uses a masked partial on a {spec.mesh.ndim}-D "
                "mesh (its shared mask buffer is not safe there)"
            )


def _tracing(args) -> bool:
    """Is torch.compile tracing this op (fake or meta tensors: no data, no collective)?"""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    for a in args:
        if isinstance(a, DTensor):
            local = a._local_tensor
            return local.is_meta or type(local) is not torch.Tensor
    return False


# Matrix products -> (first operand's index in the specs, its contracted dim, the second
# operand's contracted dim), dims counted from the end.
_MATMULS = {
    torch.ops.aten.mm.default: (0, -1, -2),
    torch.ops.aten.bmm.default: (0, -1, -2),
    torch.ops.aten.addmm.default: (1, -1, -2),
    torch.ops.aten.baddbmm.default: (1, -1, -2),
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Sums -> the index of their ``dim`` argument (None: over every dim).
_SUMS = {
    torch.ops.aten.sum.default: None,
    torch.ops.aten.sum.dim_IntList: 1,
    torch.ops.aten.mean.default: None,
    torch.ops.aten.mean.dim: 1,
    torch.ops.aten.linalg_vector_norm.default: 2,
}


def _check_low_precision_reduction(op_call, args, specs) -> None:
    """As ``_check_low_precision_sum``, for a bfloat16/float16 sum, mean or norm over a
    sharded dim: each rank rounds its partial result, torch rounds the whole once (Muon's
    ``norm()`` of its bfloat16 gradient)."""
    spec = specs[0] if specs else None
    if not hasattr(spec, "placements") or spec.tensor_meta is None:
        return
    if spec.tensor_meta.dtype not in _LOW_PRECISION:
        return
    at = _SUMS[op_call]
    dims = args[at] if at is not None and len(args) > at else None
    ndim = len(spec.shape)
    if dims is None or dims == []:
        dims = range(ndim)
    elif isinstance(dims, int):
        dims = [dims]
    reduced = {d % max(ndim, 1) for d in dims}
    if any(p.is_partial() or any(p.is_shard(d) for d in reduced) for p in spec.placements):
        raise RuntimeError(
            f"{op_call}: {spec.tensor_meta.dtype} reduction over a sharded dim (the ranks "
            "would combine partial results rounded to low precision)"
        )


def _check_low_precision_sum(op_call, specs) -> None:
    """Raise (so the op takes the exact fallback) for a bfloat16/float16 matrix product
    whose contracted dim is sharded: each rank's kernel rounds its partial sum to the low
    precision and the ranks then add rounded values, where torch's kernel accumulates in
    float32 and rounds once (Muon's Newton-Schulz iteration came out 4e-3 off)."""
    where = _MATMULS.get(op_call)
    if where is None:
        return
    first = where[0]
    pair = [s for s in specs[first : first + 2] if hasattr(s, "placements")]
    if len(pair) != 2 or pair[0].tensor_meta is None:
        return
    if pair[0].tensor_meta.dtype not in _LOW_PRECISION:
        return
    for spec, dim in zip(pair, where[1:]):
        dim += len(spec.shape)
        if any(p.is_shard(dim) or p.is_partial() for p in spec.placements):
            raise RuntimeError(
                f"{op_call}: {pair[0].tensor_meta.dtype} product over a sharded dim "
                "(the ranks would add partial sums rounded to low precision)"
            )


# A 0-d DTensor read as a Python number: ``item()`` on a plain DTensor, and torch's argument
# parser turning a tensor into a ``Scalar`` argument (``p.add_(d, alpha=t)``, LBFGS's step).
_SCALAR_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default})


def _scalar(t):
    """The global number a 0-d DTensor holds, on every rank: DTensor's own read gives a rank
    outside the tensor's sub-mesh None ("Cannot cast None to number", raised there while
    the mesh's ranks went on: a hang)."""
    from spmdgt.tensor._moves import global_value

    return global_value(t).item()


def intervenes(op_call) -> bool:
    """Might the hook run ``op_call`` otherwise than DTensor's rule says (a decomposition, a
    rewrite, a mask placed, a scalar read)? The dispatch fast path (``_fastpath``) never
    caches such an op."""
    from spmdgt.tensor import _attention

    return (
        op_call in _SCALAR_READS
        or op_call in _REWRITES
        or op_call in (_attention.CPU_FLASH, _attention.CPU_FLASH_BACKWARD)
        or _own_decomposition(op_call) is not None
    )


_backward = [0]  # > 0 while spmdgt runs the autograd engine (``backward``/``autograd.grad``)


class running_backward:
    """While the autograd engine runs under spmdgt (``_optable``'s ``AUTOGRAD`` route): a
    backward op without a rule for its layout takes the exact fallback in the hook."""

    def __enter__(self) -> None:
        _backward[0] += 1

    def __exit__(self, *exc: object) -> None:
        _backward[0] -= 1


def installed() -> bool:
    """Whether the hook is in DTensor's dispatcher."""
    return bool(_original)


def install() -> None:
    """Wrap DTensor's sharding-propagation entry (called from its C++ dispatcher on a cache
    miss) so that, inside spmdgt's calls:

    - an op whose strategy DTensor would derive from its decomposition, on an input that is
      not replicated, runs that decomposition on the DTensors (see ``_own_decomposition``):
      the slow path may return the op's result instead of a sharding, as DTensor's own
      handling of composite ops there does. Where a step of the decomposition has no rule
      (``prims.where`` in ``log_sigmoid_backward``), the op runs on global values (the exact
      fallback);
    - an op in ``_REWRITES`` runs its exact rewrite where its arguments need it;
    - a failure to find a rule raises ``NoRule``.

    "Inside spmdgt's calls" is read off DTensor's implicit-replication flag, which spmdgt sets
    for exactly the length of its calls (it is off by default, so DTensor used directly, the
    trainer's FSDP/TP tensors, keeps DTensor's own behaviour): one flag, no second state.
    ``uninstall()`` puts torch's entry back."""
    if _original:
        return
    from spmdgt.tensor import _attention, _random
    from spmdgt.tensor._fallback import run_global

    dispatcher = DTensor._op_dispatcher
    original = getattr(dispatcher, _ENTRY)
    masked = (_attention.CPU_FLASH, _attention.CPU_FLASH_BACKWARD)

    def propagate(op_call, args, kwargs, op_info, *rest, **kw):
        ours = torch._C._get_dtensor_allow_implicit_replication()
        if _random.draws(op_call, args, kwargs) and not _tracing(args):
            if ours:  # one process's numbers and generator states (see _random)
                return _random.run(op_call, args, kwargs)
            _random.note_outside()
        if ours:
            if op_call in masked:
                out = _attention.place_mask(op_call, args, kwargs)
                if out is not None:
                    return out
            if op_call in _SCALAR_READS:
                return _scalar(args[0])
            decomp = _own_decomposition(op_call)
            if decomp is not None and _sharded(op_info.schema.args_spec):
                counts[op_call.__name__] = counts.get(op_call.__name__, 0) + 1  # _paths
                try:
                    return decomp(*args, **kwargs)
                except NoRule as e:
                    return run_global(op_call, args, kwargs, f"{op_call}'s decomposition: {e}")
            rewrite = _REWRITES.get(op_call)
            if rewrite is not None and rewrite[0](args) and _sharded(op_info.schema.args_spec):
                counts[op_call.__name__] = counts.get(op_call.__name__, 0) + 1  # _paths
                return rewrite[1](op_call, args, kwargs)
        try:
            if ours and op_call in _MATMULS:
                _check_low_precision_sum(op_call, op_info.schema.args_spec)
            if ours and op_call in _SUMS:
                _check_low_precision_reduction(op_call, args, op_info.schema.args_spec)
            if ours and op_call in _RESHAPES:
                _check_reshape(op_call, op_info.schema.args_spec)
            result = original(op_call, args, kwargs, op_info, *rest, **kw)
            if ours:
                _check_nesting(op_call, op_info.schema.args_spec, result)
                _check_mask_partial(op_call, result)
            return result
        except NoRule:
            raise
        except Exception as e:
            if not ours:
                raise
            if _random.drew():
                # a composite drew already in this call: running it again from the start on
                # global values would draw twice; this op alone on global values instead
                return _random.run(op_call, args, kwargs, NoRule(op_call, e).reason())
            if _backward[0] and not op_call._schema.is_mutable:
                # a backward op on an intermediate DTensor (not a gt.Tensor: no
                # __torch_dispatch__ of ours to catch NoRule): the exact fallback here, at the
                # aten level, as __torch_dispatch__ does for saved gt.Tensors
                return run_global(op_call, args, kwargs, NoRule(op_call, e).reason())
            raise NoRule(op_call, e) from e

    setattr(dispatcher, _ENTRY, propagate)
    _original.append(original)
    _attention.install()
    search = getattr(dispatcher.sharding_propagator, "decomp_strategy", None)
    if search is not None:  # torch < 2.13 derives no strategy from decompositions
        _bound_decomp_search(search)


def uninstall() -> None:
    """Put DTensor's own sharding-propagation entry back."""
    if _original:
        from spmdgt.tensor import _attention

        # the instance attribute goes: the class's method shows through again
        delattr(DTensor._op_dispatcher, _ENTRY)
        _original.clear()
        _attention.uninstall()
        search = getattr(DTensor._op_dispatcher.sharding_propagator, "decomp_strategy", None)
        if search is not None:  # the class's method shows through again
            search.__dict__.pop("_get_candidate_placements", None)


check_torch()
