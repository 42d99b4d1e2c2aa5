"""Batches reach every rank alike: the agreements the training loop makes about its data,
and the small helpers that move and count a batch.

Every check here is a collective in a world of more than one, taken on every rank whatever its
loader looks like: ranks that ran different numbers of batches would pair a collective with
nothing and hang."""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from spmdgt.runtime import Runtime
from spmdgt.train import _hf_ce

if TYPE_CHECKING:
    from spmdgt.train._layout import Layout

__all__ = [
    "agree_on_group",
    "batch_size_of",
    "call_model",
    "check_loader",
    "check_same_batch",
    "describe",
    "loader_len",
    "loss_from_output",
    "loss_token_rule",
    "step_label_tokens",
    "num_samples",
    "num_tokens",
    "split_batch",
    "to_device",
]


def check_loader(loader: Iterable, what: str, rt: Runtime, device: torch.device) -> int | None:
    """Every rank must run equally many batches, or a collective would hang: check once.

    Collective in a world of more than one, whatever the loader: every rank gathers every
    rank's length (-1 for a loader without ``len``), so a sized loader on one rank and an
    unsized one on another is an error too, not a branch taken by some ranks only."""
    n = loader_len(loader)
    if rt.world_size > 1:
        t = torch.tensor([-1 if n is None else n], device=device)
        out = [torch.zeros_like(t) for _ in range(rt.world_size)]
        dist.all_gather(out, t)
        lens = [int(x.item()) for x in out]
        if len(set(lens)) > 1:
            raise ValueError(
                f"ranks have different numbers of {what} batches per epoch, which would "
                "hang the first collective one rank skips: "
                + ", ".join(f"rank {r}: {'no len()' if v < 0 else v}" for r, v in enumerate(lens))
                + "; use OptimizedDataLoader.create (DistributedSampler pads evenly)"
            )
    return n


def agree_on_group(pending: list, where: str, rt: Runtime, device: torch.device) -> int:
    """How many of an unsized loader's batches every rank has for this step (collective).

    The minimum over ranks: a rank holding more drops its extra batches with a warning,
    as ``DistributedSampler(drop_last=True)`` would, since the others cannot match them."""
    have = len(pending)
    if rt.world_size == 1:
        return have
    t = torch.tensor([have], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = int(t.item())
    if agreed < have:
        warnings.warn(
            f"rank {rt.rank}: dropped {have - agreed} batch(es) at {where}: another "
            "rank's loader (no len()) ran out first; shard data evenly "
            "(OptimizedDataLoader.create) so every rank has as many batches",
            stacklevel=3,
        )
    return agreed


def check_same_batch(
    inputs: object, rt: Runtime, device: torch.device, group: object = None
) -> None:
    """Tensor parallelism needs the same batch on every rank of a tensor-parallel ``group``
    (``None``: the world); check the first one (every tensor in it: a dict batch's
    ``input_ids``, ``attention_mask`` and ``labels`` alike). Collective over ``group``."""
    tensors = _tensors(inputs)
    size = rt.world_size if group is None else dist.get_world_size(group)
    if size == 1 or not tensors:
        return
    t = torch.stack(
        [torch.stack([x.double().sum(), (x.double() ** 2).sum()]) for x in tensors]
    ).flatten()
    t = t.to(device)
    out = [torch.zeros_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    if any(not torch.equal(o, out[0]) for o in out):
        if group is not None:
            raise ValueError(
                "tensor parallelism needs the same batch on every rank of a tensor-parallel "
                "group, but the first batches differ (checksums: "
                + ", ".join(f"tp rank {r}: {o[0].item():.6g}" for r, o in enumerate(out))
                + "); the trainer shards a DataLoader over its data-parallel ranks itself "
                "(a DistributedSampler over the world, or torch's sequential or random "
                "sampler), not this loader: shard it over the data-parallel ranks only "
                "(trainer.data_parallel_rank of trainer.data_parallel_size), e.g. "
                "OptimizedDataLoader.create(..., num_replicas=trainer.data_parallel_size, "
                "rank=trainer.data_parallel_rank)"
            )
        raise ValueError(
            "strategy 'placements' (tensor parallel) needs the same batch on every rank, "
            "but the first batches differ (checksums: "
            + ", ".join(f"rank {r}: {o[0].item():.6g}" for r, o in enumerate(out))
            + "); create the loader with OptimizedDataLoader.create(..., shard=False)"
        )


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


# ----------------------------------------------------------------- into the model and out


def split_batch(batch: object, with_loss_fn: bool) -> tuple[object, object]:
    """``(inputs, targets)`` of one batch, the way users of torch and of Hugging Face write
    them: a pair is ``(inputs, targets)``; a mapping (``{"input_ids", "attention_mask",
    "labels"}``, HF's ``BatchEncoding``) is the model's keyword arguments, its ``labels``
    taken out as the targets when a ``loss_fn`` computes the loss (else the model gets them
    and computes its own); anything else is the model's one input."""
    if isinstance(batch, Mapping):
        if not with_loss_fn:
            return batch, None
        if "labels" not in batch:
            raise ValueError(
                "with a loss_fn, a dict batch needs a 'labels' entry (the loss_fn's targets); "
                f"got keys {sorted(batch)}"
            )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return inputs, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if with_loss_fn:
        raise ValueError(
            "with a loss_fn, batches must be (inputs, targets) pairs or dicts with 'labels'; "
            f"got {type(batch).__name__}"
        )
    return batch, None


def call_model(model: torch.nn.Module, inputs: object) -> object:
    """``model(**inputs)`` for a mapping (HF models take keyword arguments), else
    ``model(inputs)``.

    A model whose config asks for a key/value cache (HF's ``use_cache``, on by default for
    generation) is called with ``use_cache=False`` unless the batch says otherwise, as HF's
    own gradient checkpointing does: in training nothing reads the cache, and it keeps
    every block's keys and values to the step's end. Under activation checkpointing it
    does worse: each recomputed block appends its keys and values again (its attention
    then sees the sequence twice) and the cache keeps the recomputed graph behind them
    (the norm's outputs, ``rotate_half``'s), 3 x tokens x width fp32 per finished block
    on HF's Llama (a Llama-3-70B shape at 4 rows of 8192 tokens: ~200 GiB per rank)."""
    if isinstance(inputs, Mapping):
        if "use_cache" not in inputs and _caches(model):
            return model(**inputs, use_cache=False)
        return model(**inputs)
    return model(inputs)


_takes_use_cache: dict[type, bool] = {}


def _caches(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module DDP or ``torch.compile`` wraps) has a config with
    ``use_cache`` on and a ``forward`` that takes ``use_cache``."""
    inner = getattr(model, "_orig_mod", model)
    inner = getattr(inner, "module", inner)
    if getattr(getattr(inner, "config", None), "use_cache", False) is not True:
        return False
    kind = type(inner)  # the wrappers pass keyword arguments on to it
    got = _takes_use_cache.get(kind)
    if got is None:
        try:
            params = inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            params = {}
        got = _takes_use_cache[kind] = "use_cache" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
    return got


def loss_from_output(out: object, with_loss_fn: bool) -> object:
    """What a ``loss_fn`` is given, or the loss itself without one.

    With a ``loss_fn``: the output's ``logits`` when it has them (HF's ``ModelOutput``),
    else the output. Without: the output's ``loss`` when the model computed one (HF's
    ``ModelOutput.loss``, or a dict's ``"loss"``), else the output (a model returning its
    scalar loss)."""
    if with_loss_fn:
        logits = _field(out, "logits")
        return out if logits is None else logits
    loss = _field(out, "loss")
    if loss is not None:
        return loss
    if not isinstance(out, torch.Tensor) and _has_field(out, "loss"):
        raise ValueError(
            f"the model returned {type(out).__name__} with loss=None: put 'labels' in the "
            "batch so the model computes its loss, or pass loss_fn=... (it is given the "
            "output's logits and the batch's labels)"
        )
    return out


# ------------------------------------------- the step's label tokens (HF's num_items_in_batch)


def loss_token_rule(model: torch.nn.Module) -> str | None:
    """How ``model``'s loss counts its items when the trainer can make it the step's global
    token mean, else ``None`` (the model keeps its own per-micro-batch mean):

    * ``"shifted"`` (a causal LM, ``labels[..., 1:] != -100``) and ``"unshifted"`` (masked LM,
      token classification: ``labels != -100``): the model divides by HF's
      ``num_items_in_batch``, which the trainer passes;
    * ``"logits"`` (``_hf_ce.RULE``: ``labels != -100``): a head that computes
      ``CrossEntropyLoss()`` itself (T5, BERT's masked-LM and token-classification heads);
      the trainer recomputes its loss from the output's logits (``_hf_ce``).

    Decided from the model alone (its class, forward signature and source: the same on every
    rank, read before wrapping). For ``num_items_in_batch`` the way HF's ``Trainer`` decides:
    the model's ``accepts_loss_kwargs`` when it sets one, else a forward taking
    ``num_items_in_batch`` or ``**kwargs``; and, stricter than HF, the forward must hand them
    to ``self.loss_function``, one of HF's token cross-entropies, which sum and divide by
    that count. ``accepts_loss_kwargs = False`` opts a model out of both. Any other loss (a
    regression's MSE, a user's model) would ignore the count, and passing it would silently
    scale the loss: those keep the per-rank mean. ``transformers`` is read only when the
    model's code already imported it (the core never imports it)."""
    if getattr(model, "accepts_loss_kwargs", True) is False:
        return None
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    if loss_utils is None:
        return None
    if not _forward_calls_loss_function(model):
        return _hf_ce.RULE if _hf_ce.computes_token_ce(model) else None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "num_items_in_batch" not in params and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    ):
        return None
    fn = getattr(model, "loss_function", None)  # HF's property: LOSS_MAPPING[loss_type]
    config = getattr(model, "config", None)
    if fn is loss_utils.ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False):
        return "shifted"
    if fn in (loss_utils.ForMaskedLMLoss, loss_utils.ForTokenClassification):
        return "unshifted"
    return None


def _forward_calls_loss_function(model: torch.nn.Module) -> bool:
    """Whether the model's forward computes its loss through HF's ``self.loss_function``
    with the keywords it was given. Some HF heads (``BertForMaskedLM``) take ``**kwargs`` but
    compute ``CrossEntropyLoss()`` themselves: a count passed to them would be ignored, and
    the trainer's scaling would silently multiply their loss (``_hf_ce`` recomputes theirs).
    Read from the class's source (no source: not counted)."""
    try:
        src = inspect.getsource(inspect.unwrap(type(model).forward))
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in src and ("**kwargs" in src or "num_items_in_batch" in src)


def label_tokens(inputs: object, rule: str) -> torch.Tensor | None:
    """This micro-batch's items as HF's loss counts them (a 0-dim int64 tensor on the labels'
    device, no host sync), or ``None`` when it is not a dict batch with ``labels``. A batch's
    own ``shift_labels`` (a padding-free collator's) are counted as they are, as HF does; a
    recomputed head's (``"logits"``) loss reads ``labels`` only, ignoring -100."""
    if not isinstance(inputs, Mapping) or "labels" not in inputs:
        return None
    if rule == _hf_ce.RULE:
        return (inputs["labels"] != _hf_ce.IGNORE).sum(dtype=torch.int64)
    ignore = inputs.get("ignore_index", -100)
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    else:
        labels = inputs["labels"]
        if rule == "shifted":
            labels = labels[..., 1:]
    return (labels != ignore).sum(dtype=torch.int64)


def step_label_tokens(
    micro_batches: list,
    rule: str,
    *,
    layout: Layout,
    device: torch.device,
    comm_device: torch.device,
) -> torch.Tensor:
    """The optimizer step's label tokens over all its micro-batches and every data-parallel
    rank: HF's ``num_items_in_batch``, the divisor that makes the step's loss the global token
    mean one process computes on the global batch (a 0-dim int64 tensor on ``device``).

    Collective when ``layout.dp_size > 1``: one all-reduce of two numbers over the world, on
    every rank at every step (the schedule is the config's, never the data's). The TP ranks
    of a data group share its batch, so the world's sum counts each data group
    ``layout.batch_replicas`` times and is divided by that. A micro-batch without ``labels``
    (its model would compute no loss to divide) is counted in the same all-reduce, so every
    rank raises the same error rather than some ranks going on into a backward the others
    never reach."""
    counts = [label_tokens(b, rule) for b in micro_batches]
    missing = sum(c is None for c in counts)
    present = [c for c in counts if c is not None]
    total = torch.stack(present).sum() if present else torch.zeros((), dtype=torch.int64)
    if layout.dp_size > 1:
        t = torch.stack([total.to(comm_device), torch.tensor(missing, device=comm_device)])
        dist.all_reduce(t)
        replicas = layout.batch_replicas  # the TP ranks sharing one data group's batch
        total = t[0] // replicas if replicas > 1 else t[0]
        # a dry run's fake world: every rank is this one, its own count stands for the sum
        missing = int(t[1].item()) if has_values(t) else missing
    if missing:
        raise ValueError(
            f"{missing} micro-batch(es) of this step's global batch have no 'labels': the "
            "model's loss divides by "
            "the step's label tokens (HF's num_items_in_batch), counted over every rank; "
            "give every dict batch its 'labels', or pass loss_fn=..."
        )
    return total.to(device)


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values: a dry run's fake tensors (``FakeTensorMode``) have shapes
    only, so a check that reads one is left to the real run (its collective is still run, and
    counted)."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


def _field(out: object, name: str) -> object:
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, Mapping):
        return out.get(name)
    return getattr(out, name, None)


def _has_field(out: object, name: str) -> bool:
    return (name in out) if isinstance(out, Mapping) else hasattr(out, name)


def loader_len(loader: object) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def batch_size_of(loader: object) -> int:
    return getattr(loader, "batch_size", None) or 1


def to_device(x: object, device: torch.device) -> object:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def num_samples(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.ndim else 1
    if isinstance(x, (list, tuple)) and x:
        return num_samples(x[0])
    if isinstance(x, Mapping) and x:
        return num_samples(_first(x))
    return 1


def num_tokens(x: object) -> int:
    """Token count of an integer id tensor ``[batch, seq, ...]`` (a mapping's
    ``input_ids``); 0 when not token ids."""
    if isinstance(x, torch.Tensor):
        return x.numel() if x.ndim >= 2 and not x.is_floating_point() else 0
    if isinstance(x, (list, tuple)) and x:
        return num_tokens(x[0])
    if isinstance(x, Mapping) and x:
        return num_tokens(_first(x))
    return 0


def _first(x: Mapping) -> object:
    return x["input_ids"] if "input_ids" in x else next(iter(x.values()))


def describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__
