"""Dynamo's guards on ``gt.Tensor`` inputs, made exact for the hot functions (torch 2.13).

Dynamo guards a DTensor input by its local tensor (shape, stride, dtype...) and by its spec
*without its shape* (``guards.check_dtensor_spec``: ``skip_shapes=True``), trusting the local
guard for sizes. The global shape is not determined by one rank's local shape: rows 5 and 6
over 2 ranks are 3+2 and 3+3, so rank 0's graph for 5 rows passes its guards for 6 rows and
returns a result of global shape 5 (plain ``torch.compile`` of a DTensor function shows it;
``tests/compile/test_hot_shapes_dist.py`` says how). Under the
pass the ranks then also recompile at different calls (the rank whose local shape changed),
and the compile's agreement point raises a divergence in a correct program.

So while hot functions are on, the spec guard compares shapes too, and on more than one rank
the pass compiles with static shapes: a new global shape is a recompile on every rank at the
same call. The guard function is replaced in ``torch._dynamo.guards`` (guards built before
read it by name there), and put back when the pass stops; a user's own ``torch.compile`` of
DTensor code gets the exact guard too while the pass is on.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["exact_dtensor_guards", "static_shapes"]

_saved: Any = None


def _check_dtensor_spec(value: Any, metadata: Any) -> bool:
    return value._check_equals(metadata)  # mesh, placements, order, and the global shape


def exact_dtensor_guards(on: bool) -> None:
    """Compare a DTensor input's global shape in dynamo's guards (``on``), or put torch's
    guard back."""
    global _saved
    import torch._dynamo.guards as guards

    if on and _saved is None:
        _saved = guards.check_dtensor_spec
        guards.check_dtensor_spec = _check_dtensor_spec
    elif not on and _saved is not None:
        guards.check_dtensor_spec = _saved
        _saved = None


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
