"""``DistributedTrainer``: one training loop over DDP, FSDP2 or tensor-parallel placements.

Run on one process with plain ``python train.py`` (nothing is wrapped, no process group is
made) or on N with ``torchrun --nproc_per_node=N train.py`` (gloo on CPU, NCCL on CUDA). Every
rank runs the same loop; rank 0 alone prints, draws the progress bar and writes TensorBoard.

The loop, per optimizer step: ``gradient_accumulation_steps`` micro-steps (forward under
autocast when AMP is on, backward on ``loss / micro_steps``; all but the last inside
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
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from spmdgt import interceptor, runtime
from spmdgt.config import ConfigError
from spmdgt.train._batches import (
    agree_on_group,
    batch_size_of,
    check_loader,
    check_same_batch,
    describe,
    loader_len,
    num_samples,
    num_tokens,
    to_device,
)
from spmdgt.train._checkpoint import (
    find_latest,
    load_checkpoint,
    on_rank0,
    resolve_checkpoint,
    save_checkpoint,
)
from spmdgt.train._comm import InterceptorCollectiveSink
from spmdgt.train._compile import compile_disabled_by_env, compile_seconds
from spmdgt.train._config import STRATEGIES, SchedulerConfig, TrainConfig, load_train_config
from spmdgt.train._data import ResumableDistributedSampler
from spmdgt.train._profilers import current_memory_bytes, peak_memory_bytes
from spmdgt.train._strategies import Wrapped, all_reduce_mean, clip_grad_norm, wrap_model
from spmdgt.train._summary import (
    MetricsLogger,
    ProgressBar,
    RunStats,
    build_summary,
    format_summary,
)

__all__ = ["DistributedTrainer", "build_scheduler"]

# Steps between loss reductions when nobody reads per-step losses: bounds the 0-d loss tensors
# kept on the device while avoiding a collective per step.


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A ``LambdaLR`` for ``cfg`` (None for ``constant``): warm-up, then linear or cosine decay."""
    if cfg.type == "constant" and cfg.warmup_steps == 0:
        return None
    warm, total = cfg.warmup_steps, cfg.total_steps or 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.type == "constant":
            return 1.0
        progress = min((step - warm) / max(total - warm, 1), 1.0)
        if cfg.type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class DistributedTrainer:
    """Train ``model`` with ``optimizer`` on every rank under one of three strategies.

    Batches are ``(inputs, targets)`` and the loss is ``loss_fn(model(inputs), targets)``;
    with ``loss_fn=None`` the model's output (a scalar tensor) is the loss, and a batch that is
    not a pair is passed to the model whole. Arguments left as ``None`` take their value from
    ``config`` (a ``TrainConfig`` or a YAML path), then from ``TrainConfig``'s defaults.

    The optimizer must be built on ``model.parameters()`` *before* it is given here; FSDP2 and
    tensor parallelism swap parameters for DTensors in place, so the trainer rebuilds the
    optimizer's param groups over the wrapped model's parameters (same order, same options).
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
        find_unused_parameters: bool = False,
        max_grad_norm: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        logdir: str | None = None,
        config: TrainConfig | str | os.PathLike | None = None,
        *,
        amp_dtype: torch.dtype | None = None,
        log_every: int = 10,
        compile: bool | None = None,
    ) -> None:
        if config is None:
            cfg = TrainConfig()
        elif isinstance(config, TrainConfig):
            cfg = config
        elif isinstance(config, (str, os.PathLike)):
            cfg = load_train_config(config)
        else:
            raise TypeError(f"config must be a TrainConfig or a YAML path, got {type(config)}")
        strategy = strategy if strategy is not None else cfg.strategy
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}",
                key="strategy",
                value=strategy,
            )
        if strategy == "placements" and not cfg.placements:
            raise ConfigError(
                "strategy 'placements' needs config.placements (module-name glob -> colwise | "
                "rowwise | replicate)",
                key="placements",
            )
        t = cfg.training
        self.config = cfg
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.accum = gradient_accumulation_steps or t.gradient_accumulation_steps
        if self.accum < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self.accum}")
        self.max_grad_norm = max_grad_norm if max_grad_norm is not None else t.max_grad_norm
        self.logdir = logdir if logdir is not None else cfg.logdir
        self.log_every = max(1, log_every)
        self.rt = runtime.init(backend)
        self.device = self.rt.device
        use_amp = t.use_amp if use_amp is None else use_amp

        # AMP: bf16 autocast on CPU; on CUDA bf16 when the card has it, else fp16 + GradScaler.
        self.scaler = None
        if amp_dtype is None:
            amp_dtype = torch.bfloat16
            if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
                amp_dtype = torch.float16
        if use_amp and amp_dtype == torch.float16:
            if self.device.type != "cuda" or strategy == "fsdp":
                raise ValueError(
                    "fp16 AMP needs CUDA and the ddp strategy (FSDP mixed precision uses bf16)"
                )
            self.scaler = torch.amp.GradScaler("cuda")
        self.amp_dtype = amp_dtype

        mesh = runtime.device_mesh() if self.rt.world_size > 1 else None
        self._compile_asked = cfg.compile if compile is None else compile
        self.compile = self._decide_compile(self._compile_asked)
        old_params = list(model.parameters())
        known = {id(p) for p in old_params}
        if any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "the optimizer holds parameters that are not the model's; build it with "
                "optimizer_cls(model.parameters(), ...) on the model given here"
            )
        self.wrapped: Wrapped = wrap_model(
            model,
            strategy,
            device=self.device,
            world_size=self.rt.world_size,
            backend=self.rt.backend,
            use_amp=use_amp,
            amp_dtype=amp_dtype,
            find_unused_parameters=find_unused_parameters,
            ddp=cfg.ddp,
            fsdp=cfg.fsdp,
            placements=cfg.placements,
            mesh=mesh,
            compile=self.compile,
            compile_backend=cfg.compile_backend,
            activation_checkpointing=cfg.activation_checkpointing,
        )
        self.model = self.wrapped.module
        self.optimizer = optimizer
        self._rebind_optimizer(old_params, list(model.parameters()))
        self.scheduler = scheduler or build_scheduler(optimizer, t.scheduler)
        self.global_step = 0
        self._epoch = 0
        self._samples_in_epoch = 0  # global samples consumed in the current epoch
        self._resumed_from: str | None = None

    # ------------------------------------------------------------------ setup helpers

    def _decide_compile(self, asked: bool) -> bool:
        """Whether to compile: asked for and not vetoed by ``GT_COMPILE=0``, the same on every
        rank. In a world of more than one the ranks exchange their decision (one small
        all-gather, always, so the exchange itself never depends on the config): a config or
        environment that differs between ranks is an error on every rank, naming each rank's
        decision, never ranks running different code."""
        if not isinstance(asked, bool):
            raise ConfigError(f"must be true or false, got {asked!r}", key="compile", value=asked)
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

    def _unpack(self, batch: object) -> tuple[object, torch.Tensor | None]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, targets = batch
        elif self.loss_fn is None:
            inputs, targets = batch, None
        else:
            raise ValueError(
                "with a loss_fn, batches must be (inputs, targets) pairs; got "
                f"{type(batch).__name__}"
            )
        return to_device(inputs, self.device), to_device(targets, self.device)

    def _loss(self, inputs: object, targets: torch.Tensor | None) -> torch.Tensor:
        out = self.model(inputs)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, targets)
        elif targets is not None and not (isinstance(out, torch.Tensor) and out.ndim == 0):
            raise ValueError(
                "no loss_fn was given and the model did not return a scalar loss; pass "
                "loss_fn=... (e.g. nn.functional.cross_entropy)"
            )
        else:
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"the loss must be a scalar tensor, got {describe(loss)}")
        if hasattr(loss, "full_tensor"):  # a DTensor loss (tensor parallel) -> plain
            loss = loss.full_tensor()
        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.wrapped.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

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

        Resumes from the newest checkpoint in ``checkpoint.dir`` when ``checkpoint.resume`` is
        set. The summary dict is printed on rank 0 as "Training Summary".
        """
        cfg = self.config
        epochs = epochs or cfg.training.epochs
        profile = cfg.profile if profile is None else profile
        ck = cfg.checkpoint
        if ck.dir and ck.resume and self._resumed_from is None:
            # Rank 0 reads the directory for everyone: whether to load is a collective decision.
            found = on_rank0(lambda: find_latest(ck.dir))
            if found is not None:
                self.load_checkpoint(found)
                runtime.print0(f"resumed from {found} at step {self.global_step}")
        n_batches = check_loader(train_loader, "training", self.rt, self._comm_device())
        dp = self.wrapped.data_parallel_size
        stats = RunStats(first_step=self.global_step)
        compile_at_start = compile_seconds()[0] if self.compile else 0.0
        log = self.wrapped.log
        log.clear()
        metrics = MetricsLogger(self.logdir, self.rt.is_main_process)
        total = max_steps
        if total is None and n_batches is not None:
            total = epochs * math.ceil(n_batches / self.accum)
        bar = ProgressBar(total, self.rt.is_main_process)
        prof = self._make_profiler() if profile else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        checked_batch = self.strategy != "placements"
        # Losses stay on the device until a flush all-reduces them in one collective: every
        # log_every steps and at the end. A collective's schedule must be the same on every
        # rank, so it never depends on who logs (a TensorBoard writer, a terminal's progress
        # bar: rank 0 only); deciding by those once hung rank 1 against rank 0's flushes.
        flush_every = self.log_every
        windows: list[tuple[int, float, float]] = []  # (step, start, end): placements' comm
        sink, own_interceptor = self._attach_comm_sink(profile)
        val_loss = None
        stop = False
        if prof is not None:
            prof.__enter__()
        try:
            for epoch in range(self._epoch, epochs):
                self._epoch = epoch
                sampler = getattr(train_loader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
                # Resume mid-epoch: skip the samples this rank consumed before the checkpoint
                # (global count / data-parallel ranks, so a different world size works too).
                skip = self._samples_in_epoch // dp
                skip_batches = 0
                if skip and isinstance(sampler, ResumableDistributedSampler):
                    sampler.skip_samples = skip  # the sampler starts after them: no re-reads
                elif skip:
                    skip_batches = skip // batch_size_of(train_loader)
                left = loader_len(train_loader)
                batches = iter(train_loader)
                for _ in range(skip_batches):
                    next(batches)
                if left is not None:
                    left -= skip_batches
                self.model.train()
                t0 = time.perf_counter()
                c0 = compile_seconds()[0] if self.compile else 0.0
                while not stop:
                    group = self.accum if left is None else min(self.accum, left)
                    if group <= 0:
                        break
                    source = batches
                    if left is None:
                        # An unsized loader: take the group's batches first, so the last one
                        # is known before its backward (it syncs the gradients), and agree
                        # across ranks on how many there are (one small collective per step):
                        # ranks whose loaders end at different points would otherwise run
                        # different numbers of collectives and hang.
                        pending = list(itertools.islice(batches, group))
                        group = agree_on_group(
                            pending, f"the end of epoch {epoch}", self.rt, self._comm_device()
                        )
                        if group == 0:
                            break
                        source = iter(pending[:group])
                        if group < self.accum:
                            left = group  # the epoch's last group
                    log.step = self.global_step
                    loss_sum: torch.Tensor | None = None
                    samples = tokens = 0
                    for micro in range(group):
                        try:
                            batch = next(source)
                        except StopIteration:
                            raise ValueError(
                                f"the training loader ended {group - micro} batch(es) before "
                                "its len() said it would; a loader with a __len__ must yield "
                                "that many batches (every rank runs as many steps as len() "
                                "promises, or a collective hangs)"
                            ) from None
                        inputs, targets = self._unpack(batch)
                        if not checked_batch:
                            check_same_batch(inputs, self.rt, self._comm_device())
                            checked_batch = True
                        samples += num_samples(inputs)
                        tokens += num_tokens(inputs)
                        last = micro == group - 1
                        sync = contextlib.nullcontext() if last else self.wrapped.no_sync()
                        with sync:
                            with self._autocast():
                                loss = self._loss(inputs, targets)
                            scaled = loss.float()
                            if group > 1:  # x / 1 is exact: skip the op when not accumulating
                                scaled = scaled / group
                            if self.scaler is not None:
                                self.scaler.scale(scaled).backward()
                            else:
                                scaled.backward()
                        det = loss.detach().float()
                        loss_sum = det if loss_sum is None else loss_sum + det
                    done = group
                    self._optimizer_step(params)
                    if left is not None:
                        left -= done
                    self.global_step += 1
                    self._samples_in_epoch += samples * dp
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    t1 = time.perf_counter()
                    # Compile time is reported apart: a step that compiled counts without it.
                    compiled_sec = (compile_seconds()[0] - c0) if self.compile else 0.0
                    stats.compile_sec.append(compiled_sec)
                    stats.step_times.append(t1 - t0 - compiled_sec)
                    windows.append((self.global_step - 1, t0, t1))
                    stats.pending_losses.append(loss_sum)
                    stats.pending_micro_steps.append(done)
                    stats.samples.append(samples * dp)
                    stats.tokens.append(tokens * dp)
                    stats.lrs.append(self.optimizer.param_groups[0]["lr"])
                    n = len(stats.step_times)
                    if n == 1 or n % self.log_every == 0:  # sampled: a read costs ~60 us on CPU
                        stats.sample_memory(current_memory_bytes(self.device))
                    if bar.active:
                        bar.update(self.global_step, float(loss_sum) / done, t1 - t0)
                    if prof is not None:
                        prof.step()
                    if n % flush_every == 0:
                        new = self._log_metrics(stats, metrics)
                        # Where no bar is drawn (a log file, a pipe), rank 0 prints a line at
                        # each flush: step count decides, and the line only reads what the
                        # flush (done on every rank) already brought back.
                        bar.report(self.global_step, new, stats.step_times[-len(new) :])
                    if max_steps is not None and self.global_step >= max_steps:
                        stop = True
                    if ck.dir and ck.every_steps and self.global_step % ck.every_steps == 0:
                        self.save_checkpoint()
                    t0 = time.perf_counter()  # the checkpoint write is not a training step
                    c0 = compile_seconds()[0] if self.compile else 0.0
                if stop:
                    break
                self._samples_in_epoch = 0
                self._epoch = epoch + 1
                if val_loader is not None:
                    val_loss = self.evaluate(val_loader)
                    metrics.scalars(self.global_step, {"val/loss": val_loss})
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
            self._detach_comm_sink(sink, own_interceptor)
            bar.close()
        if stats.step_times and (not stats.memory_steps or stats.memory_steps[-1] != n - 1):
            stats.sample_memory(current_memory_bytes(self.device))  # the last step too
        self._log_metrics(stats, metrics)
        ran = bool(stats.step_times)
        if ck.dir and ran and (not ck.every_steps or self.global_step % ck.every_steps != 0):
            self.save_checkpoint()
        comm_source = self.wrapped.comm_source
        if sink is not None:
            sink.fill(log, windows)
            comm_source = "interceptor"
        if comm_source is not None:
            counts, secs = log.step_counts(), log.step_seconds()
            first = stats.first_step
            for i in range(len(stats.step_times)):
                stats.collectives.append(counts.get(first + i, 0))
                stats.comm_sec.append(secs.get(first + i, 0.0))
        summary = build_summary(
            stats,
            warmup_steps=cfg.training.warmup_steps,
            peak_memory=peak_memory_bytes(self.device),
            memory_kind="cuda_allocated" if self.device.type == "cuda" else "cpu_rss",
            world_size=self.rt.world_size,
            strategy=self.strategy,
            val_loss=val_loss,
            comm_source=comm_source,
        )
        comp = self.wrapped.compiled
        if comp is not None:
            summary["compile_backend"] = comp.backend
            summary["compiled_blocks"] = len(comp.blocks)
            summary["compile_time_sec"] = compile_seconds()[0] - compile_at_start
            summary["compile_steps"] = sum(1 for c in stats.compile_sec if c > 0)
            summary["compile_fallback"] = comp.disabled_reason or "none"
        elif self._compile_asked:
            summary["compile_backend"] = "off (GT_COMPILE=0)"
        metrics.close()
        self.last_stats = stats
        runtime.print0(format_summary(summary))
        return summary

    def _attach_comm_sink(self, profile: bool) -> tuple[InterceptorCollectiveSink | None, bool]:
        """For placements, when measurement is asked for: a sink on the interceptor's stream.

        DTensor's collectives have no hook, and the project has one interception point per
        rank, so their bytes and times come from ``spmdgt.interceptor``: when it is already on
        (GT_* variables, ``spmdgt.interceptor.enable``) or ``profile=True`` turns it on for the
        run. Otherwise nothing is traced and the summary says comm time was not measured.
        Returns the sink and whether this run enabled the interceptor (and must disable it).
        """
        if self.wrapped.comm_source is not None:
            return None, False
        own = False
        if not interceptor.is_enabled():
            if not profile:
                return None, False
            interceptor.enable(stats=False, hotpath=False)
            own = True
        return interceptor.add_sink(InterceptorCollectiveSink()), own

    @staticmethod
    def _detach_comm_sink(sink: InterceptorCollectiveSink | None, own: bool) -> None:
        if sink is None:
            return
        interceptor.remove_sink(sink)  # delivers what is still buffered first
        if own:
            interceptor.disable()

    def _optimizer_step(self, params: list[nn.Parameter]) -> None:
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
        failures: list = [list(comp.failures)]
        if self.rt.world_size > 1:
            failures = [None] * self.rt.world_size
            dist.all_gather_object(failures, list(comp.failures))
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
        if metrics.writer is None:
            return new
        memory = dict(zip(stats.memory_steps, stats.memory))
        for i, loss in enumerate(new, start=start):
            dt = stats.step_times[i]
            mem = memory.get(i)
            metrics.scalars(
                stats.first_step + i + 1,
                {
                    "train/loss": loss,
                    "train/lr": stats.lrs[i],
                    "perf/step_time_sec": dt,
                    "perf/throughput_samples_per_sec": stats.samples[i] / dt if dt else None,
                    "perf/memory_gb": mem / 1e9 if mem is not None else None,
                },
            )
        return new

    def _make_profiler(self) -> torch.profiler.profile:
        """Per-rank ``torch.profiler`` traces under ``<logdir>/profile`` (``./profiles``)."""
        from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

        out = os.path.join(self.logdir, "profile") if self.logdir else "./profiles"
        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=acts,
            schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{self.rt.rank}"),
            profile_memory=True,
        )

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
