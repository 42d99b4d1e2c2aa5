"""``plan``: which parallelism, micro-batch, activation checkpointing and AMP to train a model
with on a world of devices, answered before launch.

The pieces, one job each: ``_model`` reads the model (on meta tensors: parameters by block and
root, the TP table ``placements: auto`` derives and the degrees it allows, FLOPs, ops),
``_calibrate`` runs a few dry runs of a two-block copy for the memory per row and per block,
``_space`` lists every config the trainer can run for the world and global batch, ``_cost``
prices each (memory per rank, compute, communication on each mesh dim's link, FSDP2's
overlap), ``_device`` holds the devices and links, ``_report`` ranks, explains and writes the
winner as the trainer's YAML. ``python -m spmdgt.scripts.plan`` is the command line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from spmdgt.train._config import TrainConfig
from spmdgt.train._loss import LossRule
from spmdgt.train._plan._calibrate import MemoryModel, calibrate, guess_loss_fn
from spmdgt.train._plan._cost import Estimate, price
from spmdgt.train._plan._device import DeviceSpec, budget_bytes, device_spec
from spmdgt.train._plan._model import ModelFacts, read_model
from spmdgt.train._plan._report import Plan, config_yaml
from spmdgt.train._plan._space import Candidate, enumerate_space

__all__ = [
    "Candidate",
    "DeviceSpec",
    "Estimate",
    "MemoryModel",
    "ModelFacts",
    "Plan",
    "config_yaml",
    "device_spec",
    "plan",
]


def _inputs(batch: object, loss_fn: Callable | None) -> object:
    """What the model's forward takes from one micro-batch (the trainer's split)."""
    if loss_fn is not None and isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


def _seq(inputs: object) -> int:
    """Tokens per row when the forward takes token ids (a 2-D integer tensor), else 0."""
    x = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if isinstance(x, torch.Tensor) and x.ndim == 2 and not x.is_floating_point():
        return int(x.shape[1])
    return 0


def _device(
    device: str | DeviceSpec,
    interconnect: str | None,
    intra: str | None,
    bandwidth: float | str | None,
    latency: float | str | None,
    per_node: int | None,
    profile: dict | str | os.PathLike | None = None,
) -> DeviceSpec:
    """The device as given, the ``cpu`` priced with a measured profile (a dict or the file
    ``_cpuprofile.save_profile`` wrote), or the named one with its links."""
    if isinstance(device, DeviceSpec):
        if profile is not None:
            raise ValueError("plan: give device_profile with device='cpu', not a DeviceSpec")
        return device
    if profile is not None:
        from spmdgt.train._plan._cpuprobe import cpu_spec
        from spmdgt.train._plan._cpuprofile import check_profile, load_profile

        links = {"interconnect": interconnect, "intra": intra, "bandwidth": bandwidth}
        links.update(latency=latency, per_node=per_node)
        given = [k for k, v in links.items() if v is not None]
        if device.lower() != "cpu" or given:
            raise ValueError(
                f"plan: device_profile is a measured cpu profile: it prices device='cpu' "
                f"with its own links (got device={device!r}"
                + (f" and {', '.join(given)}" if given else "")
                + ")"
            )
        if isinstance(profile, dict):
            return cpu_spec(check_profile(profile, "given"))
        return cpu_spec(load_profile(profile))
    return device_spec(
        device,
        interconnect=interconnect,
        intra=intra,
        bandwidth=bandwidth,
        latency=latency,
        per_node=per_node,
    )


def _read(
    model: nn.Module, inputs: object, dev: DeviceSpec, world: int, loss_fn: Callable | None, say
) -> ModelFacts:
    """The model's facts, and a progress line on what it allows."""
    say(f"plan: reading {type(model).__name__} (meta copy)")
    facts = read_model(model, inputs, loss_parallel=LossRule(model, loss_fn).splits_logits)
    tp = (
        f"degrees {facts.tp_degrees(min(dev.per_node, world))[1:] or 'none'} ({facts.tp_why})"
        if facts.tp_table
        else f"not offered: {facts.tp_why}"
    )
    say(f"plan: {facts.parameters:,} parameters in {facts.blocks} blocks; TP {tp}")
    return facts


def _jobs() -> int:
    """Dry runs at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _rank(
    cands: list[Candidate],
    price_one: Callable[[Candidate], Estimate],
    budget: float,
    margin: float,
    say,
) -> tuple[list[Estimate], list[Estimate]]:
    """Every candidate priced: those that fit ``budget`` (with ``margin`` on their peak),
    fastest first, and those that do not, with why."""
    ranked, dropped = [], []
    for i, c in enumerate(cands):
        e = price_one(c)
        if e.memory * (1 + margin) > budget:
            e.fits = False
            e.why = (
                f"does not fit: {e.memory / 2**30:.3f} GiB + {margin:.0%} > "
                f"{budget / 2**30:.3f} GiB"
            )
            dropped.append(e)
        else:
            ranked.append(e)
        if (i + 1) % 500 == 0:
            say(f"plan: priced {i + 1}/{len(cands)}")
    ranked.sort(key=lambda e: (e.step, e.memory))
    return ranked, dropped


def _space(
    facts: ModelFacts,
    dev: DeviceSpec,
    world: int,
    global_batch: int,
    micro_batches: Sequence[int] | None,
    ac: tuple[bool, ...],
    amp: Sequence[bool],
    strategies: Sequence[str],
) -> tuple[list[Candidate], list[str]]:
    """The candidates for the world and batch, and the notes on what is not searched."""
    cands, notes = enumerate_space(
        world,
        global_batch,
        tp_degrees=facts.tp_degrees(min(dev.per_node, world)),
        per_node=dev.per_node,
        micro_batches=list(micro_batches) if micro_batches else None,
        ac=ac,
        amp=tuple(amp),
        strategies=tuple(strategies),
        sequence_parallel=facts.sequence_parallel,
    )
    if facts.tp_table is None:
        notes.append(f"no tensor parallelism: {facts.tp_why}")
    else:
        head = "the LM head split over the vocabulary (loss_parallel), " * facts.loss_parallel
        stream = (
            "the residual stream split over the sequence (sequence_parallel)"
            if facts.sequence_parallel
            else "the residual stream whole on every rank (no sequence parallelism: "
            f"{facts.sp_why})"
        )
        notes.append(f"tensor parallelism: {head}{stream}")
    notes.append("activation checkpointing: none or per block (the trainer has no selective mode)")
    return cands, notes


def plan(
    model: nn.Module,
    batch: object,
    *,
    world: int,
    device: str | DeviceSpec = "h100",
    global_batch: int | None = None,
    memory: float | str | None = None,
    headroom: float = 0.1,
    margin: float = 0.05,
    interconnect: str | None = None,
    intra: str | None = None,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    per_node: int | None = None,
    loss_fn: Callable | None = None,
    optimizer: Callable | None = None,
    micro_batches: Sequence[int] | None = None,
    ac: Sequence[bool] = (False, True),
    amp: Sequence[bool] = (False, True),
    strategies: Sequence[str] = ("ddp", "fsdp", "placements"),
    base: TrainConfig | None = None,
    memory_model: MemoryModel | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: int | None = None,
    device_profile: dict | str | os.PathLike | None = None,
) -> Plan:
    """Search every config the trainer can run ``model`` with on ``world`` devices, price
    each, and rank those that fit.

    ``model``: the module as given to the trainer (real, or on the ``meta`` device for a
    size not here; only its meta copy is read). ``batch``: one micro-batch as the trainer's
    loop takes it (``(inputs, targets)`` with a ``loss_fn``, a dict for Hugging Face models);
    its rows are the calibration's micro-batch and, times ``world``, the default global
    batch. ``device``: ``h100``, ``h200``, ``a100`` or ``cpu`` (this machine's measured peak),
    or a ``DeviceSpec`` (``_cpuprobe.cpu_spec``: the profile measured by the ranks);
    ``device_profile``: with ``device="cpu"``, a measured profile (``probe_cpu``'s dict, or
    the JSON file ``_cpuprofile.save_profile`` wrote, ``--cpu-profile``) to price with;
    ``memory`` the budget per device (default: the device's less ``headroom``);
    ``margin`` the share added to each predicted peak before it is compared (the dry run's
    peak is within a few percent of a real run's; the 4-rank benchmark measured real peaks up
    to 0.7% above the prediction); ``interconnect``/``intra`` the links across and inside
    nodes, ``bandwidth``/``latency`` one link for all. ``optimizer``: ``params -> Optimizer``
    (default AdamW). ``base``: the settings the plan does not decide (clipping, schedule),
    kept in the winner's config. ``micro_batches``, ``ac``, ``amp`` and ``strategies`` narrow
    the search (and the calibration: a memory model made for a narrow search refuses a wider
    one). ``jobs``: calibration dry runs at once (forked workers; default: the usable cores;
    1 runs them in this process)."""
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    dev = _device(device, interconnect, intra, bandwidth, latency, per_node, device_profile)
    budget = budget_bytes(dev, memory) if memory is not None else dev.memory * (1 - headroom)
    if loss_fn is None:
        loss_fn = guess_loss_fn(batch)
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params))
    inputs = _inputs(batch, loss_fn)
    facts = _read(model, inputs, dev, world, loss_fn, say)
    ac = tuple(ac) if facts.blocks else (False,)
    mem = memory_model or calibrate(
        model,
        batch,
        facts,
        loss_fn=loss_fn,
        optimizer=optimizer,
        log=say,
        needs=(True in ac, True in amp, "fsdp" in strategies),
        jobs=jobs or _jobs(),
    )
    global_batch = global_batch or mem.rows * world
    cands, notes = _space(facts, dev, world, global_batch, micro_batches, ac, amp, strategies)
    say(f"plan: pricing {len(cands)} candidates ({time.perf_counter() - t0:.1f}s in)")
    cfg = base or TrainConfig()
    seq, clip = _seq(inputs), cfg.training.max_grad_norm is not None
    ranked, dropped = _rank(
        cands,
        lambda c: price(
            c,
            facts,
            mem,
            dev,
            seq=seq,
            clip=clip,
            reshard_after_forward=cfg.fsdp.reshard_after_forward,
        ),
        budget,
        margin,
        say,
    )
    return Plan(
        world=world,
        global_batch=global_batch,
        device=dev,
        budget=budget,
        ranked=ranked,
        dropped=dropped,
        notes=[*notes, f"calibration dry runs: {'; '.join(mem.runs)}"],
        seconds=time.perf_counter() - t0,
        base=base,
        memory_model=mem,
    )
