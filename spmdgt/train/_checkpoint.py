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

A checkpoint directory is data, not code. ``latest`` must name a ``step_<n>`` entry that
resolves (symlinks followed) to a directory inside the checkpoint directory, and so must every
``step_<n>`` the scan would pick; anything else is a ``CheckpointError`` naming the file and
its value, never a resume of some other run. Nothing is unpickled with code execution: the
trainer state and RNG files load with ``torch.load(weights_only=True)`` (the RNG state is kept
as tensors and plain numbers for that), DCP's non-tensor items are checked by a weights-only
load before DCP reads them, and DCP's ``.metadata`` pickle goes through an unpickler that
admits only DCP's metadata classes, torch sizes, dtypes and layouts, and paths.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "CheckpointError",
    "find_latest",
    "load_checkpoint",
    "on_rank0",
    "resolve_checkpoint",
    "save_checkpoint",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
_T = TypeVar("_T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the file and value."""


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
    """This rank's generator states as tensors and plain numbers (weights-only loadable)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
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

        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_rng_state(state: object, file: Path) -> None:
    """Apply ``state`` and put the current state back: a bad file fails here, on load, where
    every rank can agree on it, not later on one rank alone."""
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise CheckpointError(
            f"{file}: not an RNG state (expected a dict with 'torch' and 'python' keys, got "
            f"{_describe(state)})"
        )
    current = _rng_state()
    try:
        _set_rng_state(state)
    except Exception as e:
        raise CheckpointError(f"{file}: unusable RNG state ({type(e).__name__}: {e})") from e
    finally:
        _set_rng_state(current)


_TRAINER_COUNTERS = ("step", "epoch", "samples_in_epoch")


def _check_trainer_state(state: object, file: Path) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected the trainer's state dict, got {_describe(state)}")
    for key in _TRAINER_COUNTERS:
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{file}: key {key!r} must be an integer >= 0, got {value!r}")
    mesh = state.get("mesh")  # (dp_replicate, dp_shard, tp) it was written on; older: absent
    if mesh is not None and not (
        isinstance(mesh, (list, tuple))
        and len(mesh) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh)
    ):
        raise CheckpointError(
            f"{file}: key 'mesh' must list 3 sizes >= 1 (dp_replicate, dp_shard, tp), got "
            f"{_describe(mesh)}"
        )


def _describe(x: object) -> str:
    return f"{type(x).__name__} {x!r}"[:200]


def _load_weights_only(file: Path) -> object:
    """``torch.load(weights_only=True)`` with errors that name the file."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{file}: refused by a weights-only load, which runs no code from the file ({_why(e)})"
        ) from e
    except Exception as e:
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from e


def _why(e: BaseException) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [repr(e)]
    return next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0])


def _weights_only_bytes(obj: object, what: str) -> bytes:
    """``torch.save(obj)`` bytes, checked to load back with ``weights_only=True``: a state
    that could only be loaded by running code fails when it is saved, not at resume."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{what} holds objects a weights-only load refuses; keep checkpoint state to "
            f"tensors, numbers, strings and containers of them ({_why(e)})"
        ) from e
    return buf.getvalue()


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def _confined(entry: Path, real_root: Path, what: str) -> None:
    """``entry`` must resolve (symlinks followed) to a directory directly inside the root."""
    real = entry.resolve()
    if real.parent != real_root:
        raise CheckpointError(
            f"{what}, which resolves to {real}, outside the checkpoint directory {real_root}; "
            "a checkpoint directory resumes only its own checkpoints (remove the entry, or "
            "load another run's checkpoint explicitly with load_checkpoint(path))"
        )


def find_latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (``latest`` first, else a scan).

    ``latest`` must hold one ``step_<n>`` name of an entry inside ``directory`` (symlinks
    resolved); anything else raises ``CheckpointError`` naming the file and its value rather
    than guessing: the trainer wrote it, so another value was put there by hand or by a copy,
    and resuming anything but what it says would continue a run the user did not choose. A
    well-formed name whose checkpoint is gone or incomplete (deleted by hand) falls back to the
    newest complete ``step_<n>`` with a warning. Scanned entries are confined the same way.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    real_root = root.resolve()
    pointer = root / "latest"
    if pointer.exists() or pointer.is_symlink():
        if not pointer.is_file():
            raise CheckpointError(f"{pointer}: expected a text file naming a step_<n> directory")
        try:
            value = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{pointer}: unreadable ({type(e).__name__}: {e})") from e
        if not _STEP_RE.match(value):
            raise CheckpointError(
                f"{pointer}: names {value[:200]!r}, but it must name a step_<n> checkpoint "
                f"inside {root} (it is written by the trainer; delete it to resume from the "
                "newest complete step_<n> there)"
            )
        cand = root / value
        if cand.exists() or cand.is_symlink():
            _confined(cand, real_root, f"{pointer}: names {value!r}")
        if _is_complete(cand):
            return cand
        warnings.warn(
            f"{pointer} names {value!r}, which is missing or incomplete; resuming from the "
            "newest complete checkpoint in the directory instead",
            stacklevel=2,
        )
    steps = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_RE.match(p.name)) and _is_complete(p)
    )
    for _, p in steps:
        _confined(p, real_root, f"{p}: a checkpoint entry")
    return steps[-1][1] if steps else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is one checkpoint (holds ``.metadata``), else the newest in it.

    Raises ``FileNotFoundError`` when there is none, ``CheckpointError`` for a bad ``latest``.
    """
    path = Path(path)
    if _is_complete(path):
        return path
    found = find_latest(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {path}")
    return found


def on_rank0(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on rank 0 and hand its result, or its error, to every rank.

    For decisions read from the file system that lead to collectives (which checkpoint to
    load, whether there is one): ranks reading a shared directory at slightly different
    moments, or through different caches, must not take different branches. Collective when
    a process group of more than one rank exists; every rank raises when rank 0 did.
    """
    if not _dist():
        return fn()
    box: list = [None]
    error: BaseException | None = None
    if _rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # every rank must hear of it, or the others would wait
            error = e
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        if error is not None:
            raise error
        raise CheckpointError(f"rank 0 failed to resolve the checkpoint: {value}")
    return value


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
    # Serialised and checked on every rank before the first barrier: ``extra`` is equal on
    # every rank, so a state that cannot be loaded back weights-only fails on all of them
    # together (checked on rank 0 alone, it left the others waiting at the barrier).
    rng_bytes = _weights_only_bytes(_rng_state(), "RNG state")
    extra_bytes = _weights_only_bytes(extra, "the trainer state (scheduler, scaler, counters)")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a crashed earlier attempt at this step
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=_no_dist())
    (tmp / f"rng_rank{_rank()}.pt").write_bytes(rng_bytes)
    if _rank() == 0:
        # Trainer counters, scheduler and scaler state: plain Python, equal on every rank.
        (tmp / "trainer_state.pt").write_bytes(extra_bytes)
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


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only what DCP writes there: its metadata
    dataclasses and enums, ``_StorageInfo``, ``torch.Size``, dtypes, layouts and paths.
    Any other global (a function to call, a class to build) is refused: no code runs."""

    _ALLOWED = frozenset(
        {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
            *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath")),
            *(("pathlib", n) for n in ("WindowsPath", "PureWindowsPath")),
        }
    )

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            if module == dcp_metadata.__name__:
                obj = getattr(dcp_metadata, name, None)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise CheckpointError(
            f"{self.path}: refused to unpickle {module}.{name}; DCP metadata holds only its "
            "own dataclasses, sizes, dtypes and layouts, and a checkpoint must not run code"
        )


def _read_metadata(path: Path) -> dcp_metadata.Metadata:
    file = path / ".metadata"  # DCP's name for the global metadata file
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (not a complete checkpoint)") from None
    except Exception as e:
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(md, dcp_metadata.Metadata):
        raise CheckpointError(f"{file}: expected DCP Metadata, got {_describe(md)}")
    return md


class _CheckedReader(FileSystemReader):
    """DCP's file reader, handing DCP the metadata already read by ``_MetadataUnpickler``."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that each non-tensor item (optimizer hyper-
    parameters and the like, pickled by DCP) must pass a weights-only load first; DCP's own
    ``torch.load(weights_only=False)`` then reads bytes known to hold no code."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{self.path}: item {read_item.dest_index.fqn!r} refused by a weights-only "
                f"load, which runs no code from the file ({_why(e)})"
            ) from e
        value.seek(0)
        super().load_bytes(read_item, value)


def _agree_on_errors(error: str | None) -> None:
    """Every rank raises when any rank's files were bad (collective): a rank that failed alone
    would leave the others waiting in the next collective."""
    if not _dist():
        if error is not None:
            raise CheckpointError(error)
        return
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError("; ".join(bad))


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict:
    """Load a checkpoint into ``model``/``optimizer`` (resharding as needed); return ``extra``.

    Collective: every rank calls it. Every file is read without running code from it (see the
    module docstring); a bad file is a ``CheckpointError`` naming it, raised on every rank.
    """
    path = Path(path)
    error = None
    try:
        metadata = _read_metadata(path)
        extra = _load_weights_only(path / "trainer_state.pt")
        _check_trainer_state(extra, path / "trainer_state.pt")
        rng_file = path / f"rng_rank{_rank()}.pt"
        if not rng_file.is_file():
            warnings.warn(
                f"{path} has no RNG state for rank {_rank()} (saved by fewer ranks); this "
                "rank continues with rank 0's RNG stream",
                stacklevel=2,
            )
            rng_file = path / "rng_rank0.pt"
        rng = _load_weights_only(rng_file)
        _check_rng_state(rng, rng_file)
    except CheckpointError as e:
        error = str(e)
    _agree_on_errors(error)

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(
            state,
            checkpoint_id=str(path),
            storage_reader=_CheckedReader(path, metadata),
            planner=_WeightsOnlyPlanner(path),
            no_dist=_no_dist(),
        )
    except CheckpointException as e:  # DCP gathered every rank's failure: the same on all
        ours = [(r, exc) for r, (exc, _) in e.failures.items() if isinstance(exc, CheckpointError)]
        if ours:
            raise CheckpointError("; ".join(f"rank {r}: {exc}" for r, exc in ours)) from None
        raise
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _set_rng_state(rng)
    return extra
