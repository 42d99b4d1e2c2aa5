"""The SPMD runtime: every rank runs this same program; these answer "who am I".

``gt.init()`` is implicit on first use. Under ``torchrun --nproc_per_node=N`` it joins the
process group (gloo on CPU, NCCL on CUDA); under plain ``python`` the world is one process and
nothing is set up at all.
"""

from __future__ import annotations

import builtins

import torch
import torch.distributed as dist

from spmdgt.runtime import _agree
from spmdgt.runtime._agree import all_ranks, any_rank
from spmdgt.runtime._rank_errors import RankDivergenceError, RankFailedError, RankTimeoutError
from spmdgt.runtime._state import Runtime, get_runtime, init, shutdown, world_mesh

__all__ = [
    "RankDivergenceError",
    "RankFailedError",
    "RankTimeoutError",
    "Runtime",
    "all_ranks",
    "any_rank",
    "barrier",
    "connect",
    "device",
    "device_mesh",
    "gpu_workers",
    "init",
    "is_main_process",
    "local_rank",
    "print0",
    "rank",
    "shutdown",
    "world_size",
]


def rank() -> int:
    """This process's global rank (0 in a world of one)."""
    return get_runtime().rank


def world_size() -> int:
    """Number of ranks running this program."""
    return get_runtime().world_size


def local_rank() -> int:
    """Rank on this node (torchrun's LOCAL_RANK)."""
    return get_runtime().local_rank


def device() -> torch.device:
    """The device this rank computes on: its local CUDA device when there is one, else CPU."""
    return get_runtime().device


def is_main_process() -> bool:
    """True on rank 0: the rank that prints, logs and writes shared files."""
    return get_runtime().rank == 0


def device_mesh():
    """The 1-D ``DeviceMesh`` over all ranks (a 1-rank mesh, made without network, alone)."""
    return world_mesh()


def barrier() -> None:
    """Wait for every rank; a no-op in a world of one."""
    if get_runtime().world_size > 1:
        _agree.before_collective("gt.barrier()")
        dist.barrier()


def print0(*args: object, **kwargs) -> None:
    """``print`` on rank 0 only, so N ranks do not print N copies."""
    if get_runtime().rank == 0:
        builtins.print(*args, **kwargs)


def gpu_workers(n: int) -> int:
    """GT's worker-count knob. In SPMD the launcher fixes the world (``torchrun
    --nproc_per_node=N``), so this only checks ``n`` against it, warns once if they differ, and
    returns the real world size: the program runs either way, on the ranks there are."""
    import warnings

    world = world_size()
    if n != world:
        warnings.warn(
            f"gt.gpu_workers({n}): this program runs on {world} rank(s); the world size is set "
            f"by the launcher: torchrun --nproc_per_node={n} ...",
            stacklevel=2,
        )
    return world


def connect(address: str | None = None) -> Runtime:
    """GT's ``gt.connect("host:port")`` attached a client to a running dispatcher. spmdgt has
    none: every rank runs the program and joins its peers through torchrun's rendezvous
    (``--rdzv-endpoint host:port`` across machines). So this sets up this rank as ``gt.init()``
    does and warns that ``address`` is not used; the program runs either way."""
    import warnings

    if address is not None:
        warnings.warn(
            f"gt.connect({address!r}): spmdgt has no dispatcher to connect to; ranks meet "
            "through torchrun (torchrun --nnodes=N --rdzv-endpoint=HOST:PORT ... for many "
            "machines)",
            stacklevel=2,
        )
    return init()
