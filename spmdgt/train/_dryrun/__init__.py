"""A dry run: one training step of a world that is not there, in one process, before launch.

``dry_run(build, world=64, ...)`` runs the trainer itself, as rank 0 of ``world`` ranks, in
this one process, and says whether the job fits. The dry run is a setting of the real
``DistributedTrainer`` (torchtitan's ``comm.mode = "fake_backend"``): built on the fake
process group it asks ``_session.DrySession`` for what a fake world changes, and its
``train`` measures two of its own ``_train_step``s, so whatever a step does (HF's label-token
count, the data-parallel scaling, the GradScaler, the clip), the dry run does:

* the world is torch's fake process group (``dist.init_process_group("fake")``: rank 0 of
  ``world``; every collective is issued, none moves data);
* every tensor is a ``FakeTensor`` (``FakeTensorMode``): shapes, dtypes and devices without
  memory, so a model far larger than this machine is built, sharded and stepped in seconds;
* the trainer builds its ``Layout`` and wraps the model with ``wrap_model`` as always
  (``fully_shard`` per ``_units`` block then the root, or DDP with the counting comm hook),
  and two of its optimizer steps run;
* torch's trackers measure memory: ``FSDPMemTracker`` for FSDP2, ``MemTracker`` otherwise
  (peak over both steps, by category), and ``CollectiveCounter`` (a ``TorchDispatchMode`` on
  the ``c10d`` and functional-collective ops) counts the second step's collectives, kind and
  bytes (DDP's first step runs one all-reduce over all gradients, then rebuilds its buckets
  in gradient order, so the second step is the steady one);
* each collective's time comes from ``CommunicationProfiler``'s latency + ring-bytes /
  bandwidth model, with a bandwidth and latency given or from ``INTERCONNECTS``.

The report (``DryRunReport``) gives per rank the bytes of parameters, gradients and optimizer
state (ranks hold different FSDP shards when a dimension does not divide), rank 0's
activation and peak estimates (rank 0 holds the largest shards), the step's collectives and
a verdict: ``fits in 79.65 GiB per device (NVIDIA H100 80GB): yes (peak 15.09 GiB ...)``.

``dry_run_call(fn, world=...)`` runs any function (a script's ``main``) the same way: its
``DistributedTrainer(...)`` is built as written, on the fake backend, and its ``train(loader)``
dry-runs the loader's first batch and stops the function with the report. ``dry_run_script`` does it
for a script file (``python -m spmdgt.scripts.dryrun --world 64 train.py ...``).

What is approximate: activations are what eager torch on CPU saves (CUDA kernels, SDPA's
flash/efficient backends and CPU-vs-CUDA autocast rules save slightly different tensors);
the peak leaves out the CUDA context, NCCL buffers and allocator fragmentation, which
``headroom`` (10% by default) keeps back; ``compile`` is turned off (eager memory). The
world is the trainer's: the 1-D world mesh, or the ``parallelism`` block's
``(dp_replicate, dp_shard, tp)`` mesh built on the fake group, every collective counted with
the mesh dim whose group ran it (``DryRunReport.collectives_by_dim``).

The package: ``_tables`` (devices, interconnects, parsing), ``_fake`` (the fake world and
the workarounds torch needs on it), ``_session`` (the trainer's dry-run setting and the
measured steps under torch's trackers), ``_counting`` (collectives and per-rank bytes),
``_report`` (the report), ``_api`` (``dry_run``), ``_script`` (a user's script).
"""

from spmdgt.train._dryrun._api import dry_run
from spmdgt.train._dryrun._counting import CollectiveCounter, local_numel
from spmdgt.train._dryrun._fake import fake_world
from spmdgt.train._dryrun._report import DryRunReport
from spmdgt.train._dryrun._script import dry_run_call, dry_run_script
from spmdgt.train._dryrun._session import first_batch
from spmdgt.train._dryrun._tables import (
    DEVICES,
    INTERCONNECTS,
    DryRunError,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
)

__all__ = [
    "DEVICES",
    "INTERCONNECTS",
    "CollectiveCounter",
    "DryRunError",
    "DryRunReport",
    "dry_run",
    "dry_run_call",
    "dry_run_script",
    "fake_world",
    "first_batch",
    "local_numel",
    "parse_bandwidth",
    "parse_bytes",
    "parse_seconds",
]
