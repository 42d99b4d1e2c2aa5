"""Start N ranks of a benchmark on this machine, collect what rank 0 returns, stop them all.

``run_ranks(fn, world, *args, device="cpu", threads=1)`` starts ``world`` processes with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``); each runs ``spmdgt.init()`` (which joins
the process group as it does under torchrun: gloo on the CPU, NCCL with one GPU per rank),
then ``fn(rank, world, *args)``, then ``spmdgt.runtime.shutdown()``, and sends its return value
or its traceback back. CPU ranks are forked (~0.1 s each) and kept off any GPU
(``GT_DEVICE=cpu``); CUDA ranks are spawned (a forked child cannot use CUDA).

A rank that raises fails the run with its traceback, and the other ranks (likely waiting for it
in a collective) are given ``grace`` seconds and then killed; a run past ``timeout`` seconds is
killed and the ranks still running are named. Either way :class:`RankError` is raised and no
rank is left behind, also on Ctrl-C.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

__all__ = ["RankError", "free_port", "run_ranks"]


class RankError(RuntimeError):
    """A rank failed, died or ran past the timeout; the message holds each rank's story."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, device: str, threads: int) -> dict[str, str]:
    """torchrun's variables for one rank, its device choice and its thread count."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GT_DEVICE": device,
        "OMP_NUM_THREADS": str(threads),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }


def _child(fn, rank, world, port, device, threads, env, args, conn) -> None:
    try:
        os.environ.update(env)
        os.environ.update(rank_env(rank, world, port, device, threads))
        import torch

        torch.set_num_threads(threads)
        import spmdgt

        spmdgt.init()
        result = fn(rank, world, *args)
        spmdgt.runtime.shutdown()
        conn.send(("ok", result))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    device: str = "cpu",
    threads: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
    grace: float = 10.0,
    start: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` new ranks; return every rank's result.

    ``device``: ``"cpu"`` (forked gloo ranks, ``threads`` torch threads each) or ``"cuda"``
    (spawned NCCL ranks, rank r on GPU r). ``env``: more variables for every rank. ``start``
    overrides how ranks start (``"spawn"`` where this process may have touched CUDA: a forked
    child of such a process cannot run torch's CUDA-aware code paths; ``fn`` must then be
    importable by name)."""
    how = start or ("spawn" if device == "cuda" else "fork")
    if how == "fork":
        _preload()
    ctx = mp.get_context(how)
    port = free_port()
    procs: list = []
    conns: dict = {}
    try:
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world, port, device, threads, env or {}, args, child),
                daemon=True,
                name=f"rank{rank}",
            )
            p.start()
            child.close()
            procs.append(p)
            conns[parent] = rank
        return _collect(procs, conns, timeout, grace)
    finally:
        for p in procs:  # never leave a rank behind (an error, a timeout, Ctrl-C)
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _preload() -> None:
    """Import torch, DTensor and spmdgt here, once, before forking: every forked rank then
    starts with them loaded, where each would import them itself (~2.5-3 s a rank on 2 cores,
    the ranks' imports contending, and again for every ``run_ranks`` call). Nothing is
    initialised: no process group, no thread pool, no device."""
    import torch.distributed.tensor  # noqa: F401

    import spmdgt  # noqa: F401


def _collect(procs: list, conns: dict, timeout: float, grace: float) -> list[Any]:
    """Wait for every rank's answer; on the first failure, ``grace`` more seconds for the rest."""
    world = len(procs)
    results: list[Any] = [None] * world
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for conn in wait(list(pending), timeout=left):
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                procs[rank].join(timeout=5)
                status = "error"
                payload = f"rank {rank} died without a result (exit code {procs[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + grace)
    for rank in sorted(pending.values()):
        if errors:
            errors[rank] = f"rank {rank} still running {grace:.0f} s after another rank failed"
        else:
            errors[rank] = f"rank {rank} timed out after {timeout:.0f} s (a hang?)"
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{errors[r].rstrip()}" for r in sorted(errors))
        raise RankError(f"{len(errors)} of {world} ranks failed:\n{text}")
    return results
