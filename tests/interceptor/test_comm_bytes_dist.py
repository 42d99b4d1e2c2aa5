"""The instruction log's ``bytes`` for a collective is its buffer: the larger of its input and
output (an all-gather's gathered output, a reduce-scatter's whole input, an all-reduce's
tensor), nccl-tests' ``size`` and the trainer's ``CollectiveLog``, never input plus output.

Real gloo ranks, at both interception levels: the torch level (``dist.*`` calls take the
output buffer as an argument; DTensor's functional all-gather returns it) and the native
observer (``c10d._allgather_base_(output, input)``, ``c10d.allgather_``'s list of lists).
Every collective's result is checked against the one-process value too.
"""

from __future__ import annotations

import pytest
import torch

from spmdgt.interceptor import _native
from tests._dist import run_ranks

ROWS, COLS = 3, 5
SHARD = ROWS * COLS * 4  # one rank's float32 block: 60 B


def _full(world: int) -> torch.Tensor:
    """The global (world * ROWS) x COLS value every rank knows; rank r holds rows r*ROWS..."""
    return torch.arange(world * ROWS * COLS, dtype=torch.float32).reshape(world * ROWS, COLS)


def _collectives(rank: int, world: int, level: str, log: str) -> list[tuple[str, int]]:
    """Run five collectives of known size under the interceptor at ``level``; return the
    ``(op, bytes)`` of each ``COMM`` line of this rank's instruction log."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import spmdgt.interceptor as interceptor
    from spmdgt.interceptor._logreader import read_log
    from spmdgt.interceptor._mode import get_interceptor

    full = _full(world)
    mine = full[rank * ROWS : (rank + 1) * ROWS].clone()
    mesh = DeviceMesh("cpu", list(range(world)))
    gathered, scattered = torch.empty_like(full), torch.empty_like(mine)
    pieces = [torch.empty_like(mine) for _ in range(world)]
    summed = mine.clone()
    interceptor.enable(instruction_log=log, level=level)
    try:
        dist.all_gather_into_tensor(gathered, mine)
        dist.reduce_scatter_tensor(scattered, full)
        dist.all_gather(pieces, mine)
        dist.all_reduce(summed)
        replicated = DTensor.from_local(mine, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        replicated = replicated.to_local()
    finally:
        interceptor.disable()
        get_interceptor().level = "torch"
    # the values: one process's
    torch.testing.assert_close(gathered, full)
    torch.testing.assert_close(scattered, world * mine)
    torch.testing.assert_close(torch.cat(pieces), full)
    torch.testing.assert_close(summed, sum(full[r * ROWS : (r + 1) * ROWS] for r in range(world)))
    torch.testing.assert_close(replicated, full)
    mine_log = log.replace(".log", f".rank{rank}.log")  # each rank writes its own file
    return [(r.op, r.nbytes) for r in read_log(mine_log) if r.event == "COMM"]


@pytest.mark.parametrize(
    "level",
    [
        "torch",
        pytest.param(
            "native",
            marks=pytest.mark.skipif(
                not _native.available(), reason=f"native observer unavailable: {_native.error()}"
            ),
        ),
    ],
)
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_and_reduce_scatter_bytes_are_the_buffer(level, world, tmp_path):
    results = run_ranks(_collectives, world, tmp_path, level, str(tmp_path / "ops.log"))
    whole = world * SHARD  # the gathered output, the scattered input
    expected = [whole, whole, whole, SHARD, whole]  # in the program's order
    for rank, comm in enumerate(results):
        assert [nbytes for _, nbytes in comm] == expected, (rank, level, comm)
