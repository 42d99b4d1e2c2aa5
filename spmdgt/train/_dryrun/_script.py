"""``dry_run_call`` / ``dry_run_script``: a user's script as rank 0 of the fake world
(``DrySession``); its ``DistributedTrainer(...)`` is built as written, on the fake backend, and
its ``train(loader)`` measures two of its own steps on the first batch and stops the script.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from spmdgt.train._config import TrainConfig
from spmdgt.train._dryrun._api import _report, _resolve_config, _Settings
from spmdgt.train._dryrun._fake import _backend_memory
from spmdgt.train._dryrun._report import DryRunReport
from spmdgt.train._dryrun._session import DrySession
from spmdgt.train._dryrun._tables import DryRunError

__all__ = ["dry_run_call", "dry_run_script"]

# --------------------------------------------------------------------------- a script's trainer


class _Done(BaseException):
    """Ends the dry-run function at its ``train()`` (a BaseException: the function's own
    ``except Exception`` does not swallow it)."""

    def __init__(self, report: DryRunReport) -> None:
        super().__init__("dry run done")
        self.report = report


def dry_run_call(
    fn: Callable[[], object],
    world: int,
    *,
    config: TrainConfig | str | os.PathLike | None = None,
    strategy: str | None = None,
    device_memory: float | str | None = None,
    device: str | None = None,
    bandwidth: float | str | None = None,
    latency: float | str | None = None,
    interconnect: str | None = None,
    headroom: float = 0.1,
    links: Mapping[str, str] | None = None,
    backend: str = "nccl",
) -> DryRunReport:
    """Dry-run the first ``DistributedTrainer(...).train(loader)`` that ``fn()`` reaches.

    ``fn`` runs as rank 0 of a fake ``world`` (torchrun's variables set, the fake process
    group made, every tensor fake), its trainer is built as written, and its ``train`` runs
    one dry step on the loader's first batch and ends ``fn`` there. ``config`` (a
    ``TrainConfig`` or YAML path) and ``strategy`` replace what the trainer is given.
    ``links`` gives a mesh dim its own interconnect or bandwidth (``dry_run``'s);
    ``backend`` whose collectives' memory is modelled (``dry_run``'s: ``gloo`` copies a
    reduce-scatter's input, ``nccl`` does not). Raises ``DryRunError`` when ``fn`` returns
    without training."""
    t0 = time.perf_counter()
    _backend_memory(backend)  # an unknown backend: refused before anything runs
    s = _Settings.resolve(
        world, device_memory, device, bandwidth, latency, interconnect, headroom, links
    )
    if config is not None:
        _resolve_config(config, strategy)  # a bad config or strategy: refused before running

    def done(raw: dict, cfg: TrainConfig, notes: list[str]) -> None:
        raise _Done(_report(raw, cfg, s, t0, notes))

    session = DrySession(world, config=config, strategy=strategy, on_report=done, backend=backend)
    try:
        with session.world_of_ranks(), session.fake:
            fn()
    except _Done as finished:
        return finished.report
    raise DryRunError(
        "the dry-run function ended without calling DistributedTrainer(...).train(loader): "
        "nothing to dry-run"
    )


def dry_run_script(
    path: str | os.PathLike, argv: Sequence[str] = (), world: int = 1, **options: object
) -> DryRunReport:
    """``dry_run_call`` of a script file run as ``__main__`` with ``argv`` (its
    ``sys.argv[1:]``); ``options`` are ``dry_run_call``'s."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DryRunError(f"no such script: {path}")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        return dry_run_call(
            lambda: runpy.run_path(path, run_name="__main__"),
            world,
            **options,  # type: ignore[arg-type]
        )
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
