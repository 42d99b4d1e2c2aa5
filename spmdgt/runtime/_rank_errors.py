"""When the ranks stop running the same program: the one clear error every rank raises.

The exchange that compares the ranks lives in ``runtime._agree``; this module is what happens
when it, or a data collective, finds them apart:

- a divergence: an agreement point whose fingerprints differ. The ranks swap their
  descriptions (one more exchange, on the error path only) and each raises
  :class:`RankDivergenceError` listing every rank's (``diverged``), so the message names the
  first point (a creation, a host read, the end of the program) where they differ;
- a timeout: an exchange or a data collective that got no answer within ``GT_TIMEOUT``
  raises :class:`RankTimeoutError` naming the op and this rank's last agreed point
  (``exchange_failed``, ``translate``);
- a failure on one rank: an op that raised on one rank only ends the process groups on every
  rank, and every rank raises the same :class:`RankFailedError` (``translate``, with
  ``runtime._failed``).

It also keeps what those messages need: this rank's number, its last agreed point, and
whether the ranks fell out of step (``out_of_step``). After a :class:`RankDivergenceError`
every rank has raised at the same exchange, so the exchanges stay paired and checking goes on.
Where the ranks may no longer pair up (a timeout, a peer that did not answer, a divergence
some rank met at its end of the program) no rank exchanges again: every later agreement point
raises at once (``stopped``), saying that an earlier error left the ranks out of step, rather
than wait for a peer that is gone or compute with ranks that run different programs.

Every decision here reads only what every rank received alike (exchanged words, the store):
no rank, clock or terminal takes part.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from spmdgt._core import env as _env
from spmdgt.runtime import _failed
from spmdgt.runtime._failed import RankFailedError

__all__ = [
    "END",
    "OURS",
    "RankDivergenceError",
    "RankFailedError",
    "RankTimeoutError",
    "call_site",
    "diverged",
    "exchange_failed",
    "forget",
    "point_text",
    "record_for_torchrun",
    "report_and_exit",
    "setup",
    "site_text",
    "stopped",
    "timeout",
    "translate",
    "user_frame",
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
OURS = (RankDivergenceError, RankTimeoutError, RankFailedError)

_on = False  # a world of more than one, set up: an error may be one rank's
_rank = 0
# Set once the ranks may no longer pair up their exchanges (a timeout, a peer that did not
# answer, a divergence some rank met at its end of the program, a failure on one rank): (the
# error class, what happened, each rank's description). Every later agreement point raises
# it without exchanging (``stopped``), since an exchange could wait forever for a peer that is
# gone, and returning instead would let the ranks compute with different programs. None:
# exchanges pair up.
out_of_step: tuple[type[RuntimeError], str, dict[int, str]] | None = None


def _drop_nothing() -> None:
    pass


def _none_yet() -> tuple[int, str, str, str]:
    return (0, "none yet", "", "")


# the exchange's way to drop its references to the side group (see ``_fail_everywhere``)
_drop_side_group: Callable[[], None] = _drop_nothing
# the exchange's way to tell this rank's last agreed point, for messages: (number, what,
# detail, call site). The exchange keeps it (its hot path writes it at every point) and only
# an error reads it.
_last_agreed: Callable[[], tuple[int, str, str, str]] = _none_yet
# the exchange's way to tell whether this thread is inside dynamo's compile of a hot function,
# where no exchange may run (``_agree.closed``): an error there is the compile's to decide
_closed_here: Callable[[], bool] = bool

_ROOTS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # spmdgt/
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.dirname(os.path.abspath(threading.__file__)),  # the standard library
)
END = "the end of the program (exit or gt.shutdown())"  # its description: no call site
_NO_ANSWER = "(did not answer)"


def timeout() -> datetime.timedelta | None:
    """``GT_TIMEOUT`` as a timedelta, or None for torch's default. Bad values raise."""
    seconds = _env.number("GT_TIMEOUT")  # declared finite and > 0
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def setup(
    rank: int,
    world: int,
    drop_side_group: Callable[[], None],
    last_agreed: Callable[[], tuple[int, str, str, str]],
    closed_here: Callable[[], bool] = bool,
) -> None:
    """Start this rank's error paths (from ``_agree.setup``, every rank): ``drop_side_group``
    drops the exchange's references to its side group, so that ending the process groups
    after a failure on one rank frees it and closes its connections; ``last_agreed`` tells
    this rank's last agreed point (number, what, detail, call site); ``closed_here`` whether
    this thread is where exchanges are closed (dynamo compiling a hot function)."""
    global _on, _rank, out_of_step, _drop_side_group, _last_agreed, _closed_here
    _on, _rank, out_of_step = True, rank, None
    _drop_side_group, _last_agreed, _closed_here = drop_side_group, last_agreed, closed_here
    _failed.setup(rank, world)
    _install_excepthook()


def forget() -> None:
    """Drop all state (a forked child, ``gt.shutdown()``)."""
    global _on, out_of_step
    _on, out_of_step = False, None
    _failed.stop()


def call_site() -> str:
    """``file:line in function`` of the innermost frame outside spmdgt, torch and the standard
    library: the user's line that led here (``<no user frame>`` on a thread of torch's)."""
    f = user_frame(sys._getframe(1))
    return "<no user frame>" if f is None else site_text(f)


def user_frame(f: Any) -> Any:
    """The innermost frame from ``f`` outward outside spmdgt, torch and the standard library."""
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_ROOTS) and not name.startswith("<"):
            return f
        f = f.f_back
    return None


def site_text(f: Any) -> str:
    """A frame's ``file:line in function``, as every message names a call site."""
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def point_text(what: str, detail: str, site: str) -> str:
    """What a rank was doing at an agreement point, as the messages show it."""
    return f"{what}{detail} at {site}" if site else f"{what}{detail}"


# -- at an agreement point ----------------------------------------------------------------------
def stopped(doing: str) -> RuntimeError:
    """The error an agreement point raises, without exchanging, once the ranks fell out of
    step (see ``out_of_step``, which must be set)."""
    assert out_of_step is not None, "stopped() called while the ranks are in step"
    kind, why, rows = out_of_step
    if kind is RankFailedError:
        return _not_run(doing, why)
    message = (
        f"rank {_rank}: {doing}: not checked, because an earlier error left the ranks out of "
        f"step ({why}). Their agreement points no longer pair up, so spmdgt stops here rather "
        "than compute with ranks that may run different programs; let that error end the "
        "program."
    )
    return RankDivergenceError(message, rows) if kind is RankDivergenceError else kind(message)


def diverged(group: Any, world: int, n: int, mine: str) -> None:
    """Raise :class:`RankDivergenceError` for agreement point ``n``, whose fingerprints
    differed, listing every rank's description (``mine``: this rank's), swapped on the side
    ``group``. Every rank that met the same words calls it at the same point."""
    global out_of_step
    texts: list[Any] = [None] * world
    answered = True
    try:
        dist.all_gather_object(texts, mine, group=group)
    except RuntimeError:
        texts = [mine if r == _rank else _NO_ANSWER for r in range(world)]
        answered = False
    rows = {r: str(t) for r, t in enumerate(texts)}
    # Every rank took part in this exchange and raises here, so the next exchange of each rank
    # pairs with the next of every other: checking goes on. Not so where a peer did not answer
    # (it may never exchange again) or a rank was at its end of the program (it exchanges no
    # more): then this rank stops at every later agreement point. Both tests read only what
    # every rank received alike, so every rank that answered decides the same.
    ended = [r for r, t in rows.items() if t == END]
    if not answered:
        why = f"a divergence at agreement point #{n} where some rank did not answer"
        out_of_step = (RankDivergenceError, why, rows)
    elif ended:
        why = f"a divergence at agreement point #{n} where rank(s) {ended} ended the program"
        out_of_step = (RankDivergenceError, why, rows)
    lines = "\n".join(f"  rank {r}: {t}" for r, t in rows.items())
    raise RankDivergenceError(
        f"ranks stopped running the same program at agreement point #{n}:\n{lines}\n"
        "Every rank must make the same spmdgt calls in the same order (no branch on the rank "
        "around a host read, a tensor creation or an op on sharded tensors).",
        rows,
    )


def exchange_failed(e: BaseException, doing: str, n: int) -> None:
    """Raise what the exchange of agreement point ``n`` failing with ``e`` means on this rank:
    the :class:`RankFailedError` of a rank whose op raised alone, else
    :class:`RankTimeoutError` naming the ranks that did not arrive where known."""
    global out_of_step
    shown = _failed.reported()  # an op raised on one rank, which ended its groups?
    if shown is not None:
        raise _fail_everywhere(shown, e, f"was waiting at agreement point #{n} ({doing})")
    text = str(e)
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if getattr(e, "who", None):  # the shared-memory exchange knows who (``runtime._shm``)
        who = e.who  # type: ignore[attr-defined]
    elif found:  # rank 0's monitored barrier names the ranks that did not arrive
        missing = [int(r) for r in re.findall(r"\d+", found.group(1))]
        who = f"rank(s) {missing} did not arrive"
    elif "monitoredBarrier" in text:  # the other ranks only learn that rank 0 gave up
        who = "rank 0 reported missing ranks (see its error)"
    else:
        who = "no answer from the other ranks"
    # a peer that did not arrive may never exchange again: no later exchange on this rank
    out_of_step = (RankTimeoutError, f"agreement point #{n} timed out: {who}", {})
    within = "" if who.endswith("exited") else f" within {_waited()}"
    raise RankTimeoutError(
        f"rank {_rank}: {who}{within} at agreement point #{n} ({doing}); this "
        f"rank's last agreed point was {_said(_last_agreed())}. A rank is running something else, "
        "is stuck or has exited."
    ) from e


def _said(point: tuple[int, str, str, str]) -> str:
    n, what, detail, site = point
    return f"#{n}: {point_text(what, detail, site)}"


def _waited() -> str:
    limit = timeout()
    return f"GT_TIMEOUT={limit.total_seconds():g} s" if limit else "the process-group timeout"


# -- GT_TIMEOUT and one rank's failure on data collectives -------------------------------------
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
    if not _on or isinstance(e, OURS) or getattr(e, "_gt_seen", False):
        return e  # no world, one of ours, or decided in an inner frame of the same error
    if _closed_here():
        # raised while dynamo compiles a hot function (a ``repr`` for its error message, on
        # wrapped tensors): the compile fails, and its result is agreed by every rank after
        # it (``any_rank``); deciding here would be an exchange where none may run, paired
        # by number with whatever the other ranks decide (the both-halves scenario sweep:
        # ``torch.func.jvp`` on a sub-mesh value ended the process groups on one rank)
        return e
    global out_of_step
    name = _op_text(op)
    site = call_site()
    if out_of_step is not None and out_of_step[0] is RankFailedError:
        err = _not_run(f"{name} at {site}", out_of_step[1])
        err.__cause__ = e
        return err
    text = str(e)
    if any(w in text for w in _TIMEOUT_WORDS):
        shown = _failed.reported()  # a rank whose op raised ended its groups: this woke us
        if shown is not None:
            return _fail_everywhere(shown, e, f"was waiting in a collective in {name} at {site}")
        # the ranks no longer pair up: no later exchange, the exit's included
        out_of_step = (RankTimeoutError, f"a collective in {name} got no answer", {})
        err = RankTimeoutError(
            f"rank {_rank}: a collective in {name} at {site} got no answer within {_waited()} "
            f"({text.strip().splitlines()[0]}). This rank's last agreement point was "
            f"{_said(_last_agreed())}; another rank is running something else, is stuck or has "
            "exited (GT_CHECK_RANKS=1 names it)."
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
    global out_of_step
    out_of_step = (RankFailedError, shown, {})
    # the exchange drops its references to the side group, so that ending it frees it and
    # closes its connections; agreement points raise from ``out_of_step`` from now on
    _drop_side_group()
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


def _op_text(op: object) -> str:
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or str(op)
    module = getattr(op, "__module__", None)
    if name == "__get__":  # a property's getter (``x.T``)
        name = getattr(getattr(op, "__self__", None), "__name__", "") or name
    name = name.replace("TensorBase.", "Tensor.")  # torch._C.TensorBase: the methods' home
    return f"{module}.{name}" if module and module.startswith("torch") else str(name)


# -- one readable message per rank ---------------------------------------------------------------
def record_for_torchrun(e: BaseException, text: str) -> None:
    """Write ``e`` where torchrun's failure summary reads each rank's root cause."""
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


def report_and_exit(e: BaseException) -> None:
    """Print one of our errors met at exit (no traceback: it names every rank's part), record
    it for torchrun and end the process with status 1."""
    text = f"[rank {_rank}] spmdgt: {type(e).__name__}: {e}\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    record_for_torchrun(e, text)
    os._exit(1)


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_gt_hook", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, OURS):
            # the message says what each rank did and where: spmdgt's frames add nothing
            text = f"[rank {_rank}] spmdgt: {kind.__name__}: {value}\n"
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            import traceback

            text = "".join(traceback.format_exception(kind, value, tb))
            previous(kind, value, tb)
        record_for_torchrun(value, text)

    hook._gt_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
