"""A checkpoint directory is data, not code, and resumes only its own checkpoints.

``latest`` naming ``../other_run/step_...`` once resumed another run; a pickle in any file of a
checkpoint ran code at load. Now: ``latest`` and the ``step_<n>`` entries must resolve inside
the directory (a ``CheckpointError`` naming the file and value otherwise), every file loads
without running code (an error naming the file), and on 2 ranks every rank raises together.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp  # imported before fork: children inherit it
from torch.distributed.checkpoint.state_dict import get_state_dict

from spmdgt.train import OptimizedDataLoader
from spmdgt.train._checkpoint import CheckpointError, find_latest
from tests._dist import run_ranks
from tests.train._models import make_dataset
from tests.train.test_checkpoint import _trainer


class _Evil:
    """Unpickling it creates the directory ``marker``: proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _loader(bs=8):
    return OptimizedDataLoader.create(make_dataset(), bs, shuffle=False)


def _t(root: Path | None, **kw):
    return _trainer("ddp", None if root is None else str(root), dropout=0.0, sched=False, **kw)


def _run(root: Path, steps: int):
    t = _t(root)
    t.train(_loader(), epochs=1, max_steps=steps)  # saves step_<steps> at the end
    return t


@pytest.fixture
def two_runs(tmp_path):
    """``run/`` with step 2 and ``other_run/`` with step 3 (its own, different weights)."""
    _run(tmp_path / "other_run", 3)
    _run(tmp_path / "run", 2)
    return tmp_path / "run", tmp_path / "other_run"


def test_latest_pointing_outside_is_an_error(two_runs):
    run, _ = two_runs
    (run / "latest").write_text("../other_run/step_00000003\n")
    with pytest.raises(CheckpointError) as e:
        _t(run).train(_loader(), epochs=1)
    msg = str(e.value)
    assert str(run / "latest") in msg and "'../other_run/step_00000003'" in msg


def test_symlinked_step_outside_is_an_error(two_runs):
    run, other = two_runs
    (run / "step_00000009").symlink_to(other / "step_00000003", target_is_directory=True)
    (run / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match=r"resolves to .*other_run/step_00000003, outside"):
        find_latest(run)
    (run / "latest").unlink()  # the scan confines what it finds the same way
    with pytest.raises(CheckpointError, match="step_00000009: a checkpoint entry"):
        _t(run).train(_loader(), epochs=1)


def test_latest_naming_a_deleted_step_falls_back_with_a_warning(tmp_path):
    run = tmp_path / "run"
    t = _t(run, every=2)
    t.train(_loader(), epochs=1, max_steps=4)  # step_2, step_4
    (run / "latest").write_text("step_00000006\n")  # well-formed, inside, but not there
    with pytest.warns(UserWarning, match="'step_00000006', which is missing or incomplete"):
        assert find_latest(run) == run / "step_00000004"


def _tamper_trainer_state(ck: Path, marker: Path) -> str:
    torch.save({"step": _Evil(marker)}, ck / "trainer_state.pt")
    return str(ck / "trainer_state.pt")


def _tamper_rng(ck: Path, marker: Path) -> str:
    torch.save(_Evil(marker), ck / "rng_rank0.pt")
    return str(ck / "rng_rank0.pt")


def _tamper_metadata(ck: Path, marker: Path) -> str:
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    return str(ck / ".metadata")


def _tamper_dcp_item(ck: Path, marker: Path) -> str:
    # A real DCP checkpoint whose optimizer hyper-parameter 'maximize' is a pickled payload.
    t = _t(None)
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
    optim_sd["param_groups"][0]["maximize"] = _Evil(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ck), no_dist=True)
    return "maximize"


@pytest.mark.parametrize(
    "tamper", [_tamper_trainer_state, _tamper_rng, _tamper_metadata, _tamper_dcp_item]
)
def test_no_file_of_a_checkpoint_runs_code(tmp_path, tamper):
    run = tmp_path / "run"
    _run(run, 2)
    marker = tmp_path / "code_ran"
    named = tamper(run / "step_00000002", marker)
    with pytest.raises(CheckpointError) as e:
        _t(run).train(_loader(), epochs=1)
    assert not marker.exists()  # nothing from the file was executed
    assert named in str(e.value) and "step_00000002" in str(e.value)


def _bad_files_on_two_ranks(rank, world, root):
    import torch.distributed as dist

    root = Path(root)
    loader = OptimizedDataLoader.create(make_dataset(), 4, shuffle=False)
    _t(root / "run").train(loader, max_steps=2)
    if rank == 0:
        (root / "run" / "latest").write_text("../elsewhere/step_00000002\n")
    dist.barrier()  # rank 0's edit is on disk before anyone resumes
    errors = []
    try:
        _t(root / "run").train(loader, epochs=1)
    except CheckpointError as e:
        errors.append(str(e))
    dist.barrier()
    if rank == 0:  # a good latest, but rank 1's RNG file is a payload: rank 0 must not wait
        (root / "run" / "latest").write_text("step_00000002\n")
        torch.save(_Evil(root / "code_ran"), root / "run" / "step_00000002" / "rng_rank1.pt")
    dist.barrier()
    try:
        _t(root / "run").train(loader, epochs=1)
    except CheckpointError as e:
        errors.append(str(e))
    return errors


def test_bad_files_raise_on_every_rank(tmp_path):
    for errors in run_ranks(_bad_files_on_two_ranks, 2, tmp_path, str(tmp_path), timeout=90):
        assert len(errors) == 2, errors
        assert "'../elsewhere/step_00000002'" in errors[0] and "latest" in errors[0]
        assert "rank 1: " in errors[1] and "rng_rank1.pt" in errors[1]
    assert not (tmp_path / "code_ran").exists()


class _Schedule:
    """A callable lr factor whose state holds an object a weights-only load refuses."""

    def __init__(self) -> None:
        self.note = _Evil(Path("unused"))

    def __call__(self, step: int) -> float:
        return 1.0


def test_state_that_only_code_could_load_is_refused_at_save(tmp_path):
    t = _t(tmp_path / "run")
    t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, _Schedule())
    with pytest.raises(CheckpointError, match=r"the trainer state .* weights-only load refuses"):
        t.train(_loader(), epochs=1, max_steps=1)  # saves at the end: refused before writing
    assert not any((tmp_path / "run").glob("*step_*"))  # nothing half-written
