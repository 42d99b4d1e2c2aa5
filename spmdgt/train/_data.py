"""Data loading: a DataLoader with a resumable distributed sampler and machine-chosen settings.

``OptimizedDataLoader.create(dataset, batch_size)`` gives each data-parallel rank its own slice
of every epoch (a ``DistributedSampler`` when the world has more than one rank), picks worker
count, pinning and prefetch from the machine (all overridable), and lets the trainer resume in
the middle of an epoch without re-reading the skipped batches. Under ``torchrun`` every rank
calls it with the same arguments; under plain ``python`` the sampler covers the whole dataset.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from spmdgt import runtime
from spmdgt._core import env as _env

if TYPE_CHECKING:
    from spmdgt.train._layout import Layout

__all__ = ["OptimizedDataLoader", "ResumableDistributedSampler", "shard_loader"]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can start its next epoch after some of the epoch's samples.

    ``start_after(n)`` names how many samples of the epoch's *global* order (the permutation
    of ``seed + epoch``, the same whatever the number of replicas) every rank together has
    already consumed: the next epoch's iterator deals the rest, ``order[n:]``, round-robin
    over the replicas, padded (with the start of the epoch's order, as torch pads) or, with
    ``drop_last``, cut to a multiple of them. On the same number of replicas that is exactly
    the uninterrupted run's remainder, padding included; on another number (a checkpoint
    written by 2 data-parallel ranks and resumed by 4, or by one process) the run still
    continues at global sample ``n``, however ``n`` divides, with no sample read twice or
    skipped. ``set_epoch`` reshuffles as usual, so a resumed run visits the same samples in
    the same order as an uninterrupted one (within a global batch, ranks take them in
    another interleaving when their number changed).

    ``skip_samples`` (this rank's count, ``n / num_replicas``) is the older spelling, kept:
    it means ``start_after(skip_samples * num_replicas)``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skip_samples = 0
        self._start = 0

    def start_after(self, samples: int) -> None:
        """Start the next epoch's iterator after ``samples`` of its global order (one epoch
        only: the one after it starts from its beginning)."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"start_after takes a sample count >= 0, got {samples!r}")
        self._start = samples

    def _start_sample(self) -> int:
        return self._start or self.skip_samples * self.num_replicas

    def _remaining(self) -> list[int]:
        """The epoch's global order after the start, padded or cut to whole rounds."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            order = list(range(len(self.dataset)))
        rest = order[self._start_sample() :]
        reps = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) // reps * reps]
        pad = -len(rest) % reps
        while pad and rest:  # torch's padding: the epoch's order from its start, repeated
            take = order[:pad]
            rest += take
            pad -= len(take)
        return rest

    def __iter__(self) -> Iterator[int]:
        if not self._start_sample():
            return super().__iter__()
        indices = self._remaining()[self.rank :: self.num_replicas]
        self._start = self.skip_samples = 0  # applies to one epoch only
        return iter(indices)

    def __len__(self) -> int:
        start = self._start_sample()
        if not start:
            return self.num_samples
        rest = max(len(self.dataset) - start, 0)  # counted, not drawn: no permutation here
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)


def _worker_generator(seed: int, rank: int) -> torch.Generator:
    """The loader's own generator for its workers' seeds, by the rank it reads for: a resumed
    run restores the global RNG and must not see it moved by a new iterator, and the ranks
    that read the same rows (a data group's TP ranks) draw the same worker seeds."""
    return torch.Generator().manual_seed(seed + 1_000_003 * rank)


def _default_workers() -> int:
    """Worker processes for this rank: its share of the usable cores minus one, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local_world = _env.launcher_int("LOCAL_WORLD_SIZE", 1)
    # Leave one core per rank for the training process itself; cap at 8 (more rarely helps).
    return max(0, min(8, cpus // max(local_world, 1) - 1))


def _in_daemonic_process() -> bool:
    """Whether this process is a daemonic ``multiprocessing`` child, which may not start
    children of its own (``multiprocessing`` refuses: "daemonic processes are not allowed to
    have children"), so a ``DataLoader`` with workers would fail at its first batch."""
    return bool(multiprocessing.current_process().daemon)


def _choose_workers(num_workers: int | None) -> int:
    """``num_workers`` as asked, or the machine's default; 0 where workers cannot start.

    The default drops to 0 in a daemonic process (a ``multiprocessing`` child started with
    ``daemon=True``: test harnesses, pools) with a ``GT_VERBOSE`` line; an explicit request for
    workers there is an error now rather than a failure at the first batch. Worker count never
    leads to a collective: it changes who reads the samples, not which ones or in what order.
    """
    daemonic = _in_daemonic_process()
    if num_workers is not None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if num_workers > 0 and daemonic:
            raise ValueError(
                f"num_workers={num_workers}, but this process "
                f"({multiprocessing.current_process().name}) is a daemonic multiprocessing "
                "child, and daemonic processes may not start the DataLoader's worker "
                "processes; pass num_workers=0, or start this process with daemon=False"
            )
        return num_workers
    workers = _default_workers()
    if workers and daemonic:
        from spmdgt.interceptor import verbose

        verbose(
            f"OptimizedDataLoader: 0 workers instead of {workers}: this process "
            f"({multiprocessing.current_process().name}) is daemonic and may not start "
            "worker processes"
        )
        return 0
    return workers


class OptimizedDataLoader:
    """Factory for a ``DataLoader`` tuned to the machine and sharded across ranks."""

    @staticmethod
    def create(
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        shard: bool = True,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        collate_fn=None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> DataLoader:
        """A ``DataLoader`` over ``dataset`` with ``batch_size`` samples per rank.

        ``shard=False`` gives every rank the full dataset in the same order (what tensor-
        parallel placements need). ``num_workers`` defaults to the cores per local rank minus
        one (0 on a 1-2 core machine: worker processes would only steal the trainer's cores;
        0 in a daemonic process, which may not start workers); ``pin_memory`` to whether
        CUDA is in use; ``prefetch_factor`` to 2 with workers.
        ``drop_last`` drops the sampler's tail so every rank gets equally many samples and
        the loader's last short batch.

        ``num_replicas`` and ``rank`` (with ``shard=True``) shard over given replicas rather
        than the world (defaults: the world size and rank). The trainer needs neither: given
        a loader sharded over the world, ``train`` shards it over its data-parallel ranks
        (``shard_loader``), so on a mesh with a ``tp`` dim every tensor-parallel rank of a
        data group reads the same rows.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rt = runtime.get_runtime()
        if (num_replicas is None) != (rank is None):
            raise ValueError("pass num_replicas and rank together (or neither)")
        if not shard:
            replicas, rank = 1, 0
        elif num_replicas is not None:
            if not 0 <= rank < num_replicas:
                raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
            replicas = num_replicas
        else:
            replicas, rank = rt.world_size, rt.rank
        sampler = ResumableDistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        workers = _choose_workers(num_workers)
        pin = (rt.device.type == "cuda") if pin_memory is None else pin_memory
        kwargs = {}
        if workers > 0:
            kwargs["prefetch_factor"] = prefetch_factor or 2
            kwargs["persistent_workers"] = (
                True if persistent_workers is None else persistent_workers
            )
        generator = _worker_generator(seed, rank)
        return DataLoader(
            dataset,
            generator=generator,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=pin and torch.cuda.is_available(),
            drop_last=drop_last,
            collate_fn=collate_fn,
            **kwargs,
        )


def shard_loader(loader: object, layout: Layout) -> object:
    """``loader`` sharded over ``layout``'s data-parallel ranks, as accelerate's ``prepare``
    does: a loader written as for the 1-D world reads the right rows on any mesh.

    * A ``DataLoader`` whose ``DistributedSampler`` shards over the world (``OptimizedDataLoader
      .create`` without ``num_replicas``/``rank``, a user's ``DistributedSampler(dataset)``)
      while the layout's data-parallel ranks are fewer (a ``tp`` dim: its ranks share a
      batch): the same loader over a ``ResumableDistributedSampler`` on
      ``(data_parallel_size, data_parallel_rank)``, with the sampler's shuffle, seed, epoch
      and ``drop_last``.
    * A plain ``DataLoader`` (its sampler torch's ``SequentialSampler`` or ``RandomSampler``,
      batched by torch's ``BatchSampler``) with more than one data-parallel rank: the same,
      ``shuffle`` when it was random (the epoch's order from ``seed`` 0, as
      ``OptimizedDataLoader.create``'s default), so every data-parallel rank reads its own
      rows of one global order and the step's global batch is one process's.
    * Anything else is returned as it is: a sampler that already shards over the layout
      (``num_replicas=trainer.data_parallel_size``, or ``shard=False`` for ``placements``),
      a custom sampler or batch sampler, an iterable dataset, any other iterable. The
      trainer's first-batch check still refuses TP ranks given different batches.

    Local (no collective): every rank decides from its own loader and the layout, which are
    alike; a loader that differs between ranks is caught by the loop's agreements."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    sampler, dp, rank = loader.sampler, layout.dp_size, layout.dp_rank
    if isinstance(sampler, DistributedSampler):
        world_sharded = (sampler.num_replicas, sampler.rank) == (layout.world, layout.rank)
        if not world_sharded or (sampler.num_replicas, sampler.rank) == (dp, rank):
            return loader
        shuffle, seed, drop, epoch = (
            sampler.shuffle,
            sampler.seed,
            sampler.drop_last,
            sampler.epoch,
        )
    elif type(sampler) in (SequentialSampler, RandomSampler) and dp > 1:
        if type(loader.batch_sampler) is not BatchSampler:
            return loader
        shuffle, seed, drop, epoch = isinstance(sampler, RandomSampler), 0, False, 0
    else:
        return loader
    new = ResumableDistributedSampler(
        loader.dataset, num_replicas=dp, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop
    )
    new.set_epoch(epoch)
    generator = loader.generator  # a user's (None: the global RNG, the same on every rank)
    if isinstance(sampler, ResumableDistributedSampler):  # OptimizedDataLoader's, by rank
        generator = _worker_generator(seed, rank)
    kwargs = {}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["persistent_workers"] = loader.persistent_workers
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=new,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=generator,
        **kwargs,
    )
