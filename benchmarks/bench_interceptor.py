"""Cost of the interceptor on the small-op loop ``c = c*b + a`` (64x64, 1 CPU thread).

    python benchmarks/bench_interceptor.py [--iters 20000] [--repeats 5] [--json PATH]

Prints, side by side in one process, microseconds per op (best of ``repeats``) for:
plain torch; the interceptor imported but off (must equal plain: nothing is pushed); the
instruction log on (``GT_INSTRUCTION_LOG``'s tool, default ``torch`` level); stats only;
the log at ``aten`` level; the same at ``native`` level (the compiled RecordFunction observer,
``_native``: what ``GT_INSTRUCTION_LOG`` uses when it builds, with its C++ op counters; skipped
if it cannot), and with ``GT_STATS=1``'s hot paths and tape on top (Python); and, for
reference, a bare ``TorchDispatchMode`` and a bare
``TorchFunctionMode`` that only call the op. The issue's bar: log on <= 2x plain.

The log goes to a ``gt-bench-*`` temporary folder, removed when the run ends (also on an error
or Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import spmdgt.interceptor as interceptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Progress, write


class _BareDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _BareFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _loop(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    c = torch.zeros_like(a)
    for _ in range(n):
        c = c * b + a
    return c


def _time(n: int, setup, teardown) -> float:
    """us per op (2 ops per iteration), tools set up by ``setup``.

    ``teardown`` (which drains what the tools buffered: log lines, records for the Python
    sinks) runs inside the timed region: work deferred past the loop is still work per op.
    """
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    setup()
    done = False
    try:
        _loop(a, b, 200)  # warm caches (op names, format caches)
        t = time.perf_counter()
        _loop(a, b, n)
        teardown()
        done = True
        return (time.perf_counter() - t) / (2 * n) * 1e6
    finally:
        if not done:
            teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="gt-bench-")
    try:
        best = _run(args, os.path.join(tmp, "ops.log"))
    finally:
        interceptor.disable()  # closes the log before its folder goes
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        base = best["plain torch"]
        write(
            args.json,
            "interceptor",
            {
                "workload": "c = c*b + a, 64x64 fp32",
                "iters": args.iters,
                "repeats": args.repeats,
                "unit": "us per op (best of repeats)",
                "cases": [
                    {"name": k, "us_per_op": v, "ratio_to_plain": v / base} for k, v in best.items()
                ],
            },
            device="cpu",
            world_size=1,
            threads={"per_rank": 1},
        )


def _run(args: argparse.Namespace, log: str) -> dict[str, float]:
    """Time every case (the log, when a case writes one, goes to ``log``), print the table and
    return the best us/op per case."""
    stack: list = []

    def push(mode):
        return lambda: stack.append(contextlib.ExitStack()) or stack[-1].enter_context(mode())

    def pop():
        stack.pop().close()

    nothing = lambda: None  # noqa: E731
    cases = {
        "plain torch": (nothing, nothing),
        "interceptor off": (nothing, nothing),
        "log only (torch)": (
            lambda: interceptor.enable(instruction_log=log, stats=False, level="torch"),
            interceptor.disable,
        ),
        "stats only (torch)": (
            lambda: interceptor.enable(stats=True, level="torch"),
            interceptor.disable,
        ),
        "log + stats (torch)": (
            lambda: interceptor.enable(instruction_log=log, stats=True, level="torch"),
            interceptor.disable,
        ),
        "log only (aten)": (
            lambda: interceptor.enable(instruction_log=log, stats=False, level="aten"),
            interceptor.disable,
        ),
        "log+counters (native) = GT_INSTRUCTION_LOG": (
            lambda: interceptor.enable(instruction_log=log, stats=False, level="native"),
            interceptor.disable,
        ),
        "+ hot paths, tape (native) = GT_STATS=1": (
            lambda: interceptor.enable(instruction_log=log, stats=True, level="native"),
            interceptor.disable,
        ),
        "bare TorchFunctionMode": (push(_BareFunction), pop),
        "bare TorchDispatchMode": (push(_BareDispatch), pop),
    }
    from spmdgt.interceptor import _native

    if not _native.available():
        print(f"native level unavailable ({_native.error()}): skipped")
        cases = {k: v for k, v in cases.items() if "native" not in k}
    best = {k: float("inf") for k in cases}
    progress = Progress("bench_interceptor")
    for rep in range(args.repeats):  # interleaved so drift hits every case alike
        progress(f"round {rep + 1}/{args.repeats} of {len(cases)} cases")
        # untimed: the first case of a round ran ~25% slow (after the last case's teardown)
        _time(args.iters, *cases["plain torch"])
        for name, (setup, teardown) in cases.items():
            best[name] = min(best[name], _time(args.iters, setup, teardown))
        assert torch._C._len_torch_function_stack() == 0
        assert torch._C._len_torch_dispatch_stack() == 0
    base = best["plain torch"]
    print(f"c = c*b + a, 64x64 fp32, 1 thread, {args.iters} iters, best of {args.repeats}")
    print(f"{'case':42s} {'us/op':>8s} {'x plain':>8s}")
    for name, v in best.items():
        print(f"{name:42s} {v:8.2f} {v / base:8.2f}")
    with open(log) as f:
        lines = sum(1 for _ in f)
    print(f"(last log: {lines} lines, in a temporary folder removed at exit)")
    return best


if __name__ == "__main__":
    main()
