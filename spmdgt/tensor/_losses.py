"""The losses' guard: DTensor's path on uneven, empty and sub-mesh shards where a sweep proved
it exact, the exact gather fallback everywhere else.

The losses were ``IRREGULAR`` (any uneven, empty or sub-mesh shard: every input gathered to
every rank). Since ``_hook`` computes their sizes globally (the ``decompose`` records, the
``nll_loss`` mean rewrite), DTensor's path gives one process's values and gradients on those
layouts too: tests/core/test_losses_uneven_dist.py runs every loss below x its options
(class weights, ``ignore_index`` with targets hitting it, ``label_smoothing``, probability
targets, ``pos_weight``, ``log_target``, ``full``, ``swap``...) x reductions (``batchmean``
too) x layouts (Shard(0) over 7 rows, an empty shard, a sub-mesh, Shard(1) of the class dim,
a sharded input with plain targets), forward and backward, on 2 and 3 ranks, and with every
loss forced onto DTensor's path (``python -m tests.core.test_losses_uneven_dist``) all were
exact. ``cosine_embedding_loss`` with its feature dim sharded was not (wrong values, on even
shards too) until ``_partials._fill_partial`` made ``fill_`` of a partial value exact (its
``1 - cos`` is ``empty_like(cos).fill_(1).sub_(cos)`` in C++, and ``cos`` is partial there); it
kept the fallback until then.

The guard lets an irregular call through only inside what that sweep covered, read from
global metadata alone (so every rank decides alike): float32 tensors; every argument on the
input's 1-D mesh with the input's placement (Shard(0), Shard(1) or Replicate) or replicated
(plain tensors arrive lifted); class weights (``weight`` of the class losses,
``pos_weight``) replicated. Anything else
keeps the fallback: 2-D meshes, other dtypes (a low-precision partial sum rounds per rank),
sharded class weights, mixed layouts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmdgt.tensor._fallback import op_name
from spmdgt.tensor._guards import is_irregular
from spmdgt.tensor._registry import GUARDED, register

__all__ = ["LOSSES", "why_not_dtensor"]

LOSSES: tuple[str, ...] = (
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
)
# Keyword arguments that are per-class weights (one value a class, broadcast over the rows):
# the sweep passed them plain only. ``binary_cross_entropy``'s ``weight`` is per element
# (laid out like the input in the sweep), so it is not here.
_CLASS_WEIGHTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weight",),
    "nll_loss": ("weight",),
    "multi_margin_loss": ("weight",),
    "multilabel_soft_margin_loss": ("weight",),
    "binary_cross_entropy_with_logits": ("weight", "pos_weight"),
}
_PROVEN = (Shard(0), Shard(1), Replicate())


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a


def _replicated(t: DTensor) -> bool:
    return all(p.is_replicate() for p in t._spec.placements)


def _sharded(a) -> bool:
    return isinstance(a, DTensor) and not _replicated(a)


def why_not_dtensor(func, args, kwargs) -> str | None:
    """Why a loss call takes the exact fallback (None: DTensor's path). Even shards on the
    whole mesh keep DTensor's path, as before."""
    name = op_name(func)
    tensors = list(_tensors(args, kwargs))
    dts = [t for t in tensors if isinstance(t, DTensor)]
    if not dts:
        return None
    if not any(is_irregular(t) for t in dts):
        return None
    x = args[0] if args else None
    if not isinstance(x, DTensor):
        return "uneven shards with the input plain (not covered by the loss sweep)"
    spec = x._spec
    if spec.mesh.ndim != 1 or spec.placements[0] not in _PROVEN:
        return "uneven shards on a 2-D mesh (not covered by the loss sweep)"
    for t in dts:  # the input's layout, or replicated (a plain tensor, lifted)
        same = t._spec.placements == spec.placements or _replicated(t)
        if t._spec.mesh != spec.mesh or not same:
            return "uneven shards in mixed layouts (not covered by the loss sweep)"
    if any(t.dtype != torch.float32 for t in tensors if t.is_floating_point()):
        return "uneven shards of a dtype other than float32 (not covered by the loss sweep)"
    weights = _CLASS_WEIGHTS.get(name, ())
    # torch's functions pass these by keyword; positionally they follow input and target
    if any(_sharded(kwargs.get(k)) for k in weights) or (
        weights and any(_sharded(a) for a in args[2:])
    ):
        return "uneven shards with sharded class weights (not covered by the loss sweep)"
    return None


register(LOSSES, route=GUARDED, guard=why_not_dtensor)
