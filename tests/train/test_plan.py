"""The planner (``spmdgt.train._plan``): its search space, its YAML, its memory budget, and a
winner's YAML trained for real on 2 gloo ranks against one process.

Most tests pass a hand-made ``MemoryModel`` (no dry runs: the pricing is what they check);
the last runs the command line, with the real calibration (dry runs of the example).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from spmdgt.train import TrainConfig, TrainingConfig, load_train_config
from spmdgt.train._plan import MemoryModel, config_yaml, plan
from spmdgt.train._plan._calibrate import FsdpPeak
from spmdgt.train._plan._space import enumerate_space
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "16"]


def _example():
    if "train_transformer" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "train_transformer", ROOT / "examples" / "train_transformer.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_transformer"]


def _memory(rows: int = 4) -> MemoryModel:
    """A memory model by hand: 1 MB outside the blocks and 0.5 MB per block at 4 rows."""
    keys = [(a, p) for a in (False, True) for p in (False, True)]
    return MemoryModel(
        rows=rows,
        opt_ratio=2.0,
        buffers=0,
        rest=dict.fromkeys(keys, 1e6),
        block={k: (1e5 if k[0] else 5e5) for k in keys},
        tp_keep=0.5,
        # FSDP's peak at the backward's first block of 2: 1 MB and 2 blocks' activations,
        # the root and a block gathered, one buffer
        fsdp={
            a: FsdpPeak(2, 1, 1e6 + 2 * (1e5 if a else 5e5), 1.0, 1.0, 0.0, 1e5 if a else 5e5)
            for a in (False, True)
        },
    )


@pytest.mark.parametrize("world", [1, 3, 8, 12])
def test_every_candidate_is_a_config_the_trainer_takes_for_the_world(world):
    cands, _ = enumerate_space(world, 24, tp_degrees=[1, 2, 4], per_node=8)
    assert cands
    seen = set()
    for c in cands:
        assert c not in seen  # no candidate twice
        seen.add(c)
        cfg = c.config()  # TrainConfig's own validation runs here
        r, s, t = cfg.parallelism.resolve(world)  # a ConfigError when they do not multiply
        assert r * s * t == world
        assert c.data_parallel * c.micro_batch * c.accumulation == 24
        assert cfg.training.batch_size == c.micro_batch
        assert cfg.training.gradient_accumulation_steps == c.accumulation
        assert t in (1, 2, 4) and (t == 1 or cfg.placements == "auto")
        assert cfg.strategy != "ddp" or t == 1
        assert cfg.strategy != "placements" or t == world
        # FSDP under accumulation is offered both ways; nothing else has the choice
        assert cfg.fsdp.accumulate_sharded == c.sharded_accumulation
        assert not c.sharded_accumulation or (c.strategy == "fsdp" and c.accumulation > 1)
        if c.strategy == "fsdp" and c.accumulation > 1 and not c.sharded_accumulation:
            twin = dataclasses.replace(c, sharded_accumulation=True)
            assert twin in set(cands) and twin.label() != c.label()
    kinds = {(c.strategy, c.dp_replicate, c.dp_shard, c.tp) for c in cands}
    if world == 8:  # HSDP, 2-D and degree-1 dims are all there
        assert {("fsdp", 2, 4, 1), ("fsdp", 1, 4, 2), ("fsdp", 2, 2, 2), ("ddp", 1, 8, 1)} <= kinds
    if world == 12:  # 12 x 2 rows do not split over 8 or 12 data-parallel... 24 does; 5 not
        assert all(24 % (r * s) == 0 for _, r, s, _ in kinds)


def test_sharded_accumulation_holds_a_shard_of_the_gradients_for_a_reduce_scatter_per_micro_step():
    """FSDP's two ways to accumulate, priced: with ``accumulate_sharded`` a rank holds its
    shard of the gradients between micro-steps (less memory, by the unsharded gradients
    less their shard, where the peak sits late in the backward) for one reduce-scatter per
    unit per micro-step (more communication, as many times more bytes as micro-steps)."""
    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(4, 16, dtype=torch.long)
    got = plan(
        model,
        (x, x),
        world=4,
        device="h100",
        global_batch=32,
        loss_fn=ex.lm_loss,
        memory_model=_memory(),
        micro_batches=[4],
        strategies=("fsdp",),
    )
    by = {e.candidate: e for e in got.ranked + got.dropped}
    pairs = [
        (e, by[dataclasses.replace(c, sharded_accumulation=True)])
        for c, e in by.items()
        if c.accumulation > 1 and not c.sharded_accumulation
    ]
    assert pairs
    for plain, sharded in pairs:
        rs = "fsdp reduce-scatter"
        assert sharded.comm_parts[rs] > plain.comm_parts[rs] > 0
        assert sharded.memory <= plain.memory
    assert any(sharded.memory < plain.memory for plain, sharded in pairs)


def test_a_batch_that_does_not_split_is_noted():
    cands, notes = enumerate_space(4, 6, tp_degrees=[1, 2], per_node=8)
    assert all(c.data_parallel in (1, 2) for c in cands)
    assert any("does not split over 4 data-parallel ranks" in n for n in notes)


def test_the_yaml_round_trips_into_the_trainers_loader(tmp_path):
    base = TrainConfig(training=TrainingConfig(max_grad_norm=0.5), log_every=7)
    cands, _ = enumerate_space(8, 16, tp_degrees=[1, 2], per_node=8)
    for c in cands[:: max(1, len(cands) // 25)]:
        cfg = c.config(base)
        path = tmp_path / "plan.yaml"
        path.write_text(config_yaml(cfg, header="# a plan\n"))
        back = load_train_config(path)
        assert back == cfg
        assert back.training.max_grad_norm == 0.5 and back.log_every == 7


def test_a_budget_drops_what_does_not_fit_and_says_why():
    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(4, 16, dtype=torch.long)
    kw = dict(world=4, device="cpu", global_batch=16, loss_fn=ex.lm_loss, memory_model=_memory())
    everything = plan(model, (x, x), **kw)
    mems = sorted(e.memory for e in everything.ranked)
    assert not everything.dropped and len(set(mems)) > 2
    budget = mems[len(mems) // 2]
    cut = plan(model, (x, x), memory=budget, **kw)
    assert cut.dropped and cut.ranked
    assert len(cut.dropped) + len(cut.ranked) == len(everything.ranked)
    for e in cut.dropped:
        assert not e.fits and e.memory * 1.05 > budget
        assert e.why == (
            f"does not fit: {e.memory / 2**30:.3f} GiB + 5% > {budget / 2**30:.3f} GiB"
        )
    assert all(e.memory * 1.05 <= budget for e in cut.ranked)
    assert [e.step for e in cut.ranked] == sorted(e.step for e in cut.ranked)
    table = cut.table(limit=None, dropped=None)
    assert table.count("does not fit") == len(cut.dropped) and "winner" in table
    nothing = plan(model, (x, x), memory=1, **kw)
    assert nothing.best is None
    with pytest.raises(ValueError, match="no candidate fits"):
        nothing.config()


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    ex = _example()
    return ex.run_trainer(ex.parse_args(argv))["losses"]


def test_the_winners_yaml_trains_on_2_ranks_as_one_process(tmp_path, capsys):
    """The command line on the example (its model read at its first call, the memory
    calibrated by dry runs; checkpointing off, whose calibration ``test_plan_memory.py``
    checks, to halve the dry runs), the winner written, trained with the example as is
    (``--config``) on 2 ranks, and every step's loss compared with one process reading the
    same global batches."""
    from spmdgt.scripts.plan import main

    ex = _example()
    path = tmp_path / "plan.yaml"
    script = str(ROOT / "examples" / "train_transformer.py")
    flags = ["--world", "2", "--device", "cpu", "--global-batch", "8", "--micro-batches", "2"]
    flags += [
        "--amp",
        "off",
        "--ac",
        "off",
        "--strategies",
        "fsdp,placements",
        "--output",
        str(path),
    ]
    assert main([*flags, script, *TINY, "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "winner" in out and f"wrote {path}" in out
    cfg = load_train_config(path)
    assert cfg.strategy in ("fsdp", "placements") and cfg.training.batch_size == 2
    assert cfg.training.gradient_accumulation_steps > 1
    steps = ["--steps", "3", "--workers", "0", "--lr", "0.05"]
    got = run_ranks(_train, 2, tmp_path, [*TINY, *steps, "--config", str(path)])
    # One process: the same YAML (so the same accumulation, and the example sizes its data
    # alike), on one rank, with the 2 ranks' rows in each micro-batch.
    r, s, _ = cfg.parallelism.resolve(2)
    rows = str(cfg.training.batch_size * r * s)
    one = ["--strategy", "ddp", "--tp", "1", "--dp-shard", "1", "--dp-replicate", "1"]
    argv = [*TINY, *steps, "--config", str(path), "--batch-size", rows, *one]
    ref = ex.run_trainer(ex.parse_args(argv))["losses"]
    assert len(got[0]) == len(ref) == 3
    assert got[0] == got[1]
    # 3 AdamW steps at lr 0.05: FSDP's sums in another order, 2.8e-6 relative at step 3
    assert got[0] == pytest.approx(ref, rel=1e-5)


def test_a_links_latency_grows_with_its_group_and_the_pricing_uses_it():
    """``Link.by_size`` (measured per group size): linear between and beyond the sizes, never
    below the least; a plan priced with a 4-rank latency far above the 2-rank one ranks
    HSDP 2x2 (gathers on pairs) above FSDP over 4, and the reverse with one latency."""
    from dataclasses import replace

    from spmdgt.train._plan._device import Link

    link = Link(1e8, 4e-3, "measured", by_size=((2, 1e-3, 3e8), (4, 4e-3, 1e8)))
    assert link.at(2) == (1e-3, 3e8) and link.at(4) == (4e-3, 1e8)
    assert link.at(3) == pytest.approx((2.5e-3, 3e8))  # bandwidth: the nearest size's
    assert link.at(8)[0] == pytest.approx(10e-3)
    assert Link(1e8, 4e-3, "fixed").at(64) == (4e-3, 1e8)
    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(4, 16, dtype=torch.long)
    kw = dict(world=4, global_batch=16, loss_fn=ex.lm_loss, memory_model=_memory())
    kw.update(micro_batches=[4], ac=(False,), amp=(False,), strategies=("fsdp",))
    cpu = plan(model, (x, x), device="cpu", **kw).device
    steps = {}
    for name, lk in (("by size", link), ("fixed", Link(1e8, 1e-3, "fixed"))):
        dev = replace(cpu, intra=lk, inter=lk, op_seconds=0.0)
        got = plan(model, (x, x), device=dev, **kw)
        steps[name] = {(e.candidate.dp_replicate, e.candidate.dp_shard): e.step for e in got.ranked}
    assert steps["by size"][(2, 2)] < steps["by size"][(1, 4)]
    assert steps["fixed"][(2, 2)] > steps["fixed"][(1, 4)]


def test_loss_parallel_splits_the_bytes_outside_the_blocks_by_the_degree():
    """Under ``loss_parallel`` a rank holds the TP-2 share of the loss's bytes measured by the
    calibration, halved at each doubling of the degree; without it (``None``) all of them."""
    from spmdgt.train._plan._calibrate import rest_share

    mem = _memory()
    assert [rest_share(mem, t) for t in (1, 2, 8)] == [1.0, 1.0, 1.0]
    mem.rest_tp2 = 0.6
    assert [rest_share(mem, t) for t in (1, 2, 4, 8)] == pytest.approx([1.0, 0.6, 0.3, 0.15])
    whole = mem.dynamic(4, False, False, 8, 1)
    assert mem.dynamic(4, False, False, 8, 4) == pytest.approx(1e6 * 0.3 + 8 * 5e5 * 0.625)
    assert mem.dynamic(4, False, False, 8, 4) < whole


def test_tp_splits_a_blocks_activations_but_not_a_checkpointed_blocks_input():
    """Without checkpointing TP splits the share of a block's bytes it does not keep whole
    (``tp_keep``); with it a block saves its input alone, whole on every TP rank."""
    mem = _memory()
    one, four = mem.dynamic(4, False, False, 8, 1), mem.dynamic(4, False, False, 8, 4)
    assert four == 1e6 + 8 * 5e5 * (0.5 + 0.5 / 4) < one
    assert mem.dynamic(4, True, False, 8, 4) == mem.dynamic(4, True, False, 8, 1) == 1e6 + 8e5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hf_forward_is_counted_on_meta_tensors_as_on_real_ones(family):
    """The op-cost term: a Hugging Face forward asks whether its padding mask is all ones
    (``.item()``), which a meta tensor cannot answer (it counted 0 ops before, leaving a
    checkpointed step's recompute unpriced), and runs attention's math decomposition where
    a real tensor runs one fused kernel. Counted on meta tensors, within 3% of a real
    forward's ops."""
    from spmdgt.train._plan._model import _CountOps, count_forward_ops, meta_copy
    from tests._hf import tiny_gpt2, tiny_hf

    model = tiny_gpt2() if family == "gpt2" else tiny_hf(family)
    ids = torch.zeros(4, 16, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with torch.no_grad(), _CountOps() as real:
        model(**batch)
    meta = count_forward_ops(meta_copy(model), batch)
    assert meta == pytest.approx(real.count, rel=0.03) and meta > 50


def test_sequence_parallelism_splits_a_checkpointed_blocks_input_and_is_in_the_yaml():
    """With the stream split over the sequence a checkpointed block's saved input is 1/tp a
    rank; the candidate's config says ``sequence_parallel`` (only where it has TP), and its
    collectives are an all-gather and a reduce-scatter per split sub-block and pass."""
    from spmdgt.train._plan import _cost
    from spmdgt.train._plan._model import read_model
    from tests._hf import tiny_hf

    mem = _memory()
    mem.sequence_parallel = True
    assert mem.dynamic(4, True, False, 8, 4) == 1e6 + 8e5 / 4
    assert mem.dynamic(4, True, False, 8, 1) == 1e6 + 8e5
    cands, _ = enumerate_space(4, 8, tp_degrees=[1, 2], per_node=4, sequence_parallel=True)
    assert {c.sequence_parallel for c in cands if c.tp == 2} == {True}
    assert {c.sequence_parallel for c in cands if c.tp == 1} == {False}
    tp = next(c for c in cands if c.tp == 2)
    assert tp.config().parallelism.sequence_parallel and tp.label().endswith(" SP")
    assert "sequence_parallel: true" in config_yaml(tp.config())
    llama = tiny_hf("llama")
    ids = torch.zeros(2, 16, dtype=torch.long)
    facts = read_model(llama, {"input_ids": ids, "labels": ids}, loss_parallel=True)
    assert facts.sequence_parallel and not read_model(tiny_hf("mixtral"), ids).sequence_parallel
    from spmdgt.train._plan import device_spec

    dev = device_spec("h100")
    plain = dataclasses.replace(tp, sequence_parallel=False)
    split = _cost._communication(tp, facts, dev, 8192, clip=False, reshard=True)[_cost.TP_SP]
    whole = _cost._communication(plain, facts, dev, 8192, clip=False, reshard=True)[_cost.TP]
    # at 8192 tokens, bytes over latency: the forward's alike (a gather and a scatter: one
    # all-reduce's ring bytes), the backward's fewer (a gather and a scatter a sub-block, not
    # an all-reduce per colwise layer); more calls, so at a few tokens the latency says more
    assert 0 < split < whole


def test_a_memory_model_made_for_a_narrow_search_refuses_a_wider_one():
    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(4, 16, dtype=torch.long)
    narrow = _memory()
    narrow.rest = {k: v for k, v in narrow.rest.items() if not k[1]}
    narrow.block = {k: v for k, v in narrow.block.items() if not k[1]}
    kw = dict(world=4, device="cpu", global_batch=16, loss_fn=ex.lm_loss, memory_model=narrow)
    assert plan(model, (x, x), amp=(False,), **kw).ranked
    with pytest.raises(ValueError, match="calibrated without AMP"):
        plan(model, (x, x), amp=(True,), **kw)
    narrow.fsdp = {}
    with pytest.raises(ValueError, match="calibrated without FSDP"):
        plan(model, (x, x), amp=(False,), strategies=("fsdp",), **kw)


@pytest.mark.slow  # forked workers (~10 s); the in-process calibration is priced by every plan test
def test_the_calibration_in_forked_workers_is_the_one_in_process():
    """The dry runs the search needs (no AMP, checkpointing or FSDP here: 3 of the 7), in two
    forked workers and in this process, make the same memory model; a run left out is
    refused when priced."""
    from spmdgt.train._plan._calibrate import calibrate
    from spmdgt.train._plan._model import read_model

    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(2, 16, dtype=torch.long)
    facts = read_model(model, x)
    kw = dict(loss_fn=ex.lm_loss, optimizer=lambda p: torch.optim.AdamW(p))
    kw["needs"] = (False, False, False)
    lines: list[str] = []
    forked = calibrate(model, (x, x), facts, jobs=2, log=lines.append, **kw)
    here = calibrate(model, (x, x), facts, jobs=1, **kw)
    assert len(forked.runs) == len(here.runs) == 3
    assert sum("done in" in line for line in lines) == 3
    assert (forked.rest, forked.block, forked.tp_keep) == (here.rest, here.block, here.tp_keep)
    assert (forked.opt_ratio, forked.buffers) == (here.opt_ratio, here.buffers)
    assert forked.block[(False, False)] > 0 and not forked.fsdp
    assert set(forked.block) == {(False, False)}
