"""Pick each case's samples from OpInfo and compute its one-process reference, in the parent.

Samples are drawn once here, before the ranks are forked: every rank inherits the very same
tensors, and the reference runs the same ``observe`` code on them with plain torch. A case is
one sample of one row (op, variant, placement, world); a row gets up to
``SAMPLES_PER_ROW`` samples: the first candidates whose reference runs, of different shapes
where the op has them.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tests.parity.layouts import IDENTITY, min_dim, narrowed_rows, soft_cut
from tests.parity.observe import Job, Recorder, Stage, map_tensors, observe, out_template
from tests.parity.observe import primary_tensor as _primary

__all__ = [
    "CANDIDATES",
    "SAMPLES_PER_ROW",
    "Case",
    "RowKey",
    "build_cases",
    "candidates",
    "plain_torch",
]

# Samples tried per op (OpInfo's first ones with a tensor input of 1 or more dims), and
# samples kept per row: enough to see more than one shape without multiplying the run time.
CANDIDATES = 8
SAMPLES_PER_ROW = 2


@dataclass(frozen=True, order=True)
class RowKey:
    """One row of the ledger: an op variant on one placement at one world size."""

    op: str
    variant: str
    placement: str
    world: int


@dataclass
class Case:
    """One sample of one row, with its reference (what plain torch on one process gives)."""

    key: RowKey
    sample_no: int
    seed: int
    job: Job
    reference: dict[str, Stage]


def stable_seed(text: str) -> int:
    """A seed from a name, the same in every process and every run (``hash`` is salted)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def full_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _usable(sample: Any) -> bool:
    x = _primary(sample)
    if x is None or x.dim() < 1 or x.numel() == 0:
        return False
    ok = True

    def check(t: torch.Tensor, _label: str) -> torch.Tensor:
        nonlocal ok
        ok = ok and t.layout == torch.strided and t.device.type == "cpu"
        return t

    map_tensors((sample.input, tuple(sample.args), dict(sample.kwargs)), check, "")
    return ok


_candidates: dict[str, tuple[Any, ...]] = {}


def candidates(op: Any) -> tuple[Any, ...]:
    """The op's first ``CANDIDATES`` float32 CPU samples that have a strided tensor input of
    1 or more dims (seeded by the op's name, so every run draws the same values); cached."""
    name = full_name(op)
    if name not in _candidates:
        _candidates[name] = _draw(op)
    return _candidates[name]


@contextlib.contextmanager
def _no_test_case_lookup() -> Iterator[None]:
    """torch's sample iterators look for the running ``unittest.TestCase`` (for its per-sample
    skips) by ``inspect.stack()``, which reads the source of every frame on pytest's deep
    stack: twice per op, ~3/4 of drawing 679 ops' samples. Under pytest there is no TestCase
    and the lookup answers None; answer it at once."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    saved = core.extract_test_fn, common_utils.extract_test_fn
    core.extract_test_fn = common_utils.extract_test_fn = lambda: None
    try:
        yield
    finally:
        core.extract_test_fn, common_utils.extract_test_fn = saved


def _draw(op: Any) -> tuple[Any, ...]:
    torch.manual_seed(stable_seed(full_name(op)))
    found = []
    with warnings.catch_warnings(), _no_test_case_lookup():
        warnings.simplefilter("ignore")
        try:
            for s in op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd):
                if _usable(s):
                    found.append(s)
                if len(found) >= CANDIDATES:
                    break
        except Exception:  # a sample generator that fails on this build: keep what we have
            pass
    return tuple(found)


def _narrow(sample: Any, rows: int) -> Any | None:
    from torch.testing._internal.opinfo.core import SampleInput

    shape = _primary(sample).shape
    if shape[0] < rows:
        return None
    placed = getattr(sample, "placed", frozenset())

    def cut(t: torch.Tensor, label: str) -> torch.Tensor:
        batch = label in placed and t.dim() and t.shape[0] == shape[0]  # a batch-shaped target
        if t.shape != shape and not batch:
            return t
        return t.detach()[:rows].clone().requires_grad_(t.requires_grad)

    parts = (
        map_tensors(sample.input, cut, "input"),
        map_tensors(tuple(sample.args), cut, "args"),
        map_tensors(dict(sample.kwargs), cut, "kwargs"),
    )
    if placed:  # a training pattern's, with its batch-shaped targets (patterns.py)
        from tests.parity.patterns import Sample

        return Sample(*parts, placed=placed)
    return SampleInput(parts[0], args=parts[1], kwargs=parts[2])


def _soft_cut(sample: Any, cuts: tuple[tuple[int, int], ...]) -> Any | None:
    """``sample`` with its first input's shape cut to ``cuts`` ((dim, length) pairs) where it
    is longer, and every other tensor of that very shape (a binary op's operand) alike; None
    when no dim is longer (the sample as it is then)."""
    from torch.testing._internal.opinfo.core import SampleInput

    shape = _primary(sample).shape
    todo = [(d, n) for d, n in cuts if d < len(shape) and shape[d] > n]
    if not todo:
        return None
    placed = getattr(sample, "placed", frozenset())

    def cut(t: torch.Tensor, label: str) -> torch.Tensor:
        batch = label in placed and t.dim() and t.shape[0] == shape[0]
        if t.shape != shape and not batch:
            return t
        out = t.detach()
        for d, n in todo:
            if d < out.dim() and (t.shape == shape or d == 0):
                out = out.narrow(d, 0, n)
        return out.clone().requires_grad_(t.requires_grad)

    parts = (
        map_tensors(sample.input, cut, "input"),
        map_tensors(tuple(sample.args), cut, "args"),
        map_tensors(dict(sample.kwargs), cut, "kwargs"),
    )
    if placed:
        from tests.parity.patterns import Sample

        return Sample(*parts, placed=placed)
    return SampleInput(parts[0], args=parts[1], kwargs=parts[2])


def _fresh_plain(sample: Any) -> tuple[Any, tuple, dict]:
    def copy(t: torch.Tensor, _label: str) -> torch.Tensor:
        return t.detach().clone()

    return (
        map_tensors(sample.input, copy, ""),
        map_tensors(tuple(sample.args), copy, ""),
        map_tensors(dict(sample.kwargs), copy, ""),
    )


def _job(op: Any, variant: str, sample: Any, seed: int, values_compared: bool) -> Job | None:
    template = None
    if variant == "out":
        try:
            inp, args, kwargs = _fresh_plain(sample)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                template = out_template(op.op(inp, *args, **kwargs))
        except Exception:
            return None  # no result to shape out= after: nothing to test
    backward = op.supports_autograd and (
        variant == "fn" or (variant == "inplace" and op.supports_inplace_autograd)
    )
    return Job(op, variant, sample, seed, backward, template, values_compared)


def plain_torch(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` as plain torch in this process, whatever ``GT_*`` the sweep runs with.

    The ranks are forked from this process and inherit the compile tools its ``import
    spmdgt`` turned on from the environment (``GT_AUTO_COMPILE``, ``GT_WORKER_BATCH_SIZE``):
    that is how a sweep runs them with both compile halves. The reference and the judge must
    not run under them: a reference computed here would be a compiled one (the scenario rows'
    references are computed after the first fork), and a defect of the compile pass would
    then sit on both sides of the comparison (``spmdgt.compile.plain_torch``)."""
    compile_mod = sys.modules.get("spmdgt.compile")
    if compile_mod is None:
        return fn(*args)
    return compile_mod.plain_torch(fn, *args)


def reference(job: Job, seed: int) -> dict[str, Stage]:
    """What plain torch on this one process gives for ``job`` (``plain_torch``)."""
    return plain_torch(_reference, job, seed)


def _reference(job: Job, seed: int) -> dict[str, Stage]:
    rec = Recorder()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observe(job, IDENTITY, lambda t: t.detach().clone(), rec)
    return rec.observation


def build_cases(
    keys: list[RowKey], ops: dict[str, Any], metadata_only: frozenset[str]
) -> tuple[list[Case], dict[RowKey, str]]:
    """The cases of ``keys``, and the reason for each row that got none."""
    cache: dict[tuple, tuple[Job, dict[str, Stage]] | None] = {}
    cases: list[Case] = []
    none: dict[RowKey, str] = {}
    for key in keys:
        op = ops[key.op]
        rows = narrowed_rows(key.placement, key.world)
        cuts = soft_cut(key.placement)
        kept: list[tuple[int, Job, dict[str, Stage]]] = []
        spare: list[tuple[int, Job, dict[str, Stage]]] = []
        failing: tuple[int, Job, dict[str, Stage]] | None = None
        for i, sample in enumerate(candidates(op)):
            if _primary(sample).dim() < min_dim(key.placement):
                continue
            if cuts:
                ck = (key.op, key.variant, i, cuts)
                if ck not in cache:
                    s = _soft_cut(sample, cuts)
                    seed = stable_seed(f"{key.op}/{key.variant}/{i}/{cuts}")
                    compared = key.op not in metadata_only
                    job = None if s is None else _job(op, key.variant, s, seed, compared)
                    cache[ck] = None if job is None else (job, reference(job, seed))
                got = cache[ck]
                if got is None or got[1]["forward"].error is not None:
                    ck = (key.op, key.variant, i, None)  # uncut: the cut changed nothing, or
                    # torch refuses the cut sample (inner dims that no longer match)
            else:
                ck = (key.op, key.variant, i, rows)
            if ck not in cache:
                s = sample if rows is None else _narrow(sample, rows)
                seed = stable_seed(f"{key.op}/{key.variant}/{i}/{rows}")
                compared = key.op not in metadata_only
                job = None if s is None else _job(op, key.variant, s, seed, compared)
                cache[ck] = None if job is None else (job, reference(job, seed))
            if cache[ck] is None:
                continue
            job, ref = cache[ck]
            if ref["forward"].error is not None:
                failing = failing or (i, job, ref)
                continue
            # Prefer samples of different shapes (sharding cares about shapes); fill up with
            # same-shaped ones only when the candidates run out.
            shape = _primary(sample).shape
            if all(_primary(candidates(op)[k[0]]).shape != shape for k in kept):
                kept.append((i, job, ref))
            else:
                spare.append((i, job, ref))
            if len(kept) >= SAMPLES_PER_ROW:
                break
        kept = sorted(kept + spare[: SAMPLES_PER_ROW - len(kept)], key=lambda k: k[0])
        if not kept and failing is not None and rows is None:
            # torch itself raises on every sample: the row still checks that ranks raise too.
            kept = [failing]
        if not kept:
            none[key] = "no sample fits" if rows is None else "no sample survives the cut"
        for i, job, ref in kept:
            cases.append(Case(key, i, job.grad_seed, job, ref))
    return cases, none
