"""Tables of devices and interconnects, and the parsing of sizes, bandwidths and times a
dry run is given (``DryRunError`` names the bad value).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = [
    "DEFAULT_LATENCY",
    "DEVICES",
    "DryRunError",
    "GiB",
    "INTERCONNECTS",
    "MiB",
    "parse_bandwidth",
    "parse_bytes",
    "parse_seconds",
]

GiB = 2**30
MiB = 2**20

# Memory of one device as the driver lists it (nvidia-smi's total, MiB; MI300X: rocm-smi). A
# process allocates a little less (the CUDA context): ``headroom`` keeps some back.
DEVICES: dict[str, tuple[int, str]] = {
    "h100": (81559 * MiB, "NVIDIA H100 80GB"),
    "h200": (143771 * MiB, "NVIDIA H200 141GB"),
    "b200": (183359 * MiB, "NVIDIA B200 180GB"),
    "a100": (81920 * MiB, "NVIDIA A100 80GB"),
    "a100-80gb": (81920 * MiB, "NVIDIA A100 80GB"),
    "a100-40gb": (40960 * MiB, "NVIDIA A100 40GB"),
    "l40s": (46068 * MiB, "NVIDIA L40S 48GB"),
    "l4": (23034 * MiB, "NVIDIA L4 24GB"),
    "a10g": (23028 * MiB, "NVIDIA A10G 24GB"),
    "v100": (32768 * MiB, "NVIDIA V100 32GB"),
    "v100-16gb": (16384 * MiB, "NVIDIA V100 16GB"),
    "rtx4090": (24564 * MiB, "NVIDIA RTX 4090 24GB"),
    "mi300x": (192 * GiB, "AMD MI300X 192GB"),
}

# Bus bandwidth per device and direction in bytes/s (what nccl-tests' busbw approaches on a
# ring), a rough per-collective latency in seconds, and what it is. A job spanning nodes is
# bound by the network between them (ib-ndr, 400gbe), not by NVLink within one.
INTERCONNECTS: dict[str, tuple[float, float, str]] = {
    "nvlink5": (900e9, 10e-6, "NVLink 5 (B200): 900 GB/s per direction per GPU"),
    "nvlink4": (450e9, 10e-6, "NVLink 4 (H100/H200 SXM): 450 GB/s per direction per GPU"),
    "nvlink3": (300e9, 10e-6, "NVLink 3 (A100 SXM): 300 GB/s per direction per GPU"),
    "pcie5": (50e9, 15e-6, "PCIe 5.0 x16: ~50 GB/s per direction"),
    "pcie4": (25e9, 15e-6, "PCIe 4.0 x16: ~25 GB/s per direction"),
    "ib-xdr": (100e9, 20e-6, "InfiniBand XDR 800 Gb/s per GPU: 100 GB/s"),
    "ib-ndr": (50e9, 20e-6, "InfiniBand NDR 400 Gb/s per GPU: 50 GB/s"),
    "ib-hdr": (25e9, 20e-6, "InfiniBand HDR 200 Gb/s per GPU: 25 GB/s"),
    "400gbe": (50e9, 30e-6, "400 Gb Ethernet (RoCE) per GPU: 50 GB/s"),
    "200gbe": (25e9, 30e-6, "200 Gb Ethernet (RoCE) per GPU: 25 GB/s"),
    "100gbe": (12.5e9, 30e-6, "100 Gb Ethernet per GPU: 12.5 GB/s"),
    "25gbe": (3.125e9, 50e-6, "25 Gb Ethernet: 3.1 GB/s"),
}

DEFAULT_LATENCY = 20e-6  # seconds per collective when a bandwidth is given without a latency


class DryRunError(ValueError):
    """A dry run cannot run as asked (a bad world size, an unknown device or interconnect,
    a process group already in this process)."""


# --------------------------------------------------------------------------- units


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _parse(value: float | str, pattern: str, read, what: str, example: str) -> float:
    """``value`` as a number: itself when it is one, else ``read(match)`` of ``pattern`` (a
    number then its unit), ``None`` from ``read`` meaning a unit it does not know."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(_NUMBER + pattern + r"\s*", str(value))
    amount = read(m) if m is not None else None
    if amount is None:
        raise DryRunError(f"not a {what}: {value!r} (write e.g. {example})")
    return amount


def _positive(amount: float, value: object, what: str, allow_zero: bool = False) -> float:
    if not ((amount >= 0 if allow_zero else amount > 0) and math.isfinite(amount)):
        raise DryRunError(f"a {what} must be {'>=' if allow_zero else '>'} 0, got {value!r}")
    return amount


def parse_bytes(value: float | str) -> float:
    """``80GB`` (1e9), ``80GiB`` (2**30), ``512MiB``, or a number of bytes, as bytes."""

    def read(m: re.Match) -> float | None:
        unit = _BYTE_UNITS.get(m.group(2).lower())
        return None if unit is None else float(m.group(1)) * unit

    amount = _parse(value, r"([A-Za-z]*)", read, "memory size", "80GB, 80GiB, 512MiB, or bytes")
    return _positive(amount, value, "memory size")


def parse_bandwidth(value: float | str) -> float:
    """``50GB/s`` (bytes), ``400Gb/s`` or ``400Gbps`` (bits), or a number of bytes/s."""

    def read(m: re.Match) -> float | None:
        if m.group(2) and not m.group(3):
            return None
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
        return float(m.group(1)) * scale / (8 if m.group(3) in ("b", "bit") else 1)

    pattern = r"([kKmMgGtT]?)(B|b|bit)?(?:/s|ps)?"
    rate = _parse(value, pattern, read, "bandwidth", "50GB/s for bytes, 400Gb/s for bits")
    return _positive(rate, value, "bandwidth")


def parse_seconds(value: float | str) -> float:
    """``20us``, ``0.02ms``, ``1e-5s`` or a number of seconds."""
    units = {"s": 1, None: 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    sec = _parse(
        value, r"(s|ms|us|µs|ns)?", lambda m: float(m.group(1)) * units[m.group(2)], "time",
        "20us, 0.02ms, 2e-5",
    )  # fmt: skip
    return _positive(sec, value, "latency", allow_zero=True)


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def _lookup(table: Mapping[str, object], name: str, what: str, flag: str) -> str:
    found = {_key(k): k for k in table}.get(_key(name))
    if found is None:
        raise DryRunError(
            f"unknown {what} {name!r}; known: {', '.join(table)} (or give {flag} directly)"
        )
    return found


def _gib(n: float) -> str:
    """Bytes in binary units: ``1.50 GiB``, ``12.0 MiB``, ``3.2 KiB``, ``64 B``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= 0.1 * size if unit == "GiB" else n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    """``1.68 B``, ``357 M``, ``731``: a parameter count."""
    for unit, size in ((" B", 1e9), (" M", 1e6), (" K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
