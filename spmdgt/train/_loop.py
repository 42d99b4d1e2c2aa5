"""The training loop of ``DistributedTrainer``, as torchtitan's trainer splits it.

``TrainLoop`` is the trainer's loop half (a mixin: ``DistributedTrainer`` holds the state):
``_start_run`` opens one ``train()`` call's measurement (a ``Run``), ``_train_epoch`` runs an
epoch, ``_next_group`` says how many micro-batches the next step takes (the ranks agree for
unsized loaders), ``_train_step`` is one optimizer step (HF's label tokens counted first,
micro-steps via ``_micro_step``, then ``_optimizer_step``: the ``sharded_input`` sum, the
GradScaler, the clip, the optimizer and scheduler), ``_end_step`` what follows a step
(statistics, the loss flush every ``log_every`` steps, checkpoints, ``max_steps``) and
``_finish`` the summary. A dry run (``_dryrun``) calls ``_train_step`` itself, on the fake
world: whatever a step does, the dry run does.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from spmdgt import runtime
from spmdgt.train._batches import (
    agree_on_group,
    batch_size_of,
    check_same_batch,
    loader_len,
    num_samples,
    num_tokens,
    step_label_tokens,
)
from spmdgt.train._compile import compile_seconds
from spmdgt.train._config import TrainConfig
from spmdgt.train._data import ResumableDistributedSampler
from spmdgt.train._memory import MemoryMeter
from spmdgt.train._profilers import cuda_peaks
from spmdgt.train._run import (
    Run,
    attach_comm_sink,
    attribute_collectives,
    comm_dim_summary,
    make_profiler,
    step_scalars,
    window,
)
from spmdgt.train._strategies import clip_grad_norm
from spmdgt.train._summary import (
    MetricsLogger,
    ProgressBar,
    RunStats,
    build_summary,
    format_summary,
)

__all__ = ["TrainLoop"]


class TrainLoop:
    """The loop's methods; ``DistributedTrainer`` (``_trainer``) holds what they read."""

    def _start_run(self, cfg: TrainConfig, n_batches: int | None) -> Run:
        """Open one call's measurement: statistics from the current step, the TensorBoard
        writer and progress bar (rank 0), the profiler and, for placements when asked, the
        sink that reads collectives from the interceptor."""
        stats = RunStats(first_step=self.global_step)
        compile_at_start = compile_seconds()[0] if self._compiles else 0.0
        self.wrapped.log.clear()
        main = self.rt.is_main_process and self._dry is None  # a dry run writes nothing
        metrics = MetricsLogger(self.logdir, main)
        total = cfg.training.max_steps
        if total is None and n_batches is not None:
            total = cfg.training.epochs * math.ceil(n_batches / self.accum)
        bar = ProgressBar(total, main)
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
            dp=self.layout.dp_size,
            compile_at_start=compile_at_start,
            checked_batch=self.strategy != "placements" and self._tp_group() is None,
            # a dry run measures with its own trackers (_dryrun), on its fake devices
            memory=None
            if self._dry is not None
            else MemoryMeter(self.device, self.model, self.optimizer, compiled=self._compiles),
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
            pulled = [self._pull(run, source, group, micro) for micro in range(group)]
            waited = sum(secs for _, _, secs in pulled)
            self._check_batch(run, pulled[0][0])
            num_items = step_label_tokens(
                [inputs for inputs, _, _ in pulled],
                self._loss_tokens,
                layout=self.layout,
                device=self.device,
                comm_device=self._comm_device(),
            )
        for micro in range(group):
            if pulled is None:
                inputs, targets, secs = self._pull(run, source, group, micro)
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

    def _pull(
        self, run: Run, source: Iterator, group: int, micro: int
    ) -> tuple[object, object, float]:
        """The step's next micro-batch from ``source``, on the device, as ``(inputs,
        targets, seconds waited for it)``. The memory meter counts the batch, not what the
        loader made on the way (``MemoryMeter.loading``)."""
        t = time.perf_counter()
        with run.memory.loading() if run.memory is not None else contextlib.nullcontext():
            try:
                batch = next(source)
            except StopIteration:
                raise ValueError(
                    f"the training loader ended {group - micro} batch(es) before its len() "
                    "said it would; a loader with a __len__ must yield that many batches "
                    "(every rank runs as many steps as len() promises, or a collective hangs)"
                ) from None
            inputs, targets = self._unpack(batch)
        if run.memory is not None:
            run.memory.count_inputs((inputs, targets))
        return inputs, targets, time.perf_counter() - t

    def _check_batch(self, run: Run, inputs: object) -> None:
        """Tensor parallelism: the first batch is the same on every rank of a TP group."""
        if not run.checked_batch and self._dry is None:  # fake tensors have nothing to compare
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
        with sync, self.wrapped.loss_context():
            with self._autocast():
                loss = self._loss(inputs, targets, num_items)
            if self._dry is not None:
                self._dry.after_forward()
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
