"""Attention on sharded tensors: local work on each rank's rows or heads.

``F.scaled_dot_product_attention`` computes each (batch row, head) pair on its own: the scores
of row ``b``, head ``h`` read only ``q[b, h]``, ``k[b, h]``, ``v[b, h]`` and the mask's entry
for that pair. So inputs sharded on a batch dim (``Shard(0)``), or on the head dim of
``[B, H, L, E]`` inputs (``Shard(1)``), with the mask laid out alike (or broadcast over that
dim, then replicated), give each rank exactly its own rows of one process's result, forward
and backward, with no communication. Sharded on the sequence dim or the head size, a row
needs other ranks' values: those layouts take the exact fallback.

Two pieces make that happen:

- ``why_not_local`` (``_optable``'s ``ATTENTION`` route, in spmdgt's eager calls): which
  layouts run locally, read from global metadata alone so every rank decides alike; the rest,
  and any ``dropout_p > 0`` (random numbers, as one process draws them), take the exact
  fallback;
- sharding strategies for the CPU kernels DTensor lacks in torch 2.13
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) and for the math kernel
  (``_scaled_dot_product_attention_math``, which DTensor sees under inference mode). Without
  them DTensor derives a strategy by tracing the kernel's decomposition once for every
  combination of candidate placements of every input (5 ** 7 combinations for the backward),
  uncached while torch.compile traces: the "hang" of a compiled forward on a batch-sharded
  input. torch registers the CUDA kernels' strategies itself (flash, efficient, cuDNN: batch,
  heads, replicated); ``install`` adds ours to DTensor's propagator, ``uninstall`` takes
  them out again, and ``_hook.install``/``uninstall`` call both.

The CPU kernels take the mask as a keyword argument, which DTensor never redistributes: our
strategies only offer the mask's current placement, and ``place_mask`` (called from the
propagation hook inside spmdgt's calls and while torch.compile traces) first slices a
replicated mask that is not broadcast over the sharded dim, a local slice with no
communication. A raw DTensor user (outside spmdgt's calls) keeps the mask as given: then the
strategy replicates ``q``, ``k``, ``v`` where the mask does not fit their sharding.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmdgt.tensor import _registry

__all__ = [
    "CPU_FLASH",
    "CPU_FLASH_BACKWARD",
    "MATH",
    "SDPA",
    "install",
    "installed",
    "place_mask",
    "uninstall",
    "why_not_local",
]

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
MATH = aten._scaled_dot_product_attention_math.default
SDPA = aten.scaled_dot_product_attention.default

# F.scaled_dot_product_attention's parameters, in order
_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


def _chunk(n: int, parts: int) -> int:
    """The size of a full shard when ``n`` is split in ``parts`` (torch.chunk's rule)."""
    return -(-n // parts)


def heads_align(q_heads: int, kv_heads: int, parts: int) -> bool:
    """Can grouped-query attention (``q_heads`` a multiple of ``kv_heads``) run on head shards
    over ``parts`` ranks? Each rank's query heads must use exactly its own key/value heads:
    with torch.chunk's split, a query shard of ``g`` times the key/value shard's size, ``g``
    being the group size (``q_heads // kv_heads``)."""
    if q_heads == kv_heads:
        return True
    if kv_heads <= 0 or q_heads % kv_heads:
        return False
    return _chunk(q_heads, parts) == (q_heads // kv_heads) * _chunk(kv_heads, parts)


def _mask_dim(mask_ndim: int, ndim: int, dim: int) -> int:
    """The mask's dim that broadcasts against dim ``dim`` of ``ndim``-dim inputs (negative:
    the mask lacks it, so it broadcasts over it)."""
    return dim - (ndim - mask_ndim)


def _mask_wants(mask_shape, ndim: int, dim: int, size: int):
    """The mask placement that goes with inputs sharded on ``dim`` (of size ``size``):
    ``Shard`` of its matching dim where it holds one entry per index, ``Replicate`` where it
    broadcasts; None where it fits neither (a size that is neither 1 nor ``size``)."""
    md = _mask_dim(len(mask_shape), ndim, dim)
    if md < 0 or mask_shape[md] == 1:
        return Replicate()
    if mask_shape[md] == size:
        return Shard(md)
    return None


# -- the route: which layouts run locally (spmdgt's eager calls) ---------------------------


def _sdpa_arguments(args, kwargs) -> dict:
    bound = dict(zip(_SDPA_PARAMS, args))
    bound.update(kwargs)
    return bound


def why_not_local(args, kwargs, world_size: int) -> str | None:
    """Why ``F.scaled_dot_product_attention(*args, **kwargs)`` cannot run on each rank's own
    shards (None: it can, through DTensor's strategies). Reads dtypes, shapes, placements and
    mesh sizes only, so every rank answers alike; see the module docstring."""
    a = _sdpa_arguments(args, kwargs)
    q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "attention on non-tensor arguments"
    p = a.get("dropout_p", 0.0)
    if not isinstance(p, (int, float)) or p != 0:
        return "dropout inside attention draws random numbers"
    tensors = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    if not sharded:
        return None
    mesh = sharded[0]._spec.mesh
    if mesh.ndim != 1 or mesh.size() != world_size:
        return "attention on a sub-mesh or a multi-dim mesh"
    dims = set()
    for t in sharded:
        if t._spec.mesh is not mesh:
            return "attention inputs on different meshes"
        (pl,) = t._spec.placements
        if isinstance(pl, Shard):
            dims.add((t is mask, pl.dim))
        elif not isinstance(pl, Replicate):
            return f"attention input placed {pl}"
    qkv_dims = {d for is_mask, d in dims if not is_mask}
    ndim = q.dim()
    if len(qkv_dims) > 1 or k.dim() != ndim or v.dim() != ndim:
        return "query, key and value sharded on different dims"
    if not qkv_dims:
        # q, k, v whole on every rank: a sharded mask makes DTensor shard them to match it
        # (a local slice), or, sharded elsewhere, finds no rule (the exact fallback)
        return None
    (d,) = qkv_dims
    if d >= ndim - 2:
        return "attention sharded on the sequence or head-size dim (a row needs every key)"
    n = mesh.size()
    sizes = (q.shape[d], k.shape[d], v.shape[d])
    if min(sizes) < n or any(_chunk(s, n) * (n - 1) >= s for s in sizes):
        return "attention with an empty shard"
    if k.shape[d] != v.shape[d]:
        return "key and value of different sizes on the sharded dim"
    if q.shape[d] != k.shape[d]:
        gqa = a.get("enable_gqa", False) is True and d == ndim - 3
        if not gqa or not heads_align(q.shape[d], k.shape[d], n):
            return "grouped-query heads whose shards do not line up"
    if isinstance(mask, torch.Tensor):
        wants = _mask_wants(mask.shape, ndim, d, q.shape[d])
        if wants is None:
            return "attention mask of another size on the sharded dim"
        have = mask._spec.placements[0] if isinstance(mask, DTensor) else Replicate()
        if have != wants and not (isinstance(have, Replicate) and isinstance(wants, Shard)):
            return "attention mask sharded otherwise than query, key and value"
    return None


# -- a replicated mask sliced to match q's shards (inside spmdgt's calls) -------------------


def place_mask(op_call, args, kwargs):
    """For a CPU kernel called with a replicated ``attn_mask`` (a keyword argument, which
    DTensor does not redistribute) that holds one entry per index of the dim ``q`` is sharded
    on: the same call with the mask sliced to match (a local slice, no communication).
    None when nothing needs changing."""
    mask = kwargs.get("attn_mask")
    q = args[0] if op_call is CPU_FLASH else args[1]
    if not isinstance(mask, torch.Tensor) or not isinstance(q, DTensor):
        return None
    mesh = q._spec.mesh
    if mesh.ndim != 1:
        return None
    if isinstance(mask, DTensor) and (
        mask._spec.mesh is not mesh or not isinstance(mask._spec.placements[0], Replicate)
    ):
        return None
    (pl,) = q._spec.placements
    if not isinstance(pl, Shard) or pl.dim >= q.dim() - 2:
        return None
    wants = _mask_wants(mask.shape, q.dim(), pl.dim, q.shape[pl.dim])
    if not isinstance(wants, Shard):
        return None
    if not isinstance(mask, DTensor):  # a plain tensor: a replicated value (implicitly)
        mask = DTensor.from_local(mask, mesh, [Replicate()], run_check=False)
    sliced = mask.redistribute(mesh, [wants])
    return op_call(*args, **{**kwargs, "attn_mask": sliced})


# CPU kernels take the mask as a keyword argument DTensor never redistributes: the
# propagation hook places it first (the ops' records, ``_registry.plan``).
_registry.register_aten((CPU_FLASH, CPU_FLASH_BACKWARD), "intercept", place_mask)


# -- DTensor sharding strategies ------------------------------------------------------------


def _dropout_free(op_schema, index: int) -> bool:
    args = op_schema.args_schema
    p = args[index] if len(args) > index else op_schema.kwargs_schema.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p == 0


def _local_options(op_schema, q, k, mask, dropout_free: bool):
    """The placements, over one mesh dim, that run attention locally: ``(dim, mask
    placement)`` for each batch dim (every dim but the last two) and, where grouped-query
    heads line up, the head dim. With dropout, none: each rank would draw its own numbers."""
    if not dropout_free or q.ndim < 3 or k.ndim != q.ndim:
        return []
    mesh = op_schema.get_mesh_from_args(validate=False)
    options = []
    for dim in range(q.ndim - 2):
        if q.shape[dim] != k.shape[dim]:
            heads = dim == q.ndim - 3 and mesh.ndim == 1
            if not heads or not heads_align(q.shape[dim], k.shape[dim], mesh.size()):
                continue
        m = None
        if mask is not None:
            m = _mask_wants(mask.shape, q.ndim, dim, q.shape[dim])
            if m is None:
                continue
        options.append((dim, m))
    return options


def _mask_fixed(mask):
    """Keep a strategy only if it takes the mask as it is (DTensor does not redistribute
    keyword arguments)."""
    if mask is None:
        return None
    have = tuple(mask.strategies[0].output_spec.placements)

    def valid(input_specs, _output_specs) -> bool:
        return tuple(input_specs[-1].placements) == have

    return valid


def _cpu_flash_strategy(op_schema):
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *,
    attn_mask, scale) -> (out, logsumexp)``: replicated, or every tensor sharded on the batch
    dim, or on the head dim (``logsumexp`` is ``[B, H, L]``)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    q, k = op_schema.args_schema[0], op_schema.args_schema[1]
    mask = op_schema.kwargs_schema.get("attn_mask")
    has_mask = mask is not None
    strategies = [[Replicate()] * (5 + has_mask)]
    for dim, m in _local_options(op_schema, q, k, mask, _dropout_free(op_schema, 3)):
        strategies.append([Shard(dim)] * 5 + ([m] if has_mask else []))
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, strategies, input_index=2, is_valid_strategy_cb=_mask_fixed(mask)
    )


def _cpu_flash_backward_strategy(op_schema):
    """``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out,
    logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (grad_q, grad_k, grad_v)``: as
    the forward."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    q, k = op_schema.args_schema[1], op_schema.args_schema[2]
    mask = op_schema.kwargs_schema.get("attn_mask")
    has_mask = mask is not None
    strategies = [[Replicate()] * (9 + has_mask)]
    for dim, m in _local_options(op_schema, q, k, mask, _dropout_free(op_schema, 6)):
        strategies.append([Shard(dim)] * 9 + ([m] if has_mask else []))
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, strategies, input_index=3, is_valid_strategy_cb=_mask_fixed(mask)
    )


def _sdpa_strategy(op_schema):
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, *, scale,
    enable_gqa) -> out``, which DTensor sees itself under ``torch.inference_mode`` (autograd
    decomposes it otherwise): as the CPU kernel, with the mask a positional argument DTensor
    redistributes; each rank's kernel then picks its own backend for its own rows."""
    return _positional_mask_strategy(op_schema, outputs=1, dropout_index=4, dropout_mask=None)


def _math_strategy(op_schema):
    """``_scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal,
    dropout_mask, *, scale, enable_gqa) -> (out, attn)``: as ``_sdpa_strategy``; a given
    dropout mask (drawn over the whole batch) keeps everything replicated."""
    return _positional_mask_strategy(op_schema, outputs=2, dropout_index=4, dropout_mask=6)


def _positional_mask_strategy(op_schema, outputs: int, dropout_index: int, dropout_mask):
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    args = op_schema.args_schema
    q, k = args[0], args[1]
    mask = args[3] if len(args) > 3 and isinstance(args[3], OpStrategy) else None
    has_mask = mask is not None
    has_dropout_mask = (
        dropout_mask is not None
        and len(args) > dropout_mask
        and isinstance(args[dropout_mask], OpStrategy)
    )
    options = []
    if not has_dropout_mask:
        options = _local_options(op_schema, q, k, mask, _dropout_free(op_schema, dropout_index))
    strategies = [[Replicate()] * (outputs + 3 + has_mask + has_dropout_mask)]
    for dim, m in options:
        strategies.append([Shard(dim)] * (outputs + 3) + ([m] if has_mask else []))
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=outputs)


def _strategies():
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    # static_argnum: dropout_p on (it decides whether sharding is offered); the mask's
    # placement is a keyword's, hashed through static_kwargkey so each one gets its own entry
    return {
        CPU_FLASH: (
            _cpu_flash_strategy,
            RuntimeSchemaInfo(static_argnum=3, static_kwargkey=["attn_mask", "scale"]),
        ),
        CPU_FLASH_BACKWARD: (
            _cpu_flash_backward_strategy,
            RuntimeSchemaInfo(static_argnum=6, static_kwargkey=["attn_mask", "scale"]),
        ),
        MATH: (
            _math_strategy,
            RuntimeSchemaInfo(static_argnum=4, static_kwargkey=["scale", "enable_gqa"]),
        ),
        SDPA: (
            _sdpa_strategy,
            RuntimeSchemaInfo(static_argnum=4, static_kwargkey=["scale", "enable_gqa"]),
        ),
    }


_saved: dict = {}  # op -> (strategy, schema info) DTensor had before ours (None: none)


def installed() -> bool:
    """Whether our strategies are in DTensor's propagator."""
    return bool(_saved)


def install() -> None:
    """Register the strategies above with DTensor's sharding propagator, where torch has
    none of its own (a torch that registers them keeps its own)."""
    if _saved:
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    single_dim = getattr(prop, "op_single_dim_strategy_funcs", {})  # torch >= 2.10
    for op, (strategy, info) in _strategies().items():
        if op in prop.op_strategy_funcs or op in single_dim:
            continue
        _saved[op] = prop.op_to_schema_info.get(op)
        prop.op_strategy_funcs[op] = strategy
        prop.op_to_schema_info[op] = info
    _saved.setdefault(None, None)  # installed, even where torch had every strategy
    prop.propagate_op_sharding.cache_clear()


def uninstall() -> None:
    """Take our strategies out of DTensor's propagator again."""
    if not _saved:
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    for op, info in _saved.items():
        if op is None:
            continue
        prop.op_strategy_funcs.pop(op, None)
        if info is None:
            prop.op_to_schema_info.pop(op, None)
        else:
            prop.op_to_schema_info[op] = info
    _saved.clear()
    prop.propagate_op_sharding.cache_clear()
