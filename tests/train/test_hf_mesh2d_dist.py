"""examples/train_hf.py on a 2-D mesh, as a torchtitan user runs it: ``--tp 2`` on 4 ranks is
``dp_shard=2 x tp=2`` (the YAML's placements table inside each tp pair, FSDP per decoder
layer across the pairs), and its per-step losses equal a plain one-process HF loop on the
same global batch.

Tiny Qwen3 (its per-head ``q_norm``/``k_norm`` are ``sharded_input``: each tp rank normalises
its own heads) and Llama (the table's norm rows are dropped: no module matches them), 6 rows
per step (3 per data-parallel rank: not a power of two). Tolerance 1e-5 (fp32): the
differences are sum-order rounding (~1e-7). The helpers are test_hf_dist.py's.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch

from spmdgt.config import ConfigError
from spmdgt.train import derive_placements
from spmdgt.train._tp_plan import _style_of
from tests._dist import run_ranks
from tests.train.test_hf_dist import EX, SMALL, documented_table

MESH2D = ["--tp", "2", "--global-batch", "6"]
HSDP = ["--strategy", "fsdp", "--dp-replicate", "2", "--dp-shard", "2", "--global-batch", "12"]
CASES = {
    "qwen3": [*SMALL, *MESH2D, "--model", "qwen3"],
    "qwen3-hsdp": [*SMALL, *HSDP, "--model", "qwen3"],  # 2 x 2 data ranks, 3 rows each
}
# under -m slow (4 ranks on 2 cores: the default run keeps one model per mesh shape; the
# dry-run test trains Llama with sequence parallelism on 2x2, test_hf_loss_tokens_dist Llama
# on fsdp x tp)
SLOW_CASES = {
    "llama": [*SMALL, *MESH2D, "--model", "llama"],
    # the residual stream split over the sequence inside each tp pair, FSDP across
    "llama-sp": [*SMALL, *MESH2D, "--model", "llama", "--sequence-parallel"],
}


def _mesh_and_losses(rank: int, world: int, cases: dict) -> dict:
    """Each case's training summary on this rank (one fork of 4 ranks for all of them: the
    suite pays the process start once)."""
    torch.set_num_threads(1)
    return {name: EX.run_trainer(EX.parse_args(argv)) for name, argv in cases.items()}


@pytest.mark.parametrize("cases", [CASES, pytest.param(SLOW_CASES, marks=pytest.mark.slow)])
def test_hf_models_on_fsdp_x_tp_equal_one_process(tmp_path, capfd, cases):
    refs = {n: EX.run_reference(EX.parse_args(a))["losses"] for n, a in cases.items()}
    results = run_ranks(_mesh_and_losses, 4, tmp_path, cases, timeout=240)
    worst = 0.0
    for rank, per_case in enumerate(results):
        for name, out in per_case.items():
            assert out["world_size"] == 4 and out["strategy"] == "fsdp", (rank, name)
            dims = {
                k.split("_collectives")[0][5:]
                for k in out
                if k.endswith("_collectives_per_step") and k.startswith("comm_")
            }
            # a 2-D mesh was built: the summary has per-dim comm rows (none on the 1-D world;
            # by default FSDP2's hooks measure, so the FSDP dim is the one named)
            assert "dp_shard" in dims, (rank, name, sorted(out))
            got, want = torch.tensor(out["losses"]), torch.tensor(refs[name])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} rank {rank}")
            worst = max(worst, float((got - want).abs().max()))
    for name, ref in refs.items():
        assert ref[-1] < ref[0] - 0.5, name  # it learns: a loop that did nothing would not pass
    print(f"max |loss - one process| over 4 ranks, {len(cases)} runs: {worst:.2e}")
    # rank 0's mesh lines: TP pairs named; HSDP's one-rank tp "groups" not listed (before:
    # "tp groups: [0] on node 0; [1] on node 0; ..." after an all-gather of every rank's node)
    log = capfd.readouterr().out
    assert "mesh dp_replicate x dp_shard x tp = 1x2x2; tp groups: [0, 1] on " in log, log[-2000:]
    if "qwen3-hsdp" in cases:
        assert "mesh dp_replicate x dp_shard x tp = 2x2x1 (no tensor parallelism)\n" in log
    assert "tp groups: [0] on" not in log


def test_tp_flag_builds_the_2d_config():
    # --tp alone: fsdp over the data dims, the table derived from the model (placements:
    # auto); --dp-replicate/--dp-shard reach parallelism (HSDP x TP on 8 ranks)
    cfg = EX._train_config(EX.parse_args(CASES["qwen3"]))
    assert cfg.strategy == "fsdp" and cfg.parallelism.tp == 2 and cfg.placements == "auto"
    args = EX.parse_args([*SMALL, "--tp", "2", "--dp-replicate", "2", "--dp-shard", "2"])
    cfg = EX._train_config(args)
    assert cfg.parallelism.resolve(8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="parallelism"):
        EX._train_config(EX.parse_args([*SMALL, "--tp", "0"]))
    # GPT-2's Conv1D layers match no row: the example says so, before any rank builds a mesh
    with pytest.raises(ConfigError, match=r"--tp 2: placements: auto finds no .* --model gpt2 \("):
        EX._train_config(EX.parse_args([*SMALL, "--tp", "2", "--model", "gpt2"]))


@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_the_yaml_documented_table_is_what_auto_derives(model):
    # train_hf.yaml keeps the hand table as a comment: every module of Qwen3 (Llama: its rows
    # that match a module) gets the same style from it as from the derived table
    model = EX.build_model(EX.parse_args(["--model", model]))
    derived, where = derive_placements(model)
    assert "base_model_tp_plan" in where
    names = [n for n, _ in model.named_modules() if n]
    documented = {p: s for p, s in documented_table().items() if fnmatch.filter(names, p)}
    styles = [(n, _style_of(n, documented), _style_of(n, derived)) for n in names]
    assert [row for row in styles if row[1] != row[2]] == []
    assert sum(1 for _, s, _ in styles if s) >= 10  # the table splits something
