"""What the planner reads from the model itself, with no step run: its parameters by where
they live (inside the blocks FSDP shards one at a time, or the root), which of them a
tensor-parallel table splits and over how many ranks it can, the FLOPs per token, the ops
one forward issues, and the bytes tensor parallelism all-reduces per token.

Everything is read from a copy of the model on the ``meta`` device (``meta_copy``: no memory,
whatever its size), so a Llama-3-70B-shaped config is read in seconds.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from spmdgt.config import ConfigError
from spmdgt.train._throughput import FlopModel, flop_model
from spmdgt.train._tp_names import style_of
from spmdgt.train._tp_plan import LOSS_PARALLEL, derive_placements
from spmdgt.train._tp_sequence import SEQUENCE_STYLES
from spmdgt.train._units import find_blocks, fsdp_blocks

__all__ = ["ModelFacts", "meta_copy", "read_model"]

SPLIT_STYLES = (
    "colwise",
    "rowwise",
    "packed_colwise",
    "colwise_gather",
    "rowwise_split",
    "experts",
    LOSS_PARALLEL,
)
_HEADS = ("n_heads", "num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads")


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are ``meta`` tensors of the
    same shapes and dtypes (nothing is copied: a real or fake model alike)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


def truncated(model: nn.Module, blocks: int) -> nn.Module:
    """A meta copy of ``model`` with only its first ``blocks`` transformer blocks: the dry
    runs that calibrate memory run at one and two blocks, and the full depth is their line."""
    m = meta_copy(model)
    found = find_blocks(m)
    if found is None:
        return m
    name, _ = found
    parent, _, attr = name.rpartition(".")
    holder = m.get_submodule(parent) if parent else m
    setattr(holder, attr, nn.ModuleList(list(getattr(holder, attr))[:blocks]))
    return m


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _attr(model: nn.Module, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(model, "config", None), getattr(model, "args", None)):
        for n in names:
            v = getattr(holder, n, None) if holder is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return None


@dataclass
class ModelFacts:
    """The model's shape, as the cost model needs it (bytes as the parameters' own dtype)."""

    name: str
    parameters: int
    param_bytes: int
    param_tensors: int
    blocks: int
    """Transformer blocks (FSDP units before the root)."""
    block_bytes: int
    """The largest block's parameters."""
    root_bytes: int
    """Parameters outside the blocks (embedding, head, final norm): the root FSDP unit."""
    tp_bytes: int
    """Parameters the tensor-parallel table splits."""
    tp_block_bytes: int
    """Of those, the largest block's."""
    tp_table: dict[str, str] | None
    tp_why: str
    """Why there is no table (``tp_table`` None), else where it came from."""
    tp_row_bytes: int
    """Bytes per token (fp32) that TP all-reduces per forward (rowwise outputs)."""
    tp_col_bytes: int
    """Bytes per token (fp32) that TP all-reduces per backward (colwise inputs' gradients)."""
    tp_row_calls: int
    tp_col_calls: int
    tp_sharded_input: int
    """Parameters named ``sharded_input`` (their gradients summed over tp once per step)."""
    split_dims: list[int] = field(default_factory=list)
    """The widths TP splits (colwise outputs, rowwise inputs): a degree must divide each."""
    heads: int | None = None
    kv_heads: int | None = None
    flops: FlopModel | None = None
    tp_flop_share: float = 0.0
    """Share of the model's ``6N`` multiplying parameters that TP splits."""
    ops_forward: int = 0
    """aten ops one forward issues (counted on meta tensors)."""
    loss_parallel: bool = False
    """``placements: auto`` splits the output layer over the vocabulary (``loss_parallel``):
    the loss's logits and temporaries are split too."""
    sequence_parallel: bool = False
    """``placements: auto`` can split the residual stream over the sequence too
    (``parallelism.sequence_parallel``): the plan's TP candidates do."""
    sp_why: str = ""
    """Why it cannot (the trainer's refusal), where it cannot."""
    sp_modules: int = 0
    """Modules sequence parallelism adds DTensor calls to (norms, gathers, the split)."""

    def tp_degrees(self, limit: int) -> list[int]:
        """Tensor-parallel sizes up to ``limit`` this model can be split over (1 always)."""
        if self.tp_table is None:
            return [1]
        out = [1]
        for t in range(2, limit + 1):
            if any(d % t for d in self.split_dims):
                continue
            if any(h is not None and h % t for h in (self.heads, self.kv_heads)):
                continue
            out.append(t)
        return out


class _CountOps(TorchDispatchMode):
    """Counts the aten ops a forward issues on meta tensors. A scalar read (``.item()``) of a
    meta tensor has no value to give: it reads ``True`` (a bool: Hugging Face's "is the
    padding mask all ones?", which the planner's all-ones batch is) or ``0``, so a forward
    that only checks its input's values still runs and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.muted = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 0 if self.muted else 1
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


class _FusedAttention(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` as the one fused kernel it is on CPU and GPU
    (on meta tensors only its math decomposition runs: softmax, masks and matmuls)."""

    def __init__(self, counter: _CountOps) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention or self.counter.muted:
            return func(*args, **(kwargs or {}))
        self.counter.count += 1
        self.counter.muted = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.muted = False


def _meta_batch(batch: object) -> object:
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype, device="meta")
    if isinstance(batch, dict):
        return {k: _meta_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_meta_batch(v) for v in batch)
    return batch


def count_forward_ops(model: nn.Module, inputs: object) -> int:
    """aten ops of one forward of the meta ``model`` on meta ``inputs`` (0 when the forward
    cannot run on meta tensors: the op-cost term is then left out)."""
    args = _meta_batch(inputs)
    counter = _CountOps()
    try:
        with torch.no_grad(), counter, _FusedAttention(counter):
            if isinstance(args, dict):
                model(**args)
            else:
                model(args)
    except Exception:  # a forward that reads values (data-dependent control flow)
        return 0
    return counter.count


def _ops_forward(model: nn.Module, inputs: object, blocks: int) -> int:
    """aten ops of one forward: counted on copies cut to one and two blocks and drawn as a
    line in the blocks (a forward of 80 blocks at 8192 tokens takes seconds even on meta
    tensors; the blocks of a transformer issue the same ops), else on the whole model."""
    if blocks >= 3 and find_blocks(model) is not None:
        one = count_forward_ops(truncated(model, 1), inputs)
        two = count_forward_ops(truncated(model, 2), inputs)
        if one and two >= one:
            return one + (blocks - 1) * (two - one)
    return count_forward_ops(model, inputs)


def _tp_facts(model: nn.Module, loss_parallel: bool) -> dict:
    try:
        table, where = derive_placements(model, loss_parallel=loss_parallel)
    except ConfigError as e:
        return {"tp_table": None, "tp_why": str(e).splitlines()[0]}
    split, row_b, col_b, row_n, col_n, shin = set(), 0, 0, 0, 0, 0
    dims: set[int] = set()
    for name, mod in model.named_modules():
        style = next((s for p, s in table.items() if fnmatch.fnmatchcase(name, p)), None)
        if style in SPLIT_STYLES:
            split |= {id(p) for p in mod.parameters()}
            out = getattr(mod, "out_features", None) or getattr(mod, "embedding_dim", None)
            inp = getattr(mod, "in_features", None) or getattr(mod, "num_embeddings", None)
            if style.startswith("rowwise") and out:
                row_b, row_n = row_b + 4 * out, row_n + 1
                dims.add(inp) if inp else None
            elif out:
                if style != LOSS_PARALLEL:  # no limit on tp: such a head stays whole (priced split)
                    dims.add(out)
                if isinstance(mod, nn.Linear):
                    col_b, col_n = col_b + 4 * mod.in_features, col_n + 1
        elif style == "sharded_input":
            shin += sum(1 for _ in mod.parameters())
    sp, sp_why, sp_modules = False, "", 0
    try:  # sequence parallelism: the trainer's own derivation, or its reason why not
        sp_table, _ = derive_placements(model, loss_parallel=loss_parallel, sequence_parallel=True)
        sp = True
        sp_modules = sum(
            1
            for name, _ in model.named_modules()
            # rowwise_scatter's layers are counted as TP's own
            if name and style_of(name, sp_table) in set(SEQUENCE_STYLES) - {"rowwise_scatter"}
        )
    except ConfigError as e:
        sp_why = str(e).split(": ", 2)[-1].split("; turn")[0]
    blocks = fsdp_blocks(model)
    tp_block = max(
        (_nbytes(p for p in b.parameters() if id(p) in split) for b in blocks), default=0
    )
    return {
        "tp_table": table,
        "tp_why": where,
        "tp_bytes": _nbytes(p for p in model.parameters() if id(p) in split),
        "tp_block_bytes": tp_block,
        "tp_row_bytes": row_b,
        "tp_col_bytes": col_b,
        "tp_row_calls": row_n,
        "tp_col_calls": col_n,
        "tp_sharded_input": shin,
        "loss_parallel": LOSS_PARALLEL in table.values(),
        "sequence_parallel": sp,
        "sp_why": sp_why,
        "sp_modules": sp_modules,
        "split_dims": sorted(dims),
        "_split": split,
    }


def read_model(model: nn.Module, inputs: object, *, loss_parallel: bool = False) -> ModelFacts:
    """The facts of ``model`` (any device: read from its meta copy) for one micro-batch's
    ``inputs`` (what the model's forward takes). ``loss_parallel``: the loss is the model's
    own token cross-entropy, so ``placements: auto`` splits its output layer
    (``LossRule.splits_logits``)."""
    m = meta_copy(model)
    params = list(dict.fromkeys(m.parameters()))
    blocks = fsdp_blocks(m)
    inside = {id(p) for b in blocks for p in b.parameters()}
    tp = _tp_facts(m, loss_parallel)
    split = tp.pop("_split", set())
    fm = flop_model(m)
    share = 0.0
    if fm.params and split:
        share = min(1.0, sum(p.numel() for p in params if id(p) in split) / fm.params)
    return ModelFacts(
        name=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        param_bytes=_nbytes(params),
        param_tensors=len(params),
        blocks=len(blocks),
        block_bytes=max((_nbytes(b.parameters()) for b in blocks), default=0),
        root_bytes=_nbytes(p for p in params if id(p) not in inside),
        heads=_attr(m, _HEADS),
        kv_heads=_attr(m, _KV_HEADS),
        flops=fm,
        tp_flop_share=share,
        ops_forward=_ops_forward(m, inputs, len(blocks)),
        **{
            "tp_bytes": 0,
            "tp_block_bytes": 0,
            "tp_row_bytes": 0,
            "tp_col_bytes": 0,
            "tp_row_calls": 0,
            "tp_col_calls": 0,
            "tp_sharded_input": 0,
            **tp,
        },
    )


def read_model_bytes(model: nn.Module) -> int:
    """The largest block's parameter bytes plus the root's (parameters outside the blocks)."""
    blocks = fsdp_blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    root = _nbytes(p for p in dict.fromkeys(model.parameters()) if id(p) not in inside)
    return root + max((_nbytes(b.parameters()) for b in blocks), default=0)
