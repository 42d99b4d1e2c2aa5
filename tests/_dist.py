"""A fresh N-rank gloo group per test (forked; spawned where CUDA is), ``file://`` rendezvous.

``run_ranks(fn, world_size, tmp_path, *args)`` forks ``world_size`` children; each joins the
group, runs ``fn(rank, world_size, *args)`` and sends back its return value or traceback. A
failure on any rank fails the test with that rank's traceback; a rank that hangs is killed at
``timeout`` seconds and named, so a broken collective never hangs the suite.

Ranks are daemonic by default (``multiprocessing`` kills them if the test process dies), and a
daemonic process may not start children: ``OptimizedDataLoader`` then picks 0 workers, the same
on every machine. ``daemon=False`` starts ranks as torchrun does, able to run DataLoader
workers; every rank still alive when ``run_ranks`` returns or raises is killed either way.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path


def _context():
    """Fork (~0.1 s a rank) on a machine without CUDA; spawn (seconds a rank) where CUDA is
    present. Once the test process has touched CUDA in any way (AdamW's step asks whether a
    graph is being captured, which starts the CUDA runtime without ``torch.cuda`` knowing), a
    forked child fails at its first CUDA call, and AdamW makes one on the CPU too. Seen on an
    H200 machine; CI has no GPU and keeps forking. ``GT_TEST_START=spawn`` forces spawning."""
    import torch

    if os.environ.get("GT_TEST_START") == "spawn" or torch.cuda.is_available():
        return mp.get_context("spawn")
    return mp.get_context("fork")


def reset_spmdgt() -> None:
    """Forget the parent's rank, process group, meshes, signals and scopes (``spmdgt.session``).

    The tools (interceptor, compile pass) stay as the parent's ``import spmdgt`` set them
    from the environment, as a torchrun rank's own import would: turning them off here would
    flush the parent's buffered log lines a second time and leave ``GT_AUTO_COMPILE`` runs
    without the pass."""
    import spmdgt

    spmdgt.session.reset("runtime", "meshes", "signals", "scopes")


def rank_env(rank: int, world: int) -> dict[str, str]:
    """The environment a forked test rank runs with: torchrun's variables, one inductor
    compile thread (a cold compile in a forked child can hang otherwise), and CPU gloo ranks,
    also on a GPU machine (a forked child cannot use its parent's CUDA)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "GT_DEVICE": "cpu",
    }


def _child(fn, rank, world, init_file, env, args, conn) -> None:
    try:
        os.environ.update(env)
        os.environ.update(rank_env(rank, world))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        reset_spmdgt()
        torch.seed()  # a fresh process: torch seeds each one at random, as torchrun's are
        import random

        import numpy as np

        np.random.seed()  # and so do numpy's global stream and Python's random (a fork copies
        random.seed()  # the parent's state: the ranks would agree for free)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        import spmdgt

        spmdgt.init()  # what `import spmdgt` under torchrun gives: the ranks' generators agree
        try:
            result = fn(rank, world, *args)
        finally:
            import spmdgt.runtime._state as state

            state._owns_process_group = True
            state.shutdown()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_ranks(
    fn: Callable,
    world_size: int,
    tmp_path: Path,
    *args,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    daemon: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results.

    ``daemon=False`` starts non-daemonic ranks (they may start DataLoader workers)."""
    procs: list = []
    try:
        return _run(fn, world_size, tmp_path, args, env, timeout, daemon, procs)
    finally:
        for p in procs:  # a rank left running (an error here, a timeout, ^C): never orphaned
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def _warm() -> None:
    """Import in this (the test) process what every rank imports, once, before forking.

    A forked rank inherits its parent's modules. The test process itself rarely touches the
    tensor layer or the trainer, so without this each rank of each test imported them again
    (with what torch loads behind them: ~3.5 s of CPU per rank on a 2-core machine, ~2/3 of a
    small test's cost). That includes ``gt.Tensor`` and the compile hooks it installs in
    dynamo, which outlive a test process's own ``torch._dynamo.reset()`` (they did not once,
    and a 2-D hot function's compiled loss came out doubled: ``tests/compile/
    test_dynamo_reset.py``). ``numpy.random`` too, which each rank reseeds. Harmless where
    ranks are spawned."""

    import numpy.random  # noqa: F401

    import spmdgt.tensor._tensor
    import spmdgt.train  # noqa: F401


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Fork children inside this: the parent's objects sit in gc's permanent generation
    while they fork (``gc.freeze``), and are back to normal in the parent after.

    A forked child's gc (``spmdgt.shutdown`` runs two full collections, and a busy rank runs
    its own) then skips what it inherited instead of walking the parent's whole heap and so
    copying it page by page: a 2-rank run that does nothing cost ~0.9 s of CPU, ~0.1 s
    with the heap frozen (more, the bigger the test process: torch's OpInfo database)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run(fn, world_size, tmp_path, args, env, timeout, daemon, procs) -> list:
    _warm()
    init_file = Path(tmp_path) / f"rdzv-{os.getpid()}-{id(fn)}-{len(os.listdir(tmp_path))}"
    conns = []
    ctx = _context()
    with frozen_heap():
        _start_ranks(fn, world_size, init_file, env, args, daemon, ctx, procs, conns)
    results, errors = [None] * world_size, []
    for rank, (p, conn) in enumerate(zip(procs, conns)):
        if conn.poll(timeout):
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", f"rank {rank} died without a result"
        else:
            status, payload = "error", f"rank {rank} timed out after {timeout:.0f}s (hang?)"
            for q in procs:
                q.kill()
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return results


def _start_ranks(fn, world_size, init_file, env, args, daemon, ctx, procs, conns) -> None:
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, str(init_file), env or {}, args, child),
            daemon=daemon,
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
