"""Hugging Face ``transformers`` models train with no glue: examples/train_hf.py on 2 ranks
under ddp, fsdp and placements gives the losses of a plain one-process HF loop.

The models are built from config objects (random init, nothing downloaded). Tolerance 1e-5
(fp32): a data-parallel gradient is the step's token sum over the global label-token count
(``num_items_in_batch``), summed in another order than one process's mean (~1e-7 relative);
ten AdamW steps with clipping keep that far inside 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor.parallel  # imported before fork: children inherit it
import yaml
from torch import nn

from spmdgt.config import ConfigError
from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig
from spmdgt.train._units import find_blocks, fsdp_blocks, fsdp_units
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "6", "--seq-len", "16", "--log-every", "4"]  # more steps than log_every


def _example():
    spec = importlib.util.spec_from_file_location("train_hf", ROOT / "examples" / "train_hf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


EX = _example()


def _trainer_losses(rank, world, argv):
    torch.set_num_threads(1)
    out = EX.run_trainer(EX.parse_args(argv))
    return out["losses"], out["world_size"], out["strategy"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "ddp"],
        ["--strategy", "fsdp"],
        ["--strategy", "placements"],  # Qwen3: q_norm/k_norm are sharded_input in the YAML
        ["--strategy", "placements", "--model", "llama"],
        ["--strategy", "fsdp", "--model", "gpt2", "--tie"],  # tied wte/lm_head: one unit
        # slow: gpt2 --tie stands for a tied fsdp unit; the plan-accumulation test for
        # --global-batch's split over the data-parallel ranks
        pytest.param(["--strategy", "fsdp", "--model", "qwen3", "--tie"], marks=pytest.mark.slow),
        pytest.param(
            ["--strategy", "ddp", "--model", "gpt2", "--global-batch", "6"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda a: "-".join(x.lstrip("-") for x in a if x != "--strategy"),
)
def test_hf_example_on_two_ranks_equals_one_process(tmp_path, argv):
    argv = [*SMALL, *argv]
    ref = EX.run_reference(EX.parse_args(argv))["losses"]
    results = run_ranks(_trainer_losses, 2, tmp_path, argv, timeout=240)
    for losses, world, _ in results:
        assert world == 2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), atol=1e-5, rtol=1e-5)
    assert ref[-1] < ref[0] - 0.5  # it learns: a loop that did nothing would not pass


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_hf_example_takes_a_plans_accumulation_and_equals_one_process(tmp_path, world):
    """A planner's YAML sets ``gradient_accumulation_steps``: the example splits
    ``--global-batch`` over the data-parallel ranks and the micro-steps (12 rows: 3 x 2 on 2
    ranks, 2 x 2 on 3), so each optimizer step still reads one global batch, as the plain
    loop does (before, each step read ``accum`` global batches and the run ended early)."""
    cfg = yaml.safe_load(EX.EXAMPLE_YAML.read_text())
    cfg["training"]["gradient_accumulation_steps"] = 2
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [*SMALL, "--config", str(path), "--strategy", "fsdp", "--global-batch", "12"]
    ref = EX.run_reference(EX.parse_args(argv))["losses"]
    results = run_ranks(_trainer_losses, world, tmp_path, argv, timeout=240)
    for losses, got_world, _ in results:
        assert got_world == world and len(losses) == len(ref) == 6
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), atol=1e-5, rtol=1e-5)


def documented_table() -> dict[str, str]:
    """The placements table train_hf.yaml keeps as a comment (what ``auto`` derives for
    Qwen3), read from the file."""
    lines = EX.EXAMPLE_YAML.read_text().splitlines()
    start = lines.index("# placements:")
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        rows.append(line[1:].split("  #")[0])
    return yaml.safe_load("\n".join(rows))


def _qwen3_table_without_norms(rank, world):
    torch.set_num_threads(1)
    args = EX.parse_args([*SMALL])
    model = EX.build_model(args)
    table = {
        p: s
        for p, s in documented_table().items()
        if "norm" not in p  # the rows a user who copied a Llama plan would not have
    }
    cfg = TrainConfig(strategy="placements", placements=table)
    opt = torch.optim.AdamW(model.parameters())
    try:
        DistributedTrainer(model, opt, config=cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_qwen3_tensor_parallel_without_its_norms_is_refused_on_every_rank(tmp_path):
    # Before: q_norm/k_norm were plain parameters that saw only this rank's heads; their
    # gradients covered those heads alone and the ranks' copies drifted (3.1e-3).
    errors = run_ranks(_qwen3_table_without_norms, 2, tmp_path)
    assert errors[0] is not None and errors[0] == errors[1]
    assert "model.layers.0.self_attn.q_norm" in errors[0] and "sharded_input" in errors[0]


class _Echo(nn.Module):
    """A model taking keywords, returning a dict: what the trainer passes and uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, scale, labels=None):
        logits = self.lin(x) * scale
        loss = None if labels is None else nn.functional.mse_loss(logits, labels)
        return {"logits": logits, "loss": loss}


def _echo_data(n=8):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
    return [{"x": x[i], "scale": torch.tensor([2.0]), "labels": y[i]} for i in range(n)]


def test_dict_batches_model_loss_and_loss_fn_on_logits():
    data = _echo_data()
    runs = {}
    for name, loss_fn in [("model_loss", None), ("loss_fn", nn.functional.mse_loss)]:
        torch.manual_seed(0)
        model = _Echo()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = DistributedTrainer(model, opt, loss_fn=loss_fn, log_every=100)
        runs[name] = trainer.train(OptimizedDataLoader.create(data, 4, shuffle=False))["losses"]
    torch.manual_seed(0)
    model = _Echo()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for i in (0, 4):
        batch = torch.utils.data.default_collate(data[i : i + 4])
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert runs["model_loss"] == pytest.approx(ref, abs=1e-6)
    assert runs["loss_fn"] == pytest.approx(ref, abs=1e-6)


def test_an_output_without_its_loss_says_what_to_do():
    data = [{k: v for k, v in row.items() if k != "labels"} for row in _echo_data()]
    model = _Echo()
    trainer = DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"returned dict with loss=None: put 'labels' in"):
        trainer.train(OptimizedDataLoader.create(data, 4, shuffle=False))
    trainer = DistributedTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.mse_loss
    )
    with pytest.raises(ValueError, match=r"a dict batch needs a 'labels' entry.*\['scale', 'x'\]"):
        trainer.train(OptimizedDataLoader.create(data, 4, shuffle=False))


def test_fsdp_units_of_hf_models_are_the_layers_and_tied_weights_stay_in_one_unit():
    llama = EX.build_model(EX.parse_args(["--model", "llama", "--layers", "3"]))
    assert find_blocks(llama)[0] == "model.layers"
    units = fsdp_units(llama)
    assert units[:3] == list(llama.model.layers) and units[3] is llama and len(units) == 4

    gpt2 = EX.build_model(EX.parse_args(["--model", "gpt2", "--tie"]))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert fsdp_blocks(gpt2) == list(gpt2.transformer.h)  # wte and lm_head: the root's

    class Shared(nn.Module):  # a block sharing a weight with the head: left to the root
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 4)
            self.head.weight = self.layers[2].weight

    m = Shared()
    assert fsdp_blocks(m) == [m.layers[0], m.layers[1]]
    assert fsdp_units(m) == [m.layers[0], m.layers[1], m]


def test_the_core_never_imports_transformers():
    code = (
        "import sys, spmdgt, spmdgt.train, spmdgt.tensor, spmdgt.compile, spmdgt.interceptor\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_hf_example_under_torchrun_fsdp():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GT_DEVICE="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run(
        [*cmd, str(ROOT / "examples" / "train_hf.py"), *SMALL, "--strategy", "fsdp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("losses ")]
    assert len(lines) == 1  # rank 0 only
    ref = EX.run_reference(EX.parse_args(SMALL))["losses"]
    got = [float(x) for x in lines[0].split()[1:]]
    assert got == pytest.approx(ref, abs=1e-5)


def test_hf_example_dry_run_at_a_world_it_does_not_have(capsys):
    # --dry-run --world 8: one process, a fake group of 8 and fake tensors; FSDP's shards of
    # the tied Qwen3 are an eighth of the parameters (uneven dims round up on low ranks)
    out = EX.main([*SMALL, "--dry-run", "--world", "8", "--device", "h100", "--tie"])
    assert out["world"] == 8 and out["fits"] is True
    model = EX.build_model(EX.parse_args(["--tie"]))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(out["params"]) == total  # every byte sharded once over the 8 ranks
    kinds = {row["kind"] for row in out["collectives"]}
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert "fits in" in capsys.readouterr().out
