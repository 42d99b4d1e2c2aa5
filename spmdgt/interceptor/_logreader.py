"""Read instruction logs and trace files back into records (``visualize``, ``top``, tests).

The format is written by ``_instruction_log.py`` (its docstring lists the columns). A file may
hold one rank (``GT_INSTRUCTION_LOG``) or several (a merged trace from ``scripts.trace``): each
``#`` header carries its rank's wall-clock start, so ``LogRecord.t_unix`` puts every rank on one
clock.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LogRecord", "parse_line", "read_log", "read_logs"]

_HEADER = re.compile(r"rank=(\d+) world=(\d+) start_unix_ns=(\d+)")


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

    @property
    def t_unix(self) -> float:
        """Start time in seconds since the epoch (comparable across ranks)."""
        return self.start_unix_ns * 1e-9 + self.elapsed_s


def parse_line(line: str, start_unix_ns: int = 0) -> LogRecord:
    """Parse one non-header log line; raises ``ValueError`` naming the line if malformed."""
    f = line.split()
    if len(f) != 14:
        raise ValueError(f"instruction log line has {len(f)} columns, expected 14: {line!r}")
    try:
        return LogRecord(
            elapsed_s=float(f[0].rstrip("s")),
            rank=int(f[1].lstrip("r")),
            seq=int(f[2].lstrip("#")),
            event=f[3],
            phase=f[4],
            kind=f[5],
            op=f[6],
            nbytes=int(f[7].rstrip("B")),
            dur_us=float(f[8].removesuffix("us")),
            level=int(f[9]),
            signal=None if f[10] == "-" else f[10],
            inputs=f[11],
            outputs=f[12],
            placements=f[13],
            start_unix_ns=start_unix_ns,
        )
    except ValueError as e:
        raise ValueError(f"malformed instruction log line ({e}): {line!r}") from None


def iter_lines(lines: Iterable[str]) -> Iterator[LogRecord]:
    """Records from lines; headers set the clock origin of the rank they name."""
    origins: dict[int, int] = {}
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("#"):
            m = _HEADER.search(line)
            if m:
                origins[int(m.group(1))] = int(m.group(3))
            continue
        rec = parse_line(line)
        origin = origins.get(rec.rank, 0)
        if origin:
            rec = dataclasses.replace(rec, start_unix_ns=origin)
        yield rec


def read_log(path: str | Path) -> list[LogRecord]:
    """Every record of one file (a per-rank log or a merged multi-rank trace)."""
    with open(path) as f:
        return list(iter_lines(f))


def read_logs(paths: Iterable[str | Path]) -> list[LogRecord]:
    """Records of several files (directories expand to their ``*.log`` files), by start time.

    A record read twice is kept once: ``traces/trace_*.log`` matches both the per-rank files
    and the merged one that ``scripts.trace`` writes, and each op must be drawn once.
    """
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files.extend(sorted(p.glob("*.log")) if p.is_dir() else [p])
    seen: set[tuple[int, int, int, float]] = set()
    records = []
    for f in files:
        for r in read_log(f):
            key = (r.rank, r.seq, r.start_unix_ns, r.elapsed_s)
            if key not in seen:
                seen.add(key)
                records.append(r)
    records.sort(key=lambda r: (r.t_unix, r.rank, r.seq))
    return records
