"""``DryRunReport``: what a dry run found, as a table, a verdict and a dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spmdgt.train._dryrun._tables import _count, _gib

__all__ = ["CollectiveRow", "DryRunReport"]

# --------------------------------------------------------------------------- the report


@dataclass
class CollectiveRow:
    """One kind of collective in one optimizer step."""

    kind: str
    count: int
    buffer_bytes: int
    """Bytes of the full buffers (the all-reduced tensors, the all-gather's output, ...)."""
    ring_bytes: float
    """Bytes each rank sends by the ring algebra (``CommunicationProfiler``), over the ring
    of its mesh dim's ranks."""
    seconds: float
    dim: str = "world"
    """The mesh dim whose group runs it: ``tp``, ``dp_shard``, ``dp_replicate``; ``world`` on
    the 1-D world."""


@dataclass
class DryRunReport:
    """What one step of the job needs per rank, and whether it fits. ``str()`` is the table."""

    world: int
    strategy: str
    parameters: int
    """Parameters of the model (all ranks together)."""
    micro_steps: int
    params: list[int]
    """Bytes of parameters on each rank (the local shards)."""
    grads: list[int]
    """Bytes of gradients on each rank, just before the optimizer step."""
    optimizer: list[int]
    """Bytes of optimizer state on each rank, after the step."""
    activations: int
    """The activations a forward saves, at its end (the tracker's ``Activation``; every rank
    runs its own micro-batch of the same size)."""
    peak: int
    """Rank 0's peak estimate (rank 0 holds the largest shards)."""
    peak_breakdown: dict[str, int]
    """The peak by the tracker's categories (plus DDP's gradient buckets)."""
    collectives: list[CollectiveRow]
    comm_seconds: float
    bandwidth: float | None
    latency: float | None
    interconnect: str | None
    device_memory: float | None
    device: str | None
    headroom: float
    tracker: str
    elapsed: float
    notes: list[str] = field(default_factory=list)
    mesh: dict[str, int] | None = None
    """The ``parallelism`` block's mesh, dim -> size (``None``: the 1-D world)."""
    links: dict[str, tuple[float, float, str]] | None = None
    """Per mesh dim given its own link: (bandwidth, latency, label); other dims use
    ``bandwidth``/``latency``."""
    before_backward: dict[str, int] = field(default_factory=dict)
    """FSDP only: the tracker's activations and backward temporaries just before each FSDP
    unit's backward starts, by the unit's name (rank 0's, the last step's)."""
    backward_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    """FSDP only: the peak in each FSDP unit's backward by category (``total`` their sum),
    by the unit's name (rank 0's, the last step's)."""
    step_peak: dict[str, int] = field(default_factory=dict)
    """The peak of the forwards and backwards alone, before the optimizer step, by category
    (``total`` their sum; rank 0's, the larger step's). ``peak`` is the step's whole: where
    the optimizer step holds the most (parameters, gradients, state and its temporaries
    together: a 70B-shaped Llama's one-block copy), it shows no activation at all."""

    def collectives_by_dim(self) -> dict[str, dict[str, dict[str, int]]]:
        """One step's collectives per mesh dim: ``{dim: {kind: {count, bytes}}}`` (bytes of
        the full buffers), as ``CollectiveCounter.totals_by_dim`` counts a real run."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for r in self.collectives:
            out.setdefault(r.dim, {})[r.kind] = {"count": r.count, "bytes": r.buffer_bytes}
        return out

    @property
    def usable_memory(self) -> float | None:
        """The device's memory less ``headroom``; ``None`` when no memory was given."""
        if self.device_memory is None:
            return None
        return self.device_memory * (1.0 - self.headroom)

    @property
    def fits(self) -> bool | None:
        """Whether rank 0's peak fits the usable memory; ``None`` when no memory was given."""
        usable = self.usable_memory
        return None if usable is None else self.peak <= usable

    def biggest_item(self) -> tuple[str, int]:
        """The largest category of the peak."""
        return max(self.peak_breakdown.items(), key=lambda kv: kv[1], default=("peak", self.peak))

    def verdict(self) -> str:
        """``fits in 79.6 GiB per device (...): yes (peak ...)`` or ``does not fit: ...``."""
        usable = self.usable_memory
        if usable is None or self.device_memory is None:
            return (
                f"peak {_gib(self.peak)} per device (pass a device memory or a device for a "
                "verdict)"
            )
        where = f"{_gib(self.device_memory)} per device" + (
            f" ({self.device})" if self.device else ""
        )
        keep = f"{_gib(usable)} usable after {self.headroom:.0%} headroom"
        if self.fits:
            return f"fits in {where}: yes (peak {_gib(self.peak)} of {keep})"
        name, size = self.biggest_item()
        return (
            f"does not fit in {where}: peak {_gib(self.peak)} > {keep}; the biggest item is "
            f"{name} ({_gib(size)} on rank 0)"
        )

    def to_dict(self) -> dict:
        """The report as plain data (JSON-ready)."""
        out = dict(self.__dict__)
        out["collectives"] = [dict(r.__dict__) for r in self.collectives]
        out["fits"] = self.fits
        out["verdict"] = self.verdict()
        return out

    def _rank_rows(self) -> list[tuple[str, int, int, int]]:
        rows: list[tuple[str, int, int, int]] = []
        start = 0
        for r in range(1, self.world + 1):
            if r < self.world and (self.params[r], self.grads[r], self.optimizer[r]) == (
                self.params[start],
                self.grads[start],
                self.optimizer[start],
            ):
                continue
            name = f"rank {start}" if r - 1 == start else f"ranks {start}-{r - 1}"
            rows.append((name, self.params[start], self.grads[start], self.optimizer[start]))
            start = r
        return rows

    def format(self) -> str:
        """The report as a table."""
        shape = " as " + " x ".join(f"{k} {v}" for k, v in self.mesh.items()) if self.mesh else ""
        lines = [
            f"dry run: {self.strategy} on {self.world} rank(s){shape}, "
            f"{_count(self.parameters)} "
            f"parameters, {self.micro_steps} micro-step(s) per step (fake process group and "
            f"fake tensors: nothing allocated; {self.elapsed:.1f} s)",
            "",
            f"{'per rank':<18}{'params':>14}{'grads':>14}{'optimizer':>14}",
        ]
        for name, p, g, o in self._rank_rows():
            lines.append(f"  {name:<16}{_gib(p):>14}{_gib(g):>14}{_gib(o):>14}")
        parts = ", ".join(
            f"{k} {_gib(v)}"
            for k, v in sorted(self.peak_breakdown.items(), key=lambda kv: -kv[1])
            if v
        )
        lines += [
            f"activations (saved by one micro-step's forward): {_gib(self.activations)}",
            f"peak estimate (rank 0, {self.tracker}): {_gib(self.peak)} = {parts}",
            "",
        ]
        if self.bandwidth is not None:
            link = f" ({self.interconnect})" if self.interconnect else ""
            model = (
                f"{(self.latency or 0.0) * 1e6:.0f} us + ring bytes / "
                f"{self.bandwidth / 1e9:.1f} GB/s per collective{link}"
            )
        else:
            model = "no bandwidth given: times not estimated"
        if self.links:
            own = "; ".join(
                f"{dim}: {lat * 1e6:.0f} us + ring bytes / {bw / 1e9:.1f} GB/s ({label})"
                for dim, (bw, lat, label) in self.links.items()
            )
            rest = model if self.bandwidth is not None else "not estimated"
            model = f"{own}; other dims: {rest}"
        lines.append(f"collectives of one step (time: {model})")
        # a mesh dim column only on a mesh: the 1-D world's table stays as it was
        dims = any(r.dim != "world" for r in self.collectives)
        dim_head = f"{'mesh dim':<14}" if dims else ""
        lines.append(
            f"  {dim_head}{'kind':<16}{'count':>7}{'buffers':>14}{'sent per rank':>15}{'ms':>10}"
        )
        for row in self.collectives:
            ms = "-" if math.isnan(row.seconds) else f"{row.seconds * 1e3:.3f}"
            lines.append(
                f"  {f'{row.dim:<14}' if dims else ''}{row.kind:<16}{row.count:>7}"
                f"{_gib(row.buffer_bytes):>14}{_gib(row.ring_bytes):>15}{ms:>10}"
            )
        if not self.collectives:
            lines.append("  (none)")
        else:
            total = "-" if math.isnan(self.comm_seconds) else f"{self.comm_seconds * 1e3:.3f}"
            lines.append(
                f"  {dim_head and ' ' * 14}{'total':<16}{sum(r.count for r in self.collectives):>7}"
                f"{_gib(sum(r.buffer_bytes for r in self.collectives)):>14}"
                f"{_gib(sum(r.ring_bytes for r in self.collectives)):>15}{total:>10}"
            )
        lines += ["", self.verdict()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = format
