"""A checkpoint written on one mesh resumes on another: 2x2 (fsdp x tp), 4x1 (fsdp over 4),
1x4 (tensor parallel over 4) and one process, in both directions.

The model has uneven shapes on purpose: a vocabulary of 13 and a width of 7, so FSDP's dim-0
shards come out 7/6 over 2 ranks and 4/4/4/1 over 4 (only the tensor-parallel hidden dim, 12,
splits evenly: torch's colwise -> rowwise hand-off needs it). Every run reads the same global
batch of 12 rows a step (12 per rank in one process, 6 on 2 data-parallel ranks, 3 on 4).

For each (saved on, loaded on) pair: the full model and AdamW state gathered right after the
load equal, bit for bit, the full state the saving run had at the checkpoint (DCP reshards by
copying, no arithmetic), and the resumed run's losses equal the uninterrupted run's (bitwise on
the same mesh; 1e-5 across meshes, where the reductions' order differs: ~1e-7 in fp32).

The directions share one 4-rank start (each start costs seconds here): every rank runs the
three source meshes and then every load in turn; the one-process runs are in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint  # imported before fork: children inherit it
import torch.distributed.tensor.parallel
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from spmdgt.train import (
    CheckpointConfig,
    DistributedTrainer,
    OptimizedDataLoader,
    ParallelismConfig,
    TrainConfig,
)
from spmdgt.train._config import SchedulerConfig, TrainingConfig
from tests._dist import run_ranks

VOCAB, WIDTH, FFN = 13, 7, 12  # 13 and 7: uneven FSDP shards; 12 splits over tp=2 and tp=4
GLOBAL_BATCH, SAVE_AT, STEPS, CLIP = 12, 2, 4, 0.5
PLAN = {"up": "colwise", "down": "rowwise", "embed": "replicate", "norm": "replicate"}
PLAN["head"] = "replicate"

# name -> (parallelism, strategy); "1" is one process (no process group, nothing wrapped)
MESHES = {
    "2x2": ({"dp_shard": 2, "tp": 2}, "fsdp"),
    "4x1": ({"dp_shard": 4}, "fsdp"),
    "1x4": ({"dp_shard": 1, "tp": 4}, "placements"),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, "fsdp"),  # 2 replicas of FSDP over 2
    "1": ({}, "fsdp"),
}
# (saved on, loaded on): 2x2 to every other mesh and back, and 2x2 to itself and to HSDP
PAIRS = [
    ("2x2", "2x2"),
    ("2x2", "4x1"),
    ("2x2", "1x4"),
    ("2x2", "1"),
    ("2x2", "hsdp"),
    ("4x1", "2x2"),
    ("1x4", "2x2"),
    ("1", "2x2"),
]


class TinyLM(nn.Module):
    """Embedding -> colwise up -> rowwise down -> norm -> head: a next-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, FFN)
        self.down = nn.Linear(FFN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.norm(h + self.down(torch.relu(self.up(h)))))


def _dataset(n: int = GLOBAL_BATCH * STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (n,), generator=g)
    return TensorDataset(x, (x * 5 + 1) % VOCAB)


def _trainer(mesh: str, root: str | None, seed: int) -> DistributedTrainer:
    torch.manual_seed(seed)
    model = TinyLM()
    parallelism, strategy = MESHES[mesh]
    cfg = TrainConfig(
        strategy=strategy,
        placements=PLAN if parallelism.get("tp", 1) > 1 else {},
        parallelism=ParallelismConfig(**parallelism),
        checkpoint=CheckpointConfig(dir=root, resume=False, keep_last=10),
        training=TrainingConfig(
            max_grad_norm=CLIP,
            scheduler=SchedulerConfig(type="linear", warmup_steps=1, total_steps=8),
        ),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    return DistributedTrainer(model, opt, loss_fn=F.cross_entropy, config=cfg)


def _loader(t: DistributedTrainer):
    dp = t.data_parallel_size
    return OptimizedDataLoader.create(
        _dataset(),
        GLOBAL_BATCH // dp,
        shuffle=True,  # the sampler's permutation is the same whatever the data-parallel size
        seed=5,
        num_replicas=dp,
        rank=t.data_parallel_rank,
    )


def _full(t: DistributedTrainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full tensors, keyed by parameter name (same on every
    rank), plus the trainer's counters and the scheduler's learning rate."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer, options=opts)
    out = {}
    for k, v in model_sd.items():
        out[f"model.{k}"] = v
    for fqn, state in optim_sd["state"].items():
        for name, v in state.items():
            out[f"optim.{fqn}.{name}"] = v
    out = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in out.items()}
    out = {k: v.detach().clone().cpu() for k, v in out.items()}
    out["trainer.step"] = torch.tensor(t.global_step)
    out["trainer.samples_in_epoch"] = torch.tensor(t._samples_in_epoch)
    out["trainer.lr"] = torch.tensor(t.optimizer.param_groups[0]["lr"], dtype=torch.float64)
    return out


def _source(mesh: str, root: str) -> dict:
    """Train to SAVE_AT (the run's end saves a checkpoint), note the full state, then go on to
    STEPS: the uninterrupted run (the same trainer, nothing reloaded)."""
    t = _trainer(mesh, root, seed=0)
    loader = _loader(t)
    t.train(loader, max_steps=SAVE_AT)
    state = _full(t)
    losses = list(t.last_stats.global_losses)
    t.train(loader, max_steps=STEPS)
    return {"state": state, "losses": losses + t.last_stats.global_losses}


def _resume(mesh: str, path: str) -> dict:
    """A fresh trainer (another init: the load must overwrite it) loads ``path``, notes the
    full state, and trains on to STEPS."""
    t = _trainer(mesh, None, seed=9)
    t.load_checkpoint(path)
    state = _full(t)
    t.train(_loader(t), max_steps=STEPS)
    return {"state": state, "losses": t.last_stats.global_losses}


def _ckpt(root, mesh: str) -> str:
    return str(root / mesh / f"step_{SAVE_AT:08d}")


def _four_ranks(rank: int, world: int, root) -> dict:
    torch.set_num_threads(1)
    out = {f"src:{m}": _source(m, str(root / m)) for m in ("2x2", "4x1", "1x4")}
    for saved, loaded in PAIRS:
        if loaded != "1":
            out[f"{saved}->{loaded}"] = _resume(loaded, _ckpt(root, saved))
    return out


def _compare(src: dict, got: dict) -> tuple[bool, float]:
    """Whether the loaded state equals the saved one bit for bit, and the resumed losses'
    largest difference from the uninterrupted run's."""
    assert src["state"].keys() == got["state"].keys()
    for k, v in src["state"].items():
        assert torch.equal(got["state"][k], v), k
    want = torch.tensor(src["losses"][SAVE_AT:], dtype=torch.float64)
    have = torch.tensor(got["losses"], dtype=torch.float64)
    assert have.shape == want.shape == (STEPS - SAVE_AT,)
    return True, float((have - want).abs().max())


# slow (4 ranks, ~20 s on 2 cores): tests/train/test_mesh2d_dist.py resumes a 2x2 checkpoint
# on 2x2 bitwise and in one process (a reshard) in the default suite
@pytest.mark.slow
def test_checkpoints_resume_across_2x2_4x1_1x4_and_one_process(tmp_path):
    sources = {"1": _source("1", str(tmp_path / "1"))}
    results = run_ranks(_four_ranks, 4, tmp_path, tmp_path, timeout=300)
    for r in results[1:]:  # every rank gathered the same full state and losses
        for k, v in r.items():
            assert v["losses"] == results[0][k]["losses"], k
    sources.update({m: results[0][f"src:{m}"] for m in ("2x2", "4x1", "1x4")})
    resumed = {k: v for k, v in results[0].items() if "->" in k}
    resumed["2x2->1"] = _resume("1", _ckpt(tmp_path, "2x2"))

    rows = ["saved on | loaded on | weights+optimizer equal | resumed losses max |diff|"]
    for saved, loaded in PAIRS:
        equal, diff = _compare(sources[saved], resumed[f"{saved}->{loaded}"])
        rows.append(f"{saved:>8} | {loaded:>9} | {'bitwise' if equal else 'NO':>23} | {diff:.3g}")
        if saved == loaded:
            assert diff == 0.0  # the same mesh: the same reductions, bit for bit
        else:
            # Another mesh sums the batch and the norm in another order: fp32 rounding only.
            assert diff <= 1e-5, (saved, loaded, diff)
    # Every mesh's uninterrupted run agrees with one process (the same global batches).
    for m in ("2x2", "4x1", "1x4"):
        got, want = torch.tensor(sources[m]["losses"]), torch.tensor(sources["1"]["losses"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    print("\n" + "\n".join(rows))


# ------------------------------------------------------------------ the data position


def _rounds(samplers: list) -> list[int]:
    """The global order the ranks' samplers deal, round by round (rank 0's, rank 1's, ...)."""
    promised = [len(s) for s in samplers]  # before iterating: the start is for one epoch
    per_rank = [list(s) for s in samplers]
    assert [len(p) for p in per_rank] == promised  # len() tells the truth
    assert len(set(promised)) == 1  # equal counts: equal steps on every rank
    return [i for round_ in zip(*per_rank) for i in round_]


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_sampler_continues_at_a_global_sample_on_any_number_of_replicas(drop_last):
    from spmdgt.train import ResumableDistributedSampler

    data = list(range(23))  # 23: no replica count here divides it

    def samplers(replicas: int, start: int) -> list:
        out = []
        for r in range(replicas):
            s = ResumableDistributedSampler(
                data, num_replicas=replicas, rank=r, shuffle=True, seed=4, drop_last=drop_last
            )
            s.set_epoch(2)
            if start:
                s.start_after(start)
            out.append(s)
        return out

    order = _rounds(samplers(1, 0))  # the epoch's global order (one replica: no padding)
    assert sorted(order) == data and order != data  # shuffled
    for old in (1, 2, 3):
        whole = _rounds(samplers(old, 0))  # the uninterrupted run on `old` replicas
        for start in (old * 2, old * 3):  # a checkpoint after 2 or 3 rounds on `old`
            # the same replica count: exactly the uninterrupted remainder, padding included
            assert _rounds(samplers(old, start)) == whole[start:]
            for new in (1, 2, 4, 5):  # another count: the order from `start`, whatever divides
                got = _rounds(samplers(new, start))
                rest = order[start:]
                if drop_last:
                    assert got == rest[: len(rest) // new * new]
                else:  # padded to whole rounds with the start of the order, as torch pads
                    assert got[: len(rest)] == rest and len(got) == -(-len(rest) // new) * new
                    assert got[len(rest) :] == order[: len(got) - len(rest)]
    s = samplers(2, 6)[0]
    list(s)
    assert len(s) == len(list(s)) == s.num_samples  # the start applies to one epoch only


def test_a_plain_loader_refuses_a_position_that_is_not_whole_batches():
    """A ``DataLoader`` with torch's sampler can only drop whole batches: a checkpoint 24
    samples in, resumed with batches of 9, would read 6 samples twice; it is an error."""
    from torch.utils.data import DataLoader

    t = _trainer("1", None, seed=0)
    t._samples_in_epoch = 2 * GLOBAL_BATCH  # what a checkpoint 2 steps in restores
    with pytest.raises(ValueError, match=r"24 samples into epoch 0.*batch size 9 = 9"):
        t.train(DataLoader(_dataset(), batch_size=9), max_steps=STEPS)
    t._samples_in_epoch = 2 * GLOBAL_BATCH
    t.train(DataLoader(_dataset(), batch_size=6), max_steps=STEPS)  # 4 whole batches: fine
    assert t.global_step == STEPS
