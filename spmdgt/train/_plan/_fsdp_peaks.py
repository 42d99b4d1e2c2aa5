"""FSDP's step at its peak, read from one calibration dry run (``_calibrate``): the peak
split into what grows with the micro-batch, with the parameters and with the blocks done
(``FsdpPeak``), at the run's own peak, at its backward's start and in its first block's
backward (the tracker's per-unit snapshots), and what the activations at each block's
backward start say about a block's saved bytes. ``_cost._walk`` moves each such peak over a
candidate's blocks."""

from __future__ import annotations

from dataclasses import dataclass

from spmdgt.train._plan._model import ModelFacts

__all__ = ["FsdpPeak"]

# Left out of the dynamic part: what the cost model counts per rank itself (parameters,
# buffers, optimizer state, and the gradients, which at world 1 grow with every block and
# would otherwise be scaled as activations). FSDP's unsharded gradients stay in: they are
# part of its peak's units (``FsdpPeak``).
_STATIC = ("params", "sharded params", "buffers", "optimizer state", "grads", "sharded grads")
# Of FSDP's dynamic bytes, those that scale with the parameters, not the micro-batch: the
# gathered units, and the blocks' collective buffers.
_UNITS = ("unsharded params", "unsharded grads")
_BUFFERS = ("all-gather buffers", "reduce-scatter buffers")


@dataclass
class FsdpPeak:
    """FSDP's step at its peak (one activation-checkpointing setting), as its world-2 dry run
    of the calibration copy measured it: the peak falls in the backward of ``block`` (0 is
    the last block the backward reaches), with the saved activations (under checkpointing
    every block's, else those of the blocks up to it), the gathered root and block, a
    prefetched block's all-gather buffer (not at block 0) and a reduce-scattered one's (not
    at the first block of the backward), and the sharded gradients of the blocks after it."""

    blocks: int
    """Blocks of the calibration copy."""
    block: int
    """The block whose backward held the peak."""
    rows: float
    """Dynamic bytes at the peak that grow with the micro-batch (activations, temporaries),
    at ``MemoryModel.rows`` rows."""
    units: float
    """Bytes at the peak of gathered parameters and unsharded gradients, per byte of the
    root's parameters plus one block's."""
    gather: float
    """Bytes of all-gather buffers at every block's backward (a block gathered or being
    gathered) per byte of one block's parameters: bf16 under FSDP's AMP."""
    grads: float
    """Sharded gradients at the peak outside the blocks' (bytes, all ranks together)."""
    saved: float = 0.0
    """A block's saved activations (bytes at ``MemoryModel.rows``): the world-1 line's per
    block, under checkpointing at least the block's input (``calibrate``)."""
    fresh: float = 0.0
    """The peak block's own new gradients, unsharded, per byte of its parameters (1 where
    the peak is in a block's backward, under checkpointing; 0 at the backward's start):
    bytes the tracker counts as temporaries but that scale with the parameters, and that
    accumulation's held gradients already count."""
    amp: bool = False
    """Measured under FSDP's AMP: its bytes are AMP's (the walk scales nothing by dtype)."""
    scatter: float = 1.0
    """Bytes of the reduce-scatter buffer per byte of one block's parameters, held in every
    block's backward but the first (the previous block's gradients being reduced): fp32
    under FSDP's AMP too (its reduce dtype). 1 where the peak was in the first block's
    backward, which holds none."""
    left: float = 0.0
    """Bytes (at ``MemoryMeter.rows``) each block whose backward is done leaves alive until
    the whole backward ends: under checkpointing, tensors of its recomputed forward (on
    HF's Llama its RMSNorm outputs and the rotary ``rotate_half(q)``, 3 x tokens x width;
    found with the tracker's per-op tags, ``docs/planner.md``). Read from the calibration
    run's backward temporaries at each block's backward start (``_left_behind``)."""


def _dynamic(parts: dict[str, int]) -> float:
    return max(0.0, parts["total"] - sum(v for k, v in parts.items() if k in _STATIC))


@dataclass
class _Measured:
    """What the planner keeps of one dry run (small enough to come back from a worker)."""

    dynamic: float
    parts: dict[str, int]
    """The forwards' and backwards' peak by category (``_step_parts``)."""
    before_backward: dict[str, int]
    """Activations and backward temporaries at each FSDP unit's backward start
    (``DryRunReport.before_backward``)."""
    block_peak: dict[str, int]
    """The peak in the first block's backward (the last the backward reaches), by category
    (``DryRunReport.backward_peaks``); empty where not FSDP."""
    start_peak: dict[str, int]
    """The peak in the last block's backward (the first the backward reaches), as
    ``block_peak``."""
    optimizer: int
    params: int
    buffers: int
    seconds: float
    optimizer_step: float = 0.0
    """``_optimizer_step`` of the run."""


def _fsdp_peak(
    got: _Measured, blocks: int, block_bytes: int, units: float, ac: bool, amp: bool = False
) -> FsdpPeak:
    """FSDP's peak split (``FsdpPeak``) from its world-2 run of ``blocks`` blocks: the
    block it fell in is read from the sharded gradients held (each block whose backward is
    done holds its own, half on each of the 2 ranks)."""
    held = got.parts.get("sharded grads", 0) * 2
    block = max(blocks - 1, 0)
    if blocks and block_bytes:
        block = min(blocks - 1, max(0, blocks - 1 - round(held / block_bytes)))
    on_units = sum(got.parts.get(k, 0) for k in _UNITS)
    on_buffers = sum(got.parts.get(k, 0) for k in _BUFFERS)
    # the two kinds of buffer apart: under FSDP's AMP a gather is bf16 and a reduce-scatter
    # fp32, and every block's backward holds a gather (its own or the next one's, 4 blocks
    # of HF's Llama at world 4: one bf16 block's bytes at each) where only those after the
    # first hold a reduce-scatter (``_cost._walk``)
    gathered = got.parts.get("all-gather buffers", 0)
    scattered = got.parts.get("reduce-scatter buffers", 0)
    rows = max(0.0, got.dynamic - on_units - on_buffers)
    # the block's new unsharded gradients: bf16 under FSDP's AMP
    fresh = min(block_bytes * (0.5 if amp else 1.0), rows) if ac and blocks else 0.0
    return FsdpPeak(
        blocks=blocks,
        block=block,
        rows=rows - fresh,
        units=on_units / units if units else 0.0,
        gather=gathered / block_bytes if block_bytes else 1.0,
        grads=max(0.0, held - (blocks - 1 - block) * block_bytes) if blocks else held,
        fresh=fresh / block_bytes if block_bytes else 0.0,
        amp=amp,
        scatter=scattered / block_bytes if block_bytes and block < blocks - 1 else 1.0,
    )


def _block_peak(peaks: dict[str, dict[str, int]], first: bool) -> dict[str, int]:
    """The backward peak (``DryRunReport.backward_peaks``) of the block with the lowest
    index (``first``: the last the backward reaches), else of the highest (the first it
    reaches); empty without blocks."""
    blocks = sorted(
        (int(name.rpartition(".")[2]), name) for name in peaks if name.rpartition(".")[2].isdigit()
    )
    return dict(peaks[blocks[0 if first else -1][1]]) if blocks else {}


def _at(run: _Measured, parts: dict[str, int]) -> _Measured:
    """``run`` as it stood at another of its peaks (``parts``: a block's backward peak)."""
    dynamic = _dynamic({"total": 0, **parts})
    return _Measured(dynamic, parts, {}, {}, {}, run.optimizer, run.params, run.buffers, 0.0)


def _start_peak(
    got: dict[str, _Measured],
    key: str,
    blocks: int,
    facts: ModelFacts,
    units: float,
    main: FsdpPeak,
    fp32_saved: float,
) -> FsdpPeak:
    """FSDP's peak without checkpointing in the calibration copy's last block's backward
    (the first the backward reaches: every block's activations saved, no gradient reduced
    yet), for ``MemoryModel.fsdp_second``; ``main`` is the run's own peak.

    Under FSDP's AMP the tracker keeps that block in its backward until its gradients'
    reduce-scatter, inside the next block's backward, and shows the next block's peak for
    it (gradients reduced, a reduce-scatter buffer: HF's Llama, 2 blocks). There the fp32
    run's start stands in: its activations and temporaries scaled as a block's saved bytes
    are (AMP's over fp32's), its gathered units and buffers AMP's own (``main``'s)."""
    run, amp = got[key], main.amp
    parts = run.start_peak
    late = parts.get("sharded grads", 0) or parts.get("reduce-scatter buffers", 0)
    fp32 = got.get("fsdp")
    if amp and late and fp32 is not None and fp32.start_peak and fp32_saved:
        start = _fsdp_peak(_at(fp32, fp32.start_peak), blocks, facts.block_bytes, units, False)
        start.rows *= main.saved / fp32_saved
        start.units, start.gather, start.amp = main.units, main.gather, True
    else:
        start = _fsdp_peak(_at(run, parts), blocks, facts.block_bytes, units, False, amp)
    start.saved = main.saved
    return start


def _late_peak(
    got: dict[str, _Measured],
    key: str,
    blocks: int,
    facts: ModelFacts,
    units: float,
    saved: float,
    amp: bool = False,
) -> FsdpPeak:
    """FSDP's peak in the calibration copy's first block's backward (``MemoryModel.fsdp_second``),
    with what each finished block leaves (``_left_behind``). Its saved bytes per block: the
    world-1 checkpointing line's, less one block's leavings where that line holds them (its
    2-block run peaked after block 1's backward, block 1's gradients held beside the 1-block
    run's: at world 1 they are counted as activations)."""
    run = got[key]
    late = _fsdp_peak(_at(run, run.block_peak), blocks, facts.block_bytes, units, True, amp)
    late.left = _left_behind(run.before_backward)
    late.saved = saved
    one, two = got.get("ac1"), got.get("ac2")
    if one and two and facts.block_bytes:
        grew = two.parts.get("grads", 0) - one.parts.get("grads", 0)
        if grew >= 0.5 * facts.block_bytes:
            late.saved = max(0.0, saved - late.left)
    return late


def _step_per_block(before_backward: dict[str, int]) -> float:
    """How much the activations and temporaries at a block's backward start (``_Measured.
    before_backward``) fall from one block to the next as the backward goes (0 where they
    grow, or with fewer than 2 blocks): without checkpointing, a block's saved activations,
    freed once its backward is done. Under checkpointing they grow (``_left_behind``)."""
    return max(0.0, -_change_per_block(before_backward))


def _change_per_block(before_backward: dict[str, int]) -> float:
    """The first block's (reached last) less the last block's (reached first), over the
    blocks between; 0 with fewer than 2 blocks."""
    blocks = sorted(
        (int(name.rpartition(".")[2]), v)
        for name, v in before_backward.items()
        if name.rpartition(".")[2].isdigit()
    )
    if len(blocks) < 2:
        return 0.0
    return (blocks[0][1] - blocks[-1][1]) / (len(blocks) - 1)


def _left_behind(before_backward: dict[str, int]) -> float:
    """Bytes each finished block's backward leaves alive until the backward ends, net of
    what it frees, from the activations and temporaries at each block's backward start
    (``_Measured.before_backward``): the first block's (reached last) less the last
    block's (reached first), over the blocks between. Both hold one incoming activation
    gradient and every block's checkpoint input; what differs is what the finished blocks
    left, less the saved bytes they freed (which the walk counts for every block).

    Under checkpointing on HF's Llama a finished block leaves 3 x tokens x width in fp32
    (0.375 GiB at the 8B shape's 8192 tokens): tensors its recomputed forward made (the
    tracker's per-op tags name RMSNorm's two multiplies and ``rotate_half(q)``'s cat).
    The checkpoint's frame has handed every recomputed tensor to the backward by then (its
    ``recomputed`` dict is empty, its holders gone), ``gc.collect`` frees none of them,
    and without early stop it is the same: something the autograd graph keeps (not found)
    holds them until the backward ends (the root's post-backward frees them all). 0 with
    fewer than 2 blocks."""
    return max(0.0, _change_per_block(before_backward))
