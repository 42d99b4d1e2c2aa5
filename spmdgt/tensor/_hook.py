"""The one place spmdgt reaches into DTensor's machinery: a wrapper around its private
sharding-propagation entry (``OpDispatcher._propagate_op_sharding_dispatch_slow_path``, called
from DTensor's C++ dispatcher on a cache miss).

It (1) runs, on the DTensors, the decomposition of an op whose strategy DTensor derives
from that decomposition when the decomposition reads a size (the losses' ``mean``, the
statistics): DTensor traces it at the global shape but runs the op on local shards, so a
``2 / numel`` became ``2 / local numel``; this, and the ``_partials`` rewrites, on every DTensor
op of the process (the trainer's raw DTensors got those wrong numbers too). Inside spmdgt's
calls it also (2) runs an exact rewrite of an op
whose registered rule is wrong for some arguments (``nll_loss``'s weighted mean) or gathers
where an all-reduce would do (``mean`` over unevenly sharded dims); (3) turns
"no rule for this layout" into ``NoRule``, on which the op takes the exact fallback; (4) slices
a replicated attention mask to match batch- or head-sharded inputs for the CPU attention
kernels, which take the mask as a keyword argument DTensor never redistributes
(``_attention.place_mask``); (5) runs an op that draws random numbers on global values, so a
composite draws one process's numbers (``_random``). Which ops (1), (2) and (4) apply to, and
the checks behind (3), are the ops' records (``_registry.plan``), registered here, in
``_checks``, in ``_partials`` (the rewrites for partial values, which act on every DTensor op
of the process, spmdgt's or not) and in ``_attention``.
``install()`` also registers the attention strategies DTensor lacks (``_attention.install``)
and bounds DTensor's decomposition-based strategy search inside spmdgt's calls
(``MAX_DECOMP_CANDIDATES``); ``uninstall()`` undoes all of it. ``check_torch()`` runs at
import and names torch's version if the private entry moved.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from spmdgt.tensor import _checks, _fallback, _partials
from spmdgt.tensor._fallback import NoRule
from spmdgt.tensor._registry import plan, register, register_aten

__all__ = [
    "NoRule",
    "check_torch",
    "counts",
    "install",
    "installed",
    "running_backward",
    "uninstall",
]


# aten op name -> times spmdgt ran its exact rewrite or its decomposition on DTensors in
# place of DTensor's rule, on this rank (read by ``_paths``: the ``rewrite`` path)
counts: dict[str, int] = {}


# Ops whose decomposition reads a size of a possibly sharded input (a mean's divisor, the
# ``2 / numel`` of a squared error's gradient, a variance's ``N - 1``): the losses with a
# ``mean`` reduction and the statistics. Where DTensor has no strategy of its own for such an
# op, it derives one by tracing the decomposition on meta tensors at the *global* shape, then
# runs the op itself on each rank's *local* shard, so the local kernel divides by the shard's
# size: gradients off by the world size, weighted means normalised per rank. Running the
# decomposition itself on the DTensors computes every size globally, so spmdgt does that
# (``_registry.plan``). Each is checked by the training-pattern sweep or the OpInfo sweep. Not
# every op with a decomposition belongs here: running it on the DTensors would be exact in
# principle, but its outputs need not have the strides of the op's own kernel (attention's),
# which later views rely on, and one decomposition (``multilabel_margin_loss_forward``)
# computed other values on DTensors than its kernel does on the shards, which DTensor's own
# derived strategy gets right.
register(
    (
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
    ),
    decompose=True,
)


def _nll_mean(op_call, args, kwargs):
    """``nll_loss`` with ``reduction="mean"`` as one process computes it: the sum of the
    weighted losses over the global sum of the weights. DTensor's rule averages each rank's
    own weighted mean, which differs as soon as class weights or ignored targets make the
    ranks' weight sums unequal."""
    self, target, weight, _, ignore_index = args
    total, total_weight = op_call(self, target, weight, 2, ignore_index)  # 2: sum
    return total / total_weight, total_weight


# An op whose DTensor rule is wrong on sharded inputs for some arguments, or gathers where a
# cheaper exact way exists: (does this call need the rewrite?, the exact rewrite). Each
# rewrite runs DTensor ops whose rules hold.
register_aten(
    (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default),
    "rewrite",
    (lambda args: args[3] == 1, _nll_mean),  # reduction 1: mean
)


_MEAN_AS_SUM = (torch.float32, torch.float64)


def _mean_dims(args) -> list[int]:
    """The dims ``aten.mean`` (``.default`` or ``.dim``) reduces, counted from 0."""
    x = args[0]
    dims = args[1] if len(args) > 1 else None
    if dims is None or len(dims) == 0:
        return list(range(x.dim()))
    return [d % max(x.dim(), 1) for d in dims]


def _uneven_mean(args) -> bool:
    """Does a float32/float64 mean reduce a dim its input is sharded on unevenly? DTensor's
    rule then replicates the input (an all-gather: the average of the ranks' averages is not
    the mean there); a sum over the same dims, divided by their global size, is one
    all-reduce. Other dtypes keep DTensor's rule (bfloat16/float16: ``_checks``' fallback;
    integers: torch's error)."""
    x = args[0]
    if not isinstance(x, DTensor) or x.dtype not in _MEAN_AS_SUM:
        return False
    from spmdgt.tensor._shards import shard_shapes

    spec = x._spec
    dims = _mean_dims(args)
    sharded = {p.dim for p in spec.placements if p.is_shard()} & set(dims)
    if not sharded:
        return False
    shapes = shard_shapes(spec)
    return shapes is None or any(len({s[d] for s in shapes}) > 1 for d in sharded)


def _mean_as_sum(op_call, args, kwargs):
    """``mean`` over unevenly sharded dims as one process computes it, without gathering: the
    sum over those dims (a partial sum per rank, reduced when read) divided by their global
    number of elements."""
    x, dtype = args[0], kwargs.get("dtype")
    n = 1
    for d in _mean_dims(args):
        n *= x.shape[d]
    if len(args) > 1 and args[1] is not None and len(args[1]) > 0:
        # the dims as given, not normalised: DTensor's sharding cache keys on them, and on a
        # rank outside a sub-mesh a cached key that differs only in ``dtype=`` gives the
        # first call's dtype (a reduction with and without ``dtype=``: a defect of its own)
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        total = torch.ops.aten.sum.dim_IntList(x, args[1], keepdim, dtype=dtype)
    else:
        total = torch.ops.aten.sum.default(x, dtype=dtype)
        if len(args) > 2 and args[2]:  # mean(x, [], keepdim=True): every dim kept as 1
            total = total.reshape([1] * x.dim())
    return torch.ops.aten.div.Scalar(total, n)


register_aten(
    (torch.ops.aten.mean.default, torch.ops.aten.mean.dim), "rewrite", (_uneven_mean, _mean_as_sum)
)


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


def _scalar(op_call, args, kwargs):
    """The global number a 0-d DTensor holds, on every rank: DTensor's own read gives a rank
    outside the tensor's sub-mesh None ("Cannot cast None to number", raised there while
    the mesh's ranks went on: a hang)."""
    from spmdgt.tensor._moves import global_value

    return global_value(args[0]).item()


# A 0-d DTensor read as a Python number: ``item()`` on a plain DTensor, and torch's argument
# parser turning a tensor into a ``Scalar`` argument (``p.add_(d, alpha=t)``, LBFGS's step).
register_aten(
    (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default),
    "intercept",
    _scalar,
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
      not replicated, runs that decomposition on the DTensors (``_registry.plan``; outside
      spmdgt's calls too):
      the slow path may return the op's result instead of a sharding, as DTensor's own
      handling of composite ops there does. Where a step of the decomposition has no rule
      (``prims.where`` in ``log_sigmoid_backward``), the op runs on global values (the exact
      fallback);
    - an op with a rewrite (its record's) runs it where its arguments need it; an op with
      an intercept (a scalar read, attention's mask) runs that first; an op's check raises
      before propagation, and ``_checks``' after it, where DTensor's rule would be wrong;
    - a failure to find a rule raises ``NoRule``.

    Outside them too, such a decomposition runs, and an op with a ``partial`` rewrite
    (``_partials``: where DTensor's rule keeps a ``Partial`` through an op not linear in it)
    runs it: the trainer's FSDP/TP tensors are raw DTensors, and a wrong number there is as
    wrong.

    "Inside spmdgt's calls" is read off DTensor's implicit-replication flag, which spmdgt sets
    for exactly the length of its calls (it is off by default, so DTensor used directly, the
    trainer's FSDP/TP tensors, keeps DTensor's own behaviour but for the decompositions and
    the ``partial`` rewrites): one flag, no second state.
    ``uninstall()`` puts torch's entry back."""
    if _original:
        return
    from spmdgt.tensor import _attention, _random
    from spmdgt.tensor._fallback import run_global

    dispatcher = DTensor._op_dispatcher
    original = getattr(dispatcher, _ENTRY)

    def propagate(op_call, args, kwargs, op_info, *rest, **kw):
        ours = torch._C._get_dtensor_allow_implicit_replication()
        if _random.draws(op_call, args, kwargs):
            if ours and not _fallback.tracing(args):  # one process's numbers (see _random)
                return _random.run(op_call, args, kwargs)
            # outside spmdgt's calls or while dynamo traces, DTensor caches its sharding,
            # where spmdgt's next call would find it and draw per shard (see _random)
            _random.note_outside()
        p = plan(op_call)  # the op's record: see _registry
        partial = p.partial  # every DTensor op's, ours or not: a Partial kept wrongly
        if partial is not None and partial[0](args) and _sharded(op_info.schema.args_spec):
            out = partial[1](op_call, args, kwargs)  # NotImplemented: DTensor's rule holds
            if out is not NotImplemented:
                counts[op_call.__name__] = counts.get(op_call.__name__, 0) + 1  # _paths
                return out
        if ours and p.intercept is not None:  # a mask placed (_attention), a scalar read
            out = p.intercept(op_call, args, kwargs)
            if out is not None:
                return out
        # every DTensor op's too: DTensor's strategy from this decomposition is wrong on
        # uneven shards (it reads a size), a raw DTensor's mse_loss as spmdgt's
        if p.decomposition is not None and _sharded(op_info.schema.args_spec):
            counts[op_call.__name__] = counts.get(op_call.__name__, 0) + 1  # _paths
            try:
                return p.decomposition(*args, **kwargs)
            except NoRule as e:
                return run_global(op_call, args, kwargs, f"{op_call}'s decomposition: {e}")
        if ours:
            rewrite = p.rewrite
            if rewrite is not None and rewrite[0](args) and _sharded(op_info.schema.args_spec):
                out = rewrite[1](op_call, args, kwargs)  # NotImplemented: DTensor's rule holds
                if out is not NotImplemented:
                    counts[op_call.__name__] = counts.get(op_call.__name__, 0) + 1  # _paths
                    return out
        try:
            if ours and p.check is not None:
                p.check[0](op_call, args, op_info.schema.args_spec, p.check[1])
            result = original(op_call, args, kwargs, op_info, *rest, **kw)
            if ours:
                _checks.check_nesting(op_call, op_info.schema.args_spec, result)
                _checks.check_mask_partial(op_call, result)
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
    _key_dtype(dispatcher.sharding_propagator.op_to_schema_info)
    _attention.install()
    _partials.install()
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
        _partials.uninstall()
        search = getattr(DTensor._op_dispatcher.sharding_propagator, "decomp_strategy", None)
        if search is not None:  # the class's method shows through again
            search.__dict__.pop("_get_candidate_placements", None)
        DTensor._op_dispatcher.sharding_propagator.op_to_schema_info.update(_unkeyed)
        _unkeyed.clear()


_unkeyed: dict = {}  # torch's schema infos _key_dtype replaced, for uninstall()


def _key_dtype(infos: dict) -> None:
    """Make a keyword-only ``dtype`` part of DTensor's sharding cache key where torch leaves
    it out (``sum``/``mean``/``prod``/``cumsum``/``nansum``/``linalg_vector_norm``...): the
    key took only the positional arguments, so ``x.sum(0, dtype=torch.float64)`` after
    ``x.sum(0)`` got the cached float32 output spec. A rank holding a shard kept its float64
    result; a rank outside a sub-mesh made its empty result from the spec (float32), and the
    next collective mixed dtypes (gloo aborted)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    for op, info in list(infos.items()):
        keyed = list((info.static_kwargkey or []) if info is not None else [])
        takes = any(a.kwarg_only and a.name == "dtype" for a in op._schema.arguments)
        if info is None or not takes or "dtype" in keyed:
            continue
        _unkeyed[op] = info
        infos[op] = RuntimeSchemaInfo(info.static_argnum, [*keyed, "dtype"], info.needs_pytree)


check_torch()
