"""The trainer on a 2-D/3-D mesh (``parallelism``) equals one-process torch on the same data.

Four gloo ranks. ``dp_shard=2 x tp=2`` (FSDP2 over tensor-parallel DTensors) and
``dp_replicate=2 x dp_shard=2`` (HSDP) each train a few AdamW steps with clipping on a batch
of 3 rows per data-parallel rank (6 global: not a power of two); every step's loss and the
final full weights must equal the one-process reference at 1e-5 (fp32; the differences are
sum-order rounding, ~1e-7). A bad ``parallelism`` block is a ``ConfigError`` on every rank.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.distributed.tensor.parallel
import torch.nn.functional as F

from spmdgt.config import ConfigError
from spmdgt.train import (
    DistributedTrainer,
    OptimizedDataLoader,
    ParallelismConfig,
    TrainConfig,
    override,
)
from spmdgt.train._layout import build_layout, describe_groups
from tests._dist import run_ranks
from tests.train._models import (
    HIDDEN,
    TP_HIDDEN,
    full_state,
    make_dataset,
    make_model,
    make_optimizer,
    reference_train,
)

PER_DP_RANK, STEPS, CLIP = 3, 4, 0.5  # 48 rows: 4 steps of 12 under HSDP
TP_PLAN = {"up": "colwise", "down": "rowwise", "norm": "replicate"}


def _train(rank: int, world: int, parallelism: dict, hidden: int, strategy: str = "fsdp") -> tuple:
    torch.set_num_threads(1)
    model = make_model(hidden=hidden)
    cfg = TrainConfig(
        strategy=strategy,
        placements=TP_PLAN if parallelism.get("tp", 1) > 1 else {},
        parallelism=ParallelismConfig(**parallelism),
    )
    trainer = DistributedTrainer(
        model, make_optimizer(model), loss_fn=F.mse_loss, max_grad_norm=CLIP, config=cfg
    )
    loader = OptimizedDataLoader.create(
        make_dataset(),
        PER_DP_RANK,
        shuffle=False,
        num_replicas=trainer.data_parallel_size,
        rank=trainer.data_parallel_rank,
    )
    summary = trainer.train(loader, max_steps=STEPS)
    dp = (trainer.data_parallel_rank, trainer.data_parallel_size)
    if parallelism.get("tp", 1) > 1 and parallelism.get("dp_shard", 1) > 1:
        summary["norm_all_reduces"] = _norm_all_reduces(trainer.layout.mesh)
    return full_state(trainer.model), trainer.last_stats.global_losses, summary, dp


def _norm_all_reduces(mesh) -> int:
    """All-reduces of a 2-norm partial over dp_shard and tp (the clip's, of FSDP x TP
    gradients) made whole: one over the two dims flattened, and one process's value."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    full = torch.arange(35.0).reshape(5, 7)  # uneven on both dims
    x = distribute_tensor(full, mesh["dp_shard", "tp"], [Shard(0), Shard(1)])
    norm = torch.linalg.vector_norm(x)
    assert all(p.is_partial() for p in norm.placements), norm.placements
    with CommDebugMode() as comm:
        got = norm.full_tensor()
    torch.testing.assert_close(got, torch.linalg.vector_norm(full))
    return comm.get_total_counts()


def _check(results: list, hidden: int, dp_size: int) -> float:
    ref, ref_losses = reference_train(
        make_dataset(), PER_DP_RANK * dp_size, STEPS, max_grad_norm=CLIP, hidden=hidden
    )
    worst = 0.0
    for state, losses, summary, _ in results:
        assert summary["num_steps"] == STEPS
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=k)
            worst = max(worst, float((state[k] - v).abs().max()))
        got, want = torch.tensor(losses), torch.tensor(ref_losses)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        worst = max(worst, float((got - want).abs().max()))
    return worst


def test_fsdp_over_tp_2x2_matches_single_process(tmp_path):
    out = run_ranks(_train, 4, tmp_path, {"dp_shard": 2, "tp": 2}, TP_HIDDEN, timeout=180)
    # rank = dp_rank * tp + tp_rank: both TP ranks of a data group read the same rows
    assert [r[3] for r in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # the clip's norm: one all-reduce over dp_shard x tp (before: two, one per dim)
    assert [r[2]["norm_all_reduces"] for r in out] == [1] * 4
    print("max |diff| vs one process (dp_shard=2 x tp=2):", _check(out, TP_HIDDEN, 2))


def test_hsdp_2x2_matches_single_process(tmp_path):
    # HIDDEN=11: every dim-0 shard is uneven (6/5) over dp_shard.
    out = run_ranks(_train, 4, tmp_path, {"dp_replicate": 2, "dp_shard": 2}, HIDDEN, timeout=180)
    assert [r[3] for r in out] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    print("max |diff| vs one process (dp_replicate=2 x dp_shard=2):", _check(out, HIDDEN, 4))


def test_ddp_over_both_data_dims_and_pure_tp_match_single_process(tmp_path):
    # ddp with dp_replicate=2 x dp_shard=2: one DDP group over both data dims.
    for sub in ("ddp", "tp"):
        (tmp_path / sub).mkdir()
    out = run_ranks(_train, 4, tmp_path / "ddp", {"dp_replicate": 2, "dp_shard": 2}, HIDDEN, "ddp")
    print("max |diff| vs one process (ddp 2 x 2):", _check(out, HIDDEN, 4))
    # placements with tp=4: tensor parallelism alone, every rank one data group.
    out = run_ranks(_train, 4, tmp_path / "tp", {"dp_shard": 1, "tp": 4}, TP_HIDDEN, "placements")
    assert [r[3] for r in out] == [(0, 1)] * 4
    print("max |diff| vs one process (placements tp=4):", _check(out, TP_HIDDEN, 1))


def _loaders_written_as_for_1d(rank: int, world: int) -> tuple:
    """fsdp x tp on 2 x 2 with loaders written as for the 1-D world: ``OptimizedDataLoader
    .create`` without ``num_replicas``/``rank`` (sharded over the 4 ranks) and a plain
    ``DataLoader``; the trainer shards both over its 2 data-parallel ranks. A loader it cannot
    reshard (a list of batches, different on each rank) is still refused by the first-batch
    check, on every rank."""
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    cfg = TrainConfig(
        strategy="fsdp", placements=TP_PLAN, parallelism=ParallelismConfig(dp_shard=2, tp=2)
    )
    out = []
    for loader in (
        OptimizedDataLoader.create(make_dataset(), PER_DP_RANK, shuffle=False),
        DataLoader(make_dataset(), batch_size=PER_DP_RANK),
    ):
        model = make_model(hidden=TP_HIDDEN)
        trainer = DistributedTrainer(
            model, make_optimizer(model), loss_fn=F.mse_loss, max_grad_norm=CLIP, config=cfg
        )
        summary = trainer.train(loader, max_steps=STEPS)
        dp = (trainer.data_parallel_rank, trainer.data_parallel_size)
        out.append((full_state(trainer.model), trainer.last_stats.global_losses, summary, dp))
    model = make_model(hidden=TP_HIDDEN)
    trainer = DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, config=cfg)
    x, y = make_dataset().tensors
    try:
        trainer.train([(x[rank : rank + 3], y[rank : rank + 3])], max_steps=1)
        message = "no error"
    except ValueError as e:
        message = str(e)
    return out, message


@pytest.mark.slow
def test_loaders_written_as_for_1d_follow_the_2x2_layout(tmp_path):
    """Before: the 1-D-style loader stopped at the first batch with a ValueError asking for
    ``num_replicas=trainer.data_parallel_size, rank=trainer.data_parallel_rank``."""
    results = run_ranks(_loaders_written_as_for_1d, 4, tmp_path, timeout=240)
    for kind in range(2):
        runs = [r[0][kind] for r in results]
        assert [r[3] for r in runs] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        print("max |diff| vs one process (1-D-style loader, 2 x 2):", _check(runs, TP_HIDDEN, 2))
    for _, message in results:
        assert "tensor-parallel group" in message and "data_parallel_rank" in message, message


def _bad(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    messages = []
    for parallelism in ({"dp_shard": 3}, {"dp_shard": -1, "tp": -1}, {"tp": 0}):
        model = make_model(hidden=TP_HIDDEN)
        try:
            cfg = TrainConfig(
                strategy="fsdp", placements=TP_PLAN, parallelism=ParallelismConfig(**parallelism)
            )
            DistributedTrainer(model, make_optimizer(model), loss_fn=F.mse_loss, config=cfg)
        except ConfigError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_bad_parallelism_is_a_config_error_on_every_rank(tmp_path):
    out = run_ranks(_bad, 4, tmp_path)
    for product, two_rest, zero in out:
        assert "'parallelism'" in product and "world size 4" in product, product
        assert "dp_shard=3" in product, product
        assert "parallelism." in two_rest and "-1" in two_rest, two_rest
        assert "'parallelism.tp'" in zero and "0" in zero, zero


def test_default_parallelism_is_the_world():
    p = ParallelismConfig()
    assert p.is_default and p.resolve(4) == (1, 4, 1)
    assert ParallelismConfig(dp_replicate=2, dp_shard=1, tp=-1).resolve(8) == (2, 1, 4)
    with pytest.raises(ConfigError, match=r"parallelism\.dp_replicate"):
        ParallelismConfig(dp_replicate=True)
    with pytest.raises(ConfigError, match=r"parallelism\.tp"):
        TrainConfig(strategy="ddp", placements=TP_PLAN, parallelism=ParallelismConfig(tp=2))
    # override() (the examples' --tp/--dp-shard/--dp-replicate) validates like the YAML
    base = TrainConfig(strategy="fsdp", placements=TP_PLAN)
    cfg = override(base, tp=2, dp_replicate=2)
    assert cfg.parallelism.resolve(8) == (2, 2, 2) and base.parallelism.is_default
    with pytest.raises(ConfigError, match=r"parallelism\.tp"):
        override(TrainConfig(strategy="fsdp"), tp=2)  # no placements table
    with pytest.raises(ConfigError, match=r"parallelism\.dp_shard"):
        override(base, dp_shard=0)


class _HeadNormAttention(torch.nn.Module):
    """q/o projections around a per-head norm (Qwen3's q_norm), 2 heads of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 8)
        self.q_norm = torch.nn.LayerNorm(4)
        self.o_proj = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_proj(x)
        h = self.q_norm(h.unflatten(-1, (-1, 4))).flatten(-2)
        return self.o_proj(torch.tanh(h))


def _head_norm_grads_2d(rank: int, world: int, fsdp: bool) -> tuple:
    """One backward of ``_HeadNormAttention`` on a 2x2 mesh (tp inside, each data group its own
    batch): tensor parallel alone (``dp_mesh`` not given) or under FSDP over ``dp_shard``,
    where FSDP swaps the parameters for its own and the per-head norm's gradient is summed
    over the tp group after the backward (``Wrapped.sum_partial_grads``). Returns the norm's
    full gradient and the one-process reference: the mean over the data groups' batches."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmdgt import runtime
    from spmdgt.train._layout import Layout
    from spmdgt.train._strategies import wrap_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, ref = _HeadNormAttention(), _HeadNormAttention()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():  # a weight that is not all ones: its gradient differs per head
        for m in (model, ref):
            m.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 4))
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(1 + d)) for d in range(2)]
    table = {"q_proj": "colwise", "o_proj": "rowwise", "q_norm": "sharded_input"}
    layout = Layout(
        "fsdp",
        world,
        rank,
        torch.device("cpu"),
        runtime.get_runtime().backend,
        shape=(1, 2, 2),
        mesh=mesh,
        tp_mesh=mesh["tp"],
        dp_mesh=mesh["dp_shard"] if fsdp else None,  # None: tensor parallel alone
    )
    cfg = TrainConfig(strategy="fsdp", placements=table)
    wrapped = wrap_model(model, cfg, layout)
    # each data group its own batch: a world-wide sum would mix them
    wrapped.module(xs[rank // 2]).pow(2).mean().backward()
    wrapped.sum_partial_grads()
    grad = model.q_norm.weight.grad
    if fsdp:  # FSDP averaged over the data groups
        want = sum(torch.autograd.grad(ref(x).pow(2).mean(), ref.q_norm.weight)[0] for x in xs) / 2
        return grad.full_tensor(), want
    ref(xs[rank // 2]).pow(2).mean().backward()
    return grad, ref.q_norm.weight.grad


def test_sharded_input_gradients_sum_over_the_tp_group_only(tmp_path):
    """Also under FSDP x TP, where a hook on the original parameter never fired (FSDP2
    replaces it): the tp ranks' per-head norms drifted apart by 2 x lr in one AdamW step."""
    for fsdp in (False, True):
        (tmp_path / str(fsdp)).mkdir()
        for got, want in run_ranks(_head_norm_grads_2d, 4, tmp_path / str(fsdp), fsdp):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ checkpoints on 2-D


def _ckpt_trainer(root: str | None, parallelism: dict | None, seed: int = 0):
    from spmdgt.train import CheckpointConfig

    model = make_model(seed=seed, hidden=TP_HIDDEN)
    cfg = TrainConfig(
        strategy="fsdp",
        placements=TP_PLAN if parallelism and parallelism.get("tp", 1) > 1 else {},
        parallelism=ParallelismConfig(**(parallelism or {})),
        checkpoint=CheckpointConfig(dir=root),
    )
    return DistributedTrainer(
        model, make_optimizer(model), loss_fn=F.mse_loss, max_grad_norm=CLIP, config=cfg
    )


def _run_2x2(rank: int, world: int, root: str | None, steps: int, seed: int = 0) -> tuple:
    torch.set_num_threads(1)
    t = _ckpt_trainer(root, {"dp_shard": 2, "tp": 2}, seed)
    loader = OptimizedDataLoader.create(
        make_dataset(),
        PER_DP_RANK,
        shuffle=False,
        num_replicas=t.data_parallel_size,
        rank=t.data_parallel_rank,
    )
    t.train(loader, max_steps=steps)
    return t.global_step, t.last_stats.global_losses, full_state(t.model)


def test_a_2x2_checkpoint_resumes_on_2x2_bitwise_and_in_one_process(tmp_path):
    """fsdp x tp (2x2) saves at step 2; a fresh 2x2 run (another init: overwritten by the load)
    resumes to step 4 with the uninterrupted run's losses and weights, bitwise; the same
    checkpoint loads into one unwrapped process (DCP gathers the 2-D shards; the data
    position, 12 global samples, carries over) and continues like one-process torch (1e-5)."""
    root = str(tmp_path / "ck")
    full = run_ranks(_run_2x2, 4, tmp_path, None, STEPS)
    first = run_ranks(_run_2x2, 4, tmp_path, root, 2)
    shutil.copytree(root, tmp_path / "ck_one")  # step 2's checkpoint, for one process below
    second = run_ranks(_run_2x2, 4, tmp_path, root, STEPS, 5)
    for r in range(4):
        assert second[r][0] == STEPS
        assert first[r][1] + second[r][1] == full[r][1]  # exact float equality
        for k, v in full[r][2].items():
            assert torch.equal(second[r][2][k], v), k

    ref_state, ref_losses = reference_train(
        make_dataset(), PER_DP_RANK * 2, STEPS, max_grad_norm=CLIP, hidden=TP_HIDDEN
    )
    one = _ckpt_trainer(str(tmp_path / "ck_one"), None, seed=7)  # a world of one: unwrapped
    one.train(
        OptimizedDataLoader.create(make_dataset(), PER_DP_RANK * 2, shuffle=False), max_steps=STEPS
    )
    assert one.global_step == STEPS
    losses = first[0][1] + one.last_stats.global_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(one.model.state_dict()[k], v, atol=1e-5, rtol=0)


def _groups_line(rank: int, world: int, node_of_rank: list[int]) -> str | None:
    import os

    os.environ["GROUP_RANK"] = str(node_of_rank[rank])  # torchrun's node rank
    layout = build_layout(
        ParallelismConfig(dp_shard=2, tp=2), "fsdp", world, rank, torch.device("cpu")
    )
    return describe_groups(layout)


def test_the_log_names_each_tp_group_and_flags_one_that_spans_nodes(tmp_path):
    for sub in ("inside", "across"):
        (tmp_path / sub).mkdir()
    lines = run_ranks(_groups_line, 4, tmp_path / "inside", [0, 0, 1, 1])  # torchrun's order
    assert lines[0] == (
        "mesh dp_replicate x dp_shard x tp = 1x2x2; tp groups: [0, 1] on node 0; [2, 3] on node 1"
    )
    assert len(set(lines)) == 1  # every rank builds the same line (rank 0 prints it)
    lines = run_ranks(_groups_line, 4, tmp_path / "across", [0, 1, 0, 1])  # ranks interleaved
    assert "[0, 1] on node 0, node 1 SPANS NODES" in lines[0], lines[0]
    layout = build_layout(ParallelismConfig(), "fsdp", 1, 0, torch.device("cpu"))
    assert describe_groups(layout) is None  # the 1-D world: nothing said, no collective
