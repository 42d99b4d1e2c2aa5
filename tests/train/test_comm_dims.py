"""A run's communication per mesh dim, in one process: the logged collectives of each step go
to their dim (``Run.comm_by_dim``), the summary's per-dim figures leave out the warm-up, and a
1-D run (every collective on the ``world`` group) reports nothing new."""

from __future__ import annotations

import pytest

from spmdgt.train import TrainConfig, TrainingConfig
from spmdgt.train._comm import CollectiveLog, _Record
from spmdgt.train._run import Run, attribute_collectives, comm_dim_summary
from spmdgt.train._summary import MetricsLogger, ProgressBar, RunStats


def _run(steps: int) -> Run:
    stats = RunStats()
    stats.step_times = [0.1] * steps
    return Run(
        cfg=TrainConfig(training=TrainingConfig(warmup_steps=1)),
        stats=stats,
        metrics=MetricsLogger(None, False),
        bar=ProgressBar(None, False),
        prof=None,
        sink=None,
        own_interceptor=False,
        params=[],
        dp=1,
        compile_at_start=0.0,
        checked_batch=True,
    )


def _log(records: list[tuple[str, str, int, int, float]]) -> CollectiveLog:
    log = CollectiveLog()
    for dim, kind, nbytes, step, sec in records:
        log.records.append(_Record(kind, nbytes, 1.0, step, 1.0 + sec, dim))
    return log


def test_per_dim_figures_per_step_and_in_the_summary():
    run = _run(3)
    log = _log(
        [
            ("dp_shard", "all_gather", 1000, 0, 0.5),  # step 0: the warm-up, left out
            ("tp", "all_reduce", 100, 1, 0.002),
            ("tp", "all_reduce", 100, 1, 0.002),
            ("dp_shard", "all_gather", 1000, 1, 0.004),
            ("tp", "all_reduce", 100, 2, 0.002),
            ("dp_shard", "reduce_scatter", 3000, 2, 0.006),
        ]
    )
    assert attribute_collectives(run, log, "fsdp2_collective_hooks") == "fsdp2_collective_hooks"
    assert run.stats.collectives == [1, 3, 2]
    assert run.comm_by_dim["tp"]["collectives"] == [0, 2, 1]
    assert run.comm_by_dim["dp_shard"]["bytes"] == [1000, 1000, 3000]
    got = comm_dim_summary(run)
    assert got["comm_tp_collectives_per_step"] == 1.5
    assert got["comm_dp_shard_mb_per_step"] == pytest.approx(0.002)
    assert got["comm_dp_shard_ms_per_step"] == pytest.approx(5.0)
    assert got["comm_tp_ms_per_step"] == pytest.approx(3.0)
    assert log.totals_by_dim()["tp"]["all_reduce"]["count"] == 3


class _Writer:
    """TensorBoard's ``add_scalar``, kept in a dict."""

    def __init__(self) -> None:
        self.scalars: dict[tuple[str, int], float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[(tag, step)] = value


def test_tensorboard_gets_per_dim_scalars_per_step():
    run = _run(2)
    run.metrics.writer = _Writer()
    log = _log([("tp", "all_reduce", 2_000_000, 0, 0.25), ("dp_shard", "all_gather", 10, 1, 0.5)])
    attribute_collectives(run, log, "fsdp2_collective_hooks")
    got = run.metrics.writer.scalars
    assert got[("comm/tp/collectives", 1)] == 1 and got[("comm/tp/collectives", 2)] == 0
    assert got[("comm/tp/mb", 1)] == 2.0 and got[("comm/dp_shard/sec", 2)] == 0.5
    one_d = _run(1)
    one_d.metrics.writer = _Writer()
    attribute_collectives(one_d, _log([("world", "all_reduce", 8, 0, 0.1)]), "ddp_comm_hook")
    assert one_d.metrics.writer.scalars == {}  # a 1-D run's TensorBoard is what it was


def test_a_1d_run_reports_what_it_reported():
    run = _run(2)
    log = _log([("world", "all_reduce", 400, 0, 0.001), ("world", "all_reduce", 400, 1, 0.001)])
    attribute_collectives(run, log, "ddp_comm_hook")
    assert run.stats.collectives == [1, 1]
    assert comm_dim_summary(run) == {}
    unmeasured = _run(2)
    assert attribute_collectives(unmeasured, CollectiveLog(), None) is None
    assert comm_dim_summary(unmeasured) == {}
