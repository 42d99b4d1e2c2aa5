"""Communication cost: the collective algebra, measured latency and bandwidth, estimates.

Two pieces (the log of what a run issued is ``_comm``'s):

* ``measure_latency`` and ``measure_bandwidth`` probe the current process group as nccl-tests
  does: a small message per collective kind for the fixed cost of one collective (latency),
  a large all-reduce for the *bus* bandwidth (bytes each rank moves per second, ring algebra
  applied).
* ``CommunicationProfiler`` estimates a step's communication as a sum over its collectives of
  ``latency(kind) + ring bytes / bus bandwidth``, counting the collectives as the engines issue
  them: DDP one all-reduce per gradient bucket, FSDP2 one all-gather per sharded unit in
  forward and again in backward (when resharding after forward) and one reduce-scatter per
  unit, tensor-parallel placements one activation all-reduce per rowwise module in forward
  and per colwise module (whose input needs a gradient) in backward, plus the clip's norm.
  Ring bytes: all-reduce moves ``2(n-1)/n`` of the buffer per rank, all-gather and
  reduce-scatter ``(n-1)/n`` each. Without the latency term, 15 small FSDP collectives per
  step on 2 CPU ranks were estimated at 1.84 ms against 30.6 ms measured.

On a 2-D mesh ``CommunicationProfiler(mesh=...)`` probes and prices each dim on its own group
(``_comm_mesh``): TP's collectives inside a node, FSDP's across.

Works in a world of one (its own costs are 0; estimates for N ranks need ``bandwidth=``).
Under ``torchrun --nproc_per_node=N`` the probe runs on the default group, so every rank must
call it together.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Mapping

import torch

from spmdgt.interceptor._groups import WORLD
from spmdgt.train._comm_mesh import mesh_dims, probe_dims
from spmdgt.train._comm_probe import (
    _RING_FACTOR,
    KINDS,
    measure_bandwidth,
    measure_latency,
)
from spmdgt.train._units import fsdp_units

__all__ = ["KINDS", "CommunicationProfiler", "measure_bandwidth", "measure_latency"]


def _param_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None, pad_to: int = 1) -> int:
    """Bytes of the trainable parameters; ``pad_to`` rounds dim 0 up to a multiple (FSDP2
    pads every parameter's dim 0 to the world size so all shards are equal)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        numel = p.numel()  # a DTensor reports its global numel
        if pad_to > 1 and p.ndim > 0 and p.shape[0] % pad_to:
            numel = numel // p.shape[0] * (-(-p.shape[0] // pad_to) * pad_to)
        size = torch.empty((), dtype=dtype).element_size() if dtype else p.element_size()
        total += numel * size
    return total


def _ddp_bucket_bytes(
    model: torch.nn.Module, cap: int, first_cap: int, dtype: torch.dtype | None
) -> list[int]:
    """Bytes of each DDP gradient bucket, assigned as DDP's reducer does: parameters in reverse
    registration order (about the order their gradients become ready), one bucket list per
    dtype, a bucket closed once it reaches its limit (the first bucket ``first_cap``, the rest
    ``cap``). DDP rebuilds its buckets after the first step in the order gradients actually
    arrived; the count is the same whenever that order is the reverse of registration."""
    open_: dict[torch.dtype, int] = {}
    limits: dict[torch.dtype, int] = {}
    done: list[int] = []
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        key = dtype or p.dtype
        size = p.numel() * torch.empty((), dtype=key).element_size()
        open_[key] = open_.get(key, 0) + size
        if open_[key] >= limits.setdefault(key, first_cap):
            done.append(open_.pop(key))
            limits[key] = cap
    return done + [b for b in open_.values() if b]


def _per_kind(value: float | Mapping[str, float] | None) -> dict[str, float] | None:
    """One number for every kind, a mapping by kind, or None (probe it)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return dict.fromkeys(KINDS, float(value))
    bad = set(value) - set(KINDS)
    if bad:
        raise ValueError(f"unknown collective kind(s) {sorted(bad)}; expected {', '.join(KINDS)}")
    return {k: float(v) for k, v in value.items()}


class CommunicationProfiler:
    """Communication cost per optimizer step: estimated from algebra, measured in a run.

    Each collective costs ``latency[kind] + ring_bytes / bandwidth[kind]``: ``latency``
    (seconds per collective) from ``measure_latency``'s small-message probe, ``bandwidth``
    (bytes/s, bus bandwidth) from ``measure_bandwidth``'s large-message probe of the same kind
    with that latency taken off; each one float for every kind or a dict by kind. Both are
    probed on first use unless given (collective then: every rank makes the same estimate
    calls). Estimates give, per kind,
    the collectives, ring bytes per rank and seconds per step, and in total ``collectives``,
    ``bytes_per_rank``, ``latency_sec``, ``transfer_sec`` and ``estimated_sec``. Estimating
    for N ranks from a world of one, where there is nothing to probe, gives ``nan`` seconds
    unless both ``bandwidth`` and ``latency`` are passed: never a made-up 0.

    On an N-D mesh (``mesh=``, a ``DeviceMesh`` with dim names, e.g. the trainer's
    ``device_mesh``) every dim is its own link: ``latency_by_dim`` and ``bandwidths_by_dim``
    probe each dim's process group (``_comm_mesh.probe_dims``: collective, every rank, same
    order; ``probe_bytes`` is the bandwidth probe's message), and ``estimate_counted_by_dim``
    prices each dim's collectives with that dim's numbers and ring size: TP's inside ``tp``,
    FSDP's on ``dp_shard``. Without a mesh the only dim is ``world``. ``bandwidth`` and
    ``latency``, when given, are every dim's (a dry run for a fabric you don't have), or pass
    ``by_dim={dim: (bandwidth, latency)}`` for one link per dim.
    """

    def __init__(
        self,
        enabled: bool = True,
        bandwidth: float | Mapping[str, float] | None = None,
        latency: float | Mapping[str, float] | None = None,
        *,
        mesh: object | None = None,
        probe_bytes: int = 8 << 20,
        by_dim: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.enabled = enabled
        self._bandwidths = _per_kind(bandwidth)
        self._latency = _per_kind(latency)
        self.mesh = mesh
        self.probe_bytes = int(probe_bytes)
        self._dim_tables: tuple[dict, dict] | None = None
        if by_dim is not None:
            lat = {d: _per_kind(v[1]) or {} for d, v in by_dim.items()}
            bws = {d: _per_kind(v[0]) or {} for d, v in by_dim.items()}
            self._dim_tables = (lat, bws)

    def _tables_by_dim(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        if self._dim_tables is None:
            dims = mesh_dims(self.mesh)
            if self._bandwidths is not None and self._latency is not None:
                # given, not probed: the same link for every dim
                names = [d[0] for d in dims] or [WORLD]
                self._dim_tables = (
                    {d: dict(self._latency) for d in names},
                    {d: dict(self._bandwidths) for d in names},
                )
            elif self.enabled:
                self._dim_tables = probe_dims(dims, KINDS, bandwidth_bytes=self.probe_bytes)
            else:
                self._dim_tables = ({}, {})
        return self._dim_tables

    @property
    def latency_by_dim(self) -> dict[str, dict[str, float]]:
        """Seconds per collective by mesh dim and kind, each dim probed on its own group
        (collective on first use: every rank)."""
        return self._tables_by_dim()[0]

    @property
    def bandwidths_by_dim(self) -> dict[str, dict[str, float]]:
        """Bus bandwidth in bytes/s by mesh dim and kind (latency taken off), probed per dim."""
        return self._tables_by_dim()[1]

    def for_dim(self, dim: str) -> CommunicationProfiler:
        """A profiler that prices with ``dim``'s latency and bandwidth (probed per dim)."""
        lat, bws = self._tables_by_dim()
        if dim not in lat and self._bandwidths is not None and self._latency is not None:
            return CommunicationProfiler(self.enabled, dict(self._bandwidths), dict(self._latency))
        if dim not in lat:
            known = ", ".join(sorted(lat)) or "none (a world of one)"
            raise ValueError(f"no probe for mesh dim {dim!r}; probed dims: {known}")
        return CommunicationProfiler(self.enabled, dict(bws[dim]), dict(lat[dim]))

    def estimate_counted_by_dim(
        self,
        totals_by_dim: Mapping[str, Mapping[str, Mapping[str, float]]],
        sizes: Mapping[str, int] | None = None,
    ) -> dict[str, dict[str, float]]:
        """``estimate_counted`` per mesh dim: ``{dim: {kind: {count, bytes}}}`` (as
        ``CollectiveLog.totals_by_dim`` or a dry run gives them) priced with each dim's own
        latency and bandwidth over that dim's ring of ``sizes[dim]`` ranks (default: the
        mesh's sizes). Returns ``{dim: estimate}`` plus ``total``: ``collectives``,
        ``bytes_per_rank``, ``latency_sec``, ``transfer_sec``, ``estimated_sec`` summed over
        the dims (a dim's collectives do not overlap another's in this model)."""
        if sizes is None:
            sizes = {name: n for name, n, _ in mesh_dims(self.mesh)}
        out: dict[str, dict[str, float]] = {}
        keys = ("collectives", "bytes_per_rank", "latency_sec", "transfer_sec", "estimated_sec")
        total = dict.fromkeys(keys, 0.0)
        for dim, totals in totals_by_dim.items():
            n = sizes.get(dim)
            if n is None:
                raise ValueError(
                    f"collectives on mesh dim {dim!r}, whose size is not known; sizes: "
                    f"{dict(sizes)}"
                )
            prof = self if n <= 1 else self.for_dim(dim)
            est = prof.estimate_counted(totals, n)
            out[dim] = est
            for k in keys:
                total[k] += est[k]
        out["total"] = total
        return out

    @property
    def latency(self) -> dict[str, float]:
        """Seconds per collective by kind (``{}`` in a world of one, where nothing is sent)."""
        if self._latency is None:
            self._latency = measure_latency() if self.enabled else {}
        return self._latency

    @property
    def bandwidths(self) -> dict[str, float]:
        """Bus bandwidth by kind in bytes/s, each kind's latency removed (``{}`` in a world of
        one)."""
        if self._bandwidths is None:
            known = self.latency  # probed first: the bandwidth probes take it off
            self._bandwidths = (
                {k: measure_bandwidth(kind=k, latency=known[k]) for k in known}
                if self.enabled
                else {}
            )
        return self._bandwidths

    @property
    def bandwidth(self) -> float:
        """The all-reduce's bus bandwidth in bytes/s (0 in a world of one)."""
        return self.bandwidths.get("all_reduce", 0.0)

    def _cost(self, parts: dict[str, tuple[float, int]], world_size: int) -> dict[str, float]:
        """``parts``: kind -> (ring bytes per rank, collectives) per step."""
        out: dict[str, float] = {}
        one = world_size <= 1  # nothing moves
        lat = {} if one else self.latency
        bws = {} if one else self.bandwidths
        latency_sec = transfer_sec = 0.0
        for kind, (nbytes, count) in parts.items():
            # Unknown where there is no peer to probe (a world of one estimating for N ranks
            # without bandwidth= and latency=): nan, never a made-up 0.
            lat_k = 0.0 if one else lat.get(kind, math.nan)
            bw = bws.get(kind, math.nan)
            t_lat = count * lat_k if count else 0.0
            t_xfer = 0.0 if one or not nbytes else (nbytes / bw if bw > 0 else math.nan)
            out[f"{kind}_bytes"] = nbytes
            out[f"{kind}_count"] = count
            out[f"{kind}_sec"] = t_lat + t_xfer
            out[f"{kind}_latency_per_collective_sec"] = lat_k
            out[f"{kind}_bandwidth_bytes_per_sec"] = 0.0 if one else bw
            latency_sec += t_lat
            transfer_sec += t_xfer
        total_bytes = sum(b for b, _ in parts.values())
        out.update(
            world_size=world_size,
            bytes_per_rank=total_bytes,
            collectives=sum(c for _, c in parts.values()),
            # effective over the kinds: bytes / transfer time
            bandwidth_bytes_per_sec=total_bytes / transfer_sec if transfer_sec else 0.0,
            latency_sec=latency_sec,
            transfer_sec=transfer_sec,
            estimated_sec=latency_sec + transfer_sec,
        )
        if not one and math.isnan(transfer_sec):
            out["bandwidth_bytes_per_sec"] = math.nan
        return out

    def estimate_ddp_comm_cost(
        self,
        model: torch.nn.Module,
        world_size: int,
        grad_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float | None = None,
    ) -> dict[str, float]:
        """DDP: one all-reduce per gradient bucket, ``2(n-1)/n * grad_bytes`` per rank in all.

        Buckets as DDP builds them with ``bucket_cap_mb`` (the trainer passes
        ``ddp.bucket_cap_mb``, 25 by default); ``first_bucket_mb`` defaults to the same, as
        when the cap is given explicitly (DDP's own default, no cap given, is 1 MiB)."""
        n = world_size
        cap = int(bucket_cap_mb * 2**20)
        first = cap if first_bucket_mb is None else int(first_bucket_mb * 2**20)
        buckets = _ddp_bucket_bytes(model, cap, first, grad_dtype)
        factor = _RING_FACTOR["all_reduce"](n)
        return self._cost({"all_reduce": (factor * sum(buckets), len(buckets))}, n)

    def estimate_fsdp_comm_cost(
        self,
        model: torch.nn.Module,
        world_size: int,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        micro_steps: int = 1,
    ) -> dict[str, float]:
        """FSDP2 as the trainer wraps ``model`` (unwrapped, as given to the trainer): one unit
        per block holding parameters (the direct children, each element of a ``ModuleList``)
        plus the root when it holds parameters of its own. Per micro-step, every unit is
        all-gathered in forward and again in backward (when resharding after forward); per
        optimizer step, every unit's gradients are reduce-scattered once (accumulation skips
        the others). ``(n-1)/n`` of each buffer per rank; buffers are the parameters with
        dim 0 padded to a multiple of ``n``, as FSDP2 lays them out."""
        n = world_size
        units = len(fsdp_units(model))
        gathers = (2 if reshard_after_forward else 1) * micro_steps
        ag = gathers * _RING_FACTOR["all_gather"](n) * _param_bytes(model, param_dtype, n)
        rs = _RING_FACTOR["reduce_scatter"](n) * _param_bytes(model, reduce_dtype, n)
        return self._cost({"all_gather": (ag, gathers * units), "reduce_scatter": (rs, units)}, n)

    def estimate_placements_comm_cost(
        self,
        model: torch.nn.Module,
        world_size: int,
        placements: Mapping[str, str],
        example_input: object,
        micro_steps: int = 1,
        clip: bool = True,
    ) -> dict[str, float]:
        """Tensor-parallel placements (``parallelize_module`` with Colwise/RowwiseParallel).

        Activations decide the bytes, so the unwrapped ``model`` runs one forward on
        ``example_input`` (one rank's micro-batch; under ``torch.autocast`` for AMP sizes) to
        record each placed module's input and output. Per micro-step: a rowwise module
        all-reduces its output in forward (partial sums), a colwise Linear all-reduces its
        input's gradient in backward when that input needs one (it does inside a network,
        not on raw data). Per optimizer step, ``clip=True`` adds one all-reduce for the global
        norm: one fp32 per parameter of the placed modules (their gradients are DTensors, and
        ``get_total_norm`` reduces their per-tensor norms together). Patterns match module
        names as the trainer's table does (first match wins, ``replicate`` places nothing)."""
        records: list[tuple[str, int, int]] = []  # (kind of traffic, bytes, calls)
        hooks = []
        placed_params = 0

        def style_of(name: str) -> str | None:
            for pattern, style in placements.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return style
            return None

        for name, module in model.named_modules():
            style = style_of(name) if name else None
            if style not in ("colwise", "rowwise"):
                continue
            placed_params += sum(1 for _ in module.parameters(recurse=False))

            def hook(mod, args, output, style=style, module=module):
                x = args[0] if args else None
                if style == "rowwise" and isinstance(output, torch.Tensor):
                    records.append(("fwd", output.numel() * output.element_size(), 1))
                if (
                    style == "colwise"
                    and isinstance(module, torch.nn.Linear)
                    and isinstance(x, torch.Tensor)
                    and x.requires_grad
                ):
                    records.append(("bwd", x.numel() * x.element_size(), 1))

            hooks.append(module.register_forward_hook(hook))
        try:
            was_training = model.training
            model.train()
            with torch.enable_grad():
                model(example_input)
        finally:
            for h in hooks:
                h.remove()
            model.train(was_training)
        n = world_size
        factor = _RING_FACTOR["all_reduce"](n)
        nbytes = micro_steps * sum(b for _, b, _ in records)
        count = micro_steps * len(records)
        if clip and placed_params:
            nbytes += 4 * placed_params  # one fp32 norm per sharded gradient
            count += 1
        return self._cost({"all_reduce": (factor * nbytes, count)}, n)

    def estimate_counted(
        self, totals: Mapping[str, Mapping[str, float]], world_size: int
    ) -> dict[str, float]:
        """The cost of collectives counted elsewhere (a dry run's, a ``CollectiveLog``'s):
        ``totals`` by kind, each with a ``count`` and the ``bytes`` of the full buffers, as
        ``CollectiveLog.totals`` gives them. Ring bytes per rank by the same algebra
        (``measured_bytes_per_rank``), then ``latency + bytes / bandwidth`` per collective.
        A kind the model has no probe for (``broadcast``, ``all_to_all``) is costed with the
        all-reduce's latency and bandwidth."""
        ring = self.measured_bytes_per_rank({k: dict(t) for k, t in totals.items()}, world_size)
        parts = {k: (ring[f"{k}_bytes"], int(t["count"])) for k, t in totals.items()}
        if world_size <= 1:
            return self._cost(parts, world_size)
        costed = copy.copy(self)  # this profiler's own tables stay as they are
        costed._latency = dict(self.latency)
        costed._bandwidths = dict(self.bandwidths)
        for k in set(totals) - set(KINDS):
            costed._latency.setdefault(k, costed._latency.get("all_reduce", math.nan))
            costed._bandwidths.setdefault(k, costed._bandwidths.get("all_reduce", math.nan))
        return costed._cost(parts, world_size)

    @staticmethod
    def measured_bytes_per_rank(
        totals: dict[str, dict[str, float]], world_size: int
    ) -> dict[str, float]:
        """Ring bytes per rank moved by the logged collectives (buffer bytes x ring factor)."""
        out = {}
        for kind, t in totals.items():
            factor = _RING_FACTOR.get(kind, lambda n: (n - 1) / n)(world_size)
            out[f"{kind}_bytes"] = factor * t["bytes"]
        out["bytes_per_rank"] = sum(out.values())
        return out

    def compare(
        self,
        estimate: dict[str, float],
        totals: dict[str, dict[str, float]],
        num_steps: int,
        world_size: int,
    ) -> str:
        """A side-by-side table per kind: estimated vs measured collectives, MB and ms per
        optimizer step (``totals`` from ``CollectiveLog.totals`` over ``num_steps`` steps)."""
        measured = self.measured_bytes_per_rank(totals, world_size)
        lines = [
            f"{'collective':<16}{'est n':>8}{'meas n':>8}{'est MB':>10}{'meas MB':>10}"
            f"{'est ms':>9}{'meas ms':>9}"
        ]
        kinds = sorted(
            {k[: -len("_count")] for k in estimate if k.endswith("_count")} | set(totals)
        )
        steps = max(num_steps, 1)
        for k in kinds:
            lines.append(
                f"{k:<16}{estimate.get(f'{k}_count', 0):>8.0f}"
                f"{totals.get(k, {}).get('count', 0) / steps:>8.1f}"
                f"{estimate.get(f'{k}_bytes', 0.0) / 1e6:>10.3f}"
                f"{measured.get(f'{k}_bytes', 0.0) / steps / 1e6:>10.3f}"
                f"{estimate.get(f'{k}_sec', 0.0) * 1e3:>9.2f}"
                f"{totals.get(k, {}).get('sec', 0.0) / steps * 1e3:>9.2f}"
            )
        terms = ", ".join(
            f"{k} {estimate[f'{k}_latency_per_collective_sec'] * 1e6:.0f} us + bytes / "
            f"{estimate[f'{k}_bandwidth_bytes_per_sec'] / 1e9:.2f} GB/s"
            for k in kinds
            if f"{k}_latency_per_collective_sec" in estimate
        )
        lines.append(
            f"model per collective: {terms}; estimated {estimate['estimated_sec'] * 1e3:.2f} "
            f"ms/step = {estimate['latency_sec'] * 1e3:.2f} latency + "
            f"{estimate['transfer_sec'] * 1e3:.2f} transfer"
        )
        return "\n".join(lines)
