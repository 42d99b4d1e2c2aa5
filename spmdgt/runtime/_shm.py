"""The agreement exchange through shared memory, for ranks on one host.

An agreement point (``runtime._agree``) exchanges one 64-bit word a rank, OR-reduced. Over
gloo that is the smallest all-reduce there is, and still a round trip through TCP and gloo's
threads: 380-800 us on 2 ranks of this project's 2-core machine, 1.1-1.8 ms on 3 (median of
200 in a row; ``benchmarks/bench_core.py`` prints it), more than most ops cost. Ranks on one
host can meet in memory instead: each writes its word into its own slot of a small shared
segment and waits for the others' (``csrc/word_exchange.c``: a short spin, then a futex
sleep; a rank that posts wakes only ranks that sleep on it): 3-4 us on 2 ranks, ~70 us on 3
ranks sharing 2 cores. The side group stays for everything else (a divergence's details,
``all_ranks``, ``GT_CHECK_RANKS``' monitored barrier) and for ranks on more than one host.

``open_words`` is a collective over the side group, run by every rank at ``gt.init()``: it
uses shared memory only if every rank built the C file, runs on the same host (host name and
boot id) and sees every other rank's process (its pid and start time in ``/proc``), and
opened the segment rank 0 made. The decision reads exchanged values only, so it is the same on
every rank; the segment's name is unlinked once every rank has it open, so nothing is left in
``/dev/shm`` by a run that ends badly.

What gloo's connections told a waiting rank, the segment tells too: a rank whose op raised
alone ends the exchange (``end``: every waiter wakes and raises, as a closed connection made
gloo raise), a rank whose process exited is found from ``/proc`` within ``_LOOK_NS``, and a
wait is bounded by ``GT_TIMEOUT`` (torch's 30 minutes by default), as the gloo group is. Each
raises :class:`PeersMissing`, which names the ranks that did not arrive.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import secrets
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from spmdgt._core import cbuild as _cbuild
from spmdgt._core import debuglog as _debuglog

__all__ = ["ENABLED", "STAGING_MAX", "PeersMissing", "Words", "open_words"]

# Off: every rank exchanges over gloo, as ranks on more than one host do (tests of that path,
# and benchmarks comparing the two, set it before ``gt.init()``).
ENABLED = True
_SRC = os.path.join(os.path.dirname(__file__), "csrc", "word_exchange.c")
_LOOK_NS = 50_000_000  # a waiting rank looks at its peers' processes and its deadline this often
_SPINS = 4000  # polls before a waiting rank sleeps, when every rank can have a core of its own
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout
# ``gather``'s staging segment: two halves of a power of two bytes, from 1 MiB, and no more
# than this in all (larger gathers go over gloo)
_STAGE_MIN = 1 << 20
STAGING_MAX = 1 << 29
_WRITTEN = 0x5752495454454E00  # the word of "every rank wrote its rows"
_lib: Any = None


class PeersMissing(RuntimeError):
    """An exchange that some rank never joined: ``who`` names them (``_rank_errors``)."""

    def __init__(self, who: str, text: str) -> None:
        super().__init__(text)
        self.who = who


def _load() -> Any:
    global _lib
    if _lib is None:
        lib = _cbuild.load(_SRC)
        lib.gt_slot_size.restype = ctypes.c_int
        lib.gt_map.argtypes = (ctypes.c_int, ctypes.c_int64)
        lib.gt_map.restype = ctypes.c_void_p
        lib.gt_unmap.argtypes = (ctypes.c_void_p, ctypes.c_int64)
        lib.gt_unmap.restype = None
        out, ns = ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64
        post = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64]
        lib.gt_exchange.argtypes = [*post, out, ns, ctypes.c_int]
        lib.gt_exchange.restype = ctypes.c_int
        i32, u32 = ctypes.c_int, ctypes.c_uint32
        lib.gt_wait.argtypes = [ctypes.c_void_p, i32, u32, out, ns, i32]
        lib.gt_wait.restype = ctypes.c_int
        lib.gt_end.argtypes = (ctypes.c_void_p, ctypes.c_int)
        lib.gt_end.restype = None
        if lib.gt_slot_size() != 64:
            raise RuntimeError(f"word_exchange.c: a slot is {lib.gt_slot_size()} bytes, not 64")
        _lib = lib
    return _lib


def _start_time(pid: int) -> str | None:
    """A process's start time (``/proc/<pid>/stat`` field 22), None when it is gone or a
    zombie: with the pid, it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Words:
    """One OR-reduced 64-bit word a rank, exchanged through the segment (see the module)."""

    def __init__(
        self, lib: Any, base: int, size: int, rank: int, world: int, pids: list, group: Any = None
    ) -> None:
        self._lib, self._base, self._size = lib, base, size
        self._rank, self._world, self._pids, self._group = rank, world, pids, group
        # the staging segment of ``gather`` (made at the first): its address, the size of
        # each of its two halves, a view of it, the half the next gather writes
        self._stage, self._half, self._view, self._parity = 0, 0, memoryview(b""), 0
        self._no_stage = group is None
        self._gen = 0
        self._out = ctypes.c_uint64()
        self._ref = ctypes.byref(self._out)
        self._seq = (ctypes.c_uint32 * (16 * world)).from_address(base)  # seq at 16r
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        # spinning helps when every rank has a core; with more ranks than cores it steals
        # the core of the rank being waited for
        self._spins = _SPINS if world <= cores else 0
        self._exchange = lib.gt_exchange
        self._timeout_s = _DEFAULT_TIMEOUT_S

    def set_timeout(self, seconds: float | None) -> None:
        """How long a wait lasts before :class:`PeersMissing` (``GT_TIMEOUT``)."""
        self._timeout_s = _DEFAULT_TIMEOUT_S if seconds is None else seconds

    def exchange(self, word: int) -> int:
        """The OR of every rank's ``word`` at this exchange; every rank calls it in turn."""
        self._gen = gen = (self._gen + 1) & 0xFFFFFFFF
        rc = self._exchange(
            self._base, self._world, self._rank, gen, word, self._ref, _LOOK_NS, self._spins
        )
        return self._out.value if rc == 0 else self._waiting(gen, rc)

    def _waiting(self, gen: int, rc: int) -> int:
        deadline = time.monotonic() + self._timeout_s
        while True:
            if rc == 0:
                return self._out.value
            if rc == 2:
                raise PeersMissing(
                    "a rank ended the exchange",
                    "agreement exchange: ended by a rank whose op failed on it alone",
                )
            missing = [r for r in range(self._world) if (self._seq[16 * r] - gen) & 0x80000000]
            gone = [r for r in missing if _start_time(self._pids[r][0]) != self._pids[r][1]]
            if gone:
                raise PeersMissing(
                    f"rank(s) {gone} exited",
                    f"agreement exchange: the process of rank(s) {gone} has exited",
                )
            if time.monotonic() >= deadline:
                raise PeersMissing(
                    f"rank(s) {missing} did not arrive",
                    f"agreement exchange: rank(s) {missing} did not arrive within "
                    f"{self._timeout_s:g} s",
                )
            rc = self._lib.gt_wait(self._base, self._world, gen, self._ref, _LOOK_NS, self._spins)

    def end(self) -> None:
        """Wake every rank waiting in an exchange, which raises (a failure on one rank)."""
        if self._base:
            self._lib.gt_end(self._base, self._world)

    def close(self) -> None:
        """Unmap the segments (this process's view only). No exchange may follow."""
        if self._base:
            self._lib.gt_unmap(self._base, self._size)
            self._base = 0
        self._drop_stage()

    def _drop_stage(self) -> None:
        if self._stage:
            try:
                self._view.release()
                self._lib.gt_unmap(self._stage, 2 * self._half)
            except BufferError:  # a tensor still reads it: left mapped
                pass
            self._stage, self._half, self._view = 0, 0, memoryview(b"")

    # -- rows gathered through the staging segment ------------------------------------------

    def gather(
        self, local: torch.Tensor, rows: int, k: int, copy: bool = True
    ) -> torch.Tensor | None:
        """The ``k``-row matrix whose row shards (``torch.chunk``'s: ``rows`` a rank, fewer or
        none at the end) the ranks hold, on every rank; None where it does not fit, the same
        on every rank (the caller gathers over gloo). Every rank calls it at the same point
        with the same ``rows``, ``k``, row shape and dtype (the caller's agreement point
        checked that) and a contiguous CPU ``local``.

        ``copy=False``: the matrix is a view of the staging segment itself, for a caller that
        is done reading it before this rank's next exchange (a product's operand, read by
        its ``mm`` and dropped): the half it lies in is written again only after every rank
        has passed the exchange in between (``_write``)."""
        row = tuple(local.shape[1:])
        at = self._write(local, rows * local.element_size() * math.prod(row))
        if at is None:
            return None
        if not k * math.prod(row):
            return local.new_empty((k, *row))
        out = torch.frombuffer(self._view, dtype=local.dtype, count=k * math.prod(row), offset=at)
        return (out.clone() if copy else out).view(k, *row)

    def reduce(self, local: torch.Tensor, op: str) -> torch.Tensor | None:
        """``op`` (``sum``, ``max``, ``min``) over every rank's ``local``, taken in rank order,
        so every rank gets the same bits; None where it does not fit. As ``gather``: the same
        point, shape and dtype on every rank, a contiguous CPU ``local``."""
        at = self._write(local, local.numel() * local.element_size())
        if at is None:
            return None
        n, step = local.numel(), local.numel() * local.element_size()
        if not n:
            return local.clone()
        parts = [
            torch.frombuffer(self._view, dtype=local.dtype, count=n, offset=at + r * step)
            for r in range(self._world)
        ]
        out = parts[0].clone()
        for p in parts[1:]:
            if op == "sum":
                out += p
            else:
                torch.maximum(out, p, out=out) if op == "max" else torch.minimum(out, p, out=out)
        return out.view(local.shape)

    def _write(self, local: torch.Tensor, step: int) -> int | None:
        """Write ``local`` at this rank's place (``step`` bytes a rank) in the next half of the
        staging segment and wait until every rank wrote; the half's offset, or None on every
        rank where ``step`` does not fit.

        The halves alternate: a rank writes a half again only after every rank has passed
        the exchange of the call in between, which each reaches after reading this one."""
        half = self._world * step
        if self._no_stage or 2 * half > STAGING_MAX:
            return None
        if half > self._half and not self._grow(half):
            return None
        at = self._parity * self._half
        self._parity ^= 1
        if local.numel():
            mine = at + self._rank * step
            torch.frombuffer(self._view, dtype=local.dtype, count=local.numel(), offset=mine).copy_(
                local.reshape(-1)
            )
        if self.exchange(_WRITTEN) != _WRITTEN:
            raise RuntimeError("a rank sent another word than 'written' to the staging segment")
        return at

    def _grow(self, half: int) -> bool:
        """Make a staging segment whose halves hold ``half`` bytes (a collective on the side
        group, every rank deciding alike from the agreed sizes); False on every rank where
        it cannot, and then never again."""
        self._drop_stage()
        half = max(_STAGE_MIN, 1 << (half - 1).bit_length())
        base = _segment(self._group, self._rank, self._world, 2 * half)
        if not base:
            self._no_stage = True
            return False
        self.attach_stage(base, half)
        return True

    def attach_stage(self, base: int, half: int) -> None:
        """Gather through the ``2 * half`` bytes mapped at ``base`` (``_grow``; tests)."""
        self._stage, self._half, self._parity, self._no_stage = base, half, 0, False
        self._view = memoryview((ctypes.c_char * (2 * half)).from_address(base)).cast("B")


def _swap(value: Any, group: Any, world: int) -> list[Any]:
    everyone: list[Any] = [None] * world
    with torch._C.DisableTorchFunction():  # the agreement's own traffic: no hook sees it
        dist.all_gather_object(everyone, value, group=group)
    return everyone


def _segment(group: Any, rank: int, world: int, size: int, ok: bool = True) -> int:
    """A new shared segment of ``size`` bytes mapped on every rank (its address), or 0 on every
    rank: a collective on ``group``. Rank 0 makes it and reserves its pages (a full
    ``/dev/shm`` refuses here, not with a SIGBUS at the first write); the name is unlinked
    once every rank has mapped it or given up. ``ok``: this rank's own condition for it."""
    lib, fd, name = _lib, -1, ""
    if rank == 0:  # the maker, before anyone looks for it
        name = f"/dev/shm/spmdgt-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            _debuglog.verbose(f"shared memory: {name}: {e}")
            if fd >= 0:
                os.close(fd)
                fd = -1
    made = _swap(name if fd >= 0 else "", group, world)[0]
    base = 0
    try:
        if made and fd < 0:
            fd = os.open(made, os.O_RDWR)
        if fd >= 0:
            base = lib.gt_map(fd, size) or 0
    except OSError as e:
        _debuglog.verbose(f"shared memory: {made}: {e}")
    mapped = all(_swap(bool(base) and ok, group, world))
    if fd >= 0:
        os.close(fd)  # the mapping stays
    if name:
        with contextlib.suppress(OSError):
            os.unlink(name)
    if not mapped and base:
        lib.gt_unmap(base, size)
    return base if mapped else 0


def open_words(group: Any, rank: int, world: int) -> Words | None:
    """The shared-memory exchange for ``group`` (the side group, every rank), or None where
    the ranks must use gloo: a collective on ``group``, the same answer on every rank."""
    built, why = False, ""
    if ENABLED and os.path.isdir("/dev/shm"):
        try:
            built = _load() is not None
        except Exception as e:  # no compiler, no futex (not Linux): gloo, as before
            why = f"{type(e).__name__}: {str(e).strip()[:200]}"
    me = os.getpid()
    everyone = _swap((built, socket.gethostname(), _boot_id(), me, _start_time(me)), group, world)
    words = None
    if all(e[0] for e in everyone) and len({(e[1], e[2]) for e in everyone}) == 1:
        pids = [(e[3], e[4]) for e in everyone]
        seen = all(_start_time(pid) == start for pid, start in pids)  # one pid namespace
        size = 64 * (world + 1)
        base = _segment(group, rank, world, size, seen)
        if base:
            words = Words(_lib, base, size, rank, world, pids, group)
        else:
            why = "a rank could not map the segment or see another rank's process"
    elif not why:
        why = "the ranks are not all on one host, or a rank could not build the exchange"
    if words is None:
        _debuglog.verbose(f"agreement exchange over gloo ({why})")
    return words
