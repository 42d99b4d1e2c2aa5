"""What "the blocks" of a model are: one rule for FSDP2's units, compile and the cost model.

torchtitan shards each transformer block, then the root; it compiles the same blocks. The
trainer does both from this one rule, so a Hugging Face decoder (``model.model.layers``) is
sharded and compiled layer by layer without configuration:

* :func:`find_blocks`: the elements of the model's ``ModuleList`` of layers (the outermost
  list named ``layers``, ``blocks``, ``h`` or ``layer``; else the list holding the most
  parameters). ``None`` when the model has no such list.
* :func:`fsdp_blocks`: those blocks, or (a model without a block list) each direct child that
  owns parameters. A block that shares a parameter with anything outside it (tied
  embeddings: GPT-2's ``wte`` and ``lm_head``) is left to its parent unit, so a tied
  parameter is always managed by one FSDP unit (torch refuses a parameter in two).
* :func:`fsdp_units`: the blocks, then the root when parameters are left outside them.

``_strategies`` wraps and compiles, ``_compile`` compiles, ``_comm``'s
``CommunicationProfiler`` counts one all-gather and one reduce-scatter per unit: all read this
module, which imports only torch (so ``_comm`` need not import ``_strategies``).
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_blocks", "fsdp_blocks", "fsdp_units"]

_BLOCK_LIST_NAMES = ("layers", "blocks", "h", "layer")


def find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """The model's transformer blocks: ``(list name, [(qualified name, block), ...])``.

    The ``ModuleList`` named ``layers``/``blocks``/``h``/``layer`` (the outermost one found),
    else the ``ModuleList`` whose elements hold the most parameters; ``None`` when the model has
    no ``ModuleList`` with parameters."""
    best: tuple[int, int, str, nn.ModuleList] | None = None
    inside: set[str] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue  # a list inside a chosen block list: its blocks are taken whole
        params = sum(p.numel() for p in mod.parameters())
        if params == 0:
            continue
        inside.add(name)
        named = name.rsplit(".", 1)[-1] in _BLOCK_LIST_NAMES
        key = (int(named), params, name, mod)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    _, _, name, mod = best
    return name, [(f"{name}.{i}", b) for i, b in enumerate(mod)]


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``fully_shard`` wraps before the root, so parameters are gathered one block
    at a time: :func:`find_blocks`' blocks, else each direct child that owns parameters;
    without the blocks that share a parameter with a module outside them (tied weights)."""
    found = find_blocks(model)
    if found is not None:
        candidates = [b for _, b in found[1]]
    else:
        candidates = [c for c in model.children() if any(True for _ in c.parameters())]
    owners: dict[int, list[nn.Module]] = {}  # parameter -> the modules that hold it directly
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod)
    blocks = []
    for block in candidates:
        inside = {id(m) for m in block.modules()}
        shared = any(id(owner) not in inside for p in block.parameters() for owner in owners[id(p)])
        if not shared and any(True for _ in block.parameters()):
            blocks.append(block)
    return blocks


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units that communicate when the trainer shards ``model``: its blocks, then
    the root when parameters are left outside them (a root without parameters issues no
    collectives). One all-gather per unit per forward (and backward), one reduce-scatter."""
    blocks = fsdp_blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = any(id(p) not in inside for p in model.parameters())
    return [*blocks, model] if rest else blocks
