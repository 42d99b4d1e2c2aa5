"""``DistributedTrainer``: one training loop over DDP, FSDP2 or tensor-parallel placements.

Run on one process with plain ``python train.py`` (nothing is wrapped, no process group is
made) or on N with ``torchrun --nproc_per_node=N train.py`` (gloo on CPU, NCCL on CUDA). Every
rank runs the same loop; rank 0 alone prints, draws the progress bar and writes TensorBoard.

The loop, per optimizer step: ``gradient_accumulation_steps`` micro-steps (forward under
autocast when AMP is on, backward on ``loss / micro_steps``, or for an HF token loss on the
loss over the step's label tokens counted on every data-parallel rank, HF's
``num_items_in_batch`` (``_batches.step_label_tokens``); all but the last inside
``no_sync``, so gradients are communicated once per step), optional global-norm clipping
(correct for sharded parameters), the optimizer and scheduler step, a checkpoint every
``checkpoint.every_steps``.

This module holds the trainer's setup (config, AMP, the compile agreement, the ``Layout``
built once, the wrapping), ``train`` and ``evaluate``. The rest, one job each: ``_layout``
(the meshes and data-parallel size), ``_loss`` (the HF loss rules), ``_loop`` (the loop's
steps), ``_resume`` (checkpoints), ``_strategies`` (the wrapping), ``_data`` (sharding a
loader over the layout), ``_summary`` (what is measured and how); ``_dryrun`` runs this
trainer on a fake process group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from spmdgt import compile as gt_compile
from spmdgt import runtime
from spmdgt.config import ConfigError
from spmdgt.train._batches import agree_on_group, check_loader, split_batch, to_device
from spmdgt.train._compile import compile_disabled_by_env
from spmdgt.train._config import TrainConfig, load_train_config, override
from spmdgt.train._data import shard_loader
from spmdgt.train._layout import Layout, build_layout, describe_groups, tp_group
from spmdgt.train._loop import TrainLoop
from spmdgt.train._loss import LossRule
from spmdgt.train._resume import CheckpointMixin
from spmdgt.train._run import detach_comm_sink
from spmdgt.train._schedule import build_scheduler
from spmdgt.train._strategies import Wrapped, all_reduce_mean, wrap_model
from spmdgt.train._throughput import Throughput

__all__ = ["DistributedTrainer"]


def _as_config(config: TrainConfig | str | os.PathLike | None) -> TrainConfig:
    """``config`` as a ``TrainConfig``: as given, read from a YAML path, or the defaults."""
    if config is None:
        return TrainConfig()
    if isinstance(config, TrainConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_train_config(config)
    raise TypeError(f"config must be a TrainConfig or a YAML path, got {type(config)}")


class DistributedTrainer(TrainLoop, CheckpointMixin):
    """Train ``model`` with ``optimizer`` on every rank under one of three strategies.

    Batches are ``(inputs, targets)`` and the loss is ``loss_fn(model(inputs), targets)``;
    with ``loss_fn=None`` the model's output (a scalar tensor) is the loss, and a batch that is
    not a pair is passed to the model whole. A dict batch is passed as keywords,
    ``model(**batch)``, and an output with a ``loss`` (Hugging Face's ``ModelOutput``) gives
    the loss, as in HF's ``Trainer``; with a ``loss_fn``, a dict's ``labels`` are its targets
    and the output's ``logits`` its input (``_batches.split_batch``/``loss_from_output``).

    ``config`` (a ``TrainConfig`` or a YAML path) is the place for settings. The keyword
    arguments named like its fields (``strategy``, ``use_amp``, ``gradient_accumulation_steps``,
    ``find_unused_parameters`` (``ddp.``), ``max_grad_norm``, ``logdir``, ``log_every``,
    ``compile``) are kept as pass-throughs: a value given sets that field of ``self.config``
    (a new config, validated like the YAML: a ``ConfigError`` naming field and value; the
    caller's object is not changed), and ``None`` keeps the config's value, as does
    ``gradient_accumulation_steps=0``. ``backend``, ``scheduler`` (an object, else one is built from
    ``training.scheduler``) and ``amp_dtype`` are not config settings.

    The optimizer must be built on ``model.parameters()`` *before* it is given here; FSDP2 and
    tensor parallelism swap parameters for DTensors in place, so the trainer rebuilds the
    optimizer's param groups over the wrapped model's parameters (same order, same options).

    ``config.parallelism`` lays the ranks out on a ``(dp_replicate, dp_shard, tp)`` mesh
    (``device_mesh``; ``None`` for the default 1-D world), built once as ``layout``.
    ``data_parallel_size`` and ``data_parallel_rank`` say which rows this rank reads (on the
    1-D world the world size and rank; 1 and 0 for ``placements``): ``train`` and ``evaluate``
    shard a loader written as for 1-D over them (``_data.shard_loader``, as accelerate's
    ``prepare`` does), so the TP ranks of a data group share a batch whatever the mesh.

    On torch's fake process group (``spmdgt.train._dryrun``) the trainer is a dry run of
    itself: its wrapping runs on fake tensors and ``train`` measures two of its own steps.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        backend: str | None = None,
        use_amp: bool | None = None,
        gradient_accumulation_steps: int | None = None,
        find_unused_parameters: bool | None = None,
        max_grad_norm: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        logdir: str | None = None,
        config: TrainConfig | str | os.PathLike | None = None,
        *,
        amp_dtype: torch.dtype | None = None,
        log_every: int | None = None,
        compile: bool | None = None,
    ) -> None:
        self.rt = runtime.init(backend)
        # torch's fake process group: a dry run (spmdgt.train._dryrun) of this very trainer
        self._dry = _dry_session() if self.rt.backend == "fake" else None
        if self._dry is not None:
            config, strategy = self._dry.replace(config, strategy)
        self.config = override(
            _as_config(config),
            strategy=strategy,
            use_amp=use_amp,
            gradient_accumulation_steps=gradient_accumulation_steps or None,  # 0: the config's
            find_unused_parameters=find_unused_parameters,
            max_grad_norm=max_grad_norm,
            logdir=logdir,
            log_every=log_every,
            compile=compile,
        )
        if self._dry is not None:
            self.config = self._dry.eager(self.config)  # a dry run steps eagerly
        self.strategy = self.config.strategy
        self.loss_fn = loss_fn
        self.device = self.rt.device
        self.scaler, self.amp_dtype = self._setup_amp(amp_dtype)
        self.compile = self._decide_compile(self.config.compile)
        self.optimizer = optimizer
        self.throughput = Throughput(  # FLOPs from the model's shapes, read before wrapping
            model, self.device, self._compute_dtype(), self.rt.world_size
        )
        # the layout, built once: meshes, data-parallel size and rank, the batch's dims
        self.layout: Layout = self._build_layout()
        # the loss's rule: read from the model before wrapping (FSDP2 swaps its class)
        self.loss_rule = LossRule(model, loss_fn)
        self.loss_rule.warn_mean_of_means(self.layout.dp_size, self.accum, self.rt.rank)
        self.wrapped: Wrapped = self._wrap(model)
        self.model = self.wrapped.module
        self.scheduler = scheduler or build_scheduler(optimizer, self.config.training.scheduler)
        self.global_step = 0
        self._epoch = 0
        self._samples_in_epoch = 0  # global samples consumed in the current epoch
        self._resumed_from: str | None = None

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different rows (``layout.dp_size``; 1 for ``placements``)."""
        return self.layout.dp_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank (``layout.dp_rank``): the rows it reads."""
        return self.layout.dp_rank

    @property
    def device_mesh(self) -> object | None:
        """The ``parallelism`` block's ``(dp_replicate, dp_shard, tp)`` mesh; ``None`` on the
        1-D world."""
        return self.layout.mesh

    @property
    def _loss_tokens(self) -> str | None:
        """HF's ``num_items_in_batch`` rule of this model (``LossRule.tokens``)."""
        return self.loss_rule.tokens

    @_loss_tokens.setter
    def _loss_tokens(self, rule: str | None) -> None:
        self.loss_rule.tokens = rule

    # The settings the loop reads, from the config (the one place they are kept).

    @property
    def accum(self) -> int:
        """Micro-steps per optimizer step (``training.gradient_accumulation_steps``)."""
        return self.config.training.gradient_accumulation_steps

    @property
    def max_grad_norm(self) -> float | None:
        """Global gradient-norm clip (``training.max_grad_norm``); ``None``: no clipping."""
        return self.config.training.max_grad_norm

    @property
    def logdir(self) -> str | None:
        """TensorBoard and profiler directory (``logdir``)."""
        return self.config.logdir

    @property
    def log_every(self) -> int:
        """Steps between loss reductions and progress lines (``log_every``)."""
        return self.config.log_every

    # ------------------------------------------------------------------ setup helpers

    def _setup_amp(
        self, amp_dtype: torch.dtype | None
    ) -> tuple[torch.amp.GradScaler | None, torch.dtype]:
        """The autocast dtype and, for fp16, the ``GradScaler``: bf16 on CPU; on CUDA bf16
        when the card has it, else fp16 + GradScaler (DDP only: FSDP's mixed precision is
        bf16). ``amp_dtype`` given picks the dtype."""
        if amp_dtype is None:
            amp_dtype = torch.bfloat16
            if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
                amp_dtype = torch.float16
        if not (self.config.training.use_amp and amp_dtype == torch.float16):
            return None, amp_dtype
        if self.device.type != "cuda" or self.strategy == "fsdp":
            raise ValueError(
                "fp16 AMP needs CUDA and the ddp strategy (FSDP mixed precision uses bf16)"
            )
        return torch.amp.GradScaler("cuda"), amp_dtype

    @property
    def _compiles(self) -> bool:
        """Whether torch.compile may run during steps (``compile: true``, or the
        ``GT_AUTO_COMPILE`` pass): its time is then counted and taken out of step times."""
        return self.compile or gt_compile.is_enabled()

    def _compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in (for the peak FLOP/s MFU is measured against): the AMP
        dtype under AMP or FSDP mixed precision, else fp32."""
        mixed = self.strategy == "fsdp" and self.config.fsdp.use_mixed_precision
        return self.amp_dtype if self.config.training.use_amp or mixed else torch.float32

    def _wrap(self, model: nn.Module) -> Wrapped:
        """Wrap ``model`` as the config says (``wrap_model``: TP, AC, compile, FSDP/DDP) and
        point the optimizer at the wrapped model's parameters."""
        old_params = list(model.parameters())
        known = {id(p) for p in old_params}
        if any(id(p) not in known for g in self.optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "the optimizer holds parameters that are not the model's; build it with "
                "optimizer_cls(model.parameters(), ...) on the model given here"
            )
        cfg = self.config
        wrapping = self._dry.wrapping(model) if self._dry else contextlib.nullcontext()
        with wrapping:
            wrapped = wrap_model(
                model,
                cfg,
                self.layout,
                amp_dtype=self.amp_dtype,
                compile=self.compile,
                loss_parallel=self.loss_rule.splits_logits,
            )
        self._rebind_optimizer(old_params, list(model.parameters()))
        if wrapped.placements is not None and cfg.placements == "auto":
            # the derived table from here on (the same on every rank: read from the model);
            # its sequence-parallel rows, if any, are in it now
            self.config = override(
                self.config, placements=wrapped.placements, sequence_parallel=False
            )
        return wrapped

    def _build_layout(self) -> Layout:
        """The ``parallelism`` block as this rank's ``Layout`` (collective when it makes a
        mesh), and the tensor-parallel groups said on rank 0."""
        building = self._dry.meshes() if self._dry else contextlib.nullcontext()
        with building:
            layout = build_layout(
                self.config.parallelism,
                self.strategy,
                self.rt.world_size,
                self.rt.rank,
                self.device,
                self.rt.backend,
            )
        groups = describe_groups(layout)  # collective on an N-D layout, every rank
        if groups:
            runtime.print0(f"spmdgt.train: {groups}")
        return layout

    def _decide_compile(self, asked: bool) -> bool:
        """Whether to compile: asked for and not vetoed by ``GT_COMPILE=0``, the same on every
        rank. In a world of more than one the ranks exchange their decision (one small
        all-gather, always, so the exchange itself never depends on the config): a config or
        environment that differs between ranks is an error on every rank, naming each rank's
        decision, never ranks running different code."""
        vetoed = asked and compile_disabled_by_env()
        if vetoed:
            runtime.print0("spmdgt.train: GT_COMPILE=0: compile=True ignored, training eagerly")
        want = asked and not vetoed
        if self.rt.world_size > 1 and self._dry is None:  # a fake world has no peers
            t = torch.tensor([int(asked), int(want)], device=self._comm_device())
            out = [torch.zeros_like(t) for _ in range(self.rt.world_size)]
            dist.all_gather(out, t)
            rows = [tuple(int(v) for v in o.tolist()) for o in out]
            if len(set(rows)) > 1:
                raise ConfigError(
                    "ranks disagree on compiling the model (the compile setting or GT_COMPILE "
                    "differs between ranks): "
                    + ", ".join(
                        f"rank {r}: {'compile' if w else 'eager'}"
                        + (" (GT_COMPILE=0)" if a and not w else "")
                        for r, (a, w) in enumerate(rows)
                    ),
                    key="compile",
                    value=asked,
                )
        return want

    def _rebind_optimizer(self, old: list[nn.Parameter], new: list[nn.Parameter]) -> None:
        """Point the optimizer at the wrapped model's parameters (FSDP/TP replace them)."""
        if all(a is b for a, b in zip(old, new)) and len(old) == len(new):
            return
        index = {id(p): i for i, p in enumerate(old)}
        if self.optimizer.state:
            raise ValueError("the optimizer already has state; hand it over before any step")
        for group in self.optimizer.param_groups:
            try:
                group["params"] = [new[index[id(p)]] for p in group["params"]]
            except KeyError:
                raise ValueError(
                    "the optimizer holds parameters that are not the model's; build it with "
                    "optimizer_cls(model.parameters(), ...)"
                ) from None

    def _unpack(self, batch: object) -> tuple[object, object]:
        inputs, targets = split_batch(batch, self.loss_fn is not None)
        return to_device(inputs, self.device), to_device(targets, self.device)

    def _loss(
        self, inputs: object, targets: object, num_items: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One micro-batch's forward and loss, by the model's ``LossRule``."""
        return self.loss_rule.loss(
            self.model,
            inputs,
            targets,
            num_items,
            world_size=self.rt.world_size,
            comm_device=self._comm_device(),
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.wrapped.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _tp_group(self) -> object:
        """The tensor-parallel process group on a mesh with a ``tp`` dim > 1, else ``None``."""
        return tp_group(self.layout)

    def _comm_device(self) -> torch.device:
        return self.device if self.rt.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ the loop

    def train(
        self,
        train_loader: Iterable,
        val_loader: Iterable | None = None,
        epochs: int | None = None,
        profile: bool | None = None,
        max_steps: int | None = None,
    ) -> dict:
        """Train for ``epochs`` (or until ``max_steps`` optimizer steps); return the summary.

        ``epochs``, ``profile`` and ``max_steps`` are the config's ``training.epochs``,
        ``profile`` and ``training.max_steps`` (the config is the place for them), overridden
        for this call only when given (``epochs=0`` keeps the config's). Resumes from the newest
        checkpoint in ``checkpoint.dir`` when ``checkpoint.resume`` is set. The summary dict is
        printed on rank 0 as "Training Summary".

        The loop, as torchtitan's trainer splits it: ``_train_epoch`` per epoch (validation
        after each), ``_train_step`` per optimizer step, ``_end_step`` for what follows a step
        (statistics, the loss flush, a checkpoint), ``_finish`` for the summary.
        """
        train_loader = shard_loader(train_loader, self.layout)
        if self._dry is not None:  # a dry run: two of this trainer's steps, measured
            return self._dry.train(self, train_loader)
        cfg = override(self.config, epochs=epochs or None, profile=profile, max_steps=max_steps)
        self._resume_if_asked()
        n_batches = check_loader(train_loader, "training", self.rt, self._comm_device())
        run = self._start_run(cfg, n_batches)
        if run.prof is not None:
            run.prof.__enter__()
        try:
            for epoch in range(self._epoch, cfg.training.epochs):
                if self._train_epoch(run, train_loader, epoch):
                    break  # max_steps reached: the epoch stays unfinished (a resume continues it)
                self._samples_in_epoch = 0
                self._epoch = epoch + 1
                if val_loader is not None:
                    run.val_loss = self.evaluate(val_loader)
                    run.metrics.scalars(self.global_step, {"val/loss": run.val_loss})
        finally:
            if run.prof is not None:
                run.prof.__exit__(None, None, None)
            detach_comm_sink(run.sink, run.own_interceptor)
            run.bar.close()
        return self._finish(run)

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> float:
        """Mean loss over ``loader`` (per-rank mean, then averaged across ranks).

        Collective: forward passes communicate (FSDP gathers, tensor-parallel reductions, DDP
        buffer broadcasts), so every rank must run as many batches. Sized loaders are checked
        for equal lengths once; for unsized ones ranks agree before each batch."""
        loader = shard_loader(loader, self.layout)
        n_batches = check_loader(loader, "validation", self.rt, self._comm_device())
        agree = n_batches is None and self.rt.world_size > 1
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        n = 0
        batches = iter(loader)
        while True:
            batch = next(batches, _END)
            if (
                agree
                and agree_on_group(
                    [] if batch is _END else [batch], "validation", self.rt, self._comm_device()
                )
                == 0
            ):
                break
            if batch is _END:
                break
            inputs, targets = self._unpack(batch)
            with self._autocast():
                total += self._loss(inputs, targets).double().cpu()
            n += 1
        self.model.train()
        mean = total / max(n, 1)
        return float(all_reduce_mean(mean.to(self._comm_device())).item())


_END = object()  # the end of an iterator, for next(it, _END)


def _dry_session() -> object:
    """The dry run this trainer is part of (the fake process group is its world)."""
    from spmdgt.train._dryrun._session import active_session

    return active_session()
