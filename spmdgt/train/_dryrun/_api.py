"""``dry_run``: the entry point, from settings to report."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from spmdgt.train._comm import CommunicationProfiler
from spmdgt.train._config import TrainConfig, load_train_config, override
from spmdgt.train._dryrun._fake import _check_world, _fake_mode, fake_world
from spmdgt.train._dryrun._report import CollectiveRow, DryRunReport
from spmdgt.train._dryrun._step import _simulate
from spmdgt.train._dryrun._tables import (
    DEFAULT_LATENCY,
    DEVICES,
    INTERCONNECTS,
    DryRunError,
    _lookup,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)

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
        return cls(world, memory, label, bw, lat, link, float(headroom))


def _resolve_config(
    config: TrainConfig | str | os.PathLike | None, strategy: str | None
) -> tuple[TrainConfig, list[str]]:
    cfg = config if isinstance(config, TrainConfig) else None
    if cfg is None:
        cfg = load_train_config(config) if config is not None else TrainConfig()
    cfg = override(cfg, strategy=strategy)
    notes = []
    if cfg.compile:
        notes.append("compile=True is not dry-run: the step ran eagerly (eager memory)")
    return cfg, notes


def _report(raw: dict, cfg: TrainConfig, s: _Settings, t0: float, notes: list[str]) -> DryRunReport:
    rows: list[CollectiveRow] = []
    comm = 0.0
    by_dim = raw["collectives"]  # {dim: {kind: {count, bytes}}}
    sizes = raw["sizes"]
    if by_dim:
        if s.bandwidth is not None:
            prof = CommunicationProfiler(bandwidth=s.bandwidth, latency=s.latency)
            est = prof.estimate_counted_by_dim(by_dim, sizes)
            comm = est["total"]["estimated_sec"]
        else:
            est = {}
            for dim, totals in by_dim.items():
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
        mesh={k: v for k, v in sizes.items() if k != "world"} or None,
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
        device_memory=s.device_memory,
        device=s.device,
        headroom=s.headroom,
        tracker=raw["tracker"],
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
) -> DryRunReport:
    """One training step of ``world`` ranks, in this process, with nothing allocated.

    ``build()`` returns ``(model, optimizer, batch)``: the model as given to the trainer, its
    optimizer on ``model.parameters()`` and one rank's micro-batch, as the trainer's loop
    takes them (``(inputs, targets)`` with a ``loss_fn``, a dict, or the model's input). It
    runs under ``FakeTensorMode``: build as usual, nothing is allocated. ``config`` (a
    ``TrainConfig`` or YAML path) and ``strategy`` are the trainer's. ``device_memory``
    (``"80GB"``, bytes) or ``device`` (a ``DEVICES`` name) gives the verdict; ``bandwidth``
    (``"50GB/s"``, bytes/s) and ``latency`` or ``interconnect`` (an ``INTERCONNECTS`` name)
    give the collectives' times. Raises ``DryRunError`` on bad input, before building."""
    t0 = time.perf_counter()
    s = _Settings.resolve(world, device_memory, device, bandwidth, latency, interconnect, headroom)
    cfg, notes = _resolve_config(config, strategy)
    fake = _fake_mode()
    with fake_world(world) as mesh:
        with fake:
            model, optimizer, batch = build()
        raw = _simulate(model, optimizer, batch, cfg, world, mesh, fake, loss_fn, amp_dtype)
    return _report(raw, cfg, s, t0, notes)
