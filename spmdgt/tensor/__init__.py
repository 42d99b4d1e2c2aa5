"""Tensors and placements: ``gt.Tensor`` (a DTensor subclass), creation ops, signal placement.

Pipeline of a created tensor: ``_placement`` picks a mesh and placements from the active
signal (``_scope``) or auto-shard, ``_meshes`` builds the mesh, ``_creation`` makes the global
value and keeps this rank's slice, ``_tensor`` carries it through torch ops.

``Tensor`` and ``global_value`` load ``torch.distributed.tensor`` (~2 s), so they are imported
on first use: a world of one, whose tensors are all plain, never loads it.
"""

from spmdgt.tensor import _meshes
from spmdgt.tensor._creation import (
    agree_on_creation,
    arange,
    cat,
    empty,
    eye,
    from_numpy,
    full,
    manual_seed,
    ones,
    rand,
    randn,
    tensor,
    zeros,
)
from spmdgt.tensor._dtypes import DTYPES, to_dtype

__all__ = [
    "DTYPES",
    "Tensor",
    "arange",
    "cat",
    "agree_on_creation",
    "empty",
    "eye",
    "from_numpy",
    "full",
    "global_value",
    "manual_seed",
    "ones",
    "rand",
    "randn",
    "tensor",
    "to_dtype",
    "zeros",
    "_meshes",
]


def __getattr__(name: str):
    if name in ("Tensor", "global_value"):
        from spmdgt.tensor import _tensor

        return getattr(_tensor, name)
    raise AttributeError(f"module 'spmdgt.tensor' has no attribute {name!r}")
