"""Two ranks that stop running the same program, one case of the rank-agreement table a time.

``python _diverge.py CASE`` (a rank of a 2-rank job) runs ``CASES[CASE]``; the tests also call
the functions in forked ranks. Rank 0 and rank 1 differ as each case says; whatever is
computed goes to ``show``, so a test can check that no rank got a value.
"""

import os
import sys
import time

import torch

if os.environ.get("DIVERGE_LATE_RANK") == os.environ["RANK"]:  # this rank joins late: a slow
    time.sleep(float(os.environ["DIVERGE_LATE_S"]))  # node of a cluster job, as GT_TIMEOUT meets it

import spmdgt as gt  # joins the process group


def item(rank, show):  # rank 0 reads a sharded sum, rank 1 skips it
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
    if rank == 0:
        show(x.sum().item())


def numpy(rank, show):  # rank 0 reads x then y, rank 1 skips x and reads y
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
        y = gt.randn(5, 3)
    if rank == 0:
        show(x.numpy().sum())  # line 29
    show(y.numpy().sum())  # line 30


def dtype(rank, show):  # same shape, float32 on rank 0 and float64 on rank 1
    with gt.signal.context("rows"):
        x = gt.randn(5, 3, dtype=torch.float32 if rank == 0 else torch.float64)
    show(x.sum().item())


def signal(rank, show):  # same shape, signal rows on rank 0 and cols on rank 1
    with gt.signal.context("rows" if rank == 0 else "cols"):
        x = gt.randn(6, 4)
    show(x.sum().item())


def dims16(rank, show):  # a 16-dim tensor whose last size differs between the ranks
    with gt.signal.context("rows"):
        x = gt.zeros(*([2] * 15), 2 + rank)
    show(x.sum().item())


def outside(rank, show):  # rank 1 creates outside any scope
    if rank == 0:
        with gt.signal.context("rows"):
            x = gt.randn(6, 4)
    else:
        x = gt.randn(6, 4)
    show(x.sum().item())


def op(rank, show):  # rank 0 runs an op that gathers, rank 1 one that does not; both read
    with gt.signal.context("rows"):
        x = gt.randn(6, 4)
    y = x @ x.T if rank == 0 else x.sum(0)
    show(y.sum().item())


def stuck(rank, show):  # rank 1 is busy elsewhere (a stand-in for a stuck rank) while 0 reads
    with gt.signal.context("rows"):
        x = gt.randn(6, 4)
    if rank == 1:
        time.sleep(120)
    show(x.sum().item())


def agree(rank, show):  # the control: both ranks run the same program
    with gt.signal.context("rows"):
        x = gt.randn(5, 3)
    show(round(x.sum().item(), 4))


CASES = {f.__name__: f for f in (item, numpy, dtype, signal, dims16, outside, op, stuck, agree)}

if __name__ == "__main__":
    me = int(os.environ["RANK"])
    CASES[sys.argv[1]](me, lambda v: os.write(1, f"VALUE rank {me}: {v}\n".encode()))
