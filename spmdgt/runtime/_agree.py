"""Rank agreement: the exchange that tells whether every rank runs the same program.

SPMD has one failure mode of its own: ranks that stop running the same program. A collective
then pairs with a different collective on another rank, and the job hangs without a word, or
one rank reads another rank's data and prints a wrong number. This module compares the ranks
at *agreement points*; what happens when they differ, time out or fail on one rank (the one
clear error every rank raises) is ``runtime._rank_errors``.

Always on (a world of more than one):

- Every agreement point exchanges a small fingerprint (one OR-reduced 64-bit word a rank:
  see ``_exchange``), through shared memory where every rank is on one host (``runtime._shm``,
  a few microseconds), else as the smallest all-reduce gloo runs over a gloo side group
  made at ``init()``: creating a tensor (``gt.randn``, ``gt.tensor``, ...: global shape,
  dtype, signal, placement and mesh), each host read of a sharded tensor (``.numpy()``, ``.item()``,
  ``.tolist()``, ``print``: the read, shape, dtype, placement and the user's call site), and the
  end of the program. A side group, so a fingerprint only ever pairs with a fingerprint: rank
  0 reading ``x`` while rank 1 reads ``y``, or has already finished, is an error on both ranks
  before any data moves (:class:`RankDivergenceError`, naming each rank's point).
- A creation's point is taken at once and exchanged later (``agree_soon``/``settle``), folded
  with every other point taken since into the next exchange, which comes before anything that
  moves data: a step's creations cost one round trip, not one each.
- The same exchange carries the ranks' proposals (``propose``/``on_agreed``) and
  ``any_rank``'s flag; ``all_ranks`` swaps values on the side group.

``GT_CHECK_RANKS=1`` adds an agreement point before every collective spmdgt or DTensor issues
(every redistribution: op, tensor specs and the user's call site), after a gloo monitored
barrier that names a rank that does not arrive within ``GT_TIMEOUT`` (over shared memory the
exchange names it itself, and there is no barrier).

Every exchange is reached by the same calls on every rank and decided from exchanged data only:
no rank, clock or terminal takes part in a decision.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from spmdgt._core import env as _env
from spmdgt.runtime import _rank_errors as _errors
from spmdgt.runtime import _shm
from spmdgt.runtime._rank_errors import (
    RankDivergenceError,
    RankFailedError,
    RankTimeoutError,
    call_site,
    point_text,
    site_text,
    timeout,
    user_frame,
)

__all__ = [
    "Listener",
    "RankDivergenceError",
    "RankFailedError",
    "RankTimeoutError",
    "active",
    "agree",
    "agree_soon",
    "all_ranks",
    "any_rank",
    "before_collective",
    "call_site",
    "checking",
    "closed",
    "end",
    "forget",
    "gather_rows",
    "on_agreed",
    "propose",
    "reduce",
    "settle",
    "setup",
]


_group: Any = None  # the gloo side group for agreement points; None: no exchanges
# Its gloo backend, called directly: agreement traffic is spmdgt's own, not the program's, so
# it bypasses the dispatcher and torch functions that the interceptor's levels record.
_backend: Any = None
# The same exchange through shared memory where every rank is on one host (``runtime._shm``:
# microseconds, not gloo's round trip); None: over ``_backend``.
_words: Any = None
_world = 1
_count = 0  # agreement points passed on this rank
# this rank's last agreed point, for messages: (number, what, detail, call site)
_last: tuple[int, str, str, str] = (0, "none yet", "", "")
# One exchange is one 64-bit word a rank, all-reduced with bitwise OR: the smallest all-reduce
# gloo runs (one element; two or more cost 1.5-2x its round trip on gloo's ring, see
# docs/benchmarks.md). Bits 31-61 hold x, 31 bits of the point's fingerprint, and bits 0-30
# its complement; the OR of every rank's word is then (OR of the x's, NOT (AND of the x's)),
# whose halves are complements iff every rank sent the same x, that is iff the OR's bits 0-61
# equal this rank's word (``_exchange``). That test reads exchanged data only, so every rank
# decides alike. Bit 62: some rank has proposals waiting (``propose``); bit 63: ``any_rank``'s
# flag.
_BITS = 31
_MASK = (1 << _BITS) - 1
_LOW = (1 << 62) - 1  # the fingerprint's bits 0-61
_PENDING = 1 << 62
_FLAG = 1 << 63
_OR = dist.AllreduceOptions()
_OR.reduceOp = dist.ReduceOp.BOR
# The word, made once: an agreement point costs no allocation. ``_slots`` reads and writes it
# as an unsigned Python int (a memoryview: no numpy scalar, no torch op); ``_args[0]`` is the
# backend all-reduce's argument list.
_SOON_MAX = 64  # agree_soon's points are settled at once past this many
_word = torch.zeros(1, dtype=torch.int64)
_slots = memoryview(_word.numpy()).cast("B").cast("Q")
_args = [[_word[0:1]]]
_GOLDEN = 0x9E3779B1  # odd: n -> n * _GOLDEN is one-to-one modulo 2**31 (the point's number)
# (what, site) or (what, id of the user's code object, line) -> (the 31-bit hash of the
# description and call site, the call site's text, that code object). A pure function of its key,
# so a hit and a miss give the same fingerprint on every rank; emptied past _PRINTS_MAX.
_prints: dict[tuple, tuple[int, str, Any]] = {}
_PRINTS_MAX = 4096
_check = False  # GT_CHECK_RANKS
_lock = threading.Lock()  # one exchange at a time: they share slot 0 and the count
_acquire, _release = _lock.acquire, _lock.release
_at_exit = False  # the end-of-program exchange is registered
_ENDED = object()  # the side group after a failure on one rank ended it: active, but ended
# While dynamo compiles a frame for the compile pass on this rank (``closed``): what it
# compiles, the thread compiling, and the points refused there, (what, site). None: open.
_closed: tuple[str, int, list[tuple[str, str]]] | None = None


class ClosedError(RuntimeError):
    """An agreement point reached while the exchanges are closed (``closed``)."""


@contextlib.contextmanager
def closed(why: str) -> Iterator[list[tuple[str, str]]]:
    """No exchange from this thread while the block runs: an agreement point reached in it
    raises :class:`ClosedError` on this rank at once, before anything is sent, and is listed
    in the yielded list. For dynamo's compile of a hot function (``why``: its name): the
    compiler runs user code on real tensors on its own, per rank (a ``repr`` while it builds
    an error message, on one rank only), and a point reached there would pair with whatever
    the other ranks exchange next. The caller turns a refused point into a decision every
    rank takes (the compile's result, ``any_rank``)."""
    global _closed
    prior = _closed
    seen: list[tuple[str, str]] = []
    _closed = (why, threading.get_ident(), seen)
    try:
        yield seen
    finally:
        _closed = prior
        if prior is not None:
            prior[2].extend(seen)


def _closed_here() -> bool:
    """Are the exchanges closed on this thread (``closed``)? Read on error paths only."""
    closed = _closed
    return closed is not None and closed[1] == threading.get_ident()


def _refuse(what: str, site: str | None) -> None:
    """Raise :class:`ClosedError` for a point reached while closed, on the closing thread."""
    assert _closed is not None
    why, thread, seen = _closed
    if threading.get_ident() != thread:
        return  # another thread of this rank: its points are not the compile's
    if site is None:
        f = user_frame(sys._getframe(3))  # the point's caller: _refuse < _print < the point
        site = "<no user frame>" if f is None else site_text(f)
    seen.append((what, site))
    raise ClosedError(
        f"spmdgt: {what} at {site} was reached while dynamo compiled {why} on this rank "
        "(exchanges are closed then); no data moved"
    )


def checking() -> bool:
    """True when ``GT_CHECK_RANKS=1`` put agreement before every collective."""
    return _check


def active() -> bool:
    """True when the ranks agree through the side group (a world of more than one, after
    ``gt.init()``): a decision that must be the same everywhere is then taken at an
    agreement point; in a world of one, at once."""
    return _group is not None


def setup(rank: int, world: int) -> None:
    """Make the side group (a collective: every rank calls it from ``init``), read
    ``GT_CHECK_RANKS`` and arrange the end-of-program agreement."""
    global _group, _backend, _words, _world, _count, _last, _check, _at_exit
    check = _env.flag("GT_CHECK_RANKS")  # read before the collective: a bad value raises alike
    kwargs = {"timeout": timeout()} if timeout() is not None else {}
    _group = dist.new_group(backend="gloo", **kwargs)
    _backend = _group._get_backend(torch.device("cpu"))
    _words = _shm.open_words(_group, rank, world)  # a collective on the side group
    if _words is not None:
        _words.set_timeout(timeout().total_seconds() if timeout() is not None else None)
    _world, _count, _last = world, 0, (0, "none yet", "", "")
    _check = check
    if _check:
        _install_redistribute_check()
    if not _at_exit:
        atexit.register(_end_at_exit)
        _at_exit = True
    _errors.setup(rank, world, _drop_side_group, _last_agreed, _closed_here)


def _drop_side_group() -> None:
    # after a failure on one rank: ending the process groups frees the side group and closes
    # its connections only if nothing holds it, and ending the shared-memory exchange wakes
    # every rank waiting in it; agreement points raise from then on
    global _group, _backend, _words
    if _words is not None:
        _words.end()
    _group, _backend, _words = _ENDED, None, None


def _last_agreed() -> tuple[int, str, str, str]:
    return _last


def forget() -> None:
    """Drop all state (a forked child, ``gt.shutdown()``): the side group is not ours."""
    global _group, _count, _words
    if _words is not None:
        _words.close()
    _group, _count, _words = None, 0, None
    _proposals.clear()
    _soon.clear()
    _errors.forget()


# -- the exchange -----------------------------------------------------------------------------
# The word a point sends (``_exchange``): x, its fingerprint h mixed with its number n, in
# bits 31-61, and x's complement in bits 0-30, which is x * 2**31 + (_MASK - x) = (x + 1) *
# _MASK. The number takes part: a rank that skipped a point pairs its next one with another
# number, so even the same read at the same line does not agree.


def _fingerprint(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _print(what: str, site: str | None) -> tuple[int, str, Any]:
    """(the fingerprint of ``what`` at ``site``, ``site``, a key), ``site`` None meaning the
    user's call site. Hashed once per description and call site (``_prints``): a point reached again
    (a read in a loop) costs a dictionary look-up. The hash takes the file's base name:
    checkouts on different nodes differ in path. Every point passes here first: refused
    while the exchanges are ``closed``."""
    if _closed is not None:
        _refuse(what, site)
    code = f = None
    if site is None:
        f = user_frame(sys._getframe(2))
        if f is None:
            site = "<no user frame>"
        else:
            code = f.f_code
    key = (what, site) if code is None else (what, id(code), f.f_lineno)
    entry = _prints.get(key)
    if entry is None or entry[2] is not code:  # new, or another code object at the same id
        text = site if f is None else site_text(f)
        path, _, rest = text.partition(":")
        entry = (_fingerprint(f"{what}@{os.path.basename(path)}:{rest}"), text, code)
        if len(_prints) >= _PRINTS_MAX:
            _prints.clear()
        _prints[key] = entry
    return entry  # the kept tuple itself: a hit allocates nothing


def agree(what: str, site: str | None = None, detail: str = "") -> None:
    """One agreement point: every rank must reach it with the same ``what`` (a description
    that is the same on every rank running the same program) and call site, or every rank
    raises :class:`RankDivergenceError`. ``detail`` is shown in that error but not compared
    (what may differ between ranks, e.g. the placement DTensor keeps on a rank outside a
    sub-mesh). No-op without a side group (a world of one)."""
    if _group is None:
        return
    h, site, _ = _print(what, site)
    if _errors.out_of_step is not None:
        raise _errors.stopped(point_text(what, detail, site))
    _exchange(what, site, h, _check, detail, False)


def before_collective(what: str) -> None:
    """Under ``GT_CHECK_RANKS=1``: agree on ``what`` before a collective, naming a rank that
    does not arrive within ``GT_TIMEOUT`` (a gloo monitored barrier)."""
    if _check and _group is not None:
        h, site, _ = _print(what, None)
        if _errors.out_of_step is not None:
            raise _errors.stopped(f"{what} at {site}")
        _exchange(what, site, h, True, "", False)


# Points ``agree_soon`` took that no exchange has carried yet, oldest first: (fingerprint,
# number, what, detail, call site). The next exchange carries them (``_fold``).
_soon: list[tuple[int, int, str, str, str]] = []


def agree_soon(what: str, site: str | None = None, detail: str = "") -> None:
    """An agreement point exchanged later, by the next point that needs it (``settle``): the
    next agreement point or host read, the next op that is not proven local, the next mesh
    made. A creation of a sharded tensor is one: what it makes is read only through those, so
    a divergence still raises on every rank before any data moves, and the creations of a
    step share one exchange (``_fold``) instead of a round trip each. Under
    ``GT_CHECK_RANKS=1`` it is checked at once (``agree``)."""
    global _count
    if _group is None:
        return
    if _check:
        agree(what, site, detail)
        return
    h, site, _ = _print(what, site)
    if _errors.out_of_step is not None:
        raise _errors.stopped(point_text(what, detail, site))
    with _lock:
        _count += 1
        _soon.append((h, _count, what, detail, site))
    if len(_soon) >= _SOON_MAX:
        settle()


def settle() -> None:
    """Exchange every point ``agree_soon`` took, as one: all agreed, or every rank raises
    :class:`RankDivergenceError` at the first that did not (``_first_apart``: the same one on
    every rank). Call it before anything that moves data or makes a process group; free when
    nothing is waiting."""
    if not _soon:
        return
    with _lock:
        h, n, what, detail, site = _soon.pop()  # the newest is the exchange's own point
    _exchange(what, site, h, False, detail, False, n)


def _fold(points: list[tuple[int, int, str, str, str]], x: int) -> int:
    """The 31-bit fingerprint of ``points`` (in order) followed by the point ``x``: what one
    exchange carries for all of them. Every point's number takes part, as in a lone word."""
    raw = b"".join(((h ^ (n * _GOLDEN)) & _MASK).to_bytes(4, "little") for h, n, *_ in points)
    digest = hashlib.blake2b(raw + x.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _first_apart(points: list[tuple[int, int, str, str, str]]) -> tuple[int, str]:
    """(number, text) of the first of ``points`` (this rank's, carried by one exchange whose
    words differed) that is not every rank's: the ranks swap their fingerprints on the side
    group, so every rank picks the same position. Rare: divergences only. Every rank then
    counts on from the same number (the highest any reached), so a program that catches the
    error goes on with points that pair again."""
    global _count
    mine = [(h, n) for h, n, *_ in points]
    everyone: list[Any] = [None] * _world
    try:
        with torch._C.DisableTorchFunction():
            dist.all_gather_object(everyone, mine, group=_group)
    except RuntimeError:  # a peer gone: the exchange's own point (the last) is named
        everyone = [mine]
    _count = max(n for e in everyone for _, n in e)
    i = 0
    while all(len(e) > i for e in everyone) and len({e[i] for e in everyone}) == 1:
        i += 1
    _, n, what, detail, site = points[min(i, len(points) - 1)]
    return n, point_text(what, detail, site)


def _exchange(
    what: str, site: str, h: int, barrier: bool, detail: str, flag: bool, n: int = 0
) -> bool:
    """One exchange (its word: "The word a point sends", above): agreed, or every rank
    raises. Returns whether ``flag`` holds on any rank. ``n``: the point's number, when
    ``agree_soon`` already gave it one. The points ``agree_soon`` took before are carried in
    the same word (``_fold``). The path every agreement point takes: nothing here allocates
    but the point's record, and the arguments are positional (the exchange's own Python is
    what an agreement point costs above the all-reduce)."""
    global _count, _last
    _acquire()  # not ``with _lock``: a third less of what the lock costs the exchange
    try:
        if not n:
            _count += 1
            n = _count
        x = (h ^ (n * _GOLDEN)) & _MASK
        carried = None
        if _soon:  # the points taken earlier come first, in the same word
            carried = [*_soon, (h, n, what, detail, site)]
            _soon.clear()
            x = _fold(carried[:-1], x)
        word = (x + 1) * _MASK
        sent = word | (_PENDING if _proposals else 0) | (_FLAG if flag else 0)
        try:
            if barrier and _words is None:  # shared memory names a rank that is missing itself
                dist.monitored_barrier(_group, timeout=timeout(), wait_all_ranks=True)
            if _words is not None:
                got = _words.exchange(sent)
            else:
                _slots[0] = sent
                _backend.allreduce(_args[0], _OR).wait()
                got = _slots[0]
        except RuntimeError as e:
            _errors.exchange_failed(e, point_text(what, detail, site), n)
        if got == word:  # agreed, with no proposals and no flag anywhere: the common case
            _last = (n, what, detail, site)
            return False
        if got & _LOW == word:
            _last = (n, what, detail, site)
            if got & _PENDING:
                _settle_proposals()
            return got >= _FLAG
        # every rank that met these words swaps its points first, then names the first apart
        _errors.diverged(_group, _world, *_first_apart(carried or [(h, n, what, detail, site)]))
        raise AssertionError("unreachable: diverged raises")
    finally:
        _release()


# -- proposals: per-rank observations turned into one decision at an agreement point -------------
_proposals: set[str] = set()
_listeners: list[Callable[[set[str]], None]] = []


def propose(key: str) -> None:
    """Offer ``key`` for a decision every rank must take at the same point of the program
    (the compile pass: "this function is hot"). What each rank observes may differ (op counts
    differ on a sub-mesh); at the next agreement point every rank receives the union of all
    ranks' proposals, in the same order, through the ``on_agreed`` listeners. A world of one
    decides at once."""
    if _group is None:
        for fn in list(_listeners):
            fn({key})
        return
    _proposals.add(key)


class Listener:
    """A registration made by ``on_agreed``; ``remove()`` takes back exactly it (once)."""

    def __init__(self, fn: Callable[[set[str]], None]) -> None:
        self.fn = fn

    def remove(self) -> None:
        if self in _listeners:
            _listeners.remove(self)

    def __call__(self, keys: set[str]) -> None:
        self.fn(keys)


def on_agreed(fn: Callable[[set[str]], None]) -> Listener:
    """Call ``fn(keys)`` on every rank when proposals are settled (see ``propose``), until
    the returned handle's ``remove()``. Whoever registers removes: nothing else does."""
    handle = Listener(fn)
    _listeners.append(handle)
    return handle


def all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank: one exchange on the
    side group, so it never pairs with a data collective. Every rank must call it at the
    same point of the program; in a world of one, ``[value]``."""
    if _group is None:
        return [value]
    if _closed is not None:
        _refuse("an exchange of values", None)
    if _errors.out_of_step is not None:
        raise _errors.stopped("an exchange of values")
    settle()
    everyone: list[Any] = [None] * _world
    with torch._C.DisableTorchFunction():  # the agreement's own ops: no hook sees them
        dist.all_gather_object(everyone, value, group=_group)
    return everyone


def _shared(local: torch.Tensor, group: Any) -> Any:
    """The shared-memory exchange, where it can carry ``local`` over ``group``: every rank on
    one host, the tensor on the CPU and ``group`` every rank in order; else None."""
    if _words is None or local.device.type != "cpu":
        return None
    return _words if dist.get_process_group_ranks(group) == list(range(_world)) else None


def gather_rows(
    local: torch.Tensor, group: Any, rows: int, k: int, copy: bool = True
) -> torch.Tensor | None:
    """The ``k``-row matrix from every rank's row shard (``rows`` a rank, as ``torch.chunk``
    cuts), through shared memory (``runtime._shm``, ``_shared``); else None (the caller
    gathers with a collective). First an agreement point on the gather's sizes: every rank
    then writes and reads the same places, or every rank raises before any row is read.
    ``copy=False``: a view of the segment, read before this rank's next exchange
    (``_shm.Words.gather``)."""
    words = _shared(local, group)
    if words is None:
        return None
    row = list(local.shape[1:])
    agree(f"the gather of {k} rows of {local.dtype}{row} in {rows}-row shards", site="spmdgt")
    return words.gather(local, rows, k, copy)


def reduce(local: torch.Tensor, group: Any, op: str) -> torch.Tensor | None:
    """``op`` (``sum``, ``max``, ``min``) of every rank's ``local`` (a ``Partial`` value read
    on the host), through shared memory, on the terms of ``gather_rows``; else None."""
    words = _shared(local, group) if op in ("sum", "max", "min") else None
    if words is None:
        return None
    agree(f"the {op} of {local.dtype}{list(local.shape)} over every rank", site="spmdgt")
    return words.reduce(local.contiguous(), op)


def any_rank(flag: bool, what: str, site: str) -> bool:
    """Whether ``flag`` holds on any rank: an agreement point on ``what`` at ``site`` (the
    same decision on every rank, else ``RankDivergenceError``) whose exchange carries the
    flag too (one all-reduce). This rank's ``flag`` in a world of one."""
    if _group is None:
        return flag
    h, site, _ = _print(what, site)
    if _errors.out_of_step is not None:
        raise _errors.stopped(point_text(what, "", site))
    return _exchange(what, site, h, _check, "", flag)


def _settle_proposals() -> None:
    # every rank is here, after the same agreement point: swap the proposals (rare: only when
    # some rank has any) and hand the union to the listeners
    # (its tensor ops are the agreement's own: no function mode sees them, so no lazy region
    # of the compile pass runs, with its own agreement, inside this one)
    everyone: list[Any] = [None] * _world
    with torch._C.DisableTorchFunction():
        dist.all_gather_object(everyone, sorted(_proposals), group=_group)
    _proposals.clear()
    keys = {k for ks in everyone for k in (ks or ())}
    for fn in list(_listeners):
        fn(keys)


def end() -> None:
    """The end of the program is an agreement point: a rank still waiting in a read or a
    creation learns that its peer finished, instead of waiting forever."""
    # out of step, a peer may be gone: the error was raised already, waiting here would hang
    if _group is None or _errors.out_of_step is not None or not dist.is_initialized():
        return
    try:
        _exchange(_errors.END, "", _fingerprint(f"{_errors.END}@"), _check, "", False)
    finally:
        forget()


def _end_at_exit() -> None:
    try:
        end()
    except _errors.OURS as e:
        _errors.report_and_exit(e)


# -- GT_CHECK_RANKS: before every redistribution -------------------------------------------------
def _op_in_flight() -> str:
    # the torch function or aten op spmdgt's __torch_function__/__torch_dispatch__ is running
    # (not the fast path's recording mode, which watches the call its key's first time)
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in (
            "__torch_function__",
            "__torch_dispatch__",
        ) and not f.f_code.co_filename.endswith("_fastpath.py"):
            func = f.f_locals.get("func")
            if func is not None:
                return getattr(func, "__qualname__", None) or str(func)
        f = f.f_back
    return "a redistribution"


def _install_redistribute_check() -> None:
    """Wrap ``redistribute_local_tensor``, where every collective DTensor issues starts, in the
    three modules that call it (debug mode only: nothing is wrapped otherwise)."""
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    original = _redistribute.redistribute_local_tensor
    if getattr(original, "_gt_checked", False):
        return

    def checked(local_tensor, current_spec, target_spec, *args, **kwargs):
        if current_spec.placements != target_spec.placements or (
            current_spec.mesh != target_spec.mesh
        ):
            meta = current_spec.tensor_meta
            shape = tuple(meta.shape) if meta is not None else "?"
            dtype = str(meta.dtype).removeprefix("torch.") if meta is not None else "?"
            before_collective(
                f"{_op_in_flight()}: redistribute {dtype}{list(shape)} "
                f"{tuple(current_spec.placements)} -> {tuple(target_spec.placements)} "
                f"on {_mesh_text(current_spec.mesh)}"
            )
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    checked._gt_checked = True  # type: ignore[attr-defined]
    for module in (_redistribute, _dispatch, _api):
        if getattr(module, "redistribute_local_tensor", None) is original:
            module.redistribute_local_tensor = checked


def _mesh_text(mesh: Any) -> str:
    """``mesh [0, 1]`` (1-D) or ``mesh (dp=2, tp=2) over ranks [0, 1, 2, 3]`` (n-D)."""
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1:
        return f"mesh {ranks}"
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"mesh ({dims}) over ranks {ranks}"
