"""Tensors and placements: ``gt.Tensor`` (a DTensor subclass), creation ops, signal placement.

Pipeline of a created tensor: ``_placement`` picks a mesh and placements from the active
signal (``_scope``) or auto-shard, ``_meshes`` builds the mesh, ``_creation`` makes the global
value and keeps this rank's slice, ``_tensor`` carries it through torch ops.
"""

from spmdgt.tensor import _meshes
from spmdgt.tensor._creation import (
    arange,
    cat,
    check_same_shape,
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
from spmdgt.tensor._tensor import Tensor, global_value

__all__ = [
    "DTYPES",
    "Tensor",
    "arange",
    "cat",
    "check_same_shape",
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
