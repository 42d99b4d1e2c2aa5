"""Row-sharded matrix products: gather the second operand, keep the rows.

``rows @ rows`` (both operands ``Shard(0)`` on one 1-D mesh) is GT's auto-shard workload, and
the one layout where DTensor's choice costs more than it must: it moves the *first* operand
to ``Shard(1)`` (an all-to-all; gloo has none, so torch all-gathers it whole and cuts it up),
multiplies the half-width blocks and leaves a ``Partial`` sum that the next read all-reduces.
Gathering the *second* operand instead (``Shard(0) @ Replicate``) moves ``k*n`` elements
where that moves ``m*k`` plus the reduction of ``m*n``, and leaves the product in rows
(``Shard(0)``), which a read only gathers. Each row is then one full-length dot product, as
one process computes it, not a sum of per-rank partial products.

The choice reads global shapes and the mesh size only, so every rank makes it alike; where
the second operand is the bigger move (a few rows against a wide matrix) DTensor's own
choice stands. Two ways to run it:

- ``direct``: nothing records autograd, no mode or compile watches: the second operand's
  row shards are all-gathered (c10d's own all-gather on the mesh's group, padded as DTensor
  pads uneven shards), the product runs on the local tensors and is wrapped with its spec
  (DTensor's constructor), as the dispatch fast path replays an op (``_fastpath``): one
  collective and a local ``mm``, no sharding propagation.
- ``gather_second``: otherwise, the second operand is ``redistribute``d (differentiable: the
  backward reduces its gradient back to rows) and DTensor runs ``Shard(0) @ Replicate``.

Measured in ``docs/benchmarks.md`` ("rows @ rows").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree, _rank_errors
from spmdgt.tensor._registry import register

__all__ = ["counts", "direct", "gather_rows", "gather_second"]

# The ops a 2-D matrix product reaches ``__torch_function__`` through (``torch.matmul``,
# ``torch.mm``, ``Tensor.matmul``, ``Tensor.mm``, ``Tensor.__matmul__``), by record name: their
# records say ``rows_at_rows``, which ``gt.Tensor`` reads per call
# (``_registry.rows_at_rows_funcs``) to try ``direct`` and ``gather_second``.
register(("matmul", "mm", "__matmul__"), rows_at_rows=True)
_REPLICATE = (Replicate(),)


counts = {"direct": 0, "gathered": 0}  # products run each way (``get_worker_stats``)


def _rows_at_rows(a, b) -> bool:
    """Both 2-D, row-sharded on one 1-D mesh, and gathering the second operand moves no more
    than DTensor's route (global shapes and the mesh size only: alike on every rank)."""
    sa, sb = a._spec, b._spec
    if sa.mesh is not sb.mesh or sa.mesh.ndim != 1 or len(sa.shape) != 2 or len(sb.shape) != 2:
        return False
    if not (sa.placements[0].is_shard(0) and sb.placements[0].is_shard(0)):
        return False
    m, k = sa.shape
    n = sb.shape[1]
    # elements each route moves per rank, up to the common (w - 1) / w: the second operand
    # gathered, against the first one re-split by columns and the product's reduction
    return k * n <= m * k // sa.mesh.size() + m * n


def gather_second(args: tuple) -> tuple:
    """``args`` with the second operand replicated when the product is ``rows @ rows`` worth
    gathering (``_rows_at_rows``); ``args`` unchanged otherwise."""
    if len(args) != 2:
        return args
    a, b = args
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or not _rows_at_rows(a, b):
        return args
    counts["gathered"] += 1
    return a, b.redistribute(b._spec.mesh, _REPLICATE)


# (first spec, second spec) -> (the second's replicated spec, the product's spec)
_specs: dict[tuple, tuple[DTensorSpec, DTensorSpec]] = {}
_SPECS_MAX = 256
_fn_stack = torch._C._len_torch_function_stack
_mode_stack = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_autocast = torch._C._is_any_autocast_enabled
_compiling = torch.compiler.is_compiling
_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_new = torch.Tensor._dtensor__new__
# torch 2.13 renamed it (the old name warns); torch 2.6-2.12 have the old one only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def direct(func, args: tuple, gt: type):
    """The product of two ``gt.Tensor``s run directly (module docstring), or
    ``NotImplemented`` where it is not ``rows @ rows`` or something watches or records."""
    if len(args) != 2:
        return NotImplemented
    a, b = args
    if type(a) is not gt or type(b) is not gt or a._gt_view is not None or b._gt_view is not None:
        return NotImplemented
    with _DisableSubclass():  # attribute reads without gt.Tensor's own __torch_function__
        grads = a.requires_grad or b.requires_grad
    sa, sb = a._spec, b._spec
    if (
        (grads and torch.is_grad_enabled())
        or _fn_stack()
        or _mode_stack()
        or _scope.lazy_sync is not None
        or _functorch_active()
        or _autocast()
        or _compiling()
        or _agree.checking()
        or sa.tensor_meta.dtype != sb.tensor_meta.dtype
        or not _rows_at_rows(a, b)
        or sa.mesh.get_coordinate() is None  # off the mesh: DTensor's path skips it
    ):
        return NotImplemented
    entry = _specs.get((sa, sb))
    if entry is None:
        m, n = sa.shape[0], sb.shape[1]
        meta = TensorMeta(torch.Size((m, n)), (n, 1), sa.tensor_meta.dtype)
        k, w = sb.shape[0], sb.mesh.size()
        entry = (DTensorSpec(sa.mesh, sa.placements, meta), sb.mesh.get_group(), -(-k // w), k)
        if len(_specs) >= _SPECS_MAX:
            _specs.clear()
        _specs[(sa, sb)] = entry
    spec, group, rows, k = entry
    if _agree._soon:  # data moves: the creations still being agreed on are checked first
        _agree.settle()
    try:
        with _DisableSubclass():
            full = gather_rows(b._local_tensor, group, rows, k, copy=False)
            out = torch.mm(a._local_tensor, full)
    except Exception as e:  # a collective's timeout names the op (GT_TIMEOUT)
        raise _rank_errors.translate(e, func)  # noqa: B904
    counts["direct"] += 1
    return _new(gt, out, spec, requires_grad=False)


def gather_rows(local: torch.Tensor, group, rows: int, k: int, copy: bool = True) -> torch.Tensor:
    """The whole ``k``-row matrix from each rank's row shard, by one all-gather on the mesh's
    group (c10d's own, under no autograd or functional layer). Shards follow ``torch.chunk``:
    ``rows`` each but at the end (fewer, or none), so the shards padded to ``rows`` and
    gathered in rank order hold the matrix in their first ``k`` rows. CPU ranks on one host
    gather through shared memory instead (``_agree.gather_rows``); ``copy=False`` lets that
    matrix be a view of the shared segment, for a caller that reads it at once and drops it
    (``direct``'s ``mm``: a k x n copy less in memory; its time is within this box's noise,
    ``scaling_parts.py 2048``: 0.82-0.96x DTensor's product against 0.88-0.98x before).

    Its own tensor ops (the padding only some ranks need) run with torch function modes off:
    a lazy region or the interceptor must not see ops that differ between ranks."""
    with torch._C.DisableTorchFunction():
        local = local.contiguous()
        full = _agree.gather_rows(local, group, rows, k, copy)  # one host: shared memory
        if full is not None:
            return full
        w = dist.get_world_size(group)
        if local.shape[0] != rows:
            pad = local.new_zeros((rows - local.shape[0], *local.shape[1:]))
            local = torch.cat([local, pad]) if local.shape[0] else pad
        full = local.new_empty((w * rows, *local.shape[1:]))
        _all_gather(full, local, group=group)
        return full if w * rows == k else full[:k]
