"""Static shapes for the hot functions' compiles on more than one rank.

Dynamo's guard on a DTensor input is made exact (the global shape compared) by
``tensor/_dynamo_guards``, held on while hot functions are on. Besides that guard, a graph over
DTensors that dynamo made dynamic after a recompile failed at run time on some ranks only, so
on more than one rank the pass compiles with static shapes: a new global shape is a recompile
on every rank at the same call.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["static_shapes"]


def static_shapes(on: bool) -> Any:
    """Dynamo's automatic dynamic shapes off (``on``: more than one rank): a shape change
    recompiles, at the same call on every rank. Besides the guard above, a graph over DTensors
    made dynamic after a recompile failed at run time on some ranks only, in AOTAutograd's
    rewrapping of its outputs (``DTensor.__tensor_unflatten__`` given a size of None, on
    uneven shards), and that rank's fallback ran the graph's collectives again alone: the
    ranks hung (found by the parity sweep with both halves on)."""
    if not on:
        return contextlib.nullcontext()
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(automatic_dynamic_shapes=False)
