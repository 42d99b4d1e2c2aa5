"""Every ``GT_*`` environment variable, declared once and parsed by one rule.

Each variable has a name, a type, a default and one line of meaning (``VARIABLES``). Code reads
them only through this module (public as ``spmdgt.env``; the package's own modules import it
from here so that ``python -m spmdgt.env`` runs a module ``import spmdgt`` has not loaded)::

    from spmdgt._core import env
    if env.flag("GT_AUTO_SHARD"): ...
    size = env.integer("GT_TAPE_SIZE")

so every variable means the same thing wherever it is read, and a bad value is one clear
``EnvError`` (a ``ValueError``) naming the variable, its value and what is accepted:

- flag: ``1, true, on, yes`` are on; ``0, false, off, no`` and the empty string are off
  (case-insensitive, surrounding spaces ignored); anything else is an error. Unset: its default.
- int / float: a number within the declared bounds; empty or unset: the default.
- choice: one of the declared words (case-insensitive); empty or unset: the default.
- str / path: the text as given; empty or unset: the default.

Reading an undeclared ``GT_`` name is a programming error (``KeyError``): declare it here
first. ``python -m spmdgt.env`` prints the table with this process's values;
``python -m spmdgt.env --markdown`` prints the table of ``docs/environment.md`` (a test keeps
the two equal). torchrun's own integers (``RANK``, ``WORLD_SIZE``, ...) are read with
``launcher_int`` so that a malformed one is named the same way.

Nothing here imports torch: ``import spmdgt`` reads some of these before anything else loads.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "VARIABLES",
    "EnvError",
    "Var",
    "flag",
    "get",
    "integer",
    "is_set",
    "build_root",
    "launcher_int",
    "main",
    "markdown",
    "number",
    "raw",
    "table",
    "text",
]

KINDS = ("flag", "int", "float", "str", "path", "choice")
ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no", "")
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class EnvError(ValueError):
    """A GT_* (or torchrun) variable holds a value its type does not accept."""


class Var:
    """One declared variable. ``low``/``high`` bound ints and floats (inclusive; ``low_open``
    makes ``low`` exclusive); ``choices`` lists a choice's words. A plain class, not a
    dataclass: building a dataclass costs ~2 ms, paid by every ``import spmdgt``."""

    __slots__ = ("choices", "default", "high", "kind", "low", "low_open", "meaning", "name")

    def __init__(
        self,
        name: str,
        kind: str,
        default: Any,
        meaning: str,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        choices: tuple[str, ...] = (),
    ) -> None:
        self.name, self.kind, self.default, self.meaning = name, kind, default, meaning
        self.low, self.high, self.low_open, self.choices = low, high, low_open, choices

    def __repr__(self) -> str:
        return f"Var({self.name!r}, {self.kind!r}, default={self.default!r})"


def _flag(name: str, default: bool, meaning: str) -> Var:
    return Var(name, "flag", default, meaning)


def _int(name: str, default: int | None, meaning: str, low: int = 1) -> Var:
    return Var(name, "int", default, meaning, low=low)


# Grouped as the docs present them: placement and runtime, compilation, observability.
VARIABLES: tuple[Var, ...] = (
    Var("GT_CONFIG", "path", None, "signal YAML, read on first use of a signal"),
    Var(
        "GT_AUTO_SHARD",
        "flag",
        False,
        "shard new tensors on axis 0 when the ranks divide it evenly; `plan`: choose each "
        "one's placement from the ops that use it (docs/placements.md)",
        choices=("plan",),
    ),
    Var("GT_BACKEND", "str", None, "process-group backend (default: nccl on CUDA, gloo on CPU)"),
    Var(
        "GT_DEVICE",
        "choice",
        None,
        "cpu keeps ranks on the CPU on a machine with GPUs (default: the local GPU if any)",
        choices=("cpu", "cuda"),
    ),
    _flag("GT_CHECK_SHAPES", True, "off skips the agreement point at tensor creation"),
    _flag(
        "GT_CHECK_RANKS", False, "ranks agree before each redistribution; a missing rank is named"
    ),
    Var(
        "GT_TIMEOUT",
        "float",
        None,
        "seconds: the process groups' timeout (default: torch's); a timed-out wait names its op",
        low=0,
        low_open=True,
    ),
    Var(
        "GT_RANK_ERROR_WAIT",
        "float",
        5.0,
        "seconds an op error waits for every rank to raise it; else every rank's groups end "
        "(0: off)",
        low=0,
    ),
    _flag("GT_AUTO_COMPILE", False, "the compile pass's hot functions go to torch.compile"),
    _flag("GT_COMPILE", True, "off: no compilation at all (the pass, TrainConfig(compile=True))"),
    Var("GT_COMPILE_BACKEND", "str", "inductor", "the compile pass's torch.compile backend"),
    _int("GT_COMPILE_SAMPLE_EVERY", 16, "hot functions: top-level ops between stack samples"),
    _int("GT_COMPILE_HOT_SAMPLES", 8, "hot functions: samples that make a function hot"),
    _int(
        "GT_WORKER_BATCH_SIZE", None, "lazy regions everywhere: lazy regions run at n recorded ops"
    ),
    _int(
        "GT_LAZY_MIN_NUMEL",
        65536,
        "lazy regions: elements a tensor needs for its ops to be recorded",
    ),
    _int("GT_LAZY_CACHE", 64, "lazy regions: compiled graphs kept (LRU)"),
    _int("GT_LAZY_REGION_GRAPHS", 8, "lazy regions: graphs per region before it runs eagerly"),
    Var("GT_INSTRUCTION_LOG", "path", None, "per-rank instruction log (path.rank<r> when world>1)"),
    Var(
        "GT_INSTRUCTION_LOG_MAX_MB",
        "float",
        256.0,
        "rotate each rank's instruction log at this size (0: never)",
        low=0,
    ),
    _flag("GT_STATS", False, "op counters, hot paths and the tape for gt.debug"),
    _int("GT_TAPE_SIZE", 1000, "events the tape keeps for gt.debug.get_tape() (0: none)", low=0),
    _int("GT_HOTPATH_WINDOW", 20, "hot paths: recent ops searched for repeated sequences"),
    _int("GT_HOTPATH_MIN_SEQ", 3, "hot paths: shortest sequence counted"),
    _int("GT_HOTPATH_THRESHOLD", 10, "hot paths: repeats that make a sequence hot"),
    _flag("GT_VERBOSE", False, "status lines (component gt), rank-prefixed on stderr"),
    _flag("GT_DEBUG_CLIENT", False, "debug lines of the tensor API (component tensor)"),
    _flag("GT_DEBUG_DISPATCHER", False, "placements, redistributions, every collective"),
    _flag("GT_DEBUG_WORKER", False, "every op this rank runs (component interceptor)"),
    _flag("GT_DEBUG_COMPILE", False, "each decision of the compile pass (component compile)"),
    Var(
        "GT_RUN_DIR",
        "path",
        None,
        "publish status for top, accept trace requests (the scripts' default: .gt_run)",
    ),
    Var("GT_TRACE_DIR", "path", None, "besides the run dir, the one folder traces may go to"),
    Var("GT_PROFILE", "path", None, "torch.profiler + TensorBoard for the whole run, to this dir"),
    Var(
        "GT_PROFILE_MAX_MB",
        "float",
        200.0,
        "stop profile recording at about this trace size (0: no cap)",
        low=0,
    ),
    Var(
        "GT_INTERCEPT",
        "choice",
        None,
        "interception level (default torch; native for GT_INSTRUCTION_LOG when it builds)",
        choices=("torch", "aten", "native"),
    ),
    _flag("GT_NATIVE", True, "off: never build or use the compiled op observer"),
    _flag(
        "GT_FASTPATH",
        True,
        "off: every op on a gt.Tensor takes DTensor's full path (no cached dispatch)",
    ),
)

_BY_NAME: dict[str, Var] = {v.name: v for v in VARIABLES}


def _var(name: str, kind: str | None = None) -> Var:
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared variable: declare it in spmdgt/env.py") from None
    if kind is not None and var.kind != kind:
        raise TypeError(f"{name} is a {var.kind}, not a {kind}")
    return var


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The declared variable's text as set (None when unset), unparsed."""
    _var(name)
    return (os.environ if environ is None else environ).get(name)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the declared variable is set to something other than blanks (not parsed)."""
    return bool((raw(name, environ) or "").strip())


def _bounds(var: Var) -> str:
    parts = []
    if var.low is not None:
        parts.append(f"{'>' if var.low_open else '>='} {var.low:g}")
    if var.high is not None:
        parts.append(f"<= {var.high:g}")
    return " and ".join(parts)


def _expected(var: Var) -> str:
    if var.kind == "flag":
        off = ", ".join(s or "''" for s in OFF)
        more = f", or {', '.join(var.choices)}" if var.choices else ""
        return f"one of {', '.join(ON)} (on) or {off} (off){more}"
    if var.kind == "choice":
        return f"one of {', '.join(var.choices)}"
    what = "an integer" if var.kind == "int" else "a number"
    bounds = _bounds(var)
    return f"{what} {bounds}" if bounds else what


def _error(var: Var, value: str, problem: str = "") -> EnvError:
    return EnvError(f"{var.name}={value!r}{problem}: expected {_expected(var)}")


def _parse(var: Var, value: str | None) -> Any:
    if value is None:
        return var.default
    s = value.strip()
    if var.kind == "flag":
        low = s.lower()
        if low in ON:
            return True
        if low in OFF:
            return False
        if low in var.choices:  # a flag's own extra words (GT_AUTO_SHARD=plan)
            return low
        raise _error(var, value)
    if not s:
        return var.default
    if var.kind in ("str", "path"):
        return value
    if var.kind == "choice":
        if s.lower() not in var.choices:
            raise _error(var, value)
        return s.lower()
    try:
        out: float = int(s) if var.kind == "int" else float(s)
    except ValueError:
        what = "an integer" if var.kind == "int" else "a number"
        raise _error(var, value, f" is not {what}") from None
    if not math.isfinite(out):
        raise _error(var, value, " is not finite")
    low, high = var.low, var.high
    if (low is not None and (out <= low if var.low_open else out < low)) or (
        high is not None and out > high
    ):
        raise _error(var, value, " is out of range")
    return out


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The declared variable's value, parsed by its type; its default when unset.

    ``environ`` (default ``os.environ``) lets a caller parse another mapping by the same rule.
    Raises ``EnvError`` for a value the type does not accept, ``KeyError`` for an undeclared
    name."""
    var = _var(name)
    return _parse(var, (os.environ if environ is None else environ).get(name))


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool | str:
    """A flag's value: ``1/true/on/yes`` on, ``0/false/off/no/''`` off, unset its default; a
    flag's own extra word (``GT_AUTO_SHARD=plan``) as itself (a true value)."""
    var = _var(name, "flag")
    return _parse(var, (os.environ if environ is None else environ).get(name))


def integer(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """An int variable's value within its bounds; its default (maybe None) when unset."""
    var = _var(name, "int")
    return _parse(var, (os.environ if environ is None else environ).get(name))


def number(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """A float variable's value within its bounds; its default (maybe None) when unset."""
    var = _var(name, "float")
    return _parse(var, (os.environ if environ is None else environ).get(name))


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A str, path or choice variable's value; its default (maybe None) when unset or empty."""
    var = _var(name)
    if var.kind not in ("str", "path", "choice"):
        raise TypeError(f"{name} is a {var.kind}, not text")
    return _parse(var, (os.environ if environ is None else environ).get(name))


def launcher_int(name: str, default: int) -> int:
    """torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as an int
    (``default`` when unset or empty); a malformed one is an ``EnvError`` naming it. They are
    the launcher's variables, not GT's: not in ``VARIABLES``, not documented here."""
    if name not in LAUNCHER:
        raise KeyError(f"{name} is not one of torchrun's variables {LAUNCHER}")
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None


def build_root() -> str:
    """Where spmdgt caches what it compiles (the native observer, the generator skip):
    ``$TORCH_EXTENSIONS_DIR`` as for torch's own extensions, else
    ``~/.cache/spmdgt/torch_extensions``."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "spmdgt", "torch_extensions"
    )


def _default_text(var: Var) -> str:
    if var.default is None:
        return "-"
    if var.kind == "flag":
        return "on" if var.default else "off"
    if isinstance(var.default, float):
        return f"{var.default:g}"
    return str(var.default)


def _type_text(var: Var) -> str:
    if var.kind == "choice":
        return "choice " + "/".join(var.choices)  # no "|": it would split a Markdown cell
    if var.kind == "flag" and var.choices:
        return "flag or " + "/".join(var.choices)
    bounds = _bounds(var)
    return f"{var.kind} {bounds}" if bounds else var.kind


def table(environ: Mapping[str, str] | None = None) -> str:
    """The plain-text table ``python -m spmdgt.env`` prints: name, type, default, this
    process's value (``-`` unset; a value its type refuses is marked ``INVALID``), meaning."""
    environ = os.environ if environ is None else environ
    rows = [("variable", "type", "default", "value", "meaning")]
    for var in VARIABLES:
        value = environ.get(var.name)
        shown = "-" if value is None else repr(value)
        if value is not None:
            try:
                _parse(var, value)
            except EnvError:
                shown += " INVALID"
        rows.append((var.name, _type_text(var), _default_text(var), shown, var.meaning))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
        for r in rows
    )


def markdown() -> str:
    """The Markdown table of ``docs/environment.md`` (checked equal by a test)."""
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        lines.append(
            f"| `{var.name}` | {_type_text(var)} | `{_default_text(var)}` | {var.meaning} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spmdgt.env [--markdown]``: print the table (with this process's values)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["--markdown"]):
        print("usage: python -m spmdgt.env [--markdown]", file=sys.stderr)
        return 2
    print(markdown() if args else table())
    return 0
