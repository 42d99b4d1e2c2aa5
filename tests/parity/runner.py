"""Run cases on N forked gloo ranks, in lockstep, surviving hangs and crashes.

The parent forks N ranks once per chunk of cases (they inherit the cases, samples included,
so no tensor is sent to them) and drives them case by case over pipes:

    parent: case i  ->  each rank runs a stage, answers (error, signature)
    parent: go/stop ->  on go every rank fetches global values (collectives), sends them
    ... for forward, then backward; then each rank all-reduces the case number (a check that
    the group is still in step) and says done.

Deciding "go" in the parent means no rank enters a collective that another rank skips, so
"one rank raised, another returned" is reported as such instead of as a hang. A case with a
silent rank after ``timeout`` seconds is a ``hang``, one whose rank died a ``crash``: the
ranks are killed and a fresh group picks up at the next case.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import re
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._dist import frozen_heap
from tests.parity.observe import STAGES, Stage, describe, observe

__all__ = ["CaseRun", "run_cases"]

_READY_TIMEOUT = 90.0  # forking, joining the group, building meshes; 2 shared cores
# A silent rank whose CPU time still moves is computing, not waiting (DTensor enumerating
# strategies can take 20 s on a loaded 2-core machine): its case gets more time, in steps of
# the timeout, up to this many timeouts in all. A rank that waits in a collective or sleeps
# uses (next to) no CPU, so a real hang is still called after one timeout.
_SLOW_LIMIT = 10
_BUSY = 0.2  # share of one core a silent rank must use to count as computing
_CHUNK = 400  # cases per group: a fresh group now and then keeps leaks from piling up


@dataclass
class CaseRun:
    """What the ranks did with one case: ``status`` ok, hang or crash (``note`` says how);
    ``path`` the dearest path any rank's op took (``spmdgt.tensor._paths``; "" if unknown)."""

    status: str
    observations: list[dict[str, Stage]] = field(default_factory=list)
    note: str = ""
    path: str = ""


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of process ``pid`` so far, from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Clock:
    """One case's time: ``timeout`` seconds, extended while a silent rank computes."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.limit = self.start + _SLOW_LIMIT * timeout
        self.marks: dict[int, tuple[float, float]] = {}  # pid -> (wall, cpu) last looked at

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def mark(self, pids: list[int]) -> None:
        now = time.monotonic()
        for pid in pids:
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                self.marks[pid] = (now, cpu)

    def busy(self, pids: list[int]) -> bool:
        """Did any of ``pids`` use CPU since it was last looked at? (Looks again now.)"""
        now, busy = time.monotonic(), False
        for pid in pids:
            cpu = _cpu_seconds(pid)
            wall0, cpu0 = self.marks.get(pid, (self.start, None))
            if cpu is not None and cpu0 is not None and cpu - cpu0 >= _BUSY * (now - wall0):
                busy = True
            if cpu is not None:
                self.marks[pid] = (now, cpu)
        return busy

    def extend(self) -> bool:
        """More time for a computing rank, unless the case reached its limit."""
        if time.monotonic() >= self.limit:
            return False
        self.deadline = min(self.limit, time.monotonic() + self.timeout)
        return True

    def spent(self) -> float:
        return time.monotonic() - self.start


class _Lost(Exception):
    def __init__(self, status: str, note: str):
        super().__init__(note)
        self.status, self.note = status, note


# -- rank side ---------------------------------------------------------------------------


class _RankChannel:
    def __init__(self, conn):
        self.conn = conn

    def stage(self, name: str, error: str | None, signature: tuple) -> bool:
        self.conn.send(("stage", name, error, signature))
        return self.conn.recv()

    def values(self, name: str, values: list | None, error: str | None) -> None:
        payload = None
        if values is not None:
            try:
                payload = pickle.dumps(values)
            except Exception as e:
                error = error or f"cannot send the value: {describe(e)}"
        self.conn.send(("values", name, payload, error))


def _rank_main(rank, world, init_file, conn, cases, log_path, gloo_timeout) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # Stacks to the log on a crash, and on SIGUSR1: the parent asks a silent rank where it is.
    # The log is named outright: under pytest, sys.stderr is a capture file, not fd 2.
    log = os.fdopen(os.dup(fd), "w")
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    try:
        from tests._dist import rank_env, reset_spmdgt

        os.environ.update(rank_env(rank, world))
        import warnings

        import torch
        import torch.distributed as dist

        from spmdgt.tensor._meshes import mesh_for
        from spmdgt.tensor._paths import watch, worst
        from spmdgt.tensor._tensor import global_value
        from tests.parity.layouts import (
            MESH_2D,
            PLACEMENTS,
            PLACEMENTS_AUDIT,
            fits,
            rank_layout,
            sub_mesh_ranks,
        )

        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        reset_spmdgt()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=gloo_timeout),
        )
        mesh_for(None)  # every rank builds the meshes, in the same order, before any case
        mesh_for(sub_mesh_ranks(world))
        if fits("mesh_s0s1", world):  # the 2x2 mesh of the 2-D layouts, at world 4 only
            from spmdgt.tensor._meshes import named_mesh

            named_mesh(MESH_2D)
        every = PLACEMENTS + PLACEMENTS_AUDIT
        layouts = {p: rank_layout(p, world) for p in every if fits(p, world)}
        channel = _RankChannel(conn)

        def fetch(t):
            return global_value(t).clone()

        conn.send(("ready",))
        while (i := conn.recv()) is not None:
            case = cases[i]
            torch.manual_seed(case.seed)
            watches = observe(case.job, layouts[case.key.placement], fetch, channel, watch)
            path = worst(w.path for w in watches)
            check = torch.tensor([float(i), 1.0])
            dist.all_reduce(check)
            conn.send(("done", check.tolist() == [float(i * world), float(world)], path))
    except BaseException:
        try:
            conn.send(("fatal", traceback.format_exc()))
        except Exception:
            pass
    finally:
        os._exit(0)  # no teardown: a destroyed group can block on peers that are gone


# -- parent side -------------------------------------------------------------------------


class _Group:
    """N forked ranks in one fresh gloo group (``file://`` rendezvous in ``tmp``)."""

    def __init__(self, world: int, cases: list, tmp: Path, serial: int, gloo_timeout: float):
        ctx = mp.get_context("fork")  # inherit the cases; CPU only, so forking is safe
        self.world = world
        self.logs = [tmp / f"w{world}-g{serial}-rank{r}.log" for r in range(world)]
        init_file = tmp / f"rdzv-w{world}-g{serial}"
        self.procs, self.conns = [], []
        with frozen_heap():  # the ranks' gc leaves the inherited heap (OpInfo's db) alone
            for r in range(world):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_rank_main,
                    args=(r, world, str(init_file), child, cases, str(self.logs[r]), gloo_timeout),
                    daemon=True,
                )
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)

    def send_all(self, msg: Any) -> None:
        for c in self.conns:
            c.send(msg)

    def gather(self, clock: _Clock, stage: str) -> list:
        """One message from every rank, or ``_Lost`` naming who went silent or died. A silent
        rank that is computing (its CPU time moves) gets more time, up to the clock's limit."""
        got: list = [None] * self.world
        pending = {c: r for r, c in enumerate(self.conns)}
        clock.mark([p.pid for p in self.procs])
        while pending:
            ready = mpc.wait(list(pending), timeout=clock.left())
            if not ready:
                silent = sorted(pending.values())
                if clock.busy([self.procs[r].pid for r in silent]) and clock.extend():
                    continue
                where = self._where(silent[0], ask=True)
                busy = " (computing all along: the limit)" if clock.spent() > clock.timeout else ""
                raise _Lost(
                    "hang",
                    f"{_ranks(silent)} silent in {stage} after {clock.spent():.0f} s{busy}"
                    + (f" ({where})" if where else "")
                    + _others(got),
                )
            for c in ready:
                r = pending.pop(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    raise _Lost("crash", self._death(r, stage)) from None
                if msg[0] == "fatal":
                    last = msg[1].strip().splitlines()[-1]
                    raise _Lost("crash", f"rank {r} failed in {stage}: {last[:160]}")
                got[r] = msg
        return got

    def _death(self, r: int, stage: str) -> str:
        p = self.procs[r]
        p.join(2)
        code = p.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        where = self._where(r, ask=False)
        if not where:
            lines = [ln for ln in self._log(r).splitlines() if ln.strip()]
            where = lines[-1].strip()[:160] if lines else ""
        return f"rank {r} died ({how}) in {stage}" + (f": {where}" if where else "")

    def _log(self, r: int) -> str:
        try:
            return self.logs[r].read_text(errors="replace")
        except OSError:
            return ""

    def _where(self, r: int, ask: bool) -> str:
        """Where rank ``r`` is (or died), from the stack faulthandler wrote to its log."""
        if ask:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)  # our own child
            except OSError:
                return ""
            time.sleep(0.5)
        return _frames(self._log(r))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # our own child, by its process object
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def _frames(log: str) -> str:
    """The innermost frame of the rank's main thread in the last stack dump of ``log``, and
    the innermost spmdgt and sweep frames under it: enough to see what blocked or died."""
    blocks = [b for b in log.split("(most recent call first):") if "_rank_main" in b]
    if not blocks:
        return ""
    frames = _FRAME.findall(blocks[-1].split("\n\n")[0])
    if not frames:
        return ""

    def short(path: str, line: str, fn: str) -> str:
        path = path.rsplit("site-packages/", 1)[-1]
        path = re.sub(r".*/(spmdgt|tests)/", r"\1/", path)
        return f"{fn} {path}:{line}"

    picked = [frames[0]]
    for needle in ("/spmdgt/", "/tests/parity/"):
        hit = next((f for f in frames if needle in f[0]), None)
        if hit is not None and hit not in picked:
            picked.append(hit)
    return "at " + " < ".join(short(*f) for f in picked)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _others(got: list) -> str:
    said = []
    for r, msg in enumerate(got):
        if msg is not None and msg[0] == "stage":
            said.append(f"rank {r} raised {msg[2]}" if msg[2] else f"rank {r} went on")
    return ("; " + "; ".join(said)) if said else ""


def _drive(group: _Group, i: int, timeout: float) -> CaseRun:
    clock = _Clock(timeout)
    obs: list[dict[str, Stage]] = [{} for _ in range(group.world)]
    group.send_all(i)
    for stage in STAGES:
        msgs = group.gather(clock, stage)
        for r, (_, name, error, sig) in enumerate(msgs):
            obs[r][name] = Stage(name, error, sig)
        go = all(m[2] is None for m in msgs) and len({m[3] for m in msgs}) == 1
        group.send_all(go)
        if not go:
            break
        msgs = group.gather(clock, f"{stage} (fetching global values)")
        for r, (_, name, payload, error) in enumerate(msgs):
            st = obs[r][name]
            try:
                st.values = pickle.loads(payload) if payload is not None else None
            except Exception as e:
                error = error or f"cannot read the value: {describe(e)}"
            st.error = st.error or error
    done = group.gather(clock, "the post-case check")
    if not all(m[1] for m in done):
        return CaseRun("disagree", obs, "ranks out of step after the case (unmatched collectives)")
    from spmdgt.tensor._paths import worst  # loaded in the parent already (run_cases)

    return CaseRun("ok", obs, path=worst(m[2] for m in done))


def run_cases(
    cases: list,
    world: int,
    *,
    timeout: float = 20.0,
    on_result: Callable[[int, CaseRun], None] | None = None,
    skip: Callable[[int], bool] | None = None,
) -> list[CaseRun | None]:
    """Run ``cases`` (all of world size ``world``) on ``world`` forked ranks; one CaseRun each
    (None for a case ``skip`` turned down when its turn came).

    A hang or crash kills the group; a new one continues from the next case. Aborts if a
    fresh group cannot even start twice in a row (spmdgt does not import, say).
    """
    # Import spmdgt here, once: every group forks the same code (and skips the import).
    import spmdgt.tensor._meshes
    import spmdgt.tensor._placement
    import spmdgt.tensor._tensor  # noqa: F401
    import tests._dist  # noqa: F401

    results: list[CaseRun | None] = []
    # PARITY_LOGS=DIR (``--keep-logs``) keeps every rank's log there (w<world>-g<group>-
    # rank<r>.log; with GT_DEBUG_COMPILE=1 and the like, what each rank did before a hang)
    keep = os.environ.get("PARITY_LOGS")
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gt-parity-"))
    tmp.mkdir(parents=True, exist_ok=True)
    # longer than a computing case may take: the parent, not gloo, calls the hang
    gloo_timeout = max((_SLOW_LIMIT + 2) * timeout, 60.0)
    group, serial, failed_starts, in_group = None, 0, 0, 0
    i = 0
    try:
        while i < len(cases):
            if skip is not None and skip(i):
                results.append(None)
                i += 1
                continue
            if group is None:
                serial += 1
                group = _Group(world, cases, tmp, serial, gloo_timeout)
                try:
                    group.gather(_Clock(_READY_TIMEOUT), "start-up")
                except _Lost as e:
                    group.kill()
                    group = None
                    failed_starts += 1
                    if failed_starts >= 2:
                        raise RuntimeError(f"{world} ranks cannot start: {e.note}") from None
                    continue
                failed_starts, in_group = 0, 0
            try:
                run = _drive(group, i, timeout)
            except _Lost as e:
                where = f" [logs: {tmp}/w{world}-g{serial}-rank*.log]" if keep else ""
                run = CaseRun(e.status, [], e.note + where)
                group.kill()
                group = None
            results.append(run)
            if on_result is not None:
                on_result(i, run)
            i += 1
            in_group += 1
            if group is not None and (run.status != "ok" or in_group >= _CHUNK):
                group.close()
                group = None
    finally:
        if group is not None:
            group.close()
        if not keep:
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return results
