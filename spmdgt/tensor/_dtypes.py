"""dtype names: torch dtypes, and GT's strings (``'float32'``) for the same thing."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "to_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
}


def to_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map GT's dtype strings, numpy dtypes and torch dtypes to a torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype))
    name = name.removeprefix("torch.")
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(
            f"unknown dtype {dtype!r}; use a torch dtype or one of {sorted(DTYPES)}"
        ) from None
