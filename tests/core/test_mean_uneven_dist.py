"""``mean`` over unevenly sharded dims: one all-reduce, not a gather, with one process's values.

DTensor's rule for ``mean`` replicates an input sharded unevenly on a reduced dim (an
all-gather of the whole input: the average of the ranks' averages is not the mean there).
``_hook._mean_as_sum`` computes it as the sum over those dims (a partial sum per rank, one
all-reduce when read) over their global size. Checked on 2 and 3 ranks with 7 x 5 inputs
(rows 4/3 and 3/3/1; columns 3/2 and 2/2/1), an empty shard, and rows sharded on a sub-mesh:
forward value, the input's gradient, the path (``rewrite`` where the reduced dim is sharded
unevenly) and the forward's collectives (no all-gather there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks

ROWS, COLS = 7, 5
AG = "c10d_functional.all_gather_into_tensor"

# name -> the mean taken
OPS = {
    "mean": lambda x: x.mean(),
    "mean0": lambda x: x.mean(0),
    "mean1": lambda x: x.mean(1),
    "mean01_keepdim": lambda x: x.mean((0, 1), keepdim=True),
    "mean_neg2_f64": lambda x: torch.mean(x, -2, dtype=torch.float64),
}
LAYOUTS = ("shard0", "shard0_empty", "shard1", "submesh_shard0")


def _reduces_uneven(name: str, layout: str, world: int) -> bool:
    """Does ``name`` reduce the dim ``layout`` shards, and is that dim's split uneven?"""
    dims = {"mean": {0, 1}, "mean0": {0}, "mean1": {1}, "mean01_keepdim": {0, 1}}
    sharded = 1 if layout == "shard1" else 0
    size = {"shard0": ROWS, "shard1": COLS, "shard0_empty": world - 1, "submesh_shard0": ROWS}
    parts = world - 1 if layout == "submesh_shard0" else world
    return sharded in dims.get(name, {0}) and size[layout] % parts != 0


def _put(layout: str, world: int):
    from torch.distributed.tensor import Shard

    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._moves import place
    from spmdgt.tensor._placement import Target
    from tests.parity.layouts import rank_layout, sub_mesh_ranks

    if layout == "submesh_shard0":
        target = Target(mesh_for(sub_mesh_ranks(world)), (Shard(0),))
        return lambda t: place(t, target)
    return rank_layout(layout, world).put


def _close(ours, ref) -> bool:
    ours = np.asarray(ours.numpy()) if hasattr(ours, "device_mesh") else ours.detach().numpy()
    ref = ref.detach().numpy()
    return ours.shape == ref.shape and bool(np.allclose(ours, ref, atol=1e-5, rtol=1e-5))


def _means(rank: int, world: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt  # noqa: F401 - initialised by run_ranks
    from spmdgt.tensor._moves import place, target_of
    from spmdgt.tensor._paths import watch

    out = {}
    for layout in LAYOUTS:
        rows = world - 1 if layout == "shard0_empty" else ROWS
        data = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(4))
        for name, op in OPS.items():
            ref_x = data.clone().requires_grad_()
            ref = op(ref_x)
            g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
            ref.backward(g)
            x = _put(layout, world)(data).requires_grad_()
            with watch() as fwd, CommDebugMode() as comms:
                res = op(x)
            grad = place(g, target_of(res.device_mesh, res.placements))
            res.backward(grad)
            with torch.no_grad(), watch() as quiet:
                op(x)
            out[(name, layout)] = (
                fwd.path,
                quiet.path,
                sum(v for k, v in comms.get_comm_counts().items() if str(k) == AG),
                _close(res, ref) and _close(x.grad, ref_x.grad),
            )
    # bfloat16 keeps the exact fallback (each rank would round its partial sum)
    xb = _put("shard0", world)(torch.randn(ROWS, COLS).bfloat16())
    with watch() as low:
        r = xb.mean()
    out["bf16"] = (low.path, r.dtype == torch.bfloat16)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_mean_uneven_all_reduces(tmp_path, world):
    for rank, out in enumerate(run_ranks(_means, world, tmp_path)):
        assert out.pop("bf16") == ("fallback", True), rank
        for (name, layout), (fwd, quiet, gathers, exact) in out.items():
            where = f"{name} on {layout}, rank {rank}/{world}: {fwd, quiet, gathers, exact}"
            assert exact, where
            if _reduces_uneven(name, layout, world):
                assert (fwd, quiet, gathers) == ("rewrite", "rewrite", 0), where
            else:  # DTensor's own rule: no sharded dim reduced, or an even split
                assert fwd == "dtensor" and gathers == 0, where
