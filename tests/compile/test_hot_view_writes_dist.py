"""Hot functions that write through views of sharded tensors, both halves of the compile pass
on, 3 ranks (2 under ``-m slow``), column shards (7 x 6: 2/2/2 and 3/3) and row shards (3/2/2
and 4/3): every call equals one process. Eagerly each was exact; compiled (torch 2.13, 2026-11-30):

- ``y[3, 0] = 2.0`` on an input and ``z[:, 1:].mul_(3)`` on an intermediate were wrong once
  the function compiled: AOTAutograd's write-back of a view into its base gives other values
  on DTensors (``_refusals._view_write`` now refuses such graphs: each call runs eagerly);
- a function returning ``y.unbind(1)[4]``, whose caller wrote ``.mul_(3)`` into it, left ``y``
  as it was (``_refusals._piece_output``);
- a function reading a view DTensor had to copy after its base was written read it stale, and
  one writing such a view in place wrote the copy only (``_Runner`` brings the copy up to date
  first, and runs the call as traced where the graph writes an input);
- a function returning ``u.view(-1)`` of 7 row shards (a copy DTensor had to make) returned
  the copy untagged: the caller's ``clamp_`` through it left ``u`` as it was, and a read after
  a write to ``u`` read it stale (``_refusals._copied_view_output``);
- a function writing in place into an input that needs grad (``v.mul_(3)``) made every
  backward after it compiled raise AOTAutograd's "guessed its metadata incorrectly"
  (``_refusals._grad_input_written``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.compile._both import with_both_halves

ROWS, COLS, CALLS = 7, 6, 24


def write_input(y):
    y[3, 0] = 2.0
    z = y * 1
    z[:, 1:].mul_(3)
    return z


def piece(y):
    return y.unbind(1)[4]


def scale(v):
    v.mul_(3)


def flat(y):
    return y.view(-1)


def act(v):
    v.mul_(3)


def read_after(v, y):
    y.mul_(0.5)
    return v * 2


def _program(make):
    out = []
    for i in range(CALLS):
        y = make(torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) + i)
        z = write_input(y)
        piece(y).mul_(3)
        v = y[:, 2:4]  # on column shards a copy DTensor had to make
        scale(v)
        r = read_after(v, y)
        u = make(torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) - i, "rows")
        flat(u).clamp_(max=20.0 + i)  # on 7 row shards a copy DTensor had to make
        f = read_after(flat(u), u)
        w = torch.nn.Parameter(torch.full((ROWS, COLS), 1.5, dtype=torch.float64))
        a = u * w * 2
        act(a)  # an input that needs grad, written in place
        (a * a).sum().backward()
        out.append([np.asarray(t.detach().numpy()).copy() for t in (y, z, v, r, u, f, w.grad)])
    return out


def _ranked(rank, world):
    import spmdgt as gt

    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))

    def make(x, signal="cols"):
        with gt.signal.context(signal):
            return gt.tensor(x)

    got, stats = with_both_halves(lambda: _program(make), every=1, hot_at=2, batch=16)
    return got, stats.compiled_functions if hasattr(stats, "compiled_functions") else None


# 2 ranks: slow (3 ranks stands for it)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_hot_functions_writing_through_views_equal_one_process(tmp_path, world):
    ref = _program(lambda x, signal=None: x)
    for got, _ in run_ranks(_ranked, world, tmp_path, timeout=300):
        assert len(got) == CALLS
        for i, (ours, theirs) in enumerate(zip(got, ref, strict=True)):
            for name, a, b in zip([*"yzvruf", "w.grad"], ours, theirs, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"call {i}: {name}")
