"""Run one sample of one op variant and observe what it gives: the code that the one-process
reference and every rank share, so the two differ only in where the inputs live.

A run has two stages, ``forward`` and ``backward``. Each stage first reports whether it raised
and the *signature* of what it produced (labels, shapes, dtypes, requires_grad, layout), and
only then fetches global values: fetching is a collective on a rank, so the runner lets the
ranks fetch only when all of them got through the stage with the same signature (otherwise
some ranks would wait forever in a gather the others never join).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tests.parity.layouts import Layout

__all__ = ["STAGES", "Job", "Recorder", "Stage", "describe", "observe"]

STAGES: tuple[str, ...] = ("forward", "backward")


@dataclass
class Stage:
    """What one process saw in one stage. ``values`` stays None when the stage was stopped
    before fetching (some process raised, or the processes' signatures differed)."""

    name: str
    error: str | None = None
    signature: tuple = ()
    values: list[tuple[str, Any]] | None = None


@dataclass
class Job:
    """Everything ``observe`` needs to run one sample of one op variant.

    ``variant`` is ``fn`` (OpInfo's ``op``), ``inplace`` or ``out``. ``out_template`` holds
    the (shape, dtype) of each result for ``out``. ``values_compared`` is False for ops whose
    results are uninitialised memory (only shapes and dtypes mean anything there).
    """

    op: Any
    variant: str
    sample: Any
    grad_seed: int
    backward: bool
    out_template: Any = None
    values_compared: bool = True


class Channel(Protocol):
    def stage(self, name: str, error: str | None, signature: tuple) -> bool: ...
    def values(self, name: str, values: list[tuple[str, Any]], error: str | None) -> None: ...


@dataclass
class Recorder:
    """The reference's channel: record every stage; go on whenever this process did not raise."""

    observation: dict[str, Stage] = field(default_factory=dict)

    def stage(self, name: str, error: str | None, signature: tuple) -> bool:
        self.observation[name] = Stage(name, error, signature)
        return error is None

    def values(self, name: str, values: list[tuple[str, Any]], error: str | None) -> None:
        st = self.observation[name]
        st.values = values
        st.error = st.error or error


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def describe(e: BaseException) -> str:
    """``Type: first line of the message``, with addresses blanked, at most 200 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return _ADDRESS.sub("0x?", text)[:200]


def primary_tensor(sample: Any) -> torch.Tensor | None:
    """The sample's first tensor input: ``input`` itself, or the first of a list (``cat``)."""
    x = sample.input
    if isinstance(x, torch.Tensor):
        return x
    if type(x) in (list, tuple) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def map_tensors(obj: Any, fn: Callable[[torch.Tensor, str], Any], label: str) -> Any:
    """Apply ``fn(tensor, label)`` through plain lists, tuples and dicts (labels like
    ``args[0]``); anything else is kept as is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, label)
    if type(obj) in (list, tuple):
        return type(obj)(map_tensors(x, fn, f"{label}[{i}]") for i, x in enumerate(obj))
    if type(obj) is dict:
        return {k: map_tensors(v, fn, f"{label}[{k}]") for k, v in obj.items()}
    return obj


def flatten(obj: Any, label: str) -> list[tuple[str, Any]]:
    """Leaves of a result (tuples, named tuples, lists, dicts) with their labels."""
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return [item for i, x in enumerate(obj) for item in flatten(x, f"{label}[{i}]")]
    if isinstance(obj, dict):
        return [item for k, v in obj.items() for item in flatten(v, f"{label}[{k}]")]
    return [(label, obj)]


def _fresh(sample: Any, layout: Layout):
    """Fresh copies of the sample's tensors (in-place variants must not touch the sample),
    those shaped like the first input laid out by ``layout``, and so are those the sample
    names in ``placed`` where they have the layout's dim (a training pattern's batch-shaped
    targets); and the leaves that need grads."""
    shape = primary_tensor(sample).shape
    placed = getattr(sample, "placed", ())
    leaves: list[tuple[str, torch.Tensor]] = []

    def fresh(t: torch.Tensor, label: str) -> torch.Tensor:
        c = t.detach().clone()
        if c.shape == shape:
            c = layout.put(c)
        elif label in placed:
            c = layout.put_out(c)
        if t.requires_grad:
            c.requires_grad_(True)
            leaves.append((label, c))
        return c

    inp = map_tensors(sample.input, fresh, "input")
    args = map_tensors(tuple(sample.args), fresh, "args")
    kwargs = map_tensors(dict(sample.kwargs), fresh, "kwargs")
    return inp, args, kwargs, leaves


def _forward(job: Job, inp, args, kwargs, put_out, watch) -> list[tuple[str, Any]]:
    # ``watch`` brackets the op's own call: the copies and out= tensors made for it stay out
    op = job.op
    if job.variant == "fn":
        with watch():
            ret = op.op(inp, *args, **kwargs)
        return flatten(ret, "out")
    if job.variant == "inplace":
        # A leaf that needs grad cannot be changed in place: change a copy (torch's idiom).
        target = inp.clone() if inp.requires_grad else inp
        with watch():
            ret = op.inplace_variant(target, *args, **kwargs)
        return [("self", target), ("returns self", ret is target)]
    if job.variant == "out":
        out = _out_tensors(job.out_template, put_out)
        # out= does not differentiate: torch raises if grad mode is on
        with torch.no_grad(), watch():
            ret = op.op(inp, *args, **kwargs, out=out)
        got, want = flatten(ret, "out"), flatten(out, "out")
        same = len(got) == len(want) and all(a is b for (_, a), (_, b) in zip(got, want))
        return [*want, ("returns out", same)]
    raise ValueError(f"unknown variant {job.variant!r}")


def _out_tensors(template: Any, put_out) -> Any:
    if isinstance(template, tuple) and template and isinstance(template[0], torch.Size):
        shape, dtype = template
        return put_out(torch.zeros(shape, dtype=dtype))
    return tuple(_out_tensors(t, put_out) for t in template)


def out_template(result: Any) -> Any:
    """The (shape, dtype) of each tensor of a result, shaped like the ``out=`` it needs."""
    if isinstance(result, torch.Tensor):
        return (result.shape, result.dtype)
    if isinstance(result, (list, tuple)):
        return tuple(out_template(r) for r in result)
    raise TypeError(f"no out= for a result of type {type(result).__name__}")


def _kind(t: torch.Tensor) -> str:
    if hasattr(t, "placements") and hasattr(t, "device_mesh"):
        ranks = tuple(t.device_mesh.mesh.flatten().tolist())
        return f"{type(t).__name__}{ranks}{tuple(t.placements)}"
    return "plain"


def signature(items: list[tuple[str, Any]]) -> tuple:
    """One entry per item: tensors give (label, shape, dtype, requires_grad, layout)."""
    sig = []
    for label, x in items:
        if isinstance(x, torch.Tensor):
            sig.append((label, tuple(x.shape), str(x.dtype), x.requires_grad, _kind(x)))
        else:
            sig.append((label, type(x).__name__))
    return tuple(sig)


# dtypes whose storages pickle but do not unpickle (torch 2.13): sent as raw bits instead.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PICKLES = {
    *(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    *(torch.complex64, torch.complex128, torch.bool, torch.uint8),
    *(torch.int8, torch.int16, torch.int32, torch.int64),
}


def _portable(t: torch.Tensor) -> torch.Tensor:
    """A plain, self-contained copy that pickles and compares everywhere: conjugate and
    negative views resolved, complex32 widened, uint16/32/64 and float8 as their raw bits
    (compared exactly). The signature keeps the real dtype."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().clone()
    if t.dtype == torch.complex32:
        return t.to(torch.complex64)
    if t.dtype not in _PICKLES:
        return t.view(_BITS[t.element_size()])
    return t


def _fetch_all(items, fetch, values_compared: bool):
    try:
        out = []
        for label, x in items:
            if isinstance(x, torch.Tensor):
                if values_compared:
                    out.append((label, _portable(fetch(x))))
            else:
                out.append((label, x))
        return out, None
    except Exception as e:
        return None, f"global_value failed: {describe(e)}"


def _differentiable(items: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    return [
        (label, x)
        for label, x in items
        if isinstance(x, torch.Tensor)
        and x.requires_grad
        and (x.is_floating_point() or x.is_complex())
    ]


def observe(
    job: Job,
    layout: Layout,
    fetch: Callable[[torch.Tensor], torch.Tensor],
    channel: Channel,
    watch: Callable[[], Any] | None = None,
) -> list[Any]:
    """Run ``job`` with inputs laid out by ``layout``; report each stage on ``channel``.

    Backward is ``(out * g).sum()`` over every differentiable result, ``g`` a fixed random
    tensor of the result's shape (seeded by ``job.grad_seed``, so the same on every process),
    then the gradient of every input that requires one.

    ``watch`` (a rank's ``spmdgt.tensor._paths.watch``) brackets the op's forward call and
    ``backward()``; the watches opened are returned (their paths: the row's ``path`` column).
    """
    watches: list[Any] = []

    def watched():
        if watch is None:
            return contextlib.nullcontext()
        watches.append(watch())
        return watches[-1]

    items: list[tuple[str, Any]] = []
    leaves: list[tuple[str, torch.Tensor]] = []
    error = None
    try:
        inp, args, kwargs, leaves = _fresh(job.sample, layout)
        items = _forward(job, inp, args, kwargs, layout.put_out, watched)
    except Exception as e:
        error = describe(e)
    if not channel.stage("forward", error, signature(items) if error is None else ()):
        return watches
    channel.values("forward", *_fetch_all(items, fetch, job.values_compared))

    grads: list[tuple[str, Any]] = []
    error = None
    outs = _differentiable(items) if job.backward else []
    if outs and leaves:
        try:
            loss = None
            for i, (_, t) in enumerate(outs):
                gen = torch.Generator().manual_seed(job.grad_seed + i)
                g = torch.randn(tuple(t.shape), dtype=t.dtype, generator=gen)
                term = (t * g).sum()
                term = term.real if term.is_complex() else term
                loss = term if loss is None else loss + term
            with watched():
                loss.backward()
            grads = [(f"grad {label}", leaf.grad) for label, leaf in leaves]
        except Exception as e:
            error = describe(e)
    if not channel.stage("backward", error, signature(grads) if error is None else ()):
        return watches
    channel.values("backward", *_fetch_all(grads, fetch, True))
    return watches
