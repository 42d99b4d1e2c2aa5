"""``GT_INSTRUCTION_LOG``: the flat, column-stable text log of every instruction on a rank.

One line per op event, whitespace-separated, every column always present ("-" when empty), so
``awk``/``grep``/``sort`` work as in GT's tuning guide. Columns (awk field numbers):

    $1  elapsed     seconds since the interceptor started on this rank, at op start: 2.318412s
    $2  rank        r0
    $3  seq         #00000023 (this rank's instruction counter, in completion order)
    $4  event       OP (compute), COMM (collective issued), WAIT (waiting for a collective)
    $5  phase       fwd | bwd | opt
    $6  kind        matmul | elementwise | reduce | memory | comm | wait | backward
    $7  op          mul, matmul, dist.all_reduce (torch level), aten.mm.default (ATen level)
    $8  bytes       a collective's buffer: the larger of input and output: 4096B (0B compute)
    $9  dur         wall time inside the op: 12.3us
    $10 level       0 torch-level call, 1 ATen op inside a DTensor op or backward
    $11 signal      active spmdgt signal or -
    $12 inputs      64x64:f32,64x64:f32 (first 4 tensor args)
    $13 outputs     64x64:f32
    $14 placements  inputs->outputs for DTensors: S(0),R->S(0); - for plain tensors
    $15 group       the mesh dim a collective ran on: tp, dp_shard, dp_replicate, world (the
                    default group, what a 1-D run has); - for other ops and at the native
                    level (its observer sees no process group)

``awk '$4=="COMM" {n[$15]++} END {for (g in n) print g, n[g]}'`` counts collectives per mesh dim.
Column 15 came after the first version of this log; the header's ``columns=`` lists a file's
columns, and the readers (``_logreader``, ``top``, ``trace``, ``visualize``) take files with
or without it (a missing ``group`` reads as ``-``).

So ``awk '{print $1, $7, $9}'`` prints start time, op and duration; awk reads "2.3s", "12.3us"
and "4096B" as numbers (``awk '$9+0 > 1000'`` finds ops over 1 ms). Lines starting with ``#``
are headers: the first records rank, world and the wall-clock start so ranks can be aligned.
With more than one rank each rank writes its own file, ``path`` with ``.rank<r>`` before the
extension (``debug.log`` -> ``debug.rank1.log``). Lines are written in batches (the interceptor's
batch, and at least once a second): memory is bounded however long the run.

Disk is bounded too: once a file would pass ``GT_INSTRUCTION_LOG_MAX_MB`` (default 256 MB per
rank), it is rotated at a whole line, as logrotate and Python's ``RotatingFileHandler`` do: the
full file becomes ``path.1`` (replacing an older ``.1``) and ``path`` starts again with the same
header plus a ``# rotated`` line. So ``path`` always holds the newest lines (where a hang or a
crash is), at most twice the cap is on disk per rank, and instruction numbers run on across
files. The first rotation prints one rank-prefixed line on stderr; ``0`` turns rotation off.
The native level's C++ writer rotates by the same rule (``_native.NativeLogSink``).

The columns (``COLUMNS``), event words and dtype names are ``_events``' table, shared with the
C++ writer.
"""

from __future__ import annotations

import os
from typing import IO

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import env as _env
from spmdgt.interceptor._events import COLUMNS, OpEvent, dtype_short, event_of

__all__ = [
    "COLUMNS",
    "DEFAULT_MAX_MB",
    "InstructionLogSink",
    "format_events",
    "header",
    "max_log_bytes",
    "rank_path",
    "rotation_message",
]

DEFAULT_MAX_MB = 256.0  # per rank and file; ~30 s of the busiest small-op loop, far more in
# training (bigger ops, fewer lines); two files at most: <= 512 MB per rank on disk


def max_log_bytes() -> int:
    """The rotation size from ``GT_INSTRUCTION_LOG_MAX_MB`` (MB = 10**6 bytes; 0: never)."""
    return _env_mb("GT_INSTRUCTION_LOG_MAX_MB")


def _env_mb(var: str) -> int:
    """A size variable (MB, declared ``>= 0`` with its default in ``spmdgt._core.env``) as bytes."""
    return int(_env.number(var) * 1_000_000)


def rotation_message(path: str, max_bytes: int) -> str:
    """The one line a rank prints at its log's first rotation."""
    mb = f"{max_bytes / 1e6:g} MB"
    return (
        f"instruction log {path} reached {mb} (GT_INSTRUCTION_LOG_MAX_MB): older lines move to "
        f"{path}.1, {path} keeps the newest; at most 2 x {mb} on disk (said once)"
    )


def rank_path(path: str, rank: int, world: int) -> str:
    """``path`` for this rank: unchanged in a world of one, ``name.rank<r>.ext`` otherwise."""
    if world <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def header(rank: int, world: int, origin_unix_ns: int, level: str) -> str:
    """The ``#`` header line: what ``_logreader`` needs to align this file with other ranks."""
    return (
        f"# spmdgt-instruction-log v1 rank={rank} world={world} start_unix_ns={origin_unix_ns} "
        f"level={level} columns={','.join(COLUMNS)}\n"
    )


class _Formatter:
    """Caches the string forms of shapes, dtypes and placements (few distinct ones per run)."""

    def __init__(self, rank: int, origin_ns: int) -> None:
        self.rank = f"r{rank}"
        self.origin_ns = origin_ns
        self._specs: dict[tuple, str] = {}
        self._placements: dict[tuple, str] = {}
        self._lines: dict[tuple, tuple[str, str]] = {}

    def specs(self, specs: tuple) -> str:
        if not specs:
            return "-"
        got = self._specs.get(specs)
        if got is None:
            parts = []
            for s in specs:
                shape = "x".join(map(str, s[0])) or "scalar"
                parts.append(f"{shape}:{dtype_short(s[1])}")
            got = self._specs[specs] = ",".join(parts)
        return got

    def placements(self, ins: tuple, outs: tuple) -> str:
        key = (*(s[2] for s in ins), None, *(s[2] for s in outs))
        got = self._placements.get(key)
        if got is None:
            if all(p is None for p in key):
                got = "-"
            else:

                def one(specs: tuple) -> str:
                    return ",".join(_placement_str(s[2]) for s in specs) or "-"

                got = f"{one(ins)}->{one(outs)}"
            self._placements[key] = got
        return got

    def _parts(self, e: OpEvent) -> tuple[str, str]:
        """Columns 4-8 and 10-14 of an event: constant for a given op, shapes and context."""
        sig = e.signal.replace(" ", "_") if e.signal else "-"
        mid = f"{event_of(e.kind)} {e.phase} {e.kind} {e.op} {e.nbytes}B"
        tail = (
            f"{e.level} {sig} {self.specs(e.inputs)} {self.specs(e.output)} "
            f"{self.placements(e.inputs, e.output)} {e.group or '-'}"
        )
        return mid, tail

    def lines(self, events: list[OpEvent]) -> str:
        # Most of a line repeats (same op, shapes, phase): cache it by those fields and format
        # only time, seq and duration per line (integer formatting; floats cost ~3x more).
        out = []
        origin, rank, cache = self.origin_ns, self.rank, self._lines
        for e in events:
            key = (e.op, e.level, e.phase, e.signal, e.inputs, e.output, e.nbytes, e.group)
            parts = cache.get(key)
            if parts is None:
                if len(cache) > 50_000:  # bound memory on shape-polymorphic programs
                    cache.clear()
                parts = cache[key] = self._parts(e)
            us = (e.t0_ns - origin) // 1000
            dur = e.dur_ns // 100
            out.append(
                f"{us // 1_000_000}.{us % 1_000_000:06d}s {rank} #{e.seq:08d} {parts[0]} "
                f"{dur // 10}.{dur % 10}us {parts[1]}\n"
            )
        return "".join(out)


def _placement_str(placements: tuple | None) -> str:
    """``(Shard(dim=0), Replicate())`` -> ``S(0)+R``; None (plain tensor) -> ``T``."""
    if placements is None:
        return "T"
    short = []
    for p in placements:
        r = repr(p)
        if r.startswith("Shard(dim="):
            short.append(f"S({r[10:-1]})")
        elif r.startswith("Replicate"):
            short.append("R")
        elif r.startswith("Partial"):
            short.append("P")
        else:
            short.append(r.replace(" ", ""))
    return "+".join(short)


def format_events(events: list[OpEvent], rank: int = 0, origin_ns: int = 0) -> str:
    """Format events as log lines (for tools and tests; the sink keeps its own caches)."""
    return _Formatter(rank, origin_ns).lines(events)


class InstructionLogSink:
    """Writes every event as a log line; one ``write`` per batch, no per-op I/O.

    ``max_bytes`` (default ``GT_INSTRUCTION_LOG_MAX_MB``; 0: unbounded) rotates the file at a
    whole line (module docstring).
    """

    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        origin_ns: int,
        origin_unix_ns: int,
        level: str,
        max_bytes: int | None = None,
    ) -> None:
        self.path = rank_path(path, rank, world)
        self.max_bytes = max_log_bytes() if max_bytes is None else max_bytes
        self.rotations = 0
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._header = header(rank, world, origin_unix_ns, level)
        self._file: IO[str] | None = open(self.path, "w", buffering=1 << 16)  # noqa: SIM115
        self._file.write(self._header)
        self._size = self._head_size = len(self._header)  # ASCII: characters are bytes
        self._fmt = _Formatter(rank, origin_ns)

    def on_events(self, events: list[OpEvent]) -> None:
        if self._file is None:
            return
        text = self._fmt.lines(events)
        if not self.max_bytes or self._size + len(text) <= self.max_bytes:
            self._file.write(text)
            self._size += len(text)
        else:
            self._write_rotating(text)

    def _write_rotating(self, text: str) -> None:
        """The C++ writer's rule (``write_locked``): fill the file with whole lines, rotate."""
        while text and self._file is not None:
            if self._size + len(text) <= self.max_bytes:
                self._file.write(text)
                self._size += len(text)
                return
            room = max(self.max_bytes - self._size, 0)
            cut = text.rfind("\n", 0, room) + 1
            if cut == 0 and self._size <= self._head_size:  # nothing fits a fresh file
                cut = text.find("\n") + 1 or len(text)
            if cut:
                self._file.write(text[:cut])
                self._size += cut
                text = text[cut:]
            if text:
                self._rotate()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        old = f"{self.path}.1"
        os.replace(self.path, old)
        self._file = open(self.path, "w", buffering=1 << 16)  # noqa: SIM115
        head = f"{self._header}# rotated: earlier lines are in {old}\n"
        self._file.write(head)
        self._size = self._head_size = len(head)
        self.rotations += 1
        if self.rotations == 1:
            _debuglog.notice("log", rotation_message(self.path, self.max_bytes))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
