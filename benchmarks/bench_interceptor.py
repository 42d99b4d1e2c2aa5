"""Cost of the interceptor on the small-op loop ``c = c*b + a`` (64x64, 1 CPU thread).

    python benchmarks/bench_interceptor.py [--iters 20000] [--repeats 5]

Prints, side by side in one process, microseconds per op (best of ``repeats``) for:
plain torch; the interceptor imported but off (must equal plain: nothing is pushed); the
instruction log alone, stats alone, and log + stats (what ``GT_INSTRUCTION_LOG`` turns on) at
each level (``torch``, ``aten``, ``kineto``); and, for reference, a bare ``TorchDispatchMode``,
a bare ``TorchFunctionMode`` that only call the op, and torch's profiler (``kineto`` recording
alone: the window is stopped but its events are not converted). The issue's bar: log on <= 2x
plain.

Every timed region ends with a flush (``drain``): the ``kineto`` level converts its events
only at flush points, so leaving that out would hide most of its cost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import spmdgt.interceptor as interceptor


class _BareDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _BareFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _ProfilerOnly:
    """The kineto level's recording without its conversion: enable, and disable at exit."""

    def __enter__(self) -> None:
        from spmdgt.interceptor import _kineto

        self.backend = _kineto.KinetoBackend(None)
        cfg = self.backend._config()
        _kineto._prepare_profiler(cfg, _kineto._ACTIVITIES)
        _kineto._enable_profiler(cfg, _kineto._ACTIVITIES, _kineto._SCOPES)

    def __exit__(self, *exc) -> None:
        from spmdgt.interceptor import _kineto

        _kineto._disable_profiler()


def _loop(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    c = torch.zeros_like(a)
    for _ in range(n):
        c = c * b + a
    return c


def _flush() -> None:
    from spmdgt.interceptor._mode import get_interceptor

    get_interceptor().drain()


def _time(n: int, setup, teardown) -> float:
    """us per op (2 ops per iteration), tools set up by ``setup`` and torn down after."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    setup()
    try:
        _loop(a, b, 200)  # warm caches (op names, format caches)
        _flush()
        t = time.perf_counter()
        _loop(a, b, n)
        _flush()
        return (time.perf_counter() - t) / (2 * n) * 1e6
    finally:
        teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="gt-bench-")
    log = os.path.join(tmp, "ops.log")
    stack: list = []

    def push(mode):
        return lambda: stack.append(contextlib.ExitStack()) or stack[-1].enter_context(mode())

    def pop():
        stack.pop().close()

    def enable(level: str, log_on: bool, stats: bool):
        path = log if log_on else None
        return lambda: interceptor.enable(instruction_log=path, stats=stats, level=level)

    nothing = lambda: None  # noqa: E731
    cases = {
        "plain torch": (nothing, nothing),
        "interceptor off": (nothing, nothing),
    }
    for level in ("torch", "aten", "kineto"):
        cases[f"log only ({level})"] = (enable(level, True, False), interceptor.disable)
        cases[f"stats only ({level})"] = (enable(level, False, True), interceptor.disable)
        cases[f"log + stats ({level})"] = (enable(level, True, True), interceptor.disable)
    cases["bare TorchFunctionMode"] = (push(_BareFunction), pop)
    cases["bare TorchDispatchMode"] = (push(_BareDispatch), pop)
    cases["profiler recording only"] = (push(_ProfilerOnly), pop)
    best = {k: float("inf") for k in cases}
    for _ in range(args.repeats):  # interleaved so drift hits every case alike
        for name, (setup, teardown) in cases.items():
            best[name] = min(best[name], _time(args.iters, setup, teardown))
        assert torch._C._len_torch_function_stack() == 0
        assert torch._C._len_torch_dispatch_stack() == 0
    base = best["plain torch"]
    print(f"c = c*b + a, 64x64 fp32, 1 thread, {args.iters} iters, best of {args.repeats}")
    print(f"{'case':30s} {'us/op':>8s} {'x plain':>8s}")
    for name, v in best.items():
        print(f"{name:30s} {v:8.2f} {v / base:8.2f}")
    print("(log + stats is what GT_INSTRUCTION_LOG turns on; 'profiler recording only' times")
    print(" the loop with the profiler on but stops it outside the timed region)")
    with open(log) as f:
        lines = sum(1 for _ in f)
    print(f"(last log: {lines} lines in {log})")


if __name__ == "__main__":
    main()
