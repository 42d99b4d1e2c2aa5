"""The step a dry run measures: the trainer's loop (micro-steps under ``no_sync`` but the last,
the loss over their count, the ``sharded_input`` gradients' sum over ``tp``, the clip, the
optimizer) run twice on the fake world under torch's memory trackers, the second step's
collectives counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from spmdgt.train._batches import call_model, loss_from_output, split_batch
from spmdgt.train._config import TrainConfig
from spmdgt.train._dryrun._counting import CollectiveCounter, _bytes_per_rank, _optimizer_tensors
from spmdgt.train._dryrun._fake import (
    _dtensor_metadata_apart,
    _mesh_ranks_real,
    _rebind_optimizer,
    _rebuild_ddp_buckets,
    _wrappable,
)
from spmdgt.train._memory import memory_tracker
from spmdgt.train._strategies import Wrapped, clip_grad_norm, wrap_model

__all__ = []

# --------------------------------------------------------------------------- the step


def _loss(
    wrapped: Wrapped,
    inputs: object,
    targets: object,
    loss_fn: Callable | None,
) -> torch.Tensor:
    """The trainer's forward and loss (``DistributedTrainer._loss``)."""
    dtype = wrapped.autocast_dtype
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        out = loss_from_output(call_model(wrapped.module, inputs), loss_fn is not None)
        loss = loss_fn(out, targets) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(
            "the loss must be a scalar tensor (pass loss_fn=..., or a model that returns "
            f"its loss), got {type(loss).__name__}"
        )
    if hasattr(loss, "full_tensor"):  # a DTensor loss (tensor parallel)
        loss = loss.full_tensor()
    return loss


def _train_step(
    wrapped: Wrapped,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    inputs: object,
    targets: object,
    loss_fn: Callable | None,
    micro_steps: int,
    max_grad_norm: float | None,
    before_forward: Callable[[], None],
    after_forward: Callable[[], None],
) -> None:
    """One optimizer step as ``DistributedTrainer._train_step`` takes it: micro-steps under
    ``no_sync`` but the last, each loss divided by their count, the sum of the
    ``sharded_input`` gradients over ``tp``, clip, step, zero.
    ``before_forward`` and ``after_forward`` run around each micro-step's forward."""
    for micro in range(micro_steps):
        last = micro == micro_steps - 1
        before_forward()
        with contextlib.nullcontext() if last else wrapped.no_sync():
            scaled = _loss(wrapped, inputs, targets, loss_fn).float()
            after_forward()
            if micro_steps > 1:
                scaled = scaled / micro_steps
            scaled.backward()
    # the trainer's ``_optimizer_step``: sharded_input gradients summed over ``tp`` (one
    # all-reduce per dtype under FSDP x TP; nothing otherwise), then the clip
    wrapped.sum_partial_grads()
    if max_grad_norm is not None:
        clip_grad_norm(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracker(wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> tuple[object, str]:
    # the real trainer's choice (``_memory``): a dry run and a real run count alike
    return memory_tracker(wrapped.module, optimizer)


def _layout(cfg: TrainConfig, world: int, mesh: object) -> tuple[dict, dict[str, int]]:
    """The ``parallelism`` block on the fake world, as the trainer lays it out
    (``_mesh.build_layout`` for rank 0): ``wrap_model``'s mesh arguments (``{}`` on the 1-D
    world) and the size of each mesh dim the collectives can run on (``world`` included).
    Built outside the fake mode: the mesh holds real rank numbers."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from spmdgt.interceptor._groups import register_mesh
    from spmdgt.train._mesh import build_layout

    sizes = {"world": world}
    if world <= 1:
        return {}, sizes
    with unset_fake_temporarily():  # a script's train() is reached inside the fake mode
        layout = build_layout(cfg.parallelism, cfg.strategy, world, 0, torch.device("cpu"))
    if layout.mesh is None:
        return {"mesh": mesh}, sizes
    register_mesh(layout.mesh)
    for name in layout.mesh.mesh_dim_names:  # type: ignore[attr-defined]
        sizes[name] = layout.mesh[name].size()  # type: ignore[index]
    return {"mesh": None, **layout.wrap_kwargs()}, sizes


def _wrap_like_the_trainer(
    model: nn.Module, cfg: TrainConfig, world: int, meshes: dict, amp_dtype: torch.dtype
) -> Wrapped:
    """The trainer's own ``wrap_model`` with the trainer's config, on the fake world (eager:
    ``compile`` is off in a dry run); ``meshes``: ``_layout``'s mesh arguments."""
    with _wrappable(model):
        return wrap_model(
            model,
            cfg.strategy,
            device=torch.device("cpu"),
            world_size=world,
            backend="fake",
            use_amp=cfg.training.use_amp,
            amp_dtype=amp_dtype,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            ddp=cfg.ddp,
            fsdp=cfg.fsdp,
            placements=cfg.placements,
            compile=False,
            activation_checkpointing=cfg.activation_checkpointing,
            **({"mesh": None} | meshes),
        )


def _simulate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: object,
    cfg: TrainConfig,
    world: int,
    mesh: object,
    fake_mode: object,
    loss_fn: Callable | None,
    amp_dtype: torch.dtype,
) -> dict:
    """Wrap, run two steps under the trackers, measure. Returns the raw measurements."""
    old = list(model.parameters())
    known = {id(p) for p in old}
    if any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "the optimizer holds parameters that are not the model's; build it with "
            "optimizer_cls(model.parameters(), ...) on the model given here"
        )
    parameters = sum(p.numel() for p in old)
    grads: list[int] = []

    def probe(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        tensors = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grads[:] = _bytes_per_rank(tensors, world)

    activations = [0]

    def saved_activations() -> None:
        """The activations the forward saved, read at its end (their most)."""
        snap = tracker.get_tracker_snapshot("current")  # type: ignore[attr-defined]
        for per_device in snap.values():
            activations[0] = max(activations[0], int(per_device.get("Activation", 0)))

    meshes, sizes = _layout(cfg, world, mesh)
    with fake_mode, _dtensor_metadata_apart(), _mesh_ranks_real():  # type: ignore[attr-defined]
        wrapped = _wrap_like_the_trainer(model, cfg, world, meshes, amp_dtype)
        _rebind_optimizer(optimizer, old, list(model.parameters()))
        params = [p for p in wrapped.module.parameters() if p.requires_grad]
        inputs, targets = split_batch(batch, loss_fn is not None)
        tracker, tracker_name = _tracker(wrapped, optimizer)
        counter = CollectiveCounter()
        hook = optimizer.register_step_pre_hook(probe)
        wrapped.module.train()
        try:
            with tracker:  # type: ignore[attr-defined]
                for step in range(2):
                    if step == 1:
                        _rebuild_ddp_buckets(wrapped.module, fake_mode)
                    counter.step = step
                    with counter:
                        _train_step(
                            wrapped,
                            optimizer,
                            params,
                            inputs,
                            targets,
                            loss_fn,
                            cfg.training.gradient_accumulation_steps,
                            cfg.training.max_grad_norm,
                            # the trackers refuse a second forward of the root unless their
                            # per-module stats are reset; the peak stays
                            tracker.reset_mod_stats,  # type: ignore[attr-defined]
                            saved_activations,
                        )
        finally:
            hook.remove()
        snap = tracker.get_tracker_snapshot("peak")  # type: ignore[attr-defined]
    peak = next(iter(snap.values()), {"Total": 0})
    breakdown = {_CATEGORY.get(k, k.lower()): int(v) for k, v in peak.items() if k != "Total"}
    breakdown = {k: v for k, v in breakdown.items() if v}
    total = int(peak.get("Total", 0))
    if isinstance(wrapped.module, nn.parallel.DistributedDataParallel):
        # DDP's reducer keeps a flat bucket buffer per gradient bucket for the whole run
        # (created outside the tracker, so not in its peak): as many bytes as the gradients.
        buckets = sum(p.numel() * p.element_size() for p in params)
        breakdown["DDP gradient buckets"] = buckets
        total += buckets
    return {
        "parameters": parameters,
        "params": _bytes_per_rank(list(wrapped.module.parameters()), world),
        "grads": grads or [0] * world,
        "optimizer": _bytes_per_rank(_optimizer_tensors(optimizer), world),
        "activations": activations[0],
        "peak": total,
        "breakdown": breakdown,
        "collectives": counter.totals_by_dim(step=1),
        "sizes": sizes,
        "tracker": tracker_name,
    }


# The trackers' category names, as the report says them.
_CATEGORY = {
    "Sharded Param": "sharded params",
    "Unsharded Param": "unsharded params",
    "Parameter": "params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded grads",
    "Unsharded Grad": "unsharded grads",
    "Gradient": "grads",
    "Activation": "activations",
    "Temp": "backward temporaries",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Inputs": "inputs",
    "Other": "other",
}
