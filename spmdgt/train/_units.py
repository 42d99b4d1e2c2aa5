"""Which submodules FSDP2 shards as units: shared by the wrapping and the cost model.

``_strategies`` calls ``fully_shard`` on these blocks, then the root; ``_comm``'s
``CommunicationProfiler.estimate_fsdp_comm_cost`` counts one all-gather and one reduce-scatter
per unit. Both read the one rule here, so the estimate counts what the trainer wraps. The
module sits below both (it imports only torch), which keeps ``_comm`` from importing
``_strategies``, which imports ``_comm`` for its collective hooks.
"""

from __future__ import annotations

from torch import nn

__all__ = ["fsdp_blocks", "fsdp_units"]


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``fully_shard`` wraps before the root: each direct child that owns
    parameters, or each element of a child ``ModuleList`` (transformer layers), so all-gathers
    are per block."""
    blocks = []
    for child in model.children():
        inner = child.children() if isinstance(child, nn.ModuleList) else [child]
        blocks.extend(b for b in inner if any(True for _ in b.parameters()))
    return blocks


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units that communicate when the trainer shards ``model``: its blocks, then
    the root when parameters are left outside them (a root without parameters issues no
    collectives). One all-gather per unit per forward (and backward), one reduce-scatter."""
    blocks = fsdp_blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = any(id(p) not in inside for p in model.parameters())
    return [*blocks, model] if rest else blocks
