"""Sequence parallelism: the residual stream between tensor-parallel layers split over the
sequence, its styles and where ``placements: auto`` puts them (``parallelism.sequence_parallel``).

Plain tensor parallelism splits the attention heads and the MLP's hidden features; between
them every rank holds the whole residual stream, its norms, and (under activation
checkpointing) each block's saved input. Sequence parallelism (Korthikanti et al., torch's
``SequenceParallel``, torchtitan's default with TP) splits those over the sequence: each rank
keeps ``1/tp`` of the tokens, the sub-blocks' inputs are all-gathered and their outputs
reduce-scattered (together the volume of plain TP's one all-reduce). The numbers are one
process's: norms are per token, and every split is a DTensor placement torch redistributes.

The styles (a placements table may name them by hand too):

* ``sequence_split`` (the first block): its hidden states, whole on every rank, become a
  ``Shard(1)`` DTensor (each rank keeps its tokens; nothing moves forward). A Hugging Face
  model computes its positions and causal mask from the embedding's output before the first
  block, so the split starts there, not at the embedding (torchtitan's).
* ``sequence_parallel`` (a block's norms): torch's ``SequenceParallel``, each rank normalises
  its tokens; the residual stream stays a ``Shard(1)`` DTensor, so a sequence that does not
  divide by the ranks is split unevenly, exactly (DTensor tracks the global shape).
* ``sequence_gather`` (attention, MLP): the hidden states all-gathered to a whole
  ``Replicate`` DTensor before the colwise layers read them; their input gradients, partial
  per rank, are reduce-scattered back once.
* ``rowwise_scatter`` (the sub-blocks' output layers): ``RowwiseParallel`` whose partial
  outputs are reduce-scattered over the sequence (``Shard(1)``) instead of all-reduced.
* ``sequence_parallel_gather`` (the final norm): ``SequenceParallel``, then the whole
  normed stream as a plain tensor for what reads it (the head, whole or ``loss_parallel``;
  the model's ``last_hidden_state``).

The hidden states are a module's first positional input, else its ``hidden_states=``
keyword (Hugging Face's decoder layers call attention with the keyword, the MLP
positionally); a module given neither is an error naming it. Under activation
checkpointing the first block's split moves onto its checkpoint wrapper
(``split_outside_checkpoint``), so the checkpoint saves this rank's tokens.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from spmdgt.config import ConfigError
from spmdgt.train._tp_names import style_of as _style_of
from spmdgt.train._tp_names import wild as _wild

__all__ = [
    "SEQUENCE_STYLES",
    "SequenceGather",
    "SequenceParallelGather",
    "SequenceSplit",
    "sequence_rows",
    "sequence_style",
    "split_outside_checkpoint",
    "with_sequence_parallel",
]

SEQUENCE_STYLES = (
    "sequence_split",
    "sequence_parallel",
    "sequence_gather",
    "rowwise_scatter",
    "sequence_parallel_gather",
)
_SEQ = Shard(1)


def _with_hidden(module: nn.Module, args: tuple, kwargs: dict, convert: object) -> tuple:
    """``(args, kwargs)`` with the hidden states (first positional, else ``hidden_states=``)
    replaced by ``convert(them)``."""
    if args:
        return (convert(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
    raise ValueError(
        f"sequence parallelism: {type(module).__name__} was called with no positional input "
        f"and no hidden_states= keyword (got {sorted(kwargs)}); name its input layout by hand "
        "or turn sequence_parallel off"
    )


class SequenceSplit(ParallelStyle):
    """``sequence_split``: the whole hidden states become a ``Shard(1)`` DTensor (forward: a
    local chunk; backward: the gradient all-gathered)."""

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        def split(x: object) -> object:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return x.redistribute(device_mesh, [_SEQ])

        def hook(m: nn.Module, args: tuple, kwargs: dict) -> tuple:
            return _with_hidden(m, args, kwargs, split)

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        setattr(module, _SPLIT_HOOK, (handle, hook))
        return module


_SPLIT_HOOK = "_spmdgt_sequence_split"


def split_outside_checkpoint(model: nn.Module) -> None:
    """Move the first block's ``sequence_split`` onto its activation-checkpointing wrapper.

    Registered on the block, the split runs inside the checkpointed region, which then saves
    the block's input whole (a block's saved input on every rank; the other blocks save a
    split one): on the wrapper it runs first, and the checkpoint saves this rank's tokens."""
    for wrapper in model.modules():
        block = getattr(wrapper, "_checkpoint_wrapped_module", None)
        found = getattr(block, _SPLIT_HOOK, None) if block is not None else None
        if found is not None:
            handle, hook = found
            handle.remove()
            moved = wrapper.register_forward_pre_hook(hook, with_kwargs=True)
            setattr(block, _SPLIT_HOOK, (moved, hook))


class SequenceGather(ParallelStyle):
    """``sequence_gather``: the hidden states, split over the sequence, all-gathered to a
    ``Replicate`` DTensor (the colwise layers read it; their partial input gradients meet in
    one reduce-scatter)."""

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        def gather(x: object) -> object:
            if not isinstance(x, DTensor):
                raise ValueError(
                    f"sequence_gather: {type(module).__name__}'s hidden states are a plain "
                    "tensor, not split over the sequence (the first block needs "
                    "sequence_split and the norms before it sequence_parallel)"
                )
            return x.redistribute(device_mesh, [Replicate()])

        module.register_forward_pre_hook(
            lambda m, args, kwargs: _with_hidden(m, args, kwargs, gather), with_kwargs=True
        )
        return module


class SequenceParallelGather(SequenceParallel):
    """``sequence_parallel_gather``: torch's ``SequenceParallel``, its output gathered whole
    as a plain tensor (the final norm, read by the head and the model's outputs)."""

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(device_mesh, [Replicate()]).to_local()


def rowwise_scatter() -> ParallelStyle:
    """``rowwise_scatter``: ``RowwiseParallel`` reduce-scattering its partial outputs over the
    sequence; the output stays a ``Shard(1)`` DTensor (the residual stream's layout)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=_SEQ, use_local_output=False)


STYLES = {
    "sequence_split": SequenceSplit,
    "sequence_parallel": SequenceParallel,
    "sequence_gather": SequenceGather,
    "rowwise_scatter": rowwise_scatter,
    "sequence_parallel_gather": SequenceParallelGather,
}


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(
        f"parallelism.sequence_parallel: {type(model).__name__} cannot be split over the "
        f"sequence: {why}; turn sequence_parallel off (tensor parallelism alone keeps the "
        "residual stream whole) or write the table by hand",
        key="parallelism.sequence_parallel",
        value=True,
    )


def with_sequence_parallel(model: nn.Module, table: dict[str, str]) -> dict[str, str]:
    """``table`` with ``sequence_rows``: new rows first, a row the sequence styles replace
    (``rowwise`` -> ``rowwise_scatter``) in its place, patterns left winning no module
    dropped (the table refuses unused patterns)."""
    rows = sequence_rows(model, table)
    merged = {p: s for p, s in rows.items() if p not in table}
    merged.update({p: rows.get(p, s) for p, s in table.items()})
    names = [n for n, _ in model.named_modules() if n]
    winners = {next((p for p in merged if fnmatch.fnmatchcase(n, p)), None) for n in names}
    merged = {p: s for p, s in merged.items() if p in winners}
    for name in names:  # every module the rows name gets their style
        want = _style_of(name, rows)
        if want is not None and _style_of(name, merged) != want:
            raise _refuse(model, f"the table's own pattern for {name!r} comes first")
    return merged


def sequence_rows(model: nn.Module, table: dict[str, str]) -> dict[str, str]:
    """The rows that split a tensor-parallel ``table``'s residual stream over the sequence:
    the first block's input split, every block's norms on their tokens, its attention and MLP
    (the children holding split layers) gathering their input and reduce-scattering their
    output layer, the final norm gathering whole. A ``ConfigError`` naming what stands in
    the way when the model's blocks are not norms and split sub-blocks alone (a router
    reading the stream, a dropout on it, a gathered attention)."""
    from spmdgt.train._units import find_blocks

    found = find_blocks(model)
    if found is None:
        raise _refuse(model, "it has no list of blocks (layers)")
    list_name, blocks = found
    rows: dict[str, str] = {blocks[0][0]: "sequence_split"}
    for block_name, block in blocks:
        for name, child in block.named_children():
            full = f"{block_name}.{name}"
            rows.update(_child_rows(model, full, child, table))
    parent_name = list_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    prefix = f"{parent_name}." if parent_name else ""
    norms = [prefix + n for n, c in parent.named_children() if "Norm" in type(c).__name__]
    if len(norms) != 1:
        raise _refuse(
            model,
            f"{len(norms)} norms follow its blocks in {parent_name or 'the model'!r} (one "
            "final norm gathers the stream back)",
        )
    rows[norms[0]] = "sequence_parallel_gather"
    return {_wild(k) if k != blocks[0][0] else k: v for k, v in rows.items()}


def _child_rows(
    model: nn.Module, full: str, child: nn.Module, table: dict[str, str]
) -> dict[str, str]:
    """One block child's rows: a split sub-block (``sequence_gather``, its rowwise output
    ``rowwise_scatter``) or a norm (``sequence_parallel``); refused otherwise."""
    styled = {
        f"{full}.{n}" if n else full: _style_of(f"{full}.{n}" if n else full, table)
        for n, _ in child.named_modules()
    }
    split = {n: s for n, s in styled.items() if s is not None}
    if split:
        other = sorted({s for s in split.values()} - {"colwise", "rowwise", "sharded_input"})
        if other:
            raise _refuse(
                model, f"{full!r} holds {other[0]} layers (it splits colwise and rowwise ones)"
            )
        rowwise = [n for n, s in split.items() if s == "rowwise"]
        if len(rowwise) != 1 or "colwise" not in split.values():
            raise _refuse(model, f"{full!r} is not colwise layers read by one rowwise output")
        for n, m in child.named_modules():
            qual = f"{full}.{n}" if n else full
            if qual not in split and any(True for _ in m.parameters(recurse=False)):
                raise _refuse(
                    model,
                    f"{qual!r} ({type(m).__name__}) holds parameters the table leaves whole "
                    "inside a split sub-block (a router reading the gathered stream)",
                )
        return {full: "sequence_gather", rowwise[0]: "rowwise_scatter"}
    if "Norm" in type(child).__name__:
        return {full: "sequence_parallel"}
    if any(True for _ in child.parameters()):
        raise _refuse(model, f"{full!r} ({type(child).__name__}) reads the residual stream")
    if isinstance(child, nn.Dropout) and child.p > 0:
        raise _refuse(
            model,
            f"{full!r} drops out of the residual stream (p={child.p}): DTensor's random "
            "numbers on a split stream are not one process's",
        )
    return {}


def sequence_style(style: str) -> ParallelStyle:
    """The ``ParallelStyle`` of one of ``SEQUENCE_STYLES``."""
    return STYLES[style]()
