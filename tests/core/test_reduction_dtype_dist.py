"""A reduction's ``dtype=`` after the same reduction without it: one process's dtype and value
on every rank, on uneven rows, a sub-mesh and an empty shard.

DTensor's sharding cache keyed ``sum``/``mean``/``prod``/``cumsum``/... by their positional
arguments only, so ``x.sum(0, dtype=torch.float64)`` after ``x.sum(0)`` got the cached float32
output spec: ranks holding a shard computed float64, a rank outside a sub-mesh made a float32
empty result, and the read that followed mixed dtypes in one collective (gloo aborted).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.parity.layouts import rank_layout

CALLS = {  # name: (call without dtype, call with it)
    "sum": (lambda x: x.sum(0), lambda x: x.sum(0, dtype=torch.float64)),
    "sum_all": (lambda x: x.sum(), lambda x: x.sum(dtype=torch.float64)),
    "mean": (lambda x: x.mean(0), lambda x: x.mean(0, dtype=torch.float64)),
    "prod": (lambda x: x.prod(1), lambda x: x.prod(1, dtype=torch.float64)),
    "nansum": (lambda x: x.nansum(), lambda x: x.nansum(dtype=torch.float64)),
    "cumsum": (lambda x: x.cumsum(1), lambda x: x.cumsum(1, dtype=torch.float64)),
    "norm": (
        lambda x: torch.linalg.vector_norm(x, dim=0),
        lambda x: torch.linalg.vector_norm(x, dim=0, dtype=torch.float64),
    ),
}


def _reduce(rank, world):
    import spmdgt as gt

    torch.set_num_threads(1)
    gt.register_config("sub", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1])))
    x0 = torch.randn(7, 3, generator=torch.Generator().manual_seed(3))
    layouts = {
        "shard0": rank_layout("shard0", world).put,
        "subrep": rank_layout("subrep", world).put,
        "shard0_empty": rank_layout("shard0_empty", world).put,
    }
    with gt.signal.context("sub"):
        layouts["sub_shard0"] = lambda t: gt.tensor(t)  # rows over ranks 0 and 1 only
        sub = layouts["sub_shard0"](x0)
    out = {}
    for lname, put in layouts.items():
        t0 = x0[: world - 1] if lname == "shard0_empty" else x0
        x = sub if lname == "sub_shard0" else put(t0)
        for name, (plain, typed) in CALLS.items():
            got = [f(x) for f in (plain, typed, plain)]  # again without: the first spec back
            ref = [f(t0) for f in (plain, typed, plain)]
            out[lname, name] = [
                (str(g.dtype), g.numpy(), str(r.dtype), r.numpy()) for g, r in zip(got, ref)
            ]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_dtype_is_part_of_the_reduction(tmp_path, world):
    for rank, out in enumerate(run_ranks(_reduce, world, tmp_path)):
        assert len(out) == 4 * len(CALLS)
        for (layout, name), calls in out.items():
            for g_dtype, got, r_dtype, ref in calls:
                assert g_dtype == r_dtype, (rank, layout, name)
                np.testing.assert_allclose(
                    got, ref, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {layout} {name}"
                )
