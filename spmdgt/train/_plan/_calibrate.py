"""Memory per rank, calibrated by a few dry runs and scaled, so a plan needs no dry run per
candidate.

The dry runs (``spmdgt.train._dryrun.dry_run``, its public entry point) run on a copy of the
model cut to one and two blocks, at the micro-batch given, so they take seconds at any size:

===========================  ===========================================================
run                           what it pins down
===========================  ===========================================================
world 1, 1 block and 2 blocks the step's dynamic peak (activations, backward temporaries) as
                              a part outside the blocks plus a part per block
world 1, 1 and 2 blocks, AC   a block's part with activation checkpointing (its input)
                              and the one block recomputed at a time
world 1, 2 blocks, AMP        the ratio AMP's bf16 activations make
world 2 fsdp, 2 blocks        FSDP's gathered units and buffers at the peak
world 2 placements, 2 blocks  the share of a block's activations TP does not split
===========================  ===========================================================

"Dynamic" is the tracker's peak less parameters, buffers, optimizer state and gradients (what
``DryRunReport.peak_breakdown`` names so): what grows with the micro-batch. It scales
linearly with the micro-batch's rows and with the blocks; the static part is computed from
the parameters per rank (``_cost``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spmdgt.train._config import TrainConfig, TrainingConfig
from spmdgt.train._dryrun import DryRunReport, dry_run
from spmdgt.train._plan._model import ModelFacts, meta_copy, truncated

__all__ = ["MemoryModel", "calibrate", "guess_loss_fn"]

# Left out of the dynamic part: what the cost model counts per rank itself (parameters,
# buffers, optimizer state, and the gradients, which at world 1 grow with every block and
# would otherwise be scaled as activations). FSDP's unsharded gradients (one unit's, being
# reduce-scattered) stay in: they are part of its extra.
_STATIC = ("params", "sharded params", "buffers", "optimizer state", "grads", "sharded grads")


@dataclass
class MemoryModel:
    """Bytes per rank of a step's dynamic peak, at ``rows`` rows per micro-batch."""

    rows: int
    opt_ratio: float
    """Optimizer state bytes per parameter byte (AdamW: 2)."""
    buffers: int
    rest: dict[tuple[bool, bool], float]
    """Dynamic bytes outside the blocks, by (activation checkpointing, AMP)."""
    block: dict[tuple[bool, bool], float]
    """Dynamic bytes per block, by (activation checkpointing, AMP)."""
    tp_keep: float = 1.0
    """Share of a block's dynamic bytes that tensor parallelism leaves whole on every rank."""
    fsdp_extra: float = 0.0
    """FSDP's extra dynamic bytes at the peak per byte of one block plus the root (the units
    gathered at once, their all-gather buffers)."""
    runs: list[str] = field(default_factory=list)
    """Each dry run: what it was and its seconds."""

    def dynamic(self, rows: int, ac: bool, amp: bool, blocks: int, tp: int) -> float:
        block = self.block[(ac, amp)] * (self.tp_keep + (1 - self.tp_keep) / tp)
        return (self.rest[(ac, amp)] + blocks * block) * rows / self.rows


def _dynamic(r: DryRunReport) -> float:
    return max(0.0, r.peak - sum(v for k, v in r.peak_breakdown.items() if k in _STATIC))


def guess_loss_fn(batch: object) -> Callable | None:
    """A loss for ``(inputs, targets)`` batches when none is given: cross-entropy over the
    last dim for integer targets (a language model's), else mean squared error; ``None``
    for other batches (the model returns its loss, as Hugging Face models do)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return None
    if not batch[1].is_floating_point():
        return lambda out, y: F.cross_entropy(out.flatten(0, -2).float(), y.flatten())
    return F.mse_loss


def _fake_batch(batch: object) -> object:
    """The batch's shapes and dtypes as tensors made now (fake under the dry run's mode)."""
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype)
    if isinstance(batch, dict):
        return {k: _fake_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(v) for v in batch)
    return batch


def _materialize(model: nn.Module) -> nn.Module:
    """``model`` (a meta copy) with every parameter and buffer made anew by ``torch.empty``:
    fake tensors under the dry run's ``FakeTensorMode`` (no meta tensor reaches it), tied
    parameters still tied."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=p.dtype)
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[name] = made[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                mod._buffers[name] = made[id(b)]
    return model


def _builder(model: nn.Module, batch: object, optimizer: Callable) -> Callable:
    """``dry_run``'s ``build``: a fresh meta copy made here, filled in under its mode."""
    copy_ = meta_copy(model)

    def build():
        m = _materialize(copy_)
        return m, optimizer(m.parameters()), _fake_batch(batch)

    return build


def calibrate(
    model: nn.Module,
    batch: object,
    facts: ModelFacts,
    *,
    loss_fn: Callable | None,
    optimizer: Callable,
    log: Callable[[str], None] = lambda _: None,
) -> MemoryModel:
    """The memory model of ``model`` from its dry runs (see the module's table)."""
    rows = _rows(batch)
    cut = facts.blocks >= 2
    runs: list[str] = []

    def run(label: str, blocks: int | None, world: int, cfg: TrainConfig) -> DryRunReport:
        t0 = time.perf_counter()
        m = truncated(model, blocks) if blocks else model
        try:
            report = dry_run(_builder(m, batch, optimizer), world, cfg, loss_fn=loss_fn)
        finally:
            _forget_runtime()
        runs.append(f"{label}: {time.perf_counter() - t0:.1f}s")
        log(f"calibrating memory: dry run {len(runs)} ({label}) done")
        return report

    plain = TrainConfig(log_every=1000)
    two = 2 if cut else None
    base2 = run("world 1, 2 blocks" if cut else "world 1", two, 1, plain)
    d2 = _dynamic(base2)
    if cut:
        d1 = _dynamic(run("world 1, 1 block", 1, 1, plain))
        blk = max(0.0, d2 - d1)
        rest = max(0.0, d1 - blk)
    else:
        blk, rest = 0.0, d2
    # Under AC a block keeps its input, and the one block being recomputed holds its whole
    # activations at the peak: a part per block plus a constant, pinned by 1 and 2 blocks.
    ac_cfg = TrainConfig(activation_checkpointing=True)
    ac2 = _dynamic(run("activation checkpointing, 2 blocks", two, 1, ac_cfg))
    if cut:
        ac1 = _dynamic(run("activation checkpointing, 1 block", 1, 1, ac_cfg))
        blk_ac = max(0.0, ac2 - ac1)
        rest_ac = max(0.0, ac1 - blk_ac)
    else:
        blk_ac, rest_ac = 0.0, ac2
    amp = run("AMP", two, 1, TrainConfig(training=TrainingConfig(use_amp=True)))
    r_amp = _dynamic(amp) / d2 if d2 else 1.0
    mem = MemoryModel(
        rows=rows,
        opt_ratio=base2.optimizer[0] / max(base2.params[0], 1),
        buffers=base2.peak_breakdown.get("buffers", 0),
        rest={(False, False): rest, (True, False): rest_ac},
        block={(False, False): blk, (True, False): blk_ac},
        runs=runs,
    )
    for ac_on in (False, True):
        mem.rest[(ac_on, True)] = mem.rest[(ac_on, False)] * r_amp
        mem.block[(ac_on, True)] = mem.block[(ac_on, False)] * r_amp
    fsdp = run("fsdp, world 2", two, 2, TrainConfig(strategy="fsdp"))
    units = _unit_bytes(model, two)
    mem.fsdp_extra = max(0.0, _dynamic(fsdp) - d2) / units if units else 0.0
    if cut and 2 in facts.tp_degrees(2) and blk:
        tp = run(
            "placements: auto, world 2",
            two,
            2,
            TrainConfig(strategy="placements", placements="auto"),
        )
        per_block = (_dynamic(tp) - rest) / 2
        mem.tp_keep = min(1.0, max(0.0, 2 * per_block / blk - 1))
    return mem


def _forget_runtime() -> None:
    """Forget the spmdgt runtime a dry run's trainer wrapping adopted (its fake group is
    gone): without this a ``DistributedTrainer`` built later in this process, in a world of
    one, still saw the fake world and called a collective (what ``dry_run_call`` does after
    a script; ``dry_run`` itself leaves it)."""
    from spmdgt._core.session import session

    parts = [p for p in ("meshes", "runtime") if p in session.parts()]
    if parts:
        session.reset(*parts)


def _unit_bytes(model: nn.Module, blocks: int | None) -> float:
    """One block's parameters plus the root's, in the calibration model (what FSDP holds
    gathered at its peak, in proportion)."""
    from spmdgt.train._plan._model import read_model_bytes

    return read_model_bytes(truncated(model, blocks) if blocks else model)


def _rows(batch: object) -> int:
    """Rows of the micro-batch: dim 0 of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    items = batch.values() if isinstance(batch, dict) else batch
    for v in items if isinstance(batch, (dict, list, tuple)) else ():
        if isinstance(v, torch.Tensor) and v.ndim:
            return int(v.shape[0])
    raise ValueError(
        "the batch holds no tensor with a row dim: give the micro-batch as the trainer takes it"
    )
