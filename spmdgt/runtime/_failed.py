"""An error on one rank reaches every rank, within seconds, naming the rank, the op and why.

A kernel error that only one rank's data causes (a class index out of range in rank 0's shard
of the targets, an embedding id only one shard holds) raises on that rank while the others go
on into the op's collective, or the next one, and wait for a partner that never comes: until
``GT_TIMEOUT`` (30 min by default), or for ever where the raising rank catches the error and
lives on (a notebook, a test harness, a program with ``try``). Worse, a rank that catches it
and issues its next collective pairs it with the op its peers are still in.

torch's own answer is per backend: NCCL's watchdog aborts communicators after the timeout
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``), ``_abort_process_group`` aborts them at once, gloo has
neither (``ProcessGroupGloo.abort`` leaves a waiting collective waiting) and only wakes a peer
when the connection closes, e.g. when the raising process exits (torchrun's case).

spmdgt closes the connections itself, and only on the error path. A rank whose op raises (the
``except`` of ``gt.Tensor.__torch_function__`` and of a host read, through
``_rank_errors.translate``) posts ``rank r failed in op at file:line: message`` under its own key in
the process group's store, then waits up to ``GT_RANK_ERROR_WAIT`` seconds for every other
rank's key of the same error count:

- every rank posted: the error was the same on every rank (a shape error, a wrong argument),
  nothing is out of step, and each rank raises it as it is; the program may catch it and go on;
- some rank did not: it is waiting in a collective (or will be). The first rank to decide
  writes its text under one shared key and every rank that raised ends its process groups
  (``_abort_process_group``: NCCL communicators are aborted, gloo's are freed, which closes
  their connections). A peer waiting on this rank then fails at once with "connection
  closed", finds the shared key, ends its own groups too (which wakes a rank waiting on it)
  and raises the same :class:`RankFailedError`.

Nothing of this runs on the happy path: no thread, no store access, no per-op work. The store
is the process group's own (torchrun's agent store, the harness's file store), which outlives
the process groups. The decision reads only the store, which every rank sees alike; a rank
that is more than ``GT_RANK_ERROR_WAIT`` seconds behind in raising an error every rank raises
still gets the clear error, on every rank, not a hang.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from spmdgt._core import env as _env

__all__ = [
    "RankFailedError",
    "close_connections",
    "decide",
    "end_groups",
    "reported",
    "setup",
    "stop",
]


class RankFailedError(RuntimeError):
    """An op raised on some rank(s) but not on every rank: raised on every rank, naming the
    rank, the op and its message. The process groups are ended: no more collectives."""


RankFailedError.__module__ = "spmdgt"  # gt.RankFailedError

_store: Any = None  # the default group's store, kept: it outlives the groups
_prefix = ""
_rank = 0
_world = 1
_errors = 0  # op errors this rank posted (the count pairs one rank's error with another's)
_generation = 0  # setups in this process: the same on every rank, so keys of an earlier init
# in the same store (a second gt.init(), a torchrun restart) never answer for this one
_FIRST = "first"  # the counter that elects the rank whose text every rank shows
_TEXT = "text"


def wait_seconds() -> float:
    """``GT_RANK_ERROR_WAIT``: how long a rank that raised waits for the others to raise too."""
    return _env.number("GT_RANK_ERROR_WAIT") or 0.0


def setup(rank: int, world: int) -> None:
    """Keep the default group's store and this world's key prefix, and start the watchdog
    (``gt.init``, every rank)."""
    global _store, _prefix, _rank, _world, _errors, _generation
    stop()
    _generation += 1
    _rank, _world, _errors = rank, world, 0
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _prefix = f"spmdgt/rank_error/{restart}/{_generation}/"
    try:
        _store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # a group without a store: errors stay as they are
        _store = None
    if _store is not None and world > 1 and wait_seconds() > 0:
        _start_watchdog()


def decide(e: BaseException, op: str, site: str) -> str | None:
    """After this rank's op raised ``e``: ``None`` when every rank raised too (the error is
    the program's, the same everywhere), else the failure text every rank will show (this
    rank's, or that of a rank that decided first). Blocks at most ``GT_RANK_ERROR_WAIT``."""
    global _errors
    wait = wait_seconds()
    if _store is None or wait == 0:
        return None
    _errors += 1
    text = f"rank {_rank} failed in {op} at {site}: {type(e).__name__}: {_first_line(e)}"
    try:
        _store.set(f"{_prefix}{_rank}/{_errors}", text)
        others = [f"{_prefix}{r}/{_errors}" for r in range(_world) if r != _rank]
        if _wait_for(others, wait):
            return None  # every rank raised this error: nothing is out of step
        # a rank did not raise within the wait: it waits in a collective, or will
        if _store.add(_prefix + _FIRST, 1) == 1:
            _store.set(_prefix + _TEXT, text)
            return text
        return reported(wait) or text
    except RuntimeError:  # the store is gone (its host exited): say what this rank knows
        return text


def reported(wait: float = 0.0) -> str | None:
    """The failure text some rank decided, if any (waiting up to ``wait`` seconds for it).
    Read on the error path only: a collective of this rank failed, or an op raised."""
    if _store is None:
        return None
    key = _prefix + _TEXT
    try:
        if wait > 0:
            _store.wait([key], datetime.timedelta(seconds=wait))
        elif not _store.check([key]):
            return None
        return _store.get(key).decode(errors="replace")
    except RuntimeError:
        return None


def _wait_for(keys: list[str], seconds: float) -> bool:
    """Whether all ``keys`` are in the store within ``seconds`` (polled: the store's own wait
    logs a warning when it times out, and a timeout is the expected answer here)."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while not _store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def end_groups() -> None:
    """End this process's part of every process group, so that a peer waiting on this rank
    fails at once instead of at its timeout (main thread, on the failure path): gloo's
    connections are shut down (:func:`close_connections`), then every group is aborted
    (NCCL's communicators) and forgotten, so a later collective raises at once."""
    close_connections()
    try:
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
    except (RuntimeError, ValueError):
        pass  # already ended
    gc.collect()


# -- closing gloo's connections ------------------------------------------------------------------
# gloo has no abort that wakes a waiting collective (ProcessGroupGloo.abort and shutdown leave
# it waiting), and freeing a group does not close its connections while anything still holds
# it (torch.distributed.nn's defaults and DeviceMesh do). A waiting gloo collective fails at
# once when its connection closes, so the connections are shut down at the socket: gloo's
# full mesh has one TCP connection per pair of ranks, accepted by the lower rank on a listener
# of its group; every rank shuts down the connections its own listeners accepted, and so every
# pair's connection is closed by one of its two ranks. Sockets this process had before
# ``import spmdgt`` (a notebook kernel's) and the store's are never touched. Linux (/proc);
# elsewhere a peer waits for its timeout as before.
_LISTEN, _ESTABLISHED = "0A", "01"


def _socket_fds() -> dict[str, int]:
    """This process's sockets: inode -> file descriptor."""
    found = {}
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found[link[8:-1]] = int(fd)
    except OSError:  # no /proc
        pass
    return found


_FOREIGN = frozenset(_socket_fds())  # sockets from before import spmdgt: never ours to close


def _store_ports() -> set[int]:
    store, ports = _store, set()
    while store is not None:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        store = getattr(store, "underlying_store", None)
    return ports


def close_connections() -> int:
    """Shut down the TCP connections that this process's listeners accepted (gloo's, see
    above); return how many. Safe from any thread: a socket's shutdown makes gloo's own loop
    fail the pair and close it."""
    fds = {inode: fd for inode, fd in _socket_fds().items() if inode not in _FOREIGN}
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] in fds:
                rows.append((cols[9], cols[3], int(cols[1].rsplit(":", 1)[1], 16)))
    listening = {port for _, state, port in rows if state == _LISTEN} - _store_ports()
    closed = 0
    for inode, state, port in rows:
        if state == _ESTABLISHED and port in listening:
            try:
                with socket.socket(fileno=os.dup(fds[inode])) as s:
                    s.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:
                pass  # closed meanwhile
    return closed


# -- the watchdog: a rank that waits learns of another rank's failure -----------------------------
_POLL = 1.0  # seconds between two looks at the store
_stop: threading.Event | None = None


def _start_watchdog() -> None:
    global _stop
    _stop = threading.Event()
    threading.Thread(
        target=_watch, args=(_stop, _store, _prefix + _TEXT), name="spmdgt-rank-errors", daemon=True
    ).start()


def stop() -> None:
    """Stop the watchdog (``gt.shutdown()``, a new ``gt.init()``)."""
    global _stop
    if _stop is not None:
        _stop.set()
        _stop = None


def _watch(stop_event: threading.Event, store: Any, key: str) -> None:
    # Once a rank decided that an op failed on it alone, the connections this rank accepted
    # are shut down: a collective waiting on them, this rank's or a peer's, fails at once and
    # (in spmdgt's path) raises the RankFailedError. Decided from the store alone.
    while not stop_event.wait(_POLL):
        try:
            if not store.check([key]):
                continue
        except Exception:  # the store is gone (the job is ending): nothing to watch
            return
        close_connections()
        try:
            backend = dist.get_backend() if dist.is_initialized() else "gloo"
            if backend != "gloo":  # NCCL: its waits end only when its communicators abort
                dist.distributed_c10d._abort_process_group()
        except (RuntimeError, ValueError):
            pass
        return


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"
