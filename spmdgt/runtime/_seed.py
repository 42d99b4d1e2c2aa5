"""Every rank's default random generators agree, with no call from the user.

torch seeds each process at random, so N ranks would build N different ``nn.Linear``s and draw
N different "replicated" ``gt.randn``s, and a plain weight would multiply each shard by a
different matrix: a silent wrong number. Two steps keep the ranks alike:

1. ``agree_at_import``: under a launcher (``WORLD_SIZE`` > 1), importing spmdgt seeds torch's
   default generators (CPU, and CUDA lazily) with a seed every rank of this launch derives
   from torchrun's environment (run id, rendezvous address and port, restart count). No
   network is touched. A seed the user set before the import (``torch.manual_seed(s)`` with
   ``s < 2**32``; torch's own per-process seeds are 64-bit) is kept.
2. ``agree_at_init``: when the rank joins the process group, every rank takes rank 0's
   generator states (one small broadcast), so a process group made by hand, or a launcher
   without torchrun's variables, agrees too.

``torch.manual_seed(s)`` / ``gt.manual_seed(s)`` work as always and seed every rank alike.
Per-rank streams on purpose (dropout masks that differ in data parallelism, say): seed after
``gt.init()`` with ``torch.manual_seed(base + gt.rank())``, or draw from a
``torch.Generator`` of your own.
"""

from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["agree_at_import", "agree_at_init", "launch_seed"]

_USER_SEED_BELOW = 2**32


def launch_seed() -> int | None:
    """A 63-bit seed shared by every rank of this launch, from torchrun's environment; None
    when the environment says nothing shared (no launcher)."""
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    parts = [os.environ.get(k, "") for k in keys]
    if not any(parts[:3]):
        return None
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def agree_at_import() -> None:
    """Seed the default generators alike on every rank of a launch (see module docstring)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return  # the runtime reports a malformed WORLD_SIZE when it reads it
    if world <= 1 or torch.initial_seed() < _USER_SEED_BELOW:
        return
    seed = launch_seed()
    if seed is not None:
        torch.manual_seed(seed)


def agree_at_init(device: torch.device) -> None:
    """Give every rank rank 0's default generator states (a collective over the world)."""
    import torch.distributed as dist

    comm = device if device.type == "cuda" else torch.device("cpu")
    state = torch.get_rng_state().to(comm)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(comm)
        dist.broadcast(cuda_state, src=0)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
