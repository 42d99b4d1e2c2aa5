"""Run by test_rank_agreement: two ranks stop running the same program, as the issue's table.

``python _diverge.py CASE``; rank 0 and rank 1 differ as CASE says. Whatever is computed is
printed as ``VALUE ...``: the test checks that no rank prints one.
"""

import os
import sys
import time

import torch

import spmdgt as gt

case = sys.argv[1]
rank = int(os.environ["RANK"])


def show(v) -> None:
    os.write(1, f"VALUE rank {rank}: {v}\n".encode())


if case == "item":  # rank 0 reads a sharded sum, rank 1 skips it
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
    if rank == 0:
        show(x.sum().item())
elif case == "numpy":  # rank 0 reads x then y, rank 1 skips x and reads y
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
        y = gt.randn(5, 3)
    if rank == 0:
        show(x.numpy().sum())
    show(y.numpy().sum())
elif case == "dtype":  # same shape, float32 on rank 0 and float64 on rank 1
    with gt.signal.context("rows"):
        x = gt.randn(5, 3, dtype=torch.float32 if rank == 0 else torch.float64)
    show(x.sum().item())
elif case == "signal":  # same shape, signal rows on rank 0 and cols on rank 1
    with gt.signal.context("rows" if rank == 0 else "cols"):
        x = gt.randn(6, 4)
    show(x.sum().item())
elif case == "dims16":  # a 16-dim tensor whose last size differs between the ranks
    with gt.signal.context("rows"):
        x = gt.zeros(*([2] * 15), 2 + rank)
    show(x.sum().item())
elif case == "outside":  # rank 1 creates outside any scope
    if rank == 0:
        with gt.signal.context("rows"):
            x = gt.randn(6, 4)
    else:
        x = gt.randn(6, 4)
    show(x.sum().item())
elif case == "op":  # rank 0 runs an op that gathers, rank 1 one that does not, then both read
    with gt.signal.context("rows"):
        x = gt.randn(6, 4)
    y = x @ x.T if rank == 0 else x.sum(0)
    show(y.sum().item())
elif case == "stuck":  # rank 1 is busy elsewhere (a stand-in for a stuck rank) while 0 reads
    with gt.signal.context("rows"):
        x = gt.randn(6, 4)
    if rank == 1:
        time.sleep(float(os.environ.get("STUCK_SECONDS", "120")))
    show(x.sum().item())
elif case == "agree":  # the control: both ranks run the same program
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
    show(round(x.sum().item(), 4))
else:
    raise SystemExit(f"unknown case {case!r}")
