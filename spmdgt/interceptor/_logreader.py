"""Read what the tools write back: instruction logs, trace files, run-folder status files.

The log format is written by ``_instruction_log.py`` (its docstring lists the columns). A file
may hold one rank (``GT_INSTRUCTION_LOG``) or several (a merged trace from ``scripts.trace``):
each ``#`` header carries its rank's wall-clock start, so ``LogRecord.t_unix`` puts every rank on
one clock. Status files (``rank<r>.json``) are written by ``_publish`` for ``scripts.top``.

These files are outside input to the tools: a job killed mid-write leaves a truncated line, a
disk error or a stray copy leaves binary bytes, anyone who can write the folder can put anything
there. ``parse_line`` therefore checks every column (known event, phase and kind; finite,
non-negative numbers), and the readers take a ``Skipped`` tally: given one, they skip what they
cannot read, count it and go on, so a tool draws or prints the rest and says in one line what it
left out (``Skipped.report``); without one they raise ``ValueError`` naming the line, as a test
or a script that wants exact input needs. Nothing here imports torch: ``top`` starts at once.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EVENTS",
    "KINDS",
    "PHASES",
    "LogRecord",
    "MalformedLine",
    "Skipped",
    "check_status",
    "iter_lines",
    "parse_line",
    "read_log",
    "read_logs",
    "read_statuses",
]

_HEADER = re.compile(r"rank=(\d{1,9}) world=(\d{1,9}) start_unix_ns=(\d{1,30})")
# What the writers produce (``_instruction_log``, the native observer). A line with anything else
# in these columns was not written by spmdgt and is skipped rather than guessed at.
# TODO(op-kind table): import the kinds from ``_events`` once it exports them as one table.
KINDS = frozenset({"matmul", "elementwise", "reduce", "memory", "comm", "wait", "backward"})
EVENTS = frozenset({"OP", "COMM", "WAIT"})
PHASES = frozenset({"fwd", "bwd", "opt"})
_MAX_LINE = 1 << 16  # longer "lines" are binary data without newlines, not log lines
_MAX_SECONDS = 1e9  # ~30 years: a larger time is garbage, and would overflow a plot's axis
_MAX_ORIGIN_NS = 1 << 63  # a header's start_unix_ns beyond int64 was not written by spmdgt
_STATUS_NAME = re.compile(r"rank(\d+)\.json")
_MAX_STATUS_BYTES = 1 << 20


@dataclass
class Skipped:
    """A tally of what a reader left out: malformed lines and unreadable files.

    Pass one to ``read_log``/``read_logs``/``read_statuses``/``iter_lines`` to make them
    lenient; ``first`` keeps the first problem (file, line and why) so the one-line report
    points at something concrete.
    """

    lines: int = 0
    files: int = 0
    first: str | None = None

    def line(self, where: str, why: str) -> None:
        """Count one malformed line."""
        self.lines += 1
        if self.first is None:
            self.first = f"{where}: {why}"

    def file(self, where: str, why: str) -> None:
        """Count one file that could not be read at all."""
        self.files += 1
        if self.first is None:
            self.first = f"{where}: {why}"

    def __bool__(self) -> bool:
        return bool(self.lines or self.files)

    def summary(self, tool: str) -> str:
        """``tool: skipped 2 malformed line(s) and 1 unreadable file(s) (first: ...)``."""
        parts = []
        if self.lines:
            parts.append(f"{self.lines} malformed line(s)")
        if self.files:
            parts.append(f"{self.files} unreadable file(s)")
        first = f" (first: {self.first})" if self.first else ""
        return f"{tool}: skipped {' and '.join(parts) or 'nothing'}{first}"

    def report(self, tool: str) -> None:
        """Print ``summary`` as one line to stderr, if anything was skipped."""
        if self:
            print(self.summary(tool), file=sys.stderr, flush=True)


class MalformedLine(ValueError):
    """A log line that does not parse; ``why`` says what is wrong without repeating the line."""

    def __init__(self, why: str, line: str) -> None:
        super().__init__(f"malformed instruction log line ({why}): {line[:200]!r}")
        self.why = why


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One instruction-log line, typed."""

    elapsed_s: float
    rank: int
    seq: int
    event: str
    phase: str
    kind: str
    op: str
    nbytes: int
    dur_us: float
    level: int
    signal: str | None
    inputs: str
    outputs: str
    placements: str
    start_unix_ns: int = 0  # the rank's clock origin, from its header (0 if none was seen)
    group: str = "-"
    """The mesh dim a collective ran on (column 15: ``tp``, ``dp_shard``, ``world``...); ``-``
    for other ops, the native level, and logs written before the column existed."""

    @property
    def t_unix(self) -> float:
        """Start time in seconds since the epoch (comparable across ranks)."""
        return self.start_unix_ns * 1e-9 + self.elapsed_s


def _nonneg_float(text: str, what: str, most: float) -> float:
    v = float(text)
    if not math.isfinite(v) or not 0 <= v <= most:
        raise ValueError(f"{what} {text!r} is not a number in [0, {most:g}]")
    return v


def _nonneg_int(text: str, what: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError(f"{what} {text!r} is negative")
    return v


def parse_line(line: str, start_unix_ns: int = 0) -> LogRecord:
    """Parse one non-header log line; raises ``ValueError`` naming the line if malformed.

    Malformed: not 15 columns (or 14: a log from before the ``group`` column), undecodable or
    NUL bytes, an event/phase/kind the writers never produce, a number that does not parse or
    is NaN, infinite or negative.
    """
    if "\ufffd" in line or "\x00" in line:
        raise MalformedLine("binary bytes", line)
    f = line.split()
    if len(f) not in (14, 15):
        raise MalformedLine(f"{len(f)} columns, expected 15 (or 14)", line)
    try:
        if f[3] not in EVENTS:
            raise ValueError(f"unknown event {f[3]!r}")
        if f[4] not in PHASES:
            raise ValueError(f"unknown phase {f[4]!r}")
        if f[5] not in KINDS:
            raise ValueError(f"unknown kind {f[5]!r}")
        return LogRecord(
            elapsed_s=_nonneg_float(f[0].removesuffix("s"), "elapsed", _MAX_SECONDS),
            rank=_nonneg_int(f[1].removeprefix("r"), "rank"),
            seq=_nonneg_int(f[2].removeprefix("#"), "seq"),
            event=f[3],
            phase=f[4],
            kind=f[5],
            op=f[6],
            nbytes=_nonneg_int(f[7].removesuffix("B"), "bytes"),
            dur_us=_nonneg_float(f[8].removesuffix("us"), "duration", _MAX_SECONDS * 1e6),
            level=_nonneg_int(f[9], "level"),
            signal=None if f[10] == "-" else f[10],
            inputs=f[11],
            outputs=f[12],
            placements=f[13],
            start_unix_ns=start_unix_ns,
            group=f[14] if len(f) == 15 else "-",
        )
    except ValueError as e:
        raise MalformedLine(str(e), line) from None


def iter_lines(
    lines: Iterable[str], skipped: Skipped | None = None, where: str = "<lines>"
) -> Iterator[LogRecord]:
    """Records from lines; headers set the clock origin of the rank they name.

    With ``skipped``, a malformed line is counted there (as ``where:<line number>``) and left
    out; without it, it raises ``ValueError``.
    """
    origins: dict[int, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            if line.startswith("#"):
                m = _HEADER.search(line)
                if m:
                    origin = int(m.group(3))
                    if origin >= _MAX_ORIGIN_NS:
                        raise MalformedLine("header start_unix_ns out of range", line)
                    origins[int(m.group(1))] = origin
                continue
            if len(line) > _MAX_LINE:
                raise MalformedLine(f"{len(line)} characters, not a log line", line)
            rec = parse_line(line)
        except MalformedLine as e:
            if skipped is None:
                raise
            skipped.line(f"{where}:{n}", e.why)
            continue
        origin = origins.get(rec.rank, 0)
        if origin:
            rec = dataclasses.replace(rec, start_unix_ns=origin)
        yield rec


def read_log(path: str | Path, skipped: Skipped | None = None) -> list[LogRecord]:
    """Every record of one file (a per-rank log or a merged multi-rank trace).

    Undecodable bytes make their line malformed (they never stop the read). With ``skipped``,
    malformed lines and a file that cannot be opened are counted there instead of raising.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return list(iter_lines(f, skipped, str(path)))
    except OSError as e:
        if skipped is None:
            raise
        skipped.file(str(path), e.strerror or type(e).__name__)
        return []


def read_logs(paths: Iterable[str | Path], skipped: Skipped | None = None) -> list[LogRecord]:
    """Records of several files (directories expand to their ``*.log`` files), by start time.

    A record read twice is kept once: ``traces/trace_*.log`` matches both the per-rank files
    and the merged one that ``scripts.trace`` writes, and each op must be drawn once.
    ``skipped`` as in ``read_log``.
    """
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files.extend(sorted(p.glob("*.log")) if p.is_dir() else [p])
    seen: set[tuple[int, int, int, float]] = set()
    records = []
    for f in files:
        for r in read_log(f, skipped):
            key = (r.rank, r.seq, r.start_unix_ns, r.elapsed_s)
            if key not in seen:
                seen.add(key)
                records.append(r)
    records.sort(key=lambda r: (r.t_unix, r.rank, r.seq))
    return records


# -- run-folder status files (``rank<r>.json``, written by ``_publish.RunDirPublisher``) ---------

_STATUS_NUMBERS = (
    "world", "pid", "start_unix", "updated_unix", "interval_s", "ops_total", "ops_per_s",
    "busy_frac", "idle_frac", "collectives_total", "collectives_per_s", "collective_bytes",
)  # fmt: skip


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _short_text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 256 and v.isprintable()


def check_status(s: Any) -> str | None:
    """Why ``s`` is not a status ``top`` can show (None when it is one).

    A status is a JSON object with a non-negative integer ``rank`` (and ``world``, if given, a
    positive integer); every number it has is finite; ``time_share`` maps kinds to finite
    numbers; ``phase``/``level``/``host`` are short printable text (no terminal control codes
    reach the screen).
    """
    if not isinstance(s, dict):
        return f"holds a JSON {type(s).__name__}, not an object"
    rank = s.get("rank")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        return f"rank {rank!r} is not a non-negative integer"
    for key in _STATUS_NUMBERS:
        if key in s and not _finite(s[key]):
            return f"{key} {s[key]!r} is not a finite number"
    world = s.get("world", 1)
    if not (isinstance(world, int) and 1 <= world <= 1 << 20):
        return f"world {world!r} is not a world size"
    shares = s.get("time_share", {})
    if not isinstance(shares, dict) or not all(
        _short_text(k) and _finite(v) for k, v in shares.items()
    ):
        return "time_share is not a map of kinds to finite numbers"
    for key in ("collectives_by_group", "collective_bytes_by_group"):
        groups = s.get(key, {})
        if not isinstance(groups, dict) or not all(
            _short_text(k) and _finite(v) for k, v in groups.items()
        ):
            return f"{key} is not a map of mesh dims to finite numbers"
    for key in ("phase", "level", "host"):
        if key in s and not _short_text(s[key]):
            return f"{key} is not short printable text"
    return None


def read_statuses(run_dir: str, skipped: Skipped | None = None) -> list[dict]:
    """Every rank's latest status in ``run_dir`` (``rank<r>.json``), by rank.

    A file that cannot be read, is not JSON (a half-written or binary file) or is not a status
    (``check_status``) is left out and counted in ``skipped``; without one, it is left out
    silently (a status caught mid-rewrite is normal: it will be whole next second).
    """
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "rank*.json"))):
        if not _STATUS_NAME.fullmatch(os.path.basename(path)):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_STATUS_BYTES + 1)
            if len(data) > _MAX_STATUS_BYTES:
                raise ValueError(f"over {_MAX_STATUS_BYTES} bytes")
            status = json.loads(data.decode("utf-8"))
            why = check_status(status)
            if why is not None:
                raise ValueError(why)
        except (OSError, ValueError, RecursionError) as e:
            if skipped is not None:
                why = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:120]
                skipped.file(path, why or type(e).__name__)
            continue
        out.append(status)
    return sorted(out, key=lambda s: s["rank"])
