"""Judge a case (every rank against the one-process reference) and a row (its samples).

Outcomes, best to worst:

- ``equal``: every rank got the reference's results: same labels, shapes, dtypes and
  requires_grad; integer and bool values exact; floating values within rtol 1e-5 / atol 1e-5
  with NaN in the same places. fp32 keeps ~7 digits; a sharded reduction adds partial sums in
  another order, which moves the last one or two digits on OpInfo's small sizes. 1e-5 leaves
  that room and still catches any real error (a dropped shard, a wrong offset, a stale value).
- ``raises``: every rank raised the same exception type with the same first line (torch on one
  process may have returned - spmdgt lacks the op on that layout - or raised too).
- ``differs``: the ranks agree, on a wrong result (or return where torch raises).
- ``disagree``: the ranks did not all do the same: one raised and one did not, or they hold
  different values.
- ``hang``: a rank said nothing within the per-case timeout; ``crash``: a rank died.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.parity.observe import Stage

__all__ = [
    "CRASH",
    "DIFFERS",
    "DISAGREE",
    "EQUAL",
    "FAILURES",
    "HANG",
    "OUTCOMES",
    "RAISES",
    "judge",
    "worst",
]

EQUAL, RAISES, DIFFERS, DISAGREE, HANG, CRASH = (
    "equal",
    "raises",
    "differs",
    "disagree",
    "hang",
    "crash",
)
OUTCOMES: tuple[str, ...] = (EQUAL, RAISES, DIFFERS, DISAGREE, HANG, CRASH)
FAILURES: frozenset[str] = frozenset({DIFFERS, DISAGREE, HANG, CRASH})

RTOL = ATOL = 1e-5  # see the module docstring


def _tensor_mismatch(label: str, got: torch.Tensor | None, want: torch.Tensor | None) -> str:
    if got is None or want is None:
        return "" if got is None and want is None else f"{label}: None vs a tensor"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{label}: {got.dtype}{list(got.shape)}, torch gives {want.dtype}{list(want.shape)}"
    if want.is_floating_point() or want.is_complex():
        ok = torch.isclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    else:
        ok = got == want
    if bool(ok.all()):
        return ""
    bad = ~ok
    n = int(bad.sum())
    first = [int(i) for i in bad.nonzero()[0]]
    if want.is_floating_point() or want.is_complex():
        diff = (got - want).abs()[bad]
        finite = diff[torch.isfinite(diff)]
        size = f", max |diff| {float(finite.max()):.3g}" if finite.numel() else ""
    else:
        size = ""
    where = f" first at {first}" if first else ""
    return f"{label}: {n}/{want.numel()} values differ{size}{where}"


def _item_mismatch(label: str, got: Any, want: Any) -> str:
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{label}: {type(got).__name__}, torch gives {type(want).__name__}"
        return _tensor_mismatch(label, got, want)
    if isinstance(want, float) and isinstance(got, float):
        same = (math.isnan(want) and math.isnan(got)) or math.isclose(
            got, want, rel_tol=RTOL, abs_tol=ATOL
        )
    else:
        try:
            same = bool(got == want)
        except Exception:
            same = repr(got) == repr(want)
    return "" if same else f"{label}: {got!r:.60}, torch gives {want!r:.60}"


def _values_mismatch(got: list, want: list) -> str:
    if [lbl for lbl, _ in got] != [lbl for lbl, _ in want]:
        return f"results {[lbl for lbl, _ in got]}, torch gives {[lbl for lbl, _ in want]}"
    for (label, g), (_, w) in zip(got, want):
        why = _item_mismatch(label, g, w)
        if why:
            return why
    return ""


def _identical(a: list, b: list) -> bool:
    if [lbl for lbl, _ in a] != [lbl for lbl, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            same = (x == y) | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() else x == y
            if not bool(same.all()):
                return False
        elif _item_mismatch("", x, y):
            return False
    return True


_FIELDS = ("shape", "dtype", "requires_grad", "layout")


def _what(entry: tuple) -> str:
    return "a tensor" if len(entry) > 2 else entry[1]


def _sig_mismatch(got: tuple, want: tuple, layout: bool) -> str:
    """First difference of two signatures, in words; the layout only counts across ranks."""
    if [s[0] for s in got] != [s[0] for s in want]:
        return f"results {[s[0] for s in got]} vs {[s[0] for s in want]}"
    for a, b in zip(got, want):
        if len(a) != len(b) or len(a) == 2:  # a tensor vs something else, or two non-tensors
            if a != b:
                return f"{a[0]}: {_what(a)} vs {_what(b)}"
            continue
        for name, x, y in zip(_FIELDS, a[1:], b[1:]):
            if x != y and (layout or name != "layout"):
                return f"{a[0]}: {name} {x} vs {y}"
    return ""


def _stage(name: str, ref: Stage, ranks: list[Stage]) -> tuple[str, str] | None:
    """The verdict one stage forces, or None when every rank equals the reference."""
    errors = [s.error for s in ranks]
    if all(e is not None for e in errors):
        if len(set(errors)) > 1:
            return DISAGREE, "; ".join(f"rank {r} raised {e}" for r, e in enumerate(errors))
        if ref.error is not None:
            if name == "backward":
                return EQUAL, f"backward raises in torch too: {ref.error}"
            return RAISES, f"torch raises too: {errors[0]}"
        return RAISES, f"{name}: {errors[0]}"
    if any(e is not None for e in errors):
        said = [f"rank {r} raised {e}" if e else f"rank {r} went on" for r, e in enumerate(errors)]
        return DISAGREE, f"{name}: " + "; ".join(said)
    if ref.error is not None:
        return DIFFERS, f"{name}: torch raises {ref.error}, every rank went on"
    for r, s in enumerate(ranks[1:], 1):
        why = _sig_mismatch(s.signature, ranks[0].signature, layout=True)
        if why:
            return DISAGREE, f"{name}: rank {r} vs rank 0: {why}"
    why = _sig_mismatch(ranks[0].signature, ref.signature, layout=False)
    if why:
        return DIFFERS, f"{name}: {why} (ranks vs torch)"
    wrong = [(r, _values_mismatch(s.values, ref.values)) for r, s in enumerate(ranks)]
    wrong = [(r, why) for r, why in wrong if why]
    if not wrong:
        return None
    if all(_identical(s.values, ranks[0].values) for s in ranks[1:]):
        return DIFFERS, f"{name}: {wrong[0][1]}"
    return DISAGREE, f"{name}: " + "; ".join(f"rank {r}: {why}" for r, why in wrong)


def judge(reference: dict[str, Stage], status: str, observations: list, note: str) -> tuple:
    """(outcome, reason) of one case from the reference and every rank's observation."""
    if status != "ok":
        return status, note
    remark = ""
    for name in ("forward", "backward"):
        ranks = [o.get(name) for o in observations]
        if name not in reference or any(s is None for s in ranks):
            break
        verdict = _stage(name, reference[name], ranks)
        if verdict is None:
            continue
        if verdict[0] != EQUAL:
            return verdict
        remark = verdict[1]
    return EQUAL, remark


_RANK = {o: i for i, o in enumerate(OUTCOMES)}


def worst(verdicts: list[tuple[int, str, str]]) -> tuple[str, str]:
    """A row's outcome from its samples' (sample number, outcome, reason): the worst one."""
    sample, outcome, reason = max(verdicts, key=lambda v: _RANK[v[1]])
    if outcome == EQUAL:
        reason = next((r for _, _, r in verdicts if r), "")
    if reason and len(verdicts) > 1 and outcome != EQUAL:
        reason = f"sample {sample}: {reason}"
    return outcome, reason
