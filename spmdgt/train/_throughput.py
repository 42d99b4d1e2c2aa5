"""Throughput as torchtitan logs it: tokens/s per device, achieved TFLOP/s and MFU.

FLOPs come from the model's shapes, not a profiler: a training step (forward and backward)
costs ``6 N`` FLOPs per token, where ``N`` is the parameters that multiply (every parameter
but an embedding table's: a lookup does no arithmetic; a weight tied to an output layer counts,
since the layer multiplies by it), plus ``12 L d T`` per token for attention's two matmuls
over a sequence of ``T`` (``L`` layers of width ``d``), when the model says its layers and width
(a Hugging Face ``config``, or an ``args`` with ``n_layers``/``dim``). This is torchtitan's
estimate (``get_num_flop_per_token``) and the Chinchilla paper's. A batch that is not token ids
counts ``6 N`` per sample (dense layers; a convolution reuses its weights over positions and is
undercounted: MFU is then a lower bound).

Peak FLOP/s per device come from a table of known accelerators (dense tensor-core figures, bf16
under AMP or FSDP mixed precision, TF32 or FP32 otherwise, as torch's matmul precision says), or,
for a device not in the table (every CPU), from a measured matmul probe: the best of a few
square matmuls in the training dtype on this rank's threads. The summary says which
(``peak_flops_source``), so an MFU measured against a probe is read as "share of what a large
matmul reaches here", not of a datasheet. The probe is ``1024 x 1024`` on a GPU, ``512 x 512``
on a CPU (a fraction of a second on one thread), run once per process when first needed.

Nothing here communicates: each rank estimates alone, and only rank 0 prints.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlopModel", "Throughput", "flop_model", "peak_flops"]

# Dense (no sparsity) tensor-core peaks per device in FLOP/s, by a substring of the CUDA
# device name, most specific first: (bf16/fp16, tf32, fp32). NVIDIA datasheets.
_PEAKS: list[tuple[str, tuple[float, float, float]]] = [
    ("H200", (989.4e12, 494.7e12, 66.9e12)),
    ("H100 PCIe", (756.0e12, 378.0e12, 51.2e12)),
    ("H100 NVL", (835.0e12, 417.5e12, 60.0e12)),
    ("H100", (989.4e12, 494.7e12, 66.9e12)),  # SXM
    ("H800", (989.4e12, 494.7e12, 66.9e12)),
    ("A100", (312.0e12, 156.0e12, 19.5e12)),
    ("A800", (312.0e12, 156.0e12, 19.5e12)),
    ("L40S", (362.05e12, 183.0e12, 91.6e12)),
    ("L4", (121.0e12, 60.0e12, 30.3e12)),
    ("A10G", (70.0e12, 35.0e12, 31.2e12)),
    ("V100", (125.0e12, 15.7e12, 15.7e12)),
]


@dataclass(frozen=True)
class FlopModel:
    """Training FLOPs (forward + backward) per token or per sample, and how they were found."""

    params: int
    """``N``: parameters that multiply (embedding tables left out)."""
    layers: int | None
    width: int | None

    def per_step(self, samples: int, tokens: int) -> float:
        """FLOPs of a step over ``samples`` rows holding ``tokens`` token ids (0: not
        tokens): ``6 N`` per token plus ``12 L d T`` attention, or ``6 N`` per sample."""
        if tokens and samples:
            seq = tokens / samples
            attention = 12 * self.layers * self.width * seq if self.layers and self.width else 0
            return tokens * (6 * self.params + attention)
        return samples * 6 * self.params

    def describe(self, samples: int, tokens: int) -> str:
        """The rule used, with its numbers: what the summary prints as ``flops_estimate``."""
        if tokens and samples:
            seq = tokens // samples
            if self.layers and self.width:
                return (
                    f"6N + 12LdT per token (N={self.params:,} non-embedding params, "
                    f"L={self.layers}, d={self.width}, T={seq})"
                )
            return f"6N per token (N={self.params:,}; no layer count found: attention omitted)"
        return f"6N per sample (N={self.params:,}; not token ids)"


def flop_model(model: nn.Module) -> FlopModel:
    """The model's FLOP counts, read before wrapping (FSDP and TP keep global sizes anyway)."""
    multiplying: dict[int, int] = {}
    tables: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding | nn.EmbeddingBag):
                tables.add(id(p))
            else:
                multiplying[id(p)] = p.numel()
    for module in model.modules():  # a table not also used by a layer does no arithmetic
        for p in module.parameters(recurse=False):
            if id(p) in tables and not _used_outside_tables(model, p):
                multiplying.pop(id(p), None)
    layers, width = _layers_and_width(model)
    return FlopModel(sum(multiplying.values()), layers, width)


def _used_outside_tables(model: nn.Module, param: nn.Parameter) -> bool:
    return any(
        not isinstance(m, nn.Embedding | nn.EmbeddingBag)
        and any(p is param for p in m.parameters(recurse=False))
        for m in model.modules()
    )


_LAYER_NAMES = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
_WIDTH_NAMES = ("hidden_size", "dim", "n_embd", "d_model")


def _layers_and_width(model: nn.Module) -> tuple[int | None, int | None]:
    """``L`` and ``d`` from a Hugging Face ``config`` or a torchtitan-style ``args``."""
    for holder in (getattr(model, "config", None), getattr(model, "args", None)):
        if holder is None:
            continue
        layers = next((getattr(holder, n) for n in _LAYER_NAMES if hasattr(holder, n)), None)
        width = next((getattr(holder, n) for n in _WIDTH_NAMES if hasattr(holder, n)), None)
        if isinstance(layers, int) and isinstance(width, int):
            return layers, width
    return None, None


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` computing in ``dtype``, and where the figure comes from:
    the datasheet table for a known accelerator, else a measured matmul probe (cached)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, tf32, fp32) in _PEAKS:
            if key in name:
                if dtype in (torch.bfloat16, torch.float16):
                    return half, f"table: {name}, {dtype} dense"
                if torch.get_float32_matmul_precision() != "highest":
                    return tf32, f"table: {name}, tf32 dense"
                return fp32, f"table: {name}, fp32"
    n = 1024 if device.type == "cuda" else 512
    flops, seconds = _probe(device.type, device.index, dtype, torch.get_num_threads(), n)
    where = f"{device.type}" if device.type != "cuda" else torch.cuda.get_device_name(device)
    return flops, (
        f"measured: {n}^3 {str(dtype).removeprefix('torch.')} matmul on {where}, "
        f"{torch.get_num_threads()} threads, best of 5 ({seconds * 1e3:.2f} ms)"
    )


@functools.cache
def _probe(
    kind: str, index: int | None, dtype: torch.dtype, threads: int, n: int
) -> tuple[float, float]:
    device = torch.device(kind, index) if index is not None else torch.device(kind)
    # A private generator: the probe must not draw from the run's random stream (dropout,
    # shuffles and a resumed run's RNG state would change)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.rand(n, n, device=device, generator=gen).to(dtype)
    b = torch.rand(n, n, device=device, generator=gen).to(dtype)
    best = float("inf")
    for i in range(6):  # the first warms up
        if kind == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if kind == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, best


class Throughput:
    """One run's throughput figures from its step measurements: tokens/s per device, achieved
    TFLOP/s per device and MFU. ``world_size`` devices share every step's work: under data
    parallelism each its own rows, under tensor parallelism each a part of every matmul."""

    def __init__(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, world_size: int
    ) -> None:
        self.flops = flop_model(model)
        self.device, self.dtype, self.world_size = device, dtype, world_size
        self._peak: tuple[float, str] | None = None

    @property
    def peak(self) -> tuple[float, str]:
        """Peak FLOP/s per device and its source (probed on first use when not tabled)."""
        if self._peak is None:
            self._peak = peak_flops(self.device, self.dtype)
        return self._peak

    def figures(self, samples: int, tokens: int, seconds: float) -> dict[str, float | None]:
        """Per device over ``seconds`` of steps that took ``samples`` rows and ``tokens``
        token ids (global counts): ``tokens_per_sec_per_device`` (None when not token ids),
        ``tflops_per_device`` and ``mfu`` (a fraction of the peak)."""
        if seconds <= 0:
            return {"tokens_per_sec_per_device": None, "tflops_per_device": None, "mfu": None}
        achieved = self.flops.per_step(samples, tokens) / seconds / self.world_size
        return {
            "tokens_per_sec_per_device": tokens / seconds / self.world_size if tokens else None,
            "tflops_per_device": achieved / 1e12,
            "mfu": achieved / self.peak[0],
        }
