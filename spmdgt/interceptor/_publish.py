"""The run folder: what ranks publish for ``scripts.top``; trace requests from ``scripts.trace``.

Layout of ``GT_RUN_DIR`` (any folder every rank and the tools can see):

    rank<r>.json          this rank's status, rewritten atomically about once a second:
                          cumulative counters, the last interval's rates and time shares, the
                          folders it writes traces into (``trace_dirs``) and its last trace
                          request's fate (``trace``: recording, written, rejected or failed)
    trace_request.json    written by ``scripts.trace``: {"id", "seconds", "dir"}; each rank picks
                          it up on its next tick and records that many seconds of events
    <dir>/trace_<id>.rank<r>.log   the captured window, in the instruction-log format

A trace request is outside input: anyone who can write the run folder can write one, and the
job must not become a way to write files elsewhere or to crash the user's program. So a rank
writes traces only inside the run folder or inside ``GT_TRACE_DIR`` (a folder named in the job's
environment when it starts; ``enable(trace_dir=...)`` from Python). A request is checked field
by field (``check_trace_request``): ``id`` a short token of letters, digits, ``-`` and ``_``;
``seconds`` a finite number in (0, ``MAX_TRACE_SECONDS``]; ``dir`` text with no ``..`` part that,
relative to the run folder or absolute, resolves (symlinks followed) inside one of those two
folders. The trace file is created next to nothing of the same name (never replacing a file),
through a handle on the checked folder (a symlink swapped in later changes nothing). A request
that fails any check is ignored and reported once, as ``[gt r<rank> trace] ...`` on stderr and
in the rank's status; nothing is raised into the user's program, and no error of the run folder
(full disk, folder removed) is either.

Publishing happens on the interceptor's ~1 s tick (one ``os.replace`` and one ``os.lstat`` per
second), never per op. A rank that runs no op does not tick: ``top`` shows how old each status is.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any

from spmdgt._core import env as _env
from spmdgt.interceptor._events import OpEvent
from spmdgt.interceptor._instruction_log import _Formatter, header
from spmdgt.interceptor._stats import StatsSink

__all__ = [
    "MAX_TRACE_SECONDS",
    "BadTraceRequest",
    "RunDirPublisher",
    "TraceRequest",
    "TraceSink",
    "check_trace_request",
    "status_path",
    "write_json_atomic",
]

TRACE_REQUEST = "trace_request.json"
DEFAULT_TRACE_SUBDIR = "traces"  # where a request without ``dir`` goes, inside the run folder
MAX_TRACE_SECONDS = 3600.0  # a longer window is a mistake (or an attack), not a trace
_MAX_REQUEST_BYTES = 4096
_MAX_DIR_CHARS = 1024
_TRACE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_REQUEST_KEYS = frozenset({"id", "seconds", "dir"})
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def status_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` publishes its status in ``run_dir``."""
    return os.path.join(run_dir, f"rank{rank}.json")


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON so readers never see half a file (tmp file + ``os.replace``).

    The tmp file is created fresh (a symlink or file planted at its name is removed, never
    written through), so writing a status cannot truncate a file elsewhere.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)  # removes a planted symlink itself, not its target
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    with os.fdopen(os.open(tmp, flags, 0o644), "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class BadTraceRequest(ValueError):
    """A trace request that fails a check; the message says which and why."""


@dataclass(frozen=True)
class TraceRequest:
    """A checked trace request: ``dir`` is as the request gave it (resolved when started)."""

    id: str
    seconds: float
    dir: str


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def check_trace_id(trace_id: Any) -> str:
    """``trace_id`` if it is a short safe token (it becomes part of a file name), else raise."""
    if not isinstance(trace_id, str) or not _TRACE_ID.fullmatch(trace_id):
        raise BadTraceRequest(
            f"id {_show(trace_id)} is not 1-64 letters, digits, '-' or '_' (starting with a "
            "letter or digit)"
        )
    return trace_id


def check_seconds(seconds: Any) -> float:
    """``seconds`` as a float if it is a finite number in (0, MAX_TRACE_SECONDS], else raise."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise BadTraceRequest(f"seconds {_show(seconds)} is not a number")
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TRACE_SECONDS:
        raise BadTraceRequest(
            f"seconds {_show(seconds)} is not a finite number in (0, {MAX_TRACE_SECONDS:g}]"
        )
    return float(seconds)


def check_dir_text(out_dir: Any) -> str:
    """``out_dir`` if it is text a trace folder may be named by (no ``..`` part), else raise."""
    if not isinstance(out_dir, str) or not out_dir or len(out_dir) > _MAX_DIR_CHARS:
        raise BadTraceRequest(f"dir {_show(out_dir)} is not a path of 1-{_MAX_DIR_CHARS} chars")
    if "\x00" in out_dir:
        raise BadTraceRequest(f"dir {_show(out_dir)} holds a NUL byte")
    if ".." in re.split(r"[/\\]", out_dir):
        raise BadTraceRequest(f"dir {_show(out_dir)} has a '..' part")
    return out_dir


def check_trace_request(obj: Any) -> TraceRequest:
    """The request in ``obj`` (parsed ``trace_request.json``), every field checked; raises
    ``BadTraceRequest`` naming the first field that fails. ``dir`` defaults to ``traces``
    (inside the run folder); where it resolves is checked when the trace starts."""
    if not isinstance(obj, dict):
        raise BadTraceRequest(f"request is a JSON {type(obj).__name__}, not an object")
    extra = set(obj) - _REQUEST_KEYS
    if extra:
        raise BadTraceRequest(f"unknown key(s) {_show(sorted(extra))}; known: id, seconds, dir")
    for key in ("id", "seconds"):
        if key not in obj:
            raise BadTraceRequest(f"request has no {key!r}")
    return TraceRequest(
        id=check_trace_id(obj["id"]),
        seconds=check_seconds(obj["seconds"]),
        dir=check_dir_text(obj.get("dir", DEFAULT_TRACE_SUBDIR)),
    )


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _fd_path(fd: int) -> str | None:
    """The path the kernel holds for an open folder (Linux), or None where it is not known."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _open_dir_within(real: str, roots: tuple[str, ...]) -> int:
    """Create ``real`` (already resolved and checked) and open it; verify the handle is still
    inside a root (a component swapped for a symlink between the check and here is caught)."""
    os.makedirs(real, exist_ok=True)
    fd = os.open(real, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    try:
        held = _fd_path(fd)
        if held is None:  # no /proc: the handle must be the folder the checked path names
            st, fst = os.stat(real), os.fstat(fd)
            ok = (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
        else:
            ok = any(_within(held, root) for root in roots)
        if not ok:
            raise BadTraceRequest(f"dir {real!r} changed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _exists_at(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


class TraceSink:
    """Records the events of one time window into a trace file, then detaches itself.

    The file is written as ``<name>.partial`` and given its name when the window ends, by a
    hard link that fails if the name is taken: an existing file is never replaced. Errors
    after it starts (a full disk) end the trace and are kept in ``error``; they never reach
    the op that delivered the events.
    """

    def __init__(
        self,
        ic: Any,
        path: str,
        seconds: float,
        rank: int,
        world: int,
        dir_fd: int | None = None,
    ) -> None:
        self.ic = ic
        self.path = path
        self.start_ns = time.perf_counter_ns()
        self.end_ns = self.start_ns + int(seconds * 1e9)
        self.done = False
        self.error: str | None = None
        self._name = os.path.basename(path)
        self._tmp = f"{self._name}.partial"
        if dir_fd is None:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            dir_fd = os.open(folder, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        self._dir_fd = dir_fd
        try:
            if _exists_at(self._name, dir_fd):
                raise FileExistsError(errno.EEXIST, "exists, not overwriting it", path)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
            fd = os.open(self._tmp, flags, 0o644, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        self._file: Any = os.fdopen(fd, "w", encoding="utf-8")
        self._fmt = _Formatter(rank, ic.origin_ns)
        self._write(header(rank, world, ic.origin_unix_ns, ic.level))

    def _write(self, text: str) -> None:
        try:
            self._file.write(text)
        except (OSError, ValueError) as e:
            self._fail(f"writing {self.path}.partial: {e}")

    def _fail(self, why: str) -> None:
        self.error = why
        self.done = True
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self._tmp, dir_fd=self._dir_fd)
        except OSError:
            pass
        os.close(self._dir_fd)

    def on_events(self, events: list[OpEvent]) -> None:
        if self.done:
            return
        keep = [e for e in events if self.start_ns <= e.t0_ns <= self.end_ns]
        if keep:
            self._write(self._fmt.lines(keep))
        if events and events[-1].t0_ns > self.end_ns:
            self.close()

    def flush(self) -> None:
        if not self.done and time.perf_counter_ns() > self.end_ns:
            self.close()

    def close(self) -> None:
        """End the window: give the file its name unless something took the name meanwhile."""
        if self.done:
            return
        self.done = True
        fd = self._dir_fd
        try:
            self._file.close()
            try:
                os.link(self._tmp, self._name, src_dir_fd=fd, dst_dir_fd=fd)
            except FileExistsError:
                self.error = f"{self.path} appeared while tracing; kept ours as .partial"
                return
            except OSError:  # no hard links here (some network/FUSE folders): check, rename
                if _exists_at(self._name, fd):
                    self.error = f"{self.path} appeared while tracing; kept ours as .partial"
                    return
                os.rename(self._tmp, self._name, src_dir_fd=fd, dst_dir_fd=fd)
                return
            os.unlink(self._tmp, dir_fd=fd)
        except OSError as e:
            self.error = f"finishing {self.path}: {e}"
        finally:
            os.close(fd)


class RunDirPublisher:
    """Publishes ``rank<r>.json`` each tick and starts traces that ``scripts.trace`` requests.

    ``trace_dir`` (default: ``GT_TRACE_DIR`` as the job started) is the one folder besides the
    run folder that requests may write traces into.
    """

    def __init__(
        self,
        ic: Any,
        stats: StatsSink,
        run_dir: str,
        rank: int,
        world: int,
        trace_dir: str | None = None,
    ) -> None:
        self.ic, self.stats, self.run_dir = ic, stats, run_dir
        self.rank, self.world = rank, world
        os.makedirs(run_dir, exist_ok=True)
        self.real_run_dir = os.path.realpath(run_dir)
        trace_dir = trace_dir if trace_dir is not None else _env.text("GT_TRACE_DIR")
        roots = [self.real_run_dir]
        if trace_dir:
            roots.append(os.path.realpath(trace_dir))
        self.trace_roots = tuple(roots)
        self.path = status_path(run_dir, rank)
        self.trace_state: dict[str, Any] | None = None
        self._warned: set[str] = set()
        self._last = (time.time(), 0, 0, 0, dict(stats.time_ns_by_kind))
        # A request still inside its window when this rank starts is taken on the first tick
        # (ranks start at different moments); an expired or invalid one is history.
        self._request_key = None if self._request_live() else self._request_key_now()
        self._trace: TraceSink | None = None
        self.start_unix = time.time()
        self.publish()

    # -- reporting --------------------------------------------------------------------------
    def _warn(self, msg: str) -> None:
        print(f"[gt r{self.rank} trace] {msg}", file=sys.stderr, flush=True)

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            self._warn(msg)

    # -- the request file -------------------------------------------------------------------
    def _request_key_now(self) -> tuple[int, int, int] | None:
        try:
            st = os.lstat(os.path.join(self.run_dir, TRACE_REQUEST))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read_request(self) -> tuple[TraceRequest, float]:
        """The request and its mtime. Opened without following a symlink and without blocking
        (a FIFO planted there must not hang the job), read only if a small regular file."""
        path = os.path.join(self.run_dir, TRACE_REQUEST)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as e:
            raise BadTraceRequest(f"cannot open it ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadTraceRequest("it is not a regular file")
            if st.st_size > _MAX_REQUEST_BYTES:
                raise BadTraceRequest(f"it is over {_MAX_REQUEST_BYTES} bytes")
            data = os.read(fd, _MAX_REQUEST_BYTES + 1)
        finally:
            os.close(fd)
        try:
            obj = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise BadTraceRequest(f"it is not JSON ({str(e)[:80]})") from None
        return check_trace_request(obj), st.st_mtime

    def _request_live(self) -> bool:
        try:
            req, mtime = self._read_request()
        except (BadTraceRequest, OSError):
            return False
        return time.time() < mtime + req.seconds

    # -- ticks ------------------------------------------------------------------------------
    def publish(self) -> None:
        """Write this rank's status: totals, and rates/time shares since the last publish."""
        s = self.stats
        now = time.time()
        t_last, ops_last, busy_last, coll_last, kinds_last = self._last
        interval = max(now - t_last, 1e-6)
        ops = s.total
        coll = sum(s.collectives.values())
        shares = {
            k: (v - kinds_last.get(k, 0)) * 1e-9 / interval
            for k, v in s.time_ns_by_kind.items()
            if v - kinds_last.get(k, 0) > 0
        }
        busy = min((s.busy_ns - busy_last) * 1e-9 / interval, 1.0)
        status = {
            "rank": self.rank,
            "world": self.world,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_unix": self.start_unix,
            "updated_unix": now,
            "interval_s": interval,
            "ops_total": ops,
            "ops_per_s": (ops - ops_last) / interval,
            "busy_frac": busy,
            "idle_frac": max(0.0, 1.0 - busy),
            "time_share": shares,
            "collectives_total": coll,
            "collectives_per_s": (coll - coll_last) / interval,
            "collective_bytes": s.collective_bytes,
            # collectives and bytes per mesh dim so far (``top``'s last column on a 2-D mesh)
            "collectives_by_group": dict(getattr(s, "by_group", {})),
            "collective_bytes_by_group": dict(getattr(s, "bytes_by_group", {})),
            "phase": self.ic.phase,
            "level": self.ic.level,
            "trace_dirs": list(self.trace_roots),
            "trace": self.trace_state,
        }
        write_json_atomic(self.path, status)
        self._last = (now, ops, s.busy_ns, coll, dict(s.time_ns_by_kind))

    def tick(self) -> None:
        """Publish, take a new trace request, retire a finished trace. Called between user ops
        (~once a second): whatever goes wrong here is reported, never raised into the op."""
        try:
            self._retire_trace()
            self._take_request()
        except Exception as e:  # a bug here must not kill the user's program either
            self._warn_once(f"trace handling failed: {type(e).__name__}: {e}")
        try:
            self.publish()
        except Exception as e:
            self._warn_once(f"cannot publish status to {self.path}: {e}")

    def _take_request(self) -> None:
        key = self._request_key_now()
        if key is None or key == self._request_key:
            return
        self._request_key = key  # once per request: a rewrite makes a new key
        trace_id = None
        try:
            req, _ = self._read_request()
            trace_id = req.id
            path = self.start_trace(req.id, req.seconds, req.dir)
        except (BadTraceRequest, OSError) as e:
            reason = str(e) if isinstance(e, BadTraceRequest) else f"{e.strerror}: {e.filename}"
            self.trace_state = {"id": trace_id, "state": "rejected", "detail": reason}
            self._warn(f"ignored the trace request in {self.run_dir}: {reason}")
            return
        self.trace_state = {"id": req.id, "state": "recording", "detail": path}

    def _retire_trace(self) -> None:
        t = self._trace
        if t is None or not t.done:
            return
        self.ic.remove_sink(t)
        self._trace = None
        state = self.trace_state or {}
        if t.error:
            self._warn(f"trace {state.get('id')} failed: {t.error}")
            self.trace_state = {**state, "state": "failed", "detail": t.error}
        else:
            self.trace_state = {**state, "state": "written", "detail": t.path}

    def resolve_trace_dir(self, out_dir: str) -> str:
        """The real folder ``out_dir`` names (relative: to the run folder), if it is inside the
        run folder or the trace folder named at start; raises ``BadTraceRequest`` otherwise."""
        check_dir_text(out_dir)
        base = out_dir if os.path.isabs(out_dir) else os.path.join(self.real_run_dir, out_dir)
        real = os.path.realpath(base)
        if not any(_within(real, root) for root in self.trace_roots):
            raise BadTraceRequest(
                f"dir {_show(out_dir)} resolves to {real!r}, outside the run folder"
                + (" and GT_TRACE_DIR" if len(self.trace_roots) > 1 else "")
                + " (set GT_TRACE_DIR when starting the job to allow another folder)"
            )
        return real

    def start_trace(self, trace_id: str, seconds: float, out_dir: str) -> str:
        """Record the next ``seconds`` of this rank's events into ``out_dir``; returns the path.

        Every argument is checked as a request's fields are (``BadTraceRequest``); a file of
        that name already there is an error (``FileExistsError``), never replaced.
        """
        check_trace_id(trace_id)
        seconds = check_seconds(seconds)
        real = self.resolve_trace_dir(out_dir)
        dir_fd = _open_dir_within(real, self.trace_roots)
        path = os.path.join(real, f"trace_{trace_id}.rank{self.rank}.log")
        sink = TraceSink(self.ic, path, seconds, self.rank, self.world, dir_fd=dir_fd)
        if self._trace is not None:  # a new request replaces the running window
            self._trace.close()
            self._retire_trace()
        self._trace = sink
        self.ic.add_sink(sink)
        return path

    def close(self) -> None:
        """End a running trace (its file keeps what was recorded) and publish a last time."""
        try:
            if self._trace is not None:
                self._trace.close()
                self._retire_trace()
        except Exception as e:
            self._warn_once(f"trace handling failed: {type(e).__name__}: {e}")
        try:
            self.publish()
        except Exception as e:
            self._warn_once(f"cannot publish status to {self.path}: {e}")
