"""spmdgt: GT's tensor contract on SPMD PyTorch.

    import spmdgt as gt
    x = gt.randn(1000, 1000)      # plain `python`: a world of one, nothing to set up
    y = x @ x                     # `torchrun --nproc_per_node=N`: the same program on N ranks

Every rank runs the same program; placements come from YAML signals (``GT_CONFIG``) or
auto-shard (``GT_AUTO_SHARD=1``) and are DTensor placements on a DeviceMesh. Where GT and
torch differ (string dtypes, ``max(axis)`` returning only values), torch wins: a spmdgt tensor
is a torch tensor. Layout: ``runtime/`` (ranks, devices, process group), ``config/`` (typed
YAML), ``tensor/`` (gt.Tensor, creation, placements), ``signal`` (scopes), ``interceptor/``
and ``debug`` (the op stream and its tools), ``train/`` (the distributed trainer).
"""

from __future__ import annotations

import torch
from torch import no_grad

from spmdgt import signal
from spmdgt._core.session import session
from spmdgt.config import (
    ConfigError,
    MeshConfig,
    ShardConfig,
    SignalConfig,
    get_config,
    get_mesh_config,
    load_config,
    register_config,
    register_mesh,
)
from spmdgt.runtime import (
    RankDivergenceError,
    RankFailedError,
    RankTimeoutError,
    barrier,
    connect,
    device,
    device_mesh,
    gpu_workers,
    init,
    is_main_process,
    local_rank,
    print0,
    rank,
    shutdown,
    world_size,
)
from spmdgt.runtime._seed import agree_at_import
from spmdgt.tensor import (
    _gtcompat,
    arange,
    cat,
    empty,
    eye,
    from_numpy,
    full,
    manual_seed,
    ones,
    rand,
    randn,
    tensor,
    zeros,
)

__version__ = "0.1.0"

float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
int32 = torch.int32
int64 = torch.int64
bool_ = torch.bool

__all__ = [
    "ConfigError",
    "MeshConfig",
    "RankDivergenceError",
    "RankFailedError",
    "RankTimeoutError",
    "session",
    "ShardConfig",
    "SignalConfig",
    "Tensor",
    "arange",
    "barrier",
    "bfloat16",
    "bool_",
    "cat",
    "connect",
    "debug",
    "device",
    "device_mesh",
    "empty",
    "eye",
    "float16",
    "float32",
    "float64",
    "from_numpy",
    "full",
    "get_config",
    "get_mesh_config",
    "gpu_workers",
    "init",
    "int32",
    "int64",
    "is_main_process",
    "load_config",
    "local_rank",
    "manual_seed",
    "no_grad",
    "ones",
    "print0",
    "profile",
    "rand",
    "randn",
    "rank",
    "register_config",
    "register_mesh",
    "shutdown",
    "signal",
    "tensor",
    "train",
    "world_size",
    "zeros",
]

_LAZY = {"debug": "spmdgt.debug", "train": "spmdgt.train", "interceptor": "spmdgt.interceptor"}


def __getattr__(name: str):
    # Tools and the trainer load on first use: `import spmdgt` stays as cheap as it can be.
    import importlib

    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name == "profile":
        return importlib.import_module("spmdgt.debug").profile
    if name == "Tensor":  # loads torch.distributed.tensor: only when asked for
        return importlib.import_module("spmdgt.tensor._tensor").Tensor
    raise AttributeError(f"module 'spmdgt' has no attribute {name!r}")


def _boot_tools() -> None:
    # GT_INSTRUCTION_LOG, GT_VERBOSE, GT_DEBUG_*, ... turn tools on at import; with none set
    # this reads the environment and imports nothing (tools that are off cost nothing).
    from spmdgt._core import env as _env
    from spmdgt.interceptor import maybe_enable_from_env

    maybe_enable_from_env()
    if _env.is_set("GT_AUTO_COMPILE") or _env.is_set("GT_WORKER_BATCH_SIZE"):
        # the compile pass reads the interceptor's stream: the top package wires the layers
        from spmdgt import compile as gt_compile

        gt_compile.maybe_enable_from_env()


_boot_tools()
_gtcompat.install()  # GT spellings torch lacks (x.transpose() reverses the dims)
agree_at_import()  # under torchrun: every rank's default generators start alike
