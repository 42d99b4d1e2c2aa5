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
``checkpoint.every_steps``. See ``_strategies`` for the wrapping, ``_checkpoint`` for the
atomic DCP checkpoints, ``_summary`` for what is measured and how.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from spmdgt import compile as gt_compile
from spmdgt import runtime
from spmdgt.config import ConfigError
from spmdgt.train import _hf_ce
from spmdgt.train._batches import (
    agree_on_group,
    batch_size_of,
    call_model,
    check_loader,
    check_same_batch,
    describe,
    loader_len,
    loss_from_output,
    loss_token_rule,
    num_samples,
    num_tokens,
    split_batch,
    step_label_tokens,
    to_device,
)
from spmdgt.train._checkpoint import (
    find_latest,
    load_checkpoint,
    on_rank0,
    resolve_checkpoint,
    save_checkpoint,
)
from spmdgt.train._compile import compile_disabled_by_env, compile_seconds
from spmdgt.train._config import TrainConfig, load_train_config, override
from spmdgt.train._data import ResumableDistributedSampler
from spmdgt.train._memory import MemoryMeter
from spmdgt.train._mesh import build_layout, data_parallel, describe_groups, tp_group
from spmdgt.train._profilers import cuda_peaks
from spmdgt.train._run import (
    Run,
    attach_comm_sink,
    attribute_collectives,
    comm_dim_summary,
    detach_comm_sink,
    make_profiler,
    step_scalars,
    window,
)
from spmdgt.train._schedule import build_scheduler
from spmdgt.train._strategies import Wrapped, all_reduce_mean, clip_grad_norm, wrap_model
from spmdgt.train._summary import (
    MetricsLogger,
    ProgressBar,
    RunStats,
    build_summary,
    format_summary,
)
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


class DistributedTrainer:
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
    (``device_mesh``; ``None`` for the default 1-D world). ``data_parallel_size`` and
    ``data_parallel_rank`` say which rows this rank reads: pass them to
    ``OptimizedDataLoader.create(..., num_replicas=, rank=)`` so the TP ranks of a data group
    share a batch (on the 1-D world they are the world size and rank; 1 and 0 for
    ``placements``).
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
        self.strategy = self.config.strategy
        self.loss_fn = loss_fn
        self.rt = runtime.init(backend)
        self.device = self.rt.device
        self.scaler, self.amp_dtype = self._setup_amp(amp_dtype)
        self.compile = self._decide_compile(self.config.compile)
        self.optimizer = optimizer
        self.throughput = Throughput(  # FLOPs from the model's shapes, read before wrapping
            model, self.device, self._compute_dtype(), self.rt.world_size
        )
        # which rows this rank reads, known before any mesh is built (the dry run builds none)
        self.layout = None  # set by _build_mesh, inside _wrap
        self.data_parallel_size, self.data_parallel_rank = data_parallel(
            self.config.parallelism, self.strategy, self.rt.world_size, self.rt.rank
        )
        # HF's num_items_in_batch: read from the model before wrapping (FSDP2 swaps its class)
        self._loss_tokens = loss_token_rule(model) if loss_fn is None else None
        # _hf_ce's recomputed heads: named in errors (FSDP2 renames the class), checked once
        self._model_name, self._checked_ce = type(model).__name__, False
        self._warn_mean_of_means(model)
        self.wrapped: Wrapped = self._wrap(model)
        self.model = self.wrapped.module
        self.scheduler = scheduler or build_scheduler(optimizer, self.config.training.scheduler)
        self.global_step = 0
        self._epoch = 0
        self._samples_in_epoch = 0  # global samples consumed in the current epoch
        self._resumed_from: str | None = None

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

    def _warn_mean_of_means(self, model: nn.Module) -> None:
        """Say once, on every rank, that a Hugging Face model whose loss takes no
        ``num_items_in_batch`` and is not recomputed (``_hf_ce``; e.g.
        ``BertForSequenceClassification``, three losses by problem type) keeps the mean of
        per-micro-batch means when there is more than one micro-batch per step (data
        parallelism or accumulation): decided from the config and the model's class, never
        from data."""
        hf = type(model).__module__.startswith("transformers.")
        spread = self.data_parallel_size > 1 or self.accum > 1
        if self.loss_fn is None and self._loss_tokens is None and hf and spread:
            warnings.warn(
                f"rank {self.rt.rank}: {type(model).__name__}'s loss is neither one of HF's "
                "token cross-entropies taking num_items_in_batch nor a CrossEntropyLoss() of "
                "its logits against labels the trainer can recompute (docs/trainer.md, Hugging "
                "Face models), so each micro-batch's loss is its "
                f"own mean and the trainer averages {self.data_parallel_size} data-parallel "
                f"rank(s) x {self.accum} micro-step(s) of them: one process's global mean only "
                "when every micro-batch holds as many of the loss's items (no uneven -100 "
                "padding); pass loss_fn=... for another reduction",
                stacklevel=3,
            )

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
        meshes = self._build_mesh()
        wrapped = wrap_model(
            model,
            cfg.strategy,
            device=self.device,
            world_size=self.rt.world_size,
            backend=self.rt.backend,
            use_amp=cfg.training.use_amp,
            amp_dtype=self.amp_dtype,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            ddp=cfg.ddp,
            fsdp=cfg.fsdp,
            placements=cfg.placements,
            mesh=runtime.device_mesh() if self.rt.world_size > 1 and not meshes else None,
            compile=self.compile,
            compile_backend=cfg.compile_backend,
            activation_checkpointing=cfg.activation_checkpointing,
            **meshes,
        )
        self._rebind_optimizer(old_params, list(model.parameters()))
        if wrapped.placements is not None and cfg.placements == "auto":
            # the derived table from here on (the same on every rank: read from the model)
            self.config = override(self.config, placements=wrapped.placements)
        return wrapped

    def _build_mesh(self) -> dict[str, object]:
        """The ``parallelism`` block's meshes for ``wrap_model`` (``{}``: today's 1-D world);
        sets ``device_mesh`` and this rank's ``data_parallel_rank``/``data_parallel_size``."""
        layout = build_layout(
            self.config.parallelism, self.strategy, self.rt.world_size, self.rt.rank, self.device
        )
        self.device_mesh = layout.mesh
        self.layout = layout
        self.data_parallel_size, self.data_parallel_rank = layout.dp_size, layout.dp_rank
        groups = describe_groups(layout)  # collective on a 2-D/3-D layout, every rank
        if groups:
            runtime.print0(f"spmdgt.train: {groups}")
        return layout.wrap_kwargs()

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
        if self.rt.world_size > 1:
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
        if num_items is not None and self._loss_tokens == _hf_ce.RULE:
            return self._recomputed_loss(inputs, num_items)
        if num_items is not None:  # HF's keyword: the model's loss is sum / num_items
            inputs = {**inputs, "num_items_in_batch": num_items}
        out = loss_from_output(call_model(self.model, inputs), self.loss_fn is not None)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, targets)
        elif targets is not None and not (isinstance(out, torch.Tensor) and out.ndim == 0):
            raise ValueError(
                f"no loss_fn was given and the model returned {describe(out)}, not a scalar "
                "loss; pass loss_fn=... (e.g. nn.functional.cross_entropy)"
            )
        else:
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"the loss must be a scalar tensor, got {describe(loss)}")
        if hasattr(loss, "full_tensor"):  # a DTensor loss (tensor parallel) -> plain
            loss = loss.full_tensor()
        return loss

    def _recomputed_loss(self, inputs: dict, num_items: torch.Tensor) -> torch.Tensor:
        """A head that computes ``CrossEntropyLoss()`` itself (``_hf_ce``): its token sum
        recomputed from the output's logits over the step's global label tokens. The first
        time, every rank checks that the model's own loss is that sum's local mean (one
        all-reduce, on every rank at the first counted micro-step: the schedule's, never the
        data's)."""
        out = call_model(self.model, inputs)
        name = self._model_name
        total = _hf_ce.token_ce_sum(out, inputs["labels"], name)
        if not self._checked_ce:
            self._checked_ce = True
            _hf_ce.check_token_ce(
                loss_from_output(out, False),
                total,
                inputs["labels"],
                model=name,
                world_size=self.rt.world_size,
                comm_device=self._comm_device(),
            )
        return total / num_items

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.wrapped.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _tp_group(self) -> object:
        """The tensor-parallel process group on a mesh with a ``tp`` dim > 1, else ``None``."""
        return tp_group(self.device_mesh)

    def _comm_device(self) -> torch.device:
        return self.device if self.rt.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ checkpoints

    def _trainer_state(self) -> dict:
        return {
            "step": self.global_step,
            "epoch": self._epoch,
            "samples_in_epoch": self._samples_in_epoch,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "world_size": self.rt.world_size,
            # the mesh it was written on: a resume on another says so (weights, optimizer and
            # data position carry over, see load_checkpoint)
            "mesh": list(self.layout.shape) if self.layout is not None else None,
            "data_parallel_size": self.data_parallel_size,
        }

    def save_checkpoint(self, directory: str | os.PathLike | None = None) -> str:
        """Write a checkpoint of everything needed to resume (collective: all ranks call it)."""
        directory = directory or self.config.checkpoint.dir
        if directory is None:
            raise ValueError("no checkpoint directory: pass one or set checkpoint.dir")
        path = save_checkpoint(
            directory,
            self.global_step,
            self.model,
            self.optimizer,
            self._trainer_state(),
            keep_last=self.config.checkpoint.keep_last,
        )
        return str(path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, scheduler, scaler, RNG and data position from ``path``.

        ``path`` is one ``step_<n>`` checkpoint or a checkpoint directory (its newest, as its
        ``latest`` names it, confined to the directory). Collective: rank 0 resolves the path
        and every rank loads that one, or raises rank 0's error."""
        found = on_rank0(lambda: resolve_checkpoint(path))
        extra = load_checkpoint(found, self.model, self.optimizer)
        self.global_step = extra["step"]
        self._epoch = extra["epoch"]
        self._samples_in_epoch = extra["samples_in_epoch"]
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.scaler is not None and extra["scaler"] is not None:
            self.scaler.load_state_dict(extra["scaler"])
        self._resumed_from = str(found)
        saved = extra.get("mesh")
        layout = self.layout
        if saved is not None and layout is not None and tuple(saved) != layout.shape:
            runtime.print0(
                f"spmdgt.train: {found} was written on mesh dp_replicate x dp_shard x tp = "
                f"{'x'.join(map(str, saved))} ({extra.get('world_size')} rank(s)); resuming on "
                f"{layout.describe()}: weights and optimizer state resharded, data from "
                f"global sample {self._samples_in_epoch} of epoch {self._epoch}"
            )

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

    def _resume_if_asked(self) -> None:
        """Load the newest checkpoint of ``checkpoint.dir`` when ``checkpoint.resume`` is set
        and nothing was loaded yet. Rank 0 reads the directory for everyone: whether to load
        is a collective decision."""
        ck = self.config.checkpoint
        if ck.dir and ck.resume and self._resumed_from is None:
            found = on_rank0(lambda: find_latest(ck.dir))
            if found is not None:
                self.load_checkpoint(found)
                runtime.print0(f"resumed from {found} at step {self.global_step}")

    def _start_run(self, cfg: TrainConfig, n_batches: int | None) -> Run:
        """Open one call's measurement: statistics from the current step, the TensorBoard
        writer and progress bar (rank 0), the profiler and, for placements when asked, the
        sink that reads collectives from the interceptor."""
        stats = RunStats(first_step=self.global_step)
        compile_at_start = compile_seconds()[0] if self._compiles else 0.0
        self.wrapped.log.clear()
        metrics = MetricsLogger(self.logdir, self.rt.is_main_process)
        total = cfg.training.max_steps
        if total is None and n_batches is not None:
            total = cfg.training.epochs * math.ceil(n_batches / self.accum)
        bar = ProgressBar(total, self.rt.is_main_process)
        prof = make_profiler(self.logdir, self.device, self.rt.rank) if cfg.profile else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        sink, own_interceptor = attach_comm_sink(self.wrapped.comm_source, cfg.profile)
        return Run(
            cfg=cfg,
            stats=stats,
            metrics=metrics,
            bar=bar,
            prof=prof,
            sink=sink,
            own_interceptor=own_interceptor,
            params=params,
            dp=self.wrapped.data_parallel_size,
            compile_at_start=compile_at_start,
            checked_batch=self.strategy != "placements" and self._tp_group() is None,
            memory=MemoryMeter(self.device, self.model, self.optimizer, compiled=self._compiles),
        )

    def _train_epoch(self, run: Run, loader: Iterable, epoch: int) -> bool:
        """One pass over ``loader`` from where the epoch stands, a group of micro-batches per
        optimizer step (the last group may be short). Returns True when ``max_steps`` stopped
        it before its end."""
        self._epoch = epoch
        batches, left = self._epoch_batches(loader, epoch, run.dp)
        self.model.train()
        self._restart_clock(run)
        while True:
            group, source, left = self._next_group(batches, left, epoch)
            if group <= 0:
                return False
            with run.memory.step():  # the tensor peak: MemTracker on CPU's first steps
                loss_sum, samples, tokens = self._train_step(run, source, group)
            if left is not None:
                left -= group
            if self._end_step(run, loss_sum, group, samples, tokens):
                return True

    def _epoch_batches(self, loader: Iterable, epoch: int, dp: int) -> tuple[Iterator, int | None]:
        """The epoch's batch iterator and how many batches it has left (``None``: unsized).

        Sets the sampler's epoch (its shuffle). A resumed run continues at the global sample
        the checkpoint names (``samples_in_epoch``: samples every data-parallel rank together
        consumed), whatever the data-parallel size was when it was written: the resumable
        sampler deals the epoch's global order from there over its replicas, with no re-reads
        (``ResumableDistributedSampler.start_after``). Another loader has whole batches read
        and dropped, which is exact only when the count is a whole number of global batches
        (``dp`` x its batch size); otherwise it is an error on every rank rather than a run
        that silently reads some samples twice."""
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        consumed = self._samples_in_epoch
        skip_batches = 0
        if consumed and isinstance(sampler, ResumableDistributedSampler):
            sampler.start_after(consumed)
        elif consumed:
            per_step = batch_size_of(loader) * dp
            if consumed % per_step:
                raise ValueError(
                    f"the checkpoint's data position is {consumed} samples into epoch {epoch}, "
                    f"not a whole number of this run's global batches ({dp} data-parallel "
                    f"rank(s) x batch size {batch_size_of(loader)} = {per_step}), and this "
                    f"loader's sampler ({type(sampler).__name__}) can only skip whole "
                    "batches; use OptimizedDataLoader.create (its ResumableDistributedSampler "
                    "continues at any sample), or resume with a global batch that divides it"
                )
            skip_batches = consumed // per_step
        left = loader_len(loader)
        batches = iter(loader)
        for _ in range(skip_batches):
            next(batches)
        if left is not None:
            left -= skip_batches
        return batches, left

    def _next_group(
        self, batches: Iterator, left: int | None, epoch: int
    ) -> tuple[int, Iterator, int | None]:
        """The next step's micro-batch count, their source, and the batches left after it.

        A sized loader: ``accum`` or what is left. An unsized one: the group's batches are
        taken first, so the last one is known before its backward (it syncs the gradients),
        and the ranks agree on how many they all have (one small collective per step): ranks
        whose loaders end at different points would otherwise run different numbers of
        collectives and hang. A count of 0 ends the epoch."""
        group = self.accum if left is None else min(self.accum, left)
        if group <= 0 or left is not None:
            return group, batches, left
        pending = list(itertools.islice(batches, group))
        group = agree_on_group(pending, f"the end of epoch {epoch}", self.rt, self._comm_device())
        if group < self.accum:
            left = group  # the epoch's last group
        return group, iter(pending[:group]), left

    def _train_step(self, run: Run, source: Iterator, group: int) -> tuple[torch.Tensor, int, int]:
        """One optimizer step over ``group`` micro-batches from ``source``: forward and
        backward each (gradients synchronised on the last only), then clip, optimizer and
        scheduler. Returns the summed micro-step losses (on the device: no ``.item()`` per
        step), and this rank's samples and tokens."""
        self.wrapped.log.step = self.global_step
        loss_sum: torch.Tensor | None = None
        samples = tokens = 0
        waited = 0.0
        num_items, pulled = None, None
        if self._loss_tokens is not None and (run.dp > 1 or group > 1):
            # HF's num_items_in_batch: the step's label tokens over its micro-batches and the
            # data-parallel ranks, counted before the first forward (as HF's Trainer does)
            pulled = [self._pull(source, group, micro) for micro in range(group)]
            waited = sum(secs for _, _, secs in pulled)
            self._check_batch(run, pulled[0][0])
            num_items = step_label_tokens(
                [inputs for inputs, _, _ in pulled],
                self._loss_tokens,
                dp_size=run.dp,
                rt=self.rt,
                device=self.device,
                comm_device=self._comm_device(),
            )
        for micro in range(group):
            if pulled is None:
                inputs, targets, secs = self._pull(source, group, micro)
                waited += secs
                self._check_batch(run, inputs)
            else:
                inputs, targets, _ = pulled[micro]
            samples += num_samples(inputs)
            tokens += num_tokens(inputs)
            loss = self._micro_step(
                inputs, targets, group, last=micro == group - 1, num_items=num_items, dp=run.dp
            )
            det = loss.detach().float()
            loss_sum = det if loss_sum is None else loss_sum + det
        self._optimizer_step(run.params)
        run.stats.data_sec.append(waited)
        self.global_step += 1
        self._samples_in_epoch += samples * run.dp
        return loss_sum, samples, tokens

    def _pull(self, source: Iterator, group: int, micro: int) -> tuple[object, object, float]:
        """The step's next micro-batch from ``source``, on the device, as ``(inputs,
        targets, seconds waited for it)``."""
        t = time.perf_counter()
        try:
            batch = next(source)
        except StopIteration:
            raise ValueError(
                f"the training loader ended {group - micro} batch(es) before its len() "
                "said it would; a loader with a __len__ must yield that many batches "
                "(every rank runs as many steps as len() promises, or a collective hangs)"
            ) from None
        inputs, targets = self._unpack(batch)
        return inputs, targets, time.perf_counter() - t

    def _check_batch(self, run: Run, inputs: object) -> None:
        """Tensor parallelism: the first batch is the same on every rank of a TP group."""
        if not run.checked_batch:
            check_same_batch(inputs, self.rt, self._comm_device(), self._tp_group())
            run.checked_batch = True

    def _micro_step(
        self,
        inputs: object,
        targets: torch.Tensor | None,
        group: int,
        *,
        last: bool,
        num_items: torch.Tensor | None = None,
        dp: int = 1,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss as a per-micro-step
        mean (what the loss flush divides by the step's micro-steps and averages over ranks).
        All but the ``last`` micro-step run under ``no_sync`` (gradients communicated once
        per step).

        Without ``num_items`` the loss is divided by the group's size, so accumulation equals
        one large batch when every micro-batch weighs alike. With it (HF's
        ``num_items_in_batch``: the step's label tokens on every data-parallel rank) the
        model's loss is this micro-batch's token sum over the step's global count, so the
        micro-steps' and ranks' losses add up to one process's global token mean; the
        backward runs on it times ``dp``, which the data-parallel gradient mean (DDP's, and
        FSDP's divide) takes back out, as HF's ``Trainer`` does (``loss *= num_processes``,
        no division by the accumulation steps). The value returned is scaled by ``dp x
        group`` so that the flush's mean over micro-steps and ranks gives that sum."""
        sync = contextlib.nullcontext() if last else self.wrapped.no_sync()
        with sync:
            with self._autocast():
                loss = self._loss(inputs, targets, num_items)
            scaled = loss.float()
            if num_items is not None:
                if dp > 1:
                    scaled = scaled * dp
            elif group > 1:  # x / 1 is exact: skip the op when not accumulating
                scaled = scaled / group
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        if num_items is not None and dp * group > 1:
            return loss.detach().float() * (dp * group)
        return loss

    def _end_step(
        self, run: Run, loss_sum: torch.Tensor, done: int, samples: int, tokens: int
    ) -> bool:
        """Record the step just taken, flush losses every ``log_every`` steps, save a
        checkpoint every ``checkpoint.every_steps``; return whether ``max_steps`` is reached.

        Losses stay on the device until a flush all-reduces them in one collective. A
        collective's schedule must be the same on every rank, so it goes by step count, never
        by who logs (a TensorBoard writer, a terminal's progress bar: rank 0 only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        n = self._record_step(run, t1, loss_sum, done, samples, tokens)
        if n == 1 or n % self.log_every == 0:  # sampled: a read costs ~60 us on CPU
            run.stats.sample_memory(run.memory)
        if run.bar.active:
            run.bar.update(
                self.global_step, float(loss_sum) / done, window(run.stats, 1, self.throughput)
            )
        if run.prof is not None:
            run.prof.step()
        if n % self.log_every == 0:
            new = self._log_metrics(run.stats, run.metrics)
            # Where no bar is drawn (a log file, a pipe), rank 0 prints a line at each flush:
            # it only reads what the flush (done on every rank) already brought back.
            run.bar.report(self.global_step, new, window(run.stats, len(new), self.throughput))
        max_steps = run.cfg.training.max_steps
        ck = run.cfg.checkpoint
        if ck.dir and ck.every_steps and self.global_step % ck.every_steps == 0:
            self.save_checkpoint()
        self._restart_clock(run)  # the checkpoint write is not a training step
        return max_steps is not None and self.global_step >= max_steps

    def _record_step(
        self, run: Run, t1: float, loss_sum: torch.Tensor, done: int, samples: int, tokens: int
    ) -> int:
        """Append the step that ended at ``t1`` to the run's statistics; return their count.
        Compile time is reported apart: a step that compiled counts without it."""
        stats = run.stats
        compiled_sec = (compile_seconds()[0] - run.c0) if self._compiles else 0.0
        stats.compile_sec.append(compiled_sec)
        stats.step_times.append(t1 - run.t0 - compiled_sec)
        run.windows.append((self.global_step - 1, run.t0, t1))
        stats.pending_losses.append(loss_sum)
        stats.pending_micro_steps.append(done)
        stats.samples.append(samples * run.dp)
        stats.tokens.append(tokens * run.dp)
        stats.lrs.append(self.optimizer.param_groups[0]["lr"])
        return len(stats.step_times)

    def _restart_clock(self, run: Run) -> None:
        """Start the next step's clock (and compile-time reading) now."""
        run.t0 = time.perf_counter()
        run.c0 = compile_seconds()[0] if self._compiles else 0.0

    def _finish(self, run: Run) -> dict:
        """Close the run: sample memory at the last step, flush the losses left (a collective,
        every rank), save the final checkpoint unless the last step just wrote it, attribute
        the logged collectives to steps, then build, print (rank 0) and return the summary."""
        stats = run.stats
        n = len(stats.step_times)
        if n and (not stats.memory_steps or stats.memory_steps[-1] != n - 1):
            stats.sample_memory(run.memory)  # the last step too
        self._log_metrics(stats, run.metrics)
        ck = run.cfg.checkpoint
        if ck.dir and n and (not ck.every_steps or self.global_step % ck.every_steps != 0):
            self.save_checkpoint()
        summary = build_summary(
            stats,
            warmup_steps=run.warmup_steps,
            peak_memory=run.memory.peak(),
            memory_kind=run.memory.kind,
            world_size=self.rt.world_size,
            strategy=self.strategy,
            val_loss=run.val_loss,
            comm_source=attribute_collectives(run, self.wrapped.log, self.wrapped.comm_source),
            throughput=self.throughput,
        )
        summary.update(cuda_peaks(self.device))
        summary.update(comm_dim_summary(run))  # per mesh dim on a 2-D mesh; {} on 1-D
        comp = self.wrapped.compiled
        if comp is not None:
            summary["compile_backend"] = comp.backend
            summary["compiled_blocks"] = len(comp.blocks)
            summary["compile_time_sec"] = compile_seconds()[0] - run.compile_at_start
            summary["compile_steps"] = sum(1 for c in stats.compile_sec if c > 0)
            summary["compile_fallback"] = comp.disabled_reason or "none"
        elif self.config.compile:
            summary["compile_backend"] = "off (GT_COMPILE=0)"
        run.metrics.close()
        self.last_stats = stats
        runtime.print0(format_summary(summary))
        return summary

    def _optimizer_step(self, params: list[nn.Parameter]) -> None:
        self.wrapped.sum_partial_grads()  # per-head norms under FSDP x TP (else nothing)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            clip_grad_norm(params, self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _compile_fallback(self, comp) -> None:
        """Some rank failed to compile a block: every rank turns compilation off (collective:
        every rank gets here alike, from the agreed flush)."""
        failures = runtime.all_ranks(list(comp.failures))  # on the agreement side group
        reason = "; ".join(f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs)
        comp.turn_off(reason)
        runtime.print0(
            f"spmdgt.train: torch.compile failed ({reason}); every rank trains eagerly from "
            f"step {self.global_step} on (the failing block ran eagerly until then)"
        )

    def _log_metrics(self, stats: RunStats, metrics: MetricsLogger) -> list[float]:
        """All-reduce pending losses (one collective), write the steps' scalars, return the
        newly reduced losses."""
        start = len(stats.global_losses)
        comp = self.wrapped.compiled
        # Compile failures on ranks that ran the block eagerly meanwhile (ddp/fsdp): agreed in
        # the flush's own all-reduce (one more number), the same decision on every rank.
        check = comp is not None and comp.active and comp.fallback_on_rank
        new = stats.flush_losses(self._comm_device(), flag=bool(comp.failures) if check else None)
        if check and stats.flag_anywhere:
            self._compile_fallback(comp)
        if metrics.writer is not None:  # rank 0 with a logdir
            for step, values in step_scalars(stats, start, self.throughput):
                metrics.scalars(step, values)
        return new

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> float:
        """Mean loss over ``loader`` (per-rank mean, then averaged across ranks).

        Collective: forward passes communicate (FSDP gathers, tensor-parallel reductions, DDP
        buffer broadcasts), so every rank must run as many batches. Sized loaders are checked
        for equal lengths once; for unsized ones ranks agree before each batch."""
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
