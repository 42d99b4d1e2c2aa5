"""``placements: auto``: the tensor-parallel table derived from the model, and the checks that
refuse a table (derived or hand-written) that cannot be exact, before step one.

Derivation (``derive_placements``), the same on every rank (it reads only the model):

* A Hugging Face model whose config ships ``base_model_tp_plan``: each entry, prefixed with the
  base model's attribute name (``model.``, ``gpt_neox.``), its layout mapped by ``HF_LAYOUTS``
  onto the table's styles (entries that match no module of this model are left out: HF's plans
  cover variants). The plan's entries for the fused experts' parameters (``experts.gate_up_proj:
  packed_colwise``, ``experts.down_proj: rowwise``) are what the one ``experts`` style does.
* Otherwise the module tree: in each module, linear children named like attention projections
  (``q``/``k``/``v``/``q_proj``/``query``/...) with an output projection (``o``/``o_proj``/
  ``out_proj``) are a colwise-then-rowwise pair, as are MLP pairs (``up``/``gate``/``wi``/
  ``fc1`` then ``down``/``wo``/``fc2``; a fused ``gate_up_proj`` is ``packed_colwise``). An
  attention whose forward reads the global head count (T5's ``self.n_heads``) gets gathered
  projections (``colwise_gather``/``rowwise_split``) and its other parameters (a per-head
  relative bias) stay whole (``replicate``).

The output layer of a causal LM trained on its own loss (Llama's ``lm_head``; the trainer
says so: no ``loss_fn``, HF's shifted token cross-entropy) is split over the vocabulary as
``loss_parallel``: its logits stay split and the cross-entropy runs on the shards under torch's
``loss_parallel`` (torchtitan's default), so no rank holds a row's whole logits. A head whose
weight is the input embedding's (tied: Gemma, GPT-2) stays whole, and so does one whose
vocabulary does not divide over the tensor-parallel ranks (``resolve_placements`` says so).

Checks (``check_table``): a colwise layer that is packed (HF's plan gathers or packs it, or its
name says ``gate_up``/``qkv``), an attention whose forward reads the global head count, and a
module beside a split colwise layer whose parameter is as wide as that layer's whole output (a
norm over all heads) are ``ConfigError``s naming the module, what it reads and the table that
works; the error carries that table as ``suggested_placements``.
"""

from __future__ import annotations

import fnmatch
import inspect
import re

from torch import nn

from spmdgt.config import ConfigError
from spmdgt.train._tp_names import style_of as _style_of
from spmdgt.train._tp_names import wild as _wild
from spmdgt.train._tp_sequence import with_sequence_parallel

__all__ = [
    "HF_LAYOUTS",
    "LOSS_PARALLEL",
    "check_table",
    "derive_placements",
    "loss_head",
    "resolve_placements",
    "table_yaml",
]

HF_LAYOUTS = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "packed_colwise": "packed_colwise",
    "embedding_rowwise": "rowwise",
    "replicated_with_grad_allreduce": "sharded_input",
    "moe_tp_experts": "experts",
}
"""HF's layout -> the table's style (``transformers.distributed.tensor_parallel``'s meaning)."""

SPLIT_COLWISE = ("colwise", "packed_colwise")  # styles whose output is this rank's part
LOSS_PARALLEL = "loss_parallel"  # the output layer split over the vocabulary, read by the loss
_ATTN_COL = {"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value"}
_ATTN_ROW = {"o", "o_proj", "out_proj"}
_MLP_COL = {"gate_proj", "up_proj", "wi", "wi_0", "wi_1", "fc1", "dense_h_to_4h", "w1", "w3"}
_MLP_ROW = {"down_proj", "wo", "fc2", "dense_4h_to_h", "w2"}
_PACKED = {"gate_up_proj", "qkv_proj", "qkv", "wqkv", "w13"}
# A forward that reads the global head count reshapes or builds per-head tensors with it.
_GLOBAL_HEADS = re.compile(
    r"self\.(n_heads|num_heads|num_attention_heads|inner_dim|all_head_size)\b"
    r"|config\.(num_attention_heads|num_heads|n_head)\b"
)


def _hf_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """HF's ``base_model_tp_plan`` with its keys prefixed by the base model's name ({} when
    the model ships none)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and config is not None and hasattr(config, "get_text_config"):
        plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    if not plan:
        return {}, ""
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    prefix = f"{prefix}." if prefix else ""
    return {prefix + k: v for k, v in plan.items()}, prefix


def _reads_global_heads(module: nn.Module) -> str | None:
    """The global-head-count expression the module's forward reads (``self.n_heads``), if
    any: its split output would be reshaped or added to by the whole model's head count."""
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    m = _GLOBAL_HEADS.search(src)
    return m.group(0) if m else None


def derive_placements(
    model: nn.Module, *, loss_parallel: bool = False, sequence_parallel: bool = False
) -> tuple[dict[str, str], str]:
    """The table for ``placements: auto`` and where it came from (for the log line).
    ``loss_parallel``: the loss is HF's own token cross-entropy of the output layer's logits
    (the trainer's rule), so that layer may be split over the vocabulary (``loss_head``).
    ``sequence_parallel``: the residual stream split over the sequence too (``_tp_sequence``;
    a ``ConfigError`` saying why when the model's blocks do not allow it)."""
    plan, _ = _hf_plan(model)
    table = _from_hf_plan(model, plan) if plan else _from_tree(model)
    where = (
        f"{type(model).__name__}'s base_model_tp_plan (transformers)"
        if plan
        else f"{type(model).__name__}'s module tree (no base_model_tp_plan)"
    )
    if not table:
        raise ConfigError(
            f"placements: auto found no tensor-parallel layers in {type(model).__name__}: no "
            "base_model_tp_plan in its config and no q/k/v -> o or up/gate -> down linear pairs "
            "in its module tree; write the table by hand (module-name glob -> colwise | rowwise "
            "| ...) or train with ddp/fsdp",
            key="placements",
            value="auto",
        )
    head = loss_head(model) if loss_parallel and plan else None
    if head is not None and _style_of(head, table) is None:
        table[head] = LOSS_PARALLEL
    if sequence_parallel:
        table = with_sequence_parallel(model, table)
    return table, where


def loss_head(model: nn.Module) -> str | None:
    """The name of ``model``'s output layer when it can be split over the vocabulary: HF's
    ``get_output_embeddings()``, an ``nn.Linear`` whose weight is not the input
    embedding's (a tied weight is one parameter read whole by the embedding)."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    try:
        out = get_out() if callable(get_out) else None
        emb = get_in() if callable(get_in) else None
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(out, nn.Linear):
        return None
    if emb is not None and getattr(emb, "weight", None) is out.weight:
        return None
    return next((n for n, m in model.named_modules() if m is out and n), None)


def resolve_placements(
    model: nn.Module,
    placements: dict[str, str] | str,
    *,
    tp: int = 1,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
) -> dict[str, str]:
    """``placements`` as a table: ``"auto"`` derived (``derive_placements``, the output
    layer split when ``loss_parallel`` and its vocabulary divides over ``tp`` ranks, the
    residual stream over the sequence when ``sequence_parallel``) and printed on rank 0 as
    YAML to keep; a table as given."""
    if placements != "auto":
        return dict(placements)
    from spmdgt import runtime

    table, where = derive_placements(
        model, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
    )
    note = ""
    head = next((p for p, s in table.items() if s == LOSS_PARALLEL), None)
    if head is not None:
        vocab = model.get_submodule(head).out_features
        if vocab % tp:
            del table[head]
            note = f"  # {head} kept whole: its {vocab} outputs do not divide over {tp} ranks\n"
    runtime.print0(
        f"spmdgt.train: placements: auto, from {where}:\n{table_yaml(table)}{note}", end=""
    )
    return table


def _from_hf_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    table: dict[str, str] = {}
    for key, layout in plan.items():
        hits = [n for n in modules if n and fnmatch.fnmatchcase(n, key)]
        if not hits:
            if any(fnmatch.fnmatchcase(p, key) for p in params):
                # a fused experts parameter: its module's ``experts`` entry splits it
                _check_expert_param(key, layout, plan)
            continue  # a variant this model does not have
        if layout not in HF_LAYOUTS:
            raise ConfigError(
                f"placements: auto: {type(model).__name__}'s base_model_tp_plan gives {hits[0]!r} "
                f"the layout {layout!r}, which the trainer does not map (supported: "
                f"{', '.join(HF_LAYOUTS)}); write the table by hand",
                key=f"placements.{key}",
                value=layout,
            )
        table[key] = HF_LAYOUTS[layout]
    return table


def _check_expert_param(key: str, layout: str, plan: dict[str, str]) -> None:
    want = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    module, _, leaf = key.rpartition(".")
    if plan.get(module) != "moe_tp_experts" or want.get(leaf) != layout:
        raise ConfigError(
            f"placements: auto: the plan splits the parameter {key!r} as {layout!r}, which only "
            "an 'experts' module's gate_up_proj (packed_colwise) / down_proj (rowwise) can be",
            key=f"placements.{key}",
            value=layout,
        )


def _from_tree(model: nn.Module) -> dict[str, str]:
    table: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        kids = {n: c for n, c in parent.named_children()}
        linear = {n for n, c in kids.items() if isinstance(c, nn.Linear)}
        attn_col, attn_row = linear & _ATTN_COL, linear & _ATTN_ROW
        mlp_col, mlp_row = linear & (_MLP_COL | {"gate_up_proj"}), linear & _MLP_ROW
        if attn_col and attn_row:
            gather = _reads_global_heads(parent) is not None
            for n in (n for n in kids if n in attn_col):  # the model's order
                table[_wild(prefix + n)] = "colwise_gather" if gather else "colwise"
            for n in (n for n in kids if n in attn_row):
                table[_wild(prefix + n)] = "rowwise_split" if gather else "rowwise"
            for n, c in kids.items():  # per-head biases, norms: whole beside gathered heads
                if n not in linear and any(True for _ in c.parameters()):
                    table[_wild(prefix + n)] = "replicate" if gather else "sharded_input"
        if mlp_col and mlp_row:
            for n in (n for n in kids if n in mlp_col):
                table[_wild(prefix + n)] = "packed_colwise" if n == "gate_up_proj" else "colwise"
            for n in (n for n in kids if n in mlp_row):
                table[_wild(prefix + n)] = "rowwise"
    return table


def table_yaml(table: dict[str, str]) -> str:
    """The table as the YAML block a user can paste into a training config."""
    return "placements:\n" + "".join(f'  "{p}": {s}\n' for p, s in table.items())


def _amend(model: nn.Module, table: dict[str, str], changes: dict[str, str]) -> dict[str, str]:
    """``table`` with ``changes`` (module name -> style) put first as every-layer globs, and
    the patterns that then win for no module dropped (the table refuses unused patterns)."""
    new = {_wild(n): s for n, s in changes.items()}
    new.update({p: s for p, s in table.items() if p not in new})
    names = [n for n, _ in model.named_modules() if n]
    winners = {next((p for p in new if fnmatch.fnmatchcase(n, p)), None) for n in names}
    return {p: s for p, s in new.items() if p in winners}


def _gathered(
    parent_name: str, modules: dict[str, nn.Module], table: dict[str, str]
) -> dict[str, str]:
    """The changes that run ``parent_name``'s attention on whole heads: its split colwise
    layers gathered, the rowwise layers reading them (in it, else beside it: BERT's
    ``attention.output.dense``) taking a whole input, and every other child with parameters
    whole (``replicate``)."""
    prefix = f"{parent_name}." if parent_name else ""
    changes = {}
    for n, c in modules[parent_name].named_children():
        style = _style_of(prefix + n, table)
        if style in SPLIT_COLWISE:
            changes[prefix + n] = "colwise_gather"
        elif style == "rowwise":
            changes[prefix + n] = "rowwise_split"
        elif any(True for _ in c.parameters()) and style not in ("colwise_gather", "rowwise_split"):
            changes[prefix + n] = "replicate"
    if "rowwise_split" not in changes.values() and "." in parent_name:
        grand = parent_name.rpartition(".")[0] + "."
        for n in modules:
            if n.startswith(grand) and _style_of(n, table) == "rowwise":
                changes[n] = "rowwise_split"
    return changes


def check_table(model: nn.Module, table: dict[str, str]) -> None:
    """Refuse, before step one, a table that cannot give one process's numbers (see the
    module docstring). Reads only the model and the table: the same error on every rank."""
    plan, _ = _hf_plan(model)
    modules = dict(model.named_modules())
    packed: list[tuple[str, str, dict[str, str]]] = []  # (module, why, changes)
    heads: list[tuple[str, str, dict[str, str]]] = []
    for parent_name, parent in modules.items():
        prefix = f"{parent_name}." if parent_name else ""
        kids = dict(parent.named_children())
        split = {n: c for n, c in kids.items() if _style_of(prefix + n, table) in SPLIT_COLWISE}
        if not split:
            continue
        for n in split:
            full = prefix + n
            hf = _style_of(full, plan) if plan else None
            if _style_of(full, table) != "colwise":
                continue
            # packed by name, or by HF's plan (a plan that gathers a plain q_proj does so for
            # its reader: the norm and head checks below say which)
            if hf == "packed_colwise" or n.lower() in _PACKED:
                if "gate_up" in n or hf == "packed_colwise":
                    why = (
                        "its output is packed (gate then up, chunked by the module): a "
                        "colwise split gives one rank the gate and the other the up part; "
                        "name it packed_colwise (each rank takes its slice of each part)"
                    )
                    packed.append((full, why, {full: "packed_colwise"}))
                else:
                    why = (
                        "its output is packed (q, k and v side by side, sliced by the "
                        "module at global offsets): it must be gathered whole"
                    )
                    packed.append((full, why, _gathered(parent_name, modules, table)))
        reads = _reads_global_heads(parent)
        if reads and any(_style_of(prefix + n, table) == "colwise" for n in split):
            why = (
                f"its forward reads the global head count ({reads}) while its projections "
                f"{', '.join(sorted(split))} give each rank part of the heads"
            )
            bias = [n for n, c in kids.items() if n not in split and isinstance(c, nn.Embedding)]
            if bias:
                why += f" (its per-head {bias[0]!r} is shaped by that count too)"
            heads.append((parent_name, why, _gathered(parent_name, modules, table)))
            continue
        widths = {c.out_features: n for n, c in split.items() if isinstance(c, nn.Linear)}
        for n, c in kids.items():
            if n in split or isinstance(c, (nn.Linear, nn.Embedding)):
                continue
            for pname, p in c.named_parameters():
                if p.ndim >= 1 and p.shape[-1] in widths:
                    src = prefix + widths[p.shape[-1]]
                    why = (
                        f"its {pname} is {p.shape[-1]} wide, the whole output of the colwise "
                        f"{src!r} (a norm over all heads), but each rank sees only its part"
                    )
                    heads.append((prefix + n, why, _gathered(parent_name, modules, table)))
                    break
    for found in (packed, heads):
        if found:
            changes: dict[str, str] = {}
            for _, _, ch in found:
                changes.update(ch)
            fix = _amend(model, table, changes)
            name, why, _ = found[0]
            err = ConfigError(
                f"tensor parallel cannot be exact for {name!r}: {why}. A table that works:\n"
                + table_yaml(fix),
                key=f"placements.{name}",
            )
            err.suggested_placements = fix
            raise err
