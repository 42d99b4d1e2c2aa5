"""``dry_run``: the entry point, from settings to report."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spmdgt.train._comm import CommunicationProfiler
from spmdgt.train._config import TrainConfig, load_train_config, override
from spmdgt.train._dryrun._fake import _backend_memory, _check_world
from spmdgt.train._dryrun._report import CollectiveRow, DryRunReport
from spmdgt.train._dryrun._session import DrySession
from spmdgt.train._dryrun._tables import (
    DEFAULT_LATENCY,
    DEVICES,
    INTERCONNECTS,
    DryRunError,
    _key,
    _lookup,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)
from spmdgt.train._layout import DIMS

__all__ = ["dry_run"]

# --------------------------------------------------------------------------- entry points


@dataclass
class _Settings:
    """The dry run's inputs that are not the model: checked before anything runs."""

    world: int
    device_memory: float | None
    device: str | None
    bandwidth: float | None
    latency: float | None
    interconnect: str | None
    headroom: float
    links: dict[str, tuple[float, float, str]] | None = None
    """Per mesh dim: (bandwidth, latency, label): TP's link beside FSDP's."""

    @classmethod
    def resolve(
        cls,
        world: int,
        device_memory: float | str | None,
        device: str | None,
        bandwidth: float | str | None,
        latency: float | str | None,
        interconnect: str | None,
        headroom: float,
        links: Mapping[str, str] | None = None,
    ) -> _Settings:
        _check_world(world)
        label = None
        memory = parse_bytes(device_memory) if device_memory is not None else None
        if device is not None:
            name = _lookup(DEVICES, device, "device", "device_memory")
            size, label = DEVICES[name]
            memory = memory if memory is not None else float(size)
        link = None
        bw = parse_bandwidth(bandwidth) if bandwidth is not None else None
        lat = parse_seconds(latency) if latency is not None else None
        if interconnect is not None:
            name = _lookup(INTERCONNECTS, interconnect, "interconnect", "bandwidth")
            table_bw, table_lat, link = INTERCONNECTS[name]
            bw = bw if bw is not None else table_bw
            lat = lat if lat is not None else table_lat
        if bw is not None and lat is None:
            lat = DEFAULT_LATENCY
        if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
            raise DryRunError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        return cls(world, memory, label, bw, lat, link, float(headroom), _links(links))


MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "world")  # what a link may be given for


def _links(links: Mapping[str, str] | None) -> dict[str, tuple[float, float, str]] | None:
    """``{"tp": "nvlink4", "dp_shard": "50GB/s"}`` -> per dim (bandwidth, latency, label): an
    interconnect's bandwidth and latency, or a bandwidth with ``DEFAULT_LATENCY``."""
    if not links:
        return None
    out = {}
    for dim, value in links.items():
        if dim not in MESH_DIMS:
            raise DryRunError(f"a link for mesh dim {dim!r}; the dims are {', '.join(MESH_DIMS)}")
        key = {_key(k): k for k in INTERCONNECTS}.get(_key(str(value)))
        if key is not None:
            bw, lat, label = INTERCONNECTS[key]
            out[dim] = (float(bw), float(lat), label)
        else:
            bw = parse_bandwidth(value)
            out[dim] = (bw, DEFAULT_LATENCY, f"{bw / 1e9:g} GB/s")
    return out


def _dim_profiler(s: _Settings, dim: str) -> CommunicationProfiler | None:
    """What prices ``dim``'s collectives: its own link, else the one bandwidth given, else
    nothing (times not estimated)."""
    if s.links and dim in s.links:
        bw, lat, _ = s.links[dim]
        return CommunicationProfiler(bandwidth=bw, latency=lat)
    if s.links and dim not in MESH_DIMS[:3]:
        # a dim over several (the world, dp_shard x tp flattened): its ring crosses each
        # dim's link, so it goes at the slowest given
        bw, lat, _ = min(s.links.values(), key=lambda link: (link[0], -link[1]))
        return CommunicationProfiler(bandwidth=bw, latency=lat)
    if s.bandwidth is not None:
        return CommunicationProfiler(bandwidth=s.bandwidth, latency=s.latency)
    return None


def _resolve_config(
    config: TrainConfig | str | os.PathLike | None, strategy: str | None
) -> TrainConfig:
    """The trainer's config as the dry run is asked for it (validated before anything runs)."""
    cfg = config if isinstance(config, TrainConfig) else None
    if cfg is None:
        cfg = load_train_config(config) if config is not None else TrainConfig()
    return override(cfg, strategy=strategy)


def _report(raw: dict, cfg: TrainConfig, s: _Settings, t0: float, notes: list[str]) -> DryRunReport:
    rows: list[CollectiveRow] = []
    comm = 0.0
    by_dim = raw["collectives"]  # {dim: {kind: {count, bytes}}}
    sizes = raw["sizes"]
    if by_dim:
        est = {}
        for dim, totals in by_dim.items():
            prof = _dim_profiler(s, dim)
            if prof is not None:
                est[dim] = prof.estimate_counted(totals, sizes[dim])
                comm += est[dim]["estimated_sec"]
                continue
            ring = CommunicationProfiler.measured_bytes_per_rank(
                {k: dict(v) for k, v in totals.items()}, sizes[dim]
            )
            est[dim] = {f"{k}_bytes": ring[f"{k}_bytes"] for k in totals}
            est[dim].update({f"{k}_sec": math.nan for k in totals})
            comm = math.nan
        for dim in sorted(by_dim, key=_dim_order):
            totals = by_dim[dim]
            for kind in sorted(totals):
                rows.append(
                    CollectiveRow(
                        kind,
                        int(totals[kind]["count"]),
                        int(totals[kind]["bytes"]),
                        float(est[dim][f"{kind}_bytes"]),
                        float(est[dim][f"{kind}_sec"]),
                        dim,
                    )
                )
    if s.world > 1:
        notes = [
            *notes,
            f"the trainer adds one small all-reduce (the loss flush) every {cfg.log_every} "
            "steps, not counted here",
        ]
    return DryRunReport(
        mesh={k: v for k, v in sizes.items() if k in DIMS} or None,
        world=s.world,
        strategy=cfg.strategy if s.world > 1 else f"{cfg.strategy} (world of one: unwrapped)",
        parameters=raw["parameters"],
        micro_steps=cfg.training.gradient_accumulation_steps,
        params=raw["params"],
        grads=raw["grads"],
        optimizer=raw["optimizer"],
        activations=raw["activations"],
        peak=raw["peak"],
        peak_breakdown=raw["breakdown"],
        collectives=rows,
        comm_seconds=comm,
        bandwidth=s.bandwidth,
        latency=s.latency,
        interconnect=s.interconnect,
        links={d: (bw, lat, label) for d, (bw, lat, label) in (s.links or {}).items()} or None,
        device_memory=s.device_memory,
        device=s.device,
        headroom=s.headroom,
        tracker=raw["tracker"],
        before_backward=raw.get("before_backward", {}),
        backward_peaks=raw.get("backward_peaks", {}),
        step_peak=raw.get("step_peak", {}),
        elapsed=time.perf_counter() - t0,
        notes=notes,
    )


# the mesh's own order, then anything else: rows read TP's, FSDP's, then the world's
_DIMS = ("tp", "dp_shard", "dp_replicate", "world")


def _dim_order(dim: str) -> tuple[int, str]:
    return (_DIMS.index(dim) if dim in _DIMS else len(_DIMS), dim)


def dry_run(
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, object]],
    world: int,
    config: TrainConfig | str | os.PathLike | None = None,
    *,
    strategy: str | None = None,
    loss_fn: Callable | None = None,
    device_memory: float | str | None = None,
    device: str | None = None,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    interconnect: str | None = None,
    headroom: float = 0.1,
    amp_dtype: torch.dtype = torch.bfloat16,
    links: Mapping[str, str] | None = None,
    backend: str = "nccl",
) -> DryRunReport:
    """Two steps of the trainer on ``world`` ranks, in this process, with nothing allocated:
    the ``DistributedTrainer`` itself, built on the fake world (``DrySession``).

    ``build()`` returns ``(model, optimizer, batch)``: the model as given to the trainer, its
    optimizer on ``model.parameters()`` and one rank's micro-batch, as the trainer's loop
    takes them (``(inputs, targets)`` with a ``loss_fn``, a dict, or the model's input). It
    runs under ``FakeTensorMode``: build as usual, nothing is allocated. ``config`` (a
    ``TrainConfig`` or YAML path) and ``strategy`` are the trainer's. ``device_memory``
    (``"80GB"``, bytes) or ``device`` (a ``DEVICES`` name) gives the verdict; ``bandwidth``
    (``"50GB/s"``, bytes/s) and ``latency`` or ``interconnect`` (an ``INTERCONNECTS`` name)
    give the collectives' times; ``links`` gives a mesh dim its own (``{"tp": "nvlink4",
    "dp_shard": "ib-ndr"}``: an interconnect name or a bandwidth). ``backend`` is the process
    group's whose memory is modelled: ``"nccl"``, or ``"gloo"`` (its reduce-scatter works on a
    copy of its input). Raises ``DryRunError`` on bad input, before building."""
    from spmdgt.train._trainer import DistributedTrainer

    t0 = time.perf_counter()
    s = _Settings.resolve(
        world, device_memory, device, bandwidth, latency, interconnect, headroom, links
    )
    cfg = _resolve_config(config, strategy)
    _backend_memory(backend)  # refused before anything is built
    session = DrySession(
        world, on_report=lambda raw, c, notes: _report(raw, c, s, t0, notes), backend=backend
    )
    with session.world_of_ranks():
        with session.fake:
            model, optimizer, batch = build()
        trainer = DistributedTrainer(
            model, optimizer, loss_fn=loss_fn, config=cfg, amp_dtype=amp_dtype
        )
        return session.report(trainer, batch)
