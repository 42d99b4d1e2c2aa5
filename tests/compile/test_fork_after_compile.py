"""A process forked after its parent compiled can compile: the test and benchmark ranks are
forked from a parent that may have run inductor (``bench_compile.py --both`` ran three
compiled cases and then forked its ``scope2`` ranks, which hung in their first compile)."""

from __future__ import annotations

import multiprocessing as mp

import spmdgt  # noqa: F401  (its after-fork hooks are what is tested)


def _compile_pool_runs(conn) -> None:
    from concurrent.futures import TimeoutError as FutureTimeout

    from torch._inductor.async_compile import AsyncCompile

    try:
        conn.send(AsyncCompile.pool().submit(int, "7").result(timeout=20))
    except FutureTimeout:
        conn.send("no thread ran the child's compile job")
    conn.close()


def test_a_child_forked_after_its_parent_compiled_runs_its_own_compile_jobs() -> None:
    from torch._inductor import async_compile, config

    before = config.compile_threads
    config.compile_threads = 2  # as inductor decides on a 2-core machine
    async_compile.AsyncCompile.pool.cache_clear()
    try:
        pool = async_compile.AsyncCompile.pool()  # the parent's compile threads, started
        assert pool.submit(int, "3").result(timeout=20) == 3
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_compile_pool_runs, args=(theirs,))
        child.start()
        assert ours.poll(60), "the forked child neither ran nor gave up on its compile job"
        assert ours.recv() == 7
        child.join(30)
        assert child.exitcode == 0
    finally:
        async_compile.AsyncCompile.pool().shutdown()
        async_compile.AsyncCompile.pool.cache_clear()
        config.compile_threads = before
