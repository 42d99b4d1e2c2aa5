"""The training YAML: golden file, unknown keys and bad values named by file and key."""

from __future__ import annotations

import textwrap

import pytest

from spmdgt.config import ConfigError
from spmdgt.train import TrainConfig, load_train_config

GOLDEN = """\
strategy: fsdp
fsdp: {use_mixed_precision: true, reshard_after_forward: false}
ddp: {bucket_cap_mb: 10, find_unused_parameters: true}
training:
  epochs: 3
  batch_size: 16
  gradient_accumulation_steps: 4
  max_grad_norm: 1.0
  max_steps: 40
  scheduler: {type: linear_warmup, warmup_steps: 100, total_steps: 1000}
placements:
  "layers.*.mlp.up": colwise
  "layers.*.mlp.down": rowwise
checkpoint: {dir: ckpt, every_steps: 50}
profile: true
logdir: runs/exp1
log_every: 5
"""


def _write(tmp_path, text):
    p = tmp_path / "train.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_golden(tmp_path):
    cfg = load_train_config(_write(tmp_path, GOLDEN))
    assert cfg.strategy == "fsdp"
    assert cfg.fsdp.use_mixed_precision and not cfg.fsdp.reshard_after_forward
    assert cfg.ddp.bucket_cap_mb == 10.0 and cfg.ddp.find_unused_parameters
    t = cfg.training
    assert (t.epochs, t.batch_size, t.gradient_accumulation_steps, t.max_grad_norm) == (
        3,
        16,
        4,
        1.0,
    )
    assert (t.scheduler.type, t.scheduler.warmup_steps, t.scheduler.total_steps) == (
        "linear_warmup",
        100,
        1000,
    )
    assert cfg.placements == {"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}
    assert (cfg.checkpoint.dir, cfg.checkpoint.every_steps) == ("ckpt", 50)
    assert cfg.profile and cfg.logdir == "runs/exp1" and cfg.log_every == 5
    assert t.max_steps == 40


def test_placements_auto_is_accepted_with_tp(tmp_path):
    cfg = load_train_config(_write(tmp_path, "strategy: placements\nplacements: auto\n"))
    assert cfg.placements == "auto"
    text = "strategy: fsdp\nplacements: auto\nparallelism: {tp: 2}\n"
    assert load_train_config(_write(tmp_path, text)).parallelism.tp == 2


def test_empty_file_gives_defaults(tmp_path):
    assert load_train_config(_write(tmp_path, "")) == TrainConfig()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("strategy: zero3\n", ["train.yaml", "strategy", "zero3", "ddp, fsdp, placements"]),
        ("training: {epochs: 1, batch_sise: 4}\n", ["training.batch_sise", "batch_size"]),
        ("fsdp: {use_mixed_precision: yes please}\n", ["fsdp.use_mixed_precision"]),
        ("training: {gradient_accumulation_steps: 0}\n", ["gradient_accumulation_steps", ">= 1"]),
        ("placements: {up: diagonal}\n", ["placements.up", "diagonal", "colwise"]),
        ("strategy: placements\n", ["placements", "non-empty"]),
        ("placements: automatic\n", ["placements", "'automatic'", "or 'auto'"]),
        (
            "training: {scheduler: {type: cosine, warmup_steps: 5}}\n",
            ["training.scheduler", "total_steps"],
        ),
        ("training: {scheduler: {type: step}}\n", ["training.scheduler.type", "step"]),
        ("checkpoint: {dir: c, every: 3}\n", ["checkpoint.every", "every_steps"]),
        ("log_every: 0\n", ["log_every", ">= 1", "got 0"]),
        ("training: {max_steps: -2}\n", ["training.max_steps", "got -2"]),
        ("bogus: 1\n", ["bogus", "known keys"]),
        ("strategy: [ddp\n", ["train.yaml:", "malformed YAML"]),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, needles):
    with pytest.raises(ConfigError) as e:
        load_train_config(_write(tmp_path, text))
    msg = str(e.value)
    assert "train.yaml" in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_trainer_keywords_set_the_config_fields():
    """The trainer's keywords named like config fields are pass-throughs: they set the field
    in the trainer's copy, validated as YAML would be, and leave the caller's config alone."""
    import torch.nn.functional as F

    from spmdgt.train import DistributedTrainer
    from tests.train._models import make_model, make_optimizer

    cfg = TrainConfig()
    model = make_model()
    t = DistributedTrainer(
        model,
        make_optimizer(model),
        loss_fn=F.mse_loss,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        config=cfg,
        log_every=3,
    )
    assert (t.config.log_every, t.log_every) == (3, 3)
    assert (t.config.training.gradient_accumulation_steps, t.accum) == (2, 2)
    assert t.config.training.max_grad_norm == t.max_grad_norm == 0.5
    assert cfg == TrainConfig()  # the caller's config is unchanged
    for kwargs, needles in [
        ({"log_every": 0}, ["log_every", "got 0"]),
        ({"strategy": "zero"}, ["strategy", "zero"]),
        ({"max_grad_norm": -1.0}, ["max_grad_norm", "-1.0"]),
    ]:
        model = make_model()
        with pytest.raises(ConfigError) as e:
            DistributedTrainer(model, make_optimizer(model), config=cfg, **kwargs)
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
