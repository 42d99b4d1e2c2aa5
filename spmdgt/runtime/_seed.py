"""Every rank's default random streams agree, with no call from the user.

torch seeds each process at random, so N ranks would build N different ``nn.Linear``s and draw
N different "replicated" ``gt.randn``s, and a plain weight would multiply each shard by a
different matrix: a silent wrong number. numpy's global stream (``np.random.randn``, ...) and
Python's ``random`` start at random in each process too, so a program's
``gt.from_numpy(np.random.randn(64, 32))`` would get other data on every rank. Two steps keep
the ranks alike:

1. ``agree_at_import``: under a launcher (``WORLD_SIZE`` > 1), importing spmdgt seeds torch's
   default generators (CPU, and CUDA lazily), numpy's legacy global stream and Python's
   ``random`` with seeds every rank of this launch derives from torchrun's environment (run
   id, rendezvous address and port, restart count), one seed a stream. No network is touched.
   A seed the user set before the import is kept: torch's when below 2**32 (torch's own
   per-process seeds are 64-bit), numpy's whenever its stream is no longer the one numpy
   started with. Python's ``random`` cannot tell a seed from its own start, so it is kept only
   when torch's seed was set before the import too (a program that seeds its streams itself).
2. ``agree_at_init``: when the rank joins the process group, every rank takes rank 0's
   torch generator states (one small broadcast) and rank 0's numpy and Python ``random``
   states (one small object broadcast), so a process group made by hand, or a launcher
   without torchrun's variables, agrees too.

A seed the program sets after the import (``torch.manual_seed(s)``, ``gt.manual_seed(s)``,
``np.random.seed(s)``, ``random.seed(s)``) works as always and seeds every rank alike.
Per-rank streams on purpose (dropout masks that differ in data parallelism, data that differs
per rank, say) need a seed of their own: seed after ``gt.init()`` with
``torch.manual_seed(base + gt.rank())``, or draw from a generator of your own
(``torch.Generator``, ``np.random.default_rng(base + gt.rank())``,
``random.Random(base + gt.rank())``).
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from types import ModuleType
from typing import Any

import torch

from spmdgt._core import env as _env

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


def _stream_seed(seed: int, stream: str) -> int:
    # one 63-bit seed a stream: numpy's and Python's generators are both MT19937 seeded from
    # an array of words, and the same seed would give both the same numbers
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _numpy_untouched(np_random: ModuleType) -> bool:
    """True while numpy's global stream is the one numpy started with: not seeded, not drawn
    from (numpy starts it with the high bit alone in its first key word and position 623;
    any seed or draw leaves another state)."""
    _, key, pos, has_gauss, _ = np_random.get_state(legacy=True)
    return int(key[0]) == 0x80000000 and int(pos) == 623 and not has_gauss


def agree_at_import() -> None:
    """Seed the default streams alike on every rank of a launch (see module docstring)."""
    try:
        world = _env.launcher_int("WORLD_SIZE", 1)
    except ValueError:
        return  # the runtime reports a malformed WORLD_SIZE when it reads it
    if world <= 1:
        return
    seed = launch_seed()
    if seed is None:
        return
    user_seeded_torch = torch.initial_seed() < _USER_SEED_BELOW
    if not user_seeded_torch:
        torch.manual_seed(seed)
        random.seed(_stream_seed(seed, "python"))
    # numpy.random is imported here only under a launcher (a few ms, next to torch's import);
    # not imported yet, no one can have seeded it
    fresh = "numpy.random" not in sys.modules
    import numpy.random as np_random

    if fresh or _numpy_untouched(np_random):
        numpy_seed = _stream_seed(seed, "numpy")
        np_random.seed([numpy_seed & 0xFFFFFFFF, numpy_seed >> 32])


def agree_at_init(device: torch.device) -> None:
    """Give every rank rank 0's default generator states (a collective over the world):
    torch's CPU (and CUDA) generators, numpy's global stream and Python's ``random``."""
    import numpy.random as np_random
    import torch.distributed as dist

    comm = device if device.type == "cuda" else torch.device("cpu")
    state = torch.get_rng_state().to(comm)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(comm)
        dist.broadcast(cuda_state, src=0)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
    # the states are plain Python and numpy objects: one object broadcast (two small messages)
    # carries both; its tensor ops are spmdgt's own, not the program's, so no function mode
    # (the interceptor's) sees them
    states: list[Any] = [np_random.get_state(legacy=True), random.getstate()]
    with torch._C.DisableTorchFunction():
        dist.broadcast_object_list(states, src=0, device=comm)
    np_random.set_state(states[0])
    random.setstate(states[1])
