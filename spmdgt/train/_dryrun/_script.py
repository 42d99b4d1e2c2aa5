"""``dry_run_call`` / ``dry_run_script``: a user's script as rank 0 of the fake world; its
``DistributedTrainer(...).train(loader)`` dry-runs one step on the first batch and stops it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from torch import nn

from spmdgt.train._config import TrainConfig
from spmdgt.train._dryrun._api import _report, _resolve_config, _Settings
from spmdgt.train._dryrun._fake import _fake_mode, fake_world
from spmdgt.train._dryrun._report import DryRunReport
from spmdgt.train._dryrun._step import _simulate
from spmdgt.train._dryrun._tables import DryRunError
from spmdgt.train._strategies import Wrapped

__all__ = ["dry_run_call", "dry_run_script", "first_batch"]

# --------------------------------------------------------------------------- a script's trainer


class _Done(BaseException):
    """Ends the dry-run function at its ``train()`` (a BaseException: the function's own
    ``except Exception`` does not swallow it)."""

    def __init__(self, report: DryRunReport) -> None:
        super().__init__("dry run done")
        self.report = report


def first_batch(loader: object) -> object:
    """The loader's first batch, read in this process: a ``DataLoader``'s first indices from
    its batch sampler, collated (no worker processes for fake tensors); any other iterable's
    first item."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils.data import DataLoader

    if isinstance(loader, DataLoader) and loader.batch_sampler is not None:
        with _disable_current_modes():  # a sampler draws real indices (randperm().tolist())
            indices = next(iter(loader.batch_sampler))
        return loader.collate_fn([loader.dataset[i] for i in indices])
    inner = getattr(loader, "loader", None)  # a wrapper around a DataLoader
    if isinstance(inner, DataLoader):
        return first_batch(inner)
    try:
        return next(iter(loader))  # type: ignore[call-overload]
    except StopIteration:
        raise ValueError("the training loader is empty: nothing to dry-run") from None


@contextlib.contextmanager
def _intercepted_trainer(
    s: _Settings,
    mesh: object,
    fake_mode: object,
    t0: float,
    strategy: str | None,
    config: TrainConfig | str | os.PathLike | None,
) -> Iterator[None]:
    """``DistributedTrainer`` as the dry run needs it, for the duration: ``__init__`` runs as
    written (config, runtime, AMP) outside the fake mode, except that the model is kept for
    the dry run instead of wrapped; ``train(loader)`` dry-runs one step on the loader's first
    batch and ends the function with the report."""
    from torch.utils._python_dispatch import _disable_current_modes

    from spmdgt.train._trainer import DistributedTrainer

    init, train, wrap = (
        DistributedTrainer.__init__,
        DistributedTrainer.train,
        DistributedTrainer._wrap,
    )

    def keep(self: DistributedTrainer, model: nn.Module) -> Wrapped:
        self._dry_run_model = model
        return Wrapped(model, self.config.strategy, 1)

    signature = inspect.signature(init)

    @functools.wraps(init)
    def dry_init(self: DistributedTrainer, *args: object, **kwargs: object) -> None:
        bound = signature.bind(self, *args, **kwargs)
        if config is not None:
            bound.arguments["config"] = config
        if strategy is not None:
            bound.arguments["strategy"] = strategy
        with _disable_current_modes():
            init(*bound.args, **bound.kwargs)

    def dry_train(self: DistributedTrainer, train_loader: object, *args: object, **kw: object):
        cfg, notes = _resolve_config(self.config, None)
        batch = first_batch(train_loader)
        raw = _simulate(
            self._dry_run_model,
            self.optimizer,
            batch,
            cfg,
            s.world,
            mesh,
            fake_mode,
            self.loss_fn,
            self.amp_dtype,
        )
        raise _Done(_report(raw, cfg, s, t0, notes))

    DistributedTrainer.__init__ = dry_init  # type: ignore[method-assign]
    DistributedTrainer.train = dry_train  # type: ignore[method-assign]
    DistributedTrainer._wrap = keep  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedTrainer.__init__ = init  # type: ignore[method-assign]
        DistributedTrainer.train = train  # type: ignore[method-assign]
        DistributedTrainer._wrap = wrap  # type: ignore[method-assign]


@contextlib.contextmanager
def _launcher_env(world: int) -> Iterator[None]:
    """torchrun's variables for rank 0 of ``world``, for scripts that read them, and
    ``GT_DEVICE=cpu``: the fake tensors stand for any device, and stay on the CPU's."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GT_DEVICE")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", GT_DEVICE="cpu")
    os.environ["LOCAL_WORLD_SIZE"] = str(min(world, 8))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
) -> DryRunReport:
    """Dry-run the first ``DistributedTrainer(...).train(loader)`` that ``fn()`` reaches.

    ``fn`` runs as rank 0 of a fake ``world`` (torchrun's variables set, the fake process
    group made, every tensor fake), its trainer is built as written, and its ``train`` runs
    one dry step on the loader's first batch and ends ``fn`` there. ``config`` (a
    ``TrainConfig`` or YAML path) and ``strategy`` replace what the trainer is given.
    ``links`` gives a mesh dim its own interconnect or bandwidth (``dry_run``'s).
    Raises ``DryRunError`` when ``fn`` returns without training."""
    t0 = time.perf_counter()
    s = _Settings.resolve(
        world, device_memory, device, bandwidth, latency, interconnect, headroom, links
    )
    fake = _fake_mode()
    _forget_runtime()  # a runtime this process made before (a world of one) is not this one
    try:
        with (
            _launcher_env(world),
            fake_world(world) as mesh,
            _intercepted_trainer(s, mesh, fake, t0, strategy, config),
            fake,
        ):
            fn()
    except _Done as done:
        return done.report
    finally:
        _forget_runtime()
    raise DryRunError(
        "the dry-run function ended without calling DistributedTrainer(...).train(loader): "
        "nothing to dry-run"
    )


def _forget_runtime() -> None:
    """spmdgt's runtime adopted the fake group: forget it (the group itself is gone)."""
    from spmdgt._core.session import session

    parts = [p for p in ("meshes", "runtime") if p in session.parts()]
    if parts:
        session.reset(*parts)


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
