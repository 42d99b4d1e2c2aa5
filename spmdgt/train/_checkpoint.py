"""Atomic distributed checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout under the checkpoint directory::

    step_00000040/        one complete checkpoint: DCP shards + .metadata + rng_rank<r>.pt
    step_00000080/
    latest                text file naming the newest complete checkpoint
    .tmp-step_00000120/   a save in progress (or one that crashed: ignored, removed next save)

Every rank writes its shards into the ``.tmp-`` directory; only after all ranks finished does
rank 0 rename it to ``step_<n>`` (``os.rename`` is atomic on one file system) and then replace
``latest``. A crash at any point leaves the previous checkpoint complete and named by
``latest``. Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``, keyed
by parameter name, so a checkpoint written by N ranks (DDP or FSDP shards) loads on M ranks.
RNG state is per rank (``rng_rank<r>.pt``). Works in a world of one without a process group.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["find_latest", "load_checkpoint", "save_checkpoint"]

_STEP_RE = re.compile(r"^step_(\d+)$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def find_latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (``latest`` first, else a scan)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if _is_complete(cand):
            return cand
    steps = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_RE.match(p.name)) and _is_complete(p)
    )
    return steps[-1][1] if steps else None


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    keep_last: int = 2,
) -> Path:
    """Save model, optimizer and ``extra`` (plain picklable values, equal on every rank).

    Collective: every rank calls it. Returns the final checkpoint path.
    """
    root = Path(directory)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a crashed earlier attempt at this step
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=_no_dist())
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        # Trainer counters, scheduler and scaler state: plain Python, equal on every rank.
        torch.save(extra, tmp / "trainer_state.pt")
    _barrier()  # every rank's shards are on disk
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep_last)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_RE.match(p.name)) and _is_complete(p)
    )
    for _, p in steps[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".tmp-step_"):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict:
    """Load a checkpoint into ``model``/``optimizer`` (resharding as needed); return ``extra``.

    Collective: every rank calls it.
    """
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rng_file = path / f"rng_rank{_rank()}.pt"
    if not rng_file.is_file():
        warnings.warn(
            f"{path} has no RNG state for rank {_rank()} (saved by fewer ranks); this rank "
            "continues with rank 0's RNG stream",
            stacklevel=2,
        )
        rng_file = path / "rng_rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(path / "trainer_state.pt", weights_only=False)
