"""Distributed training on torch's own engines: DDP, FSDP2 and YAML tensor-parallel placements.

One process: ``python train.py``. N processes: ``torchrun --nproc_per_node=N train.py``::

    from spmdgt.train import DistributedTrainer, OptimizedDataLoader

    loader = OptimizedDataLoader.create(dataset, batch_size=32)
    trainer = DistributedTrainer(model, optimizer, strategy="fsdp", loss_fn=F.cross_entropy,
                                 gradient_accumulation_steps=4, max_grad_norm=1.0)
    summary = trainer.train(loader, epochs=2)

The full guide is docs/trainer.md. Machinery: ``_strategies`` (wrapping: ``apply_tp``,
``apply_ac``, ``apply_compile``, ``apply_fsdp``/``apply_ddp``), ``_trainer`` (setup,
``train``, ``evaluate``), ``_loop`` (the steps), ``_loss`` (the HF loss rules), ``_resume``
(checkpoints), ``_run`` (one call's measurement), ``_layout`` (the ``Layout`` built once:
meshes, data-parallel size and rank), ``_tp_table`` (a placements table into a plan),
``_checkpoint`` (atomic DCP checkpoints), ``_comm`` (collective algebra and logging),
``_units`` (the blocks: FSDP's units and compile's), ``_compile``, ``_dryrun`` (the trainer
on a fake world), ``_plan`` (the planner: which mesh, micro-batch, AC, AMP),
``_throughput`` (FLOPs, MFU), ``_profilers``, ``_summary``,
``_data``, ``_batches`` (a batch into the model, its loss out), ``_hf_ce`` (HF heads' own
cross-entropy, recomputed as the global token mean), ``_tp_plan`` (``placements: auto`` and
the checks that refuse an inexact table), ``_tp_styles`` (the packed and experts styles),
``_schedule``, ``_config``,
``_cli`` (the flags every training script shares).
"""

from spmdgt.train._checkpoint import CheckpointError
from spmdgt.train._cli import add_dry_run_args, add_parallelism_args
from spmdgt.train._comm import CollectiveLog, CommunicationProfiler, measure_bandwidth
from spmdgt.train._config import (
    CheckpointConfig,
    DDPConfig,
    FSDPConfig,
    ParallelismConfig,
    SchedulerConfig,
    TrainConfig,
    TrainingConfig,
    load_train_config,
    override,
)
from spmdgt.train._data import OptimizedDataLoader, ResumableDistributedSampler
from spmdgt.train._dryrun import DryRunError, DryRunReport, dry_run, dry_run_call
from spmdgt.train._plan import Plan, plan
from spmdgt.train._profilers import PerformanceProfiler
from spmdgt.train._schedule import build_scheduler
from spmdgt.train._tp_plan import derive_placements, table_yaml
from spmdgt.train._trainer import DistributedTrainer

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CollectiveLog",
    "CommunicationProfiler",
    "DDPConfig",
    "DistributedTrainer",
    "DryRunError",
    "DryRunReport",
    "FSDPConfig",
    "OptimizedDataLoader",
    "ParallelismConfig",
    "PerformanceProfiler",
    "Plan",
    "ResumableDistributedSampler",
    "SchedulerConfig",
    "TrainConfig",
    "TrainingConfig",
    "add_dry_run_args",
    "add_parallelism_args",
    "build_scheduler",
    "derive_placements",
    "dry_run",
    "dry_run_call",
    "load_train_config",
    "measure_bandwidth",
    "override",
    "plan",
    "table_yaml",
]
