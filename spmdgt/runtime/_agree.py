"""Rank agreement: ranks that stop running the same program are caught and named.

SPMD has one failure mode of its own: ranks that stop running the same program. A collective
then pairs with a different collective on another rank, and the job hangs without a word, or
one rank reads another rank's data and prints a wrong number. This module turns those into an
error on every rank that says what each rank was doing and where.

Always on (a world of more than one):

- Every *agreement point* exchanges a small fingerprint (one OR-reduced 64-bit word a rank,
  the smallest all-reduce gloo runs: see ``_exchange``) over a gloo side group made at
  ``init()``: creating a tensor (``gt.randn``, ``gt.tensor``, ...: global shape, dtype, signal,
  placement and mesh), each host read of a sharded tensor (``.numpy()``, ``.item()``,
  ``.tolist()``, ``print``: the read, shape, dtype, placement and the user's call site), and the
  end of the program. A side group, so a fingerprint only ever pairs with a fingerprint: rank
  0 reading ``x`` while rank 1 reads ``y``, or has already finished, is an error on both ranks
  before any data moves. On a mismatch the ranks swap their descriptions (one more exchange,
  on the error path only) and raise :class:`RankDivergenceError`, each listing every rank's.

After a :class:`RankDivergenceError` every rank has raised at the same exchange, so the
exchanges stay paired and checking simply goes on: a program that catches the error and runs
on gets it again at the next point where the ranks differ, and computes only where they agree.
Where the ranks may no longer pair up (a timeout, a peer that did not answer, a divergence
some rank met at its end of the program) no rank exchanges again: every later agreement point
raises at once, saying that an earlier error left the ranks out of step, rather than wait for
a peer that is gone or compute with ranks that run different programs.

``GT_CHECK_RANKS=1`` adds an agreement point before every collective spmdgt or DTensor issues
(every redistribution: op, tensor specs and the user's call site), after a gloo monitored
barrier that names a rank that does not arrive within ``GT_TIMEOUT``.

``GT_TIMEOUT=seconds`` sets the process groups' timeout (default: torch's, 30 min for gloo). A
collective that times out raises :class:`RankTimeoutError` naming the op and this rank's last
agreement point.

An op that raises on one rank only (its shard holds a bad index) ends the process groups on
every rank within ``GT_RANK_ERROR_WAIT`` seconds, and every rank raises the same
:class:`RankFailedError` naming the rank, the op and the message (``runtime._failed``).

Every exchange is reached by the same calls on every rank and decided from exchanged data only:
no rank, clock or terminal takes part in a decision.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy
import torch
import torch.distributed as dist

from spmdgt._core import env as _env
from spmdgt.runtime import _failed
from spmdgt.runtime._failed import RankFailedError

__all__ = [
    "Listener",
    "RankDivergenceError",
    "RankFailedError",
    "RankTimeoutError",
    "active",
    "agree",
    "all_ranks",
    "any_rank",
    "before_collective",
    "call_site",
    "checking",
    "end",
    "agree_soon",
    "on_agreed",
    "propose",
    "settle",
    "setup",
    "timeout",
]


class RankDivergenceError(RuntimeError):
    """Ranks stopped running the same program: raised on every rank, listing each rank's
    operation and call site (``rows``: rank -> description)."""

    def __init__(self, message: str, rows: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rows = rows or {}


class RankTimeoutError(RuntimeError):
    """A collective got no answer within ``GT_TIMEOUT`` (or a peer's connection closed)."""


RankDivergenceError.__module__ = RankTimeoutError.__module__ = "spmdgt"  # gt.RankDivergenceError
_OURS = (RankDivergenceError, RankTimeoutError, RankFailedError)


_group: Any = None  # the gloo side group for agreement points; None: no exchanges
# Its gloo backend, called directly: agreement traffic is spmdgt's own, not the program's, so
# it bypasses the dispatcher and torch functions that the interceptor's levels record.
_backend: Any = None
_rank = 0
_world = 1
_count = 0  # agreement points passed on this rank
# this rank's last agreed point, for messages: (number, what, detail, call site)
_last: tuple[int, str, str, str] = (0, "none yet", "", "")
# One exchange is one 64-bit word a rank, all-reduced with bitwise OR: the smallest all-reduce
# gloo runs (one element; two or more cost 1.5-2x its round trip on gloo's ring, see
# docs/benchmarks.md). Bits 31-61 hold x, 31 bits of the point's fingerprint, and bits 0-30
# its complement; the OR of every rank's word is then (OR of the x's, NOT (AND of the x's)),
# whose halves are complements iff every rank sent the same x. That test reads exchanged data
# only, so every rank decides alike. Bit 62: some rank has proposals waiting (``propose``);
# bit 63: ``any_rank``'s flag. Written and read through numpy, so no torch op runs.
_BITS = 31
_MASK = (1 << _BITS) - 1
_PENDING = 1 << 62
_FLAG = 1 << 63
_OR = dist.AllreduceOptions()
_OR.reduceOp = dist.ReduceOp.BOR
_word_np = numpy.zeros(1, dtype=numpy.int64)
_word_u = _word_np.view(numpy.uint64)  # the same memory, read and written as unsigned
_word = torch.from_numpy(_word_np)
_GOLDEN = 0x9E3779B1  # odd: n -> n * _GOLDEN is one-to-one modulo 2**31 (the point's number)
# (what, site) or (what, id of the user's code object, line) -> (that code object, the 31-bit
# hash of the description and call site, the call site's text). A pure function of its key,
# so a hit and a miss give the same fingerprint on every rank; emptied past _PRINTS_MAX.
_prints: dict[tuple, tuple[Any, int, str]] = {}
_PRINTS_MAX = 4096
# Set once the ranks may no longer pair up their exchanges (a timeout, a peer that did not
# answer, a divergence some rank met at its end of the program): (the error class, what
# happened, each rank's description). Every later agreement point raises it without
# exchanging, since an exchange could wait forever for a peer that is gone, and returning
# instead would let the ranks compute with different programs. None: exchanges pair up.
_out_of_step: tuple[type[RuntimeError], str, dict[int, str]] | None = None
_check = False  # GT_CHECK_RANKS
_lock = threading.Lock()
_at_exit = False  # the end-of-program exchange is registered
_ROOTS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # spmdgt/
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.dirname(os.path.abspath(threading.__file__)),  # the standard library
)


def timeout() -> datetime.timedelta | None:
    """``GT_TIMEOUT`` as a timedelta, or None for torch's default. Bad values raise."""
    seconds = _env.number("GT_TIMEOUT")  # declared finite and > 0
    return None if seconds is None else datetime.timedelta(seconds=seconds)


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
    global _group, _backend, _rank, _world, _count, _last, _out_of_step, _check, _at_exit
    check = _env.flag("GT_CHECK_RANKS")  # read before the collective: a bad value raises alike
    kwargs = {"timeout": timeout()} if timeout() is not None else {}
    _group = dist.new_group(backend="gloo", **kwargs)
    _backend = _group._get_backend(torch.device("cpu"))
    _rank, _world, _count, _out_of_step = rank, world, 0, None
    _last = (0, "none yet", "", "")
    _check = check
    if _check:
        _install_redistribute_check()
    if not _at_exit:
        atexit.register(_end_at_exit)
        _at_exit = True
    _failed.setup(rank, world)
    _install_excepthook()


def forget() -> None:
    """Drop all state (a forked child, ``gt.shutdown()``): the side group is not ours."""
    global _group, _count, _out_of_step
    _group, _count, _out_of_step = None, 0, None
    _proposals.clear()
    _soon.clear()
    _failed.stop()


# -- the exchange -----------------------------------------------------------------------------
def call_site() -> str:
    """``file:line in function`` of the innermost frame outside spmdgt, torch and the standard
    library: the user's line that led here (``<no user frame>`` on a thread of torch's)."""
    f = _user_frame(sys._getframe(1))
    return "<no user frame>" if f is None else _site_text(f)


def _user_frame(f: Any) -> Any:
    """The innermost frame from ``f`` outward outside spmdgt, torch and the standard library."""
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_ROOTS) and not name.startswith("<"):
            return f
        f = f.f_back
    return None


def _site_text(f: Any) -> str:
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def _fingerprint(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _print(what: str, site: str | None) -> tuple[int, str]:
    """(the fingerprint of ``what`` at ``site``, ``site``), ``site`` None meaning the user's
    call site. Hashed once per description and call site (``_prints``): a point reached again
    (a read in a loop) costs a dictionary look-up. The hash takes the file's base name:
    checkouts on different nodes differ in path."""
    code = f = None
    if site is None:
        f = _user_frame(sys._getframe(2))
        if f is None:
            site = "<no user frame>"
        else:
            code = f.f_code
    key = (what, site) if code is None else (what, id(code), f.f_lineno)
    entry = _prints.get(key)
    if entry is None or entry[0] is not code:  # new, or another code object at the same id
        text = site if f is None else _site_text(f)
        path, _, rest = text.partition(":")
        entry = (code, _fingerprint(f"{what}@{os.path.basename(path)}:{rest}"), text)
        if len(_prints) >= _PRINTS_MAX:
            _prints.clear()
        _prints[key] = entry
    return entry[1], entry[2]


def agree(what: str, site: str | None = None, detail: str = "") -> None:
    """One agreement point: every rank must reach it with the same ``what`` (a description
    that is the same on every rank running the same program) and call site, or every rank
    raises :class:`RankDivergenceError`. ``detail`` is shown in that error but not compared
    (what may differ between ranks, e.g. the placement DTensor keeps on a rank outside a
    sub-mesh). No-op without a side group (a world of one)."""
    if _group is None:
        return
    h, site = _print(what, site)
    if _out_of_step is not None:
        raise _stopped(_out_of_step, _doing(what, detail, site))
    _exchange(what, site, h, barrier=_check, detail=detail)


def before_collective(what: str) -> None:
    """Under ``GT_CHECK_RANKS=1``: agree on ``what`` before a collective, naming a rank that
    does not arrive within ``GT_TIMEOUT`` (a gloo monitored barrier)."""
    if _check and _group is not None:
        h, site = _print(what, None)
        if _out_of_step is not None:
            raise _stopped(_out_of_step, f"{what} at {site}")
        _exchange(what, site, h, barrier=True)


# Points started by ``agree_soon`` whose exchange is in flight, oldest first: (the work, its
# word, x, number, what, detail, call site). ``settle`` checks them.
_soon: list[tuple[Any, numpy.ndarray, int, int, str, str, str]] = []
_SOON_MAX = 64  # settled at once past this many: a bounded queue of words


def agree_soon(what: str, site: str | None = None, detail: str = "") -> None:
    """An agreement point whose exchange starts now and is checked at the next point that
    needs it (``settle``): the next agreement point or host read, the next op that is not
    proven local, the next mesh made. A creation of a sharded tensor is one: what it makes
    is read only through those, so a divergence still raises on every rank before any data
    moves, and the round trip overlaps the rank's own work instead of stalling it. Under
    ``GT_CHECK_RANKS=1`` it is checked at once (``agree``)."""
    global _count
    if _group is None:
        return
    if _check:
        agree(what, site, detail)
        return
    h, site = _print(what, site)
    if _out_of_step is not None:
        raise _stopped(_out_of_step, _doing(what, detail, site))
    with _lock:
        _count += 1
        n = _count
        x = (h ^ (n * _GOLDEN)) & _MASK
        word = numpy.array([(x << _BITS) | (~x & _MASK)], dtype=numpy.uint64).view(numpy.int64)
        try:
            work = _backend.allreduce([torch.from_numpy(word)], _OR)
        except RuntimeError as e:
            _fail_timeout(e, _doing(what, detail, site), n)
        _soon.append((work, word, x, n, what, detail, site))
    if len(_soon) >= _SOON_MAX:
        settle()


def settle() -> None:
    """Check every agreement point ``agree_soon`` started: all agreed, or every rank raises
    :class:`RankDivergenceError` at the first that did not (each rank received the same
    words, so each finds the same one). Call it before anything that moves data or makes a
    process group; free when nothing is in flight."""
    global _last
    if not _soon:
        return
    with _lock:
        pending = list(_soon)
        _soon.clear()
        first_bad = None
        for work, word, x, n, what, detail, site in pending:
            try:
                work.wait()
            except RuntimeError as e:
                _fail_timeout(e, _doing(what, detail, site), n)
            got = int(word.view(numpy.uint64)[0])
            if (got >> _BITS) & _MASK == x and got & _MASK == ~x & _MASK:
                if first_bad is None:
                    _last = (n, what, detail, site)
            elif first_bad is None:
                first_bad = (n, _doing(what, detail, site))
    if first_bad is not None:
        _diverged(*first_bad)


def _doing(what: str, detail: str, site: str) -> str:
    return f"{what}{detail} at {site}" if site else f"{what}{detail}"


def _stopped(state: tuple[type[RuntimeError], str, dict[int, str]], doing: str) -> RuntimeError:
    """The error an agreement point raises, without exchanging, once the ranks fell out of
    step (``state``: see ``_out_of_step``)."""
    kind, why, rows = state
    if kind is RankFailedError:
        return _not_run(doing, why)
    message = (
        f"rank {_rank}: {doing}: not checked, because an earlier error left the ranks out of "
        f"step ({why}). Their agreement points no longer pair up, so spmdgt stops here rather "
        "than compute with ranks that may run different programs; let that error end the "
        "program."
    )
    return RankDivergenceError(message, rows) if kind is RankDivergenceError else kind(message)


def _exchange(
    what: str, site: str, h: int, barrier: bool, detail: str = "", flag: bool = False
) -> bool:
    """One exchange (see ``_word``): agreed, or every rank raises. Returns whether ``flag``
    holds on any rank."""
    global _count, _last
    if _soon:
        settle()  # the points started earlier come first, in order
    with _lock:
        _count += 1
        n = _count
        # the point's number takes part: a rank that skipped a point pairs its next one with
        # another number, so even the same read at the same line does not agree
        x = (h ^ (n * _GOLDEN)) & _MASK
        _word_u[0] = (
            (x << _BITS) | (~x & _MASK) | (_PENDING if _proposals else 0) | (_FLAG if flag else 0)
        )
        try:
            if barrier:
                dist.monitored_barrier(_group, timeout=timeout(), wait_all_ranks=True)
            _backend.allreduce([_word], _OR).wait()
        except RuntimeError as e:
            _fail_timeout(e, _doing(what, detail, site), n)
        got = int(_word_u[0])
        if (got >> _BITS) & _MASK == x and got & _MASK == ~x & _MASK:
            _last = (n, what, detail, site)
            if got & _PENDING:
                _settle_proposals()
            return bool(got & _FLAG)
        _diverged(n, _doing(what, detail, site))
        raise AssertionError("unreachable: _diverged raises")


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
    if _out_of_step is not None:
        raise _stopped(_out_of_step, "an exchange of values")
    settle()
    everyone: list[Any] = [None] * _world
    with torch._C.DisableTorchFunction():  # the agreement's own ops: no hook sees them
        dist.all_gather_object(everyone, value, group=_group)
    return everyone


def any_rank(flag: bool, what: str, site: str) -> bool:
    """Whether ``flag`` holds on any rank: an agreement point on ``what`` at ``site`` (the
    same decision on every rank, else ``RankDivergenceError``) whose exchange carries the
    flag too (one all-reduce). This rank's ``flag`` in a world of one."""
    if _group is None:
        return flag
    h, site = _print(what, site)
    if _out_of_step is not None:
        raise _stopped(_out_of_step, _doing(what, "", site))
    return _exchange(what, site, h, barrier=_check, flag=flag)


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


def _diverged(n: int, mine: str) -> None:
    global _out_of_step
    texts: list[Any] = [None] * _world
    answered = True
    try:
        dist.all_gather_object(texts, mine, group=_group)
    except RuntimeError:
        texts = [mine if r == _rank else _NO_ANSWER for r in range(_world)]
        answered = False
    rows = {r: str(t) for r, t in enumerate(texts)}
    # Every rank took part in this exchange and raises here, so the next exchange of each rank
    # pairs with the next of every other: checking goes on. Not so where a peer did not answer
    # (it may never exchange again) or a rank was at its end of the program (it exchanges no
    # more): then this rank stops at every later agreement point. Both tests read only what
    # every rank received alike, so every rank that answered decides the same.
    ended = [r for r, t in rows.items() if t == _END]
    if not answered:
        why = f"a divergence at agreement point #{n} where some rank did not answer"
        _out_of_step = (RankDivergenceError, why, rows)
    elif ended:
        why = f"a divergence at agreement point #{n} where rank(s) {ended} ended the program"
        _out_of_step = (RankDivergenceError, why, rows)
    lines = "\n".join(f"  rank {r}: {t}" for r, t in rows.items())
    raise RankDivergenceError(
        f"ranks stopped running the same program at agreement point #{n}:\n{lines}\n"
        "Every rank must make the same spmdgt calls in the same order (no branch on the rank "
        "around a host read, a tensor creation or an op on sharded tensors).",
        rows,
    )


def _fail_timeout(e: BaseException, doing: str, n: int) -> None:
    global _out_of_step
    shown = _failed.reported()  # an op raised on one rank, which ended its groups?
    if shown is not None:
        raise _fail_everywhere(shown, e, f"was waiting at agreement point #{n} ({doing})")
    text = str(e)
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if found:  # rank 0's monitored barrier names the ranks that did not arrive
        missing = [int(r) for r in re.findall(r"\d+", found.group(1))]
        who = f"rank(s) {missing} did not arrive"
    elif "monitoredBarrier" in text:  # the other ranks only learn that rank 0 gave up
        who = "rank 0 reported missing ranks (see its error)"
    else:
        who = "no answer from the other ranks"
    # a peer that did not arrive may never exchange again: no later exchange on this rank
    _out_of_step = (RankTimeoutError, f"agreement point #{n} timed out: {who}", {})
    raise RankTimeoutError(
        f"rank {_rank}: {who} within {_waited()} at agreement point #{n} ({doing}); this "
        f"rank's last agreed point was {_said(_last)}. A rank is running something else, is stuck "
        "or has exited."
    ) from e


def _said(point: tuple[int, str, str, str]) -> str:
    n, what, detail, site = point
    return f"#{n}: {_doing(what, detail, site)}"


def _waited() -> str:
    limit = timeout()
    return f"GT_TIMEOUT={limit.total_seconds():g} s" if limit else "the process-group timeout"


_END = "the end of the program (exit or gt.shutdown())"  # its description: no call site
_NO_ANSWER = "(did not answer)"


def end() -> None:
    """The end of the program is an agreement point: a rank still waiting in a read or a
    creation learns that its peer finished, instead of waiting forever."""
    # out of step, a peer may be gone: the error was raised already, waiting here would hang
    if _group is None or _out_of_step is not None or not dist.is_initialized():
        return
    try:
        _exchange(_END, "", _fingerprint(f"{_END}@"), barrier=_check)
    finally:
        forget()


def _end_at_exit() -> None:
    try:
        end()
    except _OURS as e:
        text = f"[rank {_rank}] spmdgt: {type(e).__name__}: {e}\n"
        sys.stderr.write(text)
        sys.stderr.flush()
        _record_for_torchrun(e, text)
        os._exit(1)


# -- GT_TIMEOUT on data collectives -------------------------------------------------------------
_TIMEOUT_WORDS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")


def translate(e: BaseException, op: object) -> BaseException:
    """What an error inside ``op`` (a torch function, a host read) becomes on this rank.

    - An error this rank alone raised (its shard holds a bad index, ...) or one of a rank that
      did: :class:`RankFailedError`, the same on every rank, naming that rank, its op and its
      message, after the process groups were ended so that no rank waits (``runtime._failed``).
    - A collective's timeout or lost peer: :class:`RankTimeoutError` naming the op, the call
      site and this rank's last agreement point.
    - An error every rank raised (the program's own): ``e`` itself, so ``raise translate(e,
      op)`` in an ``except`` block re-raises it unchanged.

    The new error's ``__cause__`` is ``e``. Runs on the error path only."""
    if _group is None or isinstance(e, _OURS) or getattr(e, "_gt_seen", False):
        return e  # no world, one of ours, or decided in an inner frame of the same error
    global _out_of_step
    name = _op_text(op)
    site = call_site()
    if _out_of_step is not None and _out_of_step[0] is RankFailedError:
        err = _not_run(f"{name} at {site}", _out_of_step[1])
        err.__cause__ = e
        return err
    text = str(e)
    if any(w in text for w in _TIMEOUT_WORDS):
        shown = _failed.reported()  # a rank whose op raised ended its groups: this woke us
        if shown is not None:
            return _fail_everywhere(shown, e, f"was waiting in a collective in {name} at {site}")
        # the ranks no longer pair up: no later exchange, the exit's included
        _out_of_step = (RankTimeoutError, f"a collective in {name} got no answer", {})
        err = RankTimeoutError(
            f"rank {_rank}: a collective in {name} at {site} got no answer within {_waited()} "
            f"({text.strip().splitlines()[0]}). This rank's last agreement point was "
            f"{_said(_last)}; another rank is running something else, is stuck or has exited "
            "(GT_CHECK_RANKS=1 names it)."
        )
        err.__cause__ = e
        return err
    shown = _failed.decide(e, name, site)
    if shown is None:  # every rank raised it: the program's own error, nothing out of step
        try:
            e._gt_seen = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return e
    mine = shown.startswith(f"rank {_rank} ")
    return _fail_everywhere(
        shown, e, "raised it" if mine else f"raised {type(e).__name__} in {name} at {site} too"
    )


_GROUPS_ENDED = (
    "No collective can run in this process any more: a program that catches this error "
    "cannot go on with distributed work. Let it end the program, and fix the data or the op "
    "on the rank named."
)


def _fail_everywhere(shown: str, e: BaseException, doing: str) -> RankFailedError:
    """End this rank's process groups (which wakes a peer waiting on it) and return the
    :class:`RankFailedError` every rank raises for the failure ``shown``; ``doing``: what this
    rank did ("raised it", "was waiting in a collective in ...")."""
    global _out_of_step, _group, _backend
    _out_of_step = (RankFailedError, shown, {})
    # drop our references to the side group, so that ending it frees it and closes its
    # connections; agreement points raise from ``_out_of_step`` from now on
    _group, _backend = _ENDED, None
    _failed.end_groups()
    err = RankFailedError(
        f"{shown}\nNot every rank raised it, and a rank that did not was left waiting in a "
        "collective: spmdgt ended the process groups on every rank, and every rank raises this "
        f"error (rank {_rank} {doing}). {_GROUPS_ENDED}"
    )
    err.__cause__ = e
    return err


def _not_run(doing: str, shown: str) -> RankFailedError:
    """The error of a collective, agreement point or exchange asked for after the process
    groups were ended by the failure ``shown``."""
    return RankFailedError(
        f"rank {_rank}: {doing}: not run: the process groups were ended after an op failed on "
        f"one rank ({shown}). {_GROUPS_ENDED}"
    )


_ENDED = object()  # the side group after _fail_everywhere: active, but ended


def _op_text(op: object) -> str:
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or str(op)
    module = getattr(op, "__module__", None)
    if name == "__get__":  # a property's getter (``x.T``)
        name = getattr(getattr(op, "__self__", None), "__name__", "") or name
    name = name.replace("TensorBase.", "Tensor.")  # torch._C.TensorBase: the methods' home
    return f"{module}.{name}" if module and module.startswith("torch") else str(name)


# -- GT_CHECK_RANKS: before every redistribution -------------------------------------------------
def _op_in_flight() -> str:
    # the torch function or aten op spmdgt's __torch_function__/__torch_dispatch__ is running
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in ("__torch_function__", "__torch_dispatch__"):
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


# -- one readable message per rank ---------------------------------------------------------------
def _record_for_torchrun(e: BaseException, text: str) -> None:
    # torchrun's failure summary shows each rank's root cause from this file, in the layout
    # of torch's own ErrorHandler.record_exception (which reads the traceback from
    # sys.exc_info, empty in an exit hook); a file the program wrote itself is kept
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import json
    import time

    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary is a courtesy: never hide the error itself
        pass


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_gt_hook", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, _OURS):
            # the message says what each rank did and where: spmdgt's frames add nothing
            text = f"[rank {_rank}] spmdgt: {kind.__name__}: {value}\n"
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            import traceback

            text = "".join(traceback.format_exception(kind, value, tb))
            previous(kind, value, tb)
        _record_for_torchrun(value, text)

    hook._gt_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
