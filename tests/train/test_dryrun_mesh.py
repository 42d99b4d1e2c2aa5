"""The dry run on a 2-D mesh in one process: the table's mesh-dim column, one link per mesh
dim, and bad links. (Its counts against a real 4-rank 2 x 2 run: ``test_comm2d_dist.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmdgt.train import ParallelismConfig, TrainConfig, TrainingConfig
from spmdgt.train._dryrun import DryRunError, dry_run
from tests.train._models import IN, OUT, TP_HIDDEN, make_model, make_optimizer

TP_PLAN = {"up": "colwise", "down": "rowwise", "norm": "replicate"}
CONFIG = TrainConfig(
    strategy="fsdp",
    placements=TP_PLAN,
    parallelism=ParallelismConfig(dp_shard=2, tp=2),
    training=TrainingConfig(max_grad_norm=0.5),
)


def _build():
    model = make_model(hidden=TP_HIDDEN)
    return model, make_optimizer(model), (torch.randn(3, IN), torch.randn(3, OUT))


def test_each_mesh_dim_priced_on_its_own_link():
    links = {"tp": "nvlink4", "dp_shard": "25GB/s"}
    report = dry_run(_build, 4, CONFIG, loss_fn=F.mse_loss, links=links)
    assert report.mesh == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    rows = {(r.dim, r.kind): r for r in report.collectives}
    assert set(rows) == {
        ("tp", "all_reduce"),
        ("dp_shard", "all_gather"),
        ("dp_shard", "all_reduce"),
        ("dp_shard", "reduce_scatter"),
        # the clip's norm over dp_shard x tp flattened (the world here): at the slower link
        ("world", "all_reduce"),
    }
    clip = rows[("world", "all_reduce")]
    assert clip.count == 1
    assert clip.seconds == pytest.approx(20e-6 + clip.ring_bytes / 25e9)
    tp, ag = rows[("tp", "all_reduce")], rows[("dp_shard", "all_gather")]
    # nvlink4: 10 us + ring bytes / 450 GB/s; 25 GB/s given alone: the default 20 us
    assert tp.seconds == pytest.approx(tp.count * 10e-6 + tp.ring_bytes / 450e9)
    assert ag.seconds == pytest.approx(ag.count * 20e-6 + ag.ring_bytes / 25e9)
    assert tp.ring_bytes == 2 * (2 - 1) / 2 * tp.buffer_bytes  # a ring of the 2 TP ranks
    assert report.comm_seconds == pytest.approx(sum(r.seconds for r in report.collectives))
    text = str(report)
    assert "as dp_replicate 1 x dp_shard 2 x tp 2" in text and "mesh dim" in text
    assert "tp: 10 us + ring bytes / 450.0 GB/s" in text and "\n  tp " in text
    assert report.to_dict()["collectives"][0]["dim"] == "tp"


def test_a_link_for_an_unknown_dim_is_an_error():
    with pytest.raises(DryRunError, match="a link for mesh dim 'pp'"):
        dry_run(_build, 4, CONFIG, loss_fn=F.mse_loss, links={"pp": "nvlink4"})
    with pytest.raises(DryRunError, match="bandwidth"):
        dry_run(_build, 4, CONFIG, loss_fn=F.mse_loss, links={"tp": "fast"})
