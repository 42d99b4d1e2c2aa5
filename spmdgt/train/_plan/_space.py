"""The space a plan searches: every way the trainer can run a global batch on a world.

A candidate is one ``TrainConfig`` the trainer runs as is: a strategy on a mesh
``(dp_replicate, dp_shard, tp)`` (degree-1 dims included), activation checkpointing on or off
(the trainer's one setting: ``checkpoint_wrapper`` per block; it has no selective mode, so
none is offered), AMP on or off, and the micro-batch with the accumulation steps that make
the global batch (under FSDP both ways to accumulate: gradients unsharded until the step's
one reduce-scatter, or reduce-scattered every micro-step and held sharded). Only what the
trainer accepts is listed:

* ``ddp`` on the 1-D world mesh (DDP takes no DTensor parameters: no TP under it);
* ``fsdp`` on ``(r, s, t)`` with ``s > 1`` (HSDP when ``r > 1``; FSDP over one rank is DDP's
  work with more calls), and ``t > 1`` only with a TP table the model allows at ``t``;
* ``placements`` (TP alone) with ``t`` = the world.

TP stays inside a node (``t`` <= devices per node, as torchtitan advises: its all-reduces
are per layer). The global batch must split evenly: ``B = dp x micro-batch x accumulation``.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdgt.train._config import (
    FSDPConfig,
    ParallelismConfig,
    TrainConfig,
    TrainingConfig,
)

__all__ = ["Candidate", "enumerate_space"]


@dataclass(frozen=True)
class Candidate:
    strategy: str
    dp_replicate: int
    dp_shard: int
    tp: int
    micro_batch: int
    accumulation: int
    ac: bool
    amp: bool
    sharded_accumulation: bool = False
    """FSDP's ``accumulate_sharded`` (micro-steps only): a reduce-scatter per micro-step, the
    gradients held sharded between them."""
    sequence_parallel: bool = False
    """TP with the residual stream split over the sequence (``tp > 1`` only)."""

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def label(self) -> str:
        mesh = f"{self.dp_replicate}x{self.dp_shard}x{self.tp}"
        return (
            f"{self.strategy:<10} {mesh:<9} mb {self.micro_batch:>3} "
            f"{'x' + str(self.accumulation) + ('s' if self.sharded_accumulation else ''):<4}"
            f" {'AC' if self.ac else '--'} {'AMP' if self.amp else 'fp32':<4}"
            f" {'SP' if self.sequence_parallel else '  '}"
        )

    def config(self, base: TrainConfig | None = None, placements: object = "auto") -> TrainConfig:
        """This candidate as the trainer's config (``base``'s other settings kept)."""
        base = base or TrainConfig()
        sp = self.sequence_parallel and self.tp > 1
        par = ParallelismConfig(
            dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, sequence_parallel=sp
        )
        if self.strategy != "fsdp" and self.tp == 1:
            par = ParallelismConfig()  # the 1-D world mesh
        if self.strategy == "placements":
            par = ParallelismConfig(dp_replicate=1, dp_shard=1, tp=self.tp, sequence_parallel=sp)
        training = TrainingConfig(
            **{
                **{f: getattr(base.training, f) for f in base.training.__slots__},
                "batch_size": self.micro_batch,
                "gradient_accumulation_steps": self.accumulation,
                "use_amp": self.amp,
            }
        )
        fields = {f: getattr(base, f) for f in base.__slots__}
        fields.update(
            strategy=self.strategy,
            training=training,
            parallelism=par,
            activation_checkpointing=self.ac,
            placements=placements if self.tp > 1 else {},
            fsdp=FSDPConfig(
                use_mixed_precision=False,
                reshard_after_forward=base.fsdp.reshard_after_forward,
                accumulate_sharded=self.sharded_accumulation,
            ),
        )
        return TrainConfig(**fields)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(world: int, tp_degrees: list[int], per_node: int) -> list[tuple[str, int, int, int]]:
    out = [("ddp", 1, world, 1)] if world > 1 else [("ddp", 1, 1, 1)]
    for t in tp_degrees:
        if world % t or t > per_node:
            continue
        rest = world // t
        for r in _divisors(rest):
            s = rest // r
            if s > 1:
                out.append(("fsdp", r, s, t))
        if t == world and t > 1:
            out.append(("placements", 1, 1, t))
    return out


def enumerate_space(
    world: int,
    global_batch: int,
    *,
    tp_degrees: list[int],
    per_node: int,
    micro_batches: list[int] | None = None,
    ac: tuple[bool, ...] = (False, True),
    amp: tuple[bool, ...] = (False, True),
    strategies: tuple[str, ...] = ("ddp", "fsdp", "placements"),
    sequence_parallel: bool = False,
) -> tuple[list[Candidate], list[str]]:
    """Every candidate for ``world`` ranks and ``global_batch`` rows per optimizer step, and
    the notes on what was left out (a mesh whose data-parallel size does not divide the
    batch). ``micro_batches`` limits the micro-batch sizes tried (default: every divisor of
    the rows per data-parallel rank). ``sequence_parallel``: TP candidates split the
    residual stream over the sequence (torchtitan's default with TP: the same numbers and
    bytes moved, the stream's memory over ``tp``)."""
    out: list[Candidate] = []
    notes: list[str] = []
    for strategy, r, s, t in _meshes(world, tp_degrees, per_node):
        if strategy not in strategies:
            continue
        dp = r * s
        if global_batch % dp:
            notes.append(
                f"{strategy} {r}x{s}x{t}: the global batch {global_batch} does not split over "
                f"{dp} data-parallel ranks"
            )
            continue
        per_rank = global_batch // dp
        sizes = [m for m in _divisors(per_rank) if micro_batches is None or m in micro_batches]
        for m in sizes:
            k = per_rank // m
            # FSDP's two ways to accumulate: unsharded gradients, one reduce-scatter per step,
            # or sharded ones, a reduce-scatter per micro-step (``accumulate_sharded``)
            ways = (False, True) if strategy == "fsdp" and k > 1 else (False,)
            for a in ac:
                for p in amp:
                    for w in ways:
                        sp = sequence_parallel and t > 1
                        out.append(Candidate(strategy, r, s, t, m, k, a, p, w, sp))
    return out, notes
