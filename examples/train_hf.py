"""Train a Hugging Face ``transformers`` model with ``spmdgt.train.DistributedTrainer``, no glue.

The model is built from a config object (random init, nothing downloaded): a small Qwen3,
Llama or GPT-2. Batches are HF's dicts, ``{"input_ids", "attention_mask", "labels"}``: the
trainer calls ``model(**batch)`` and trains on the ``loss`` the model returns, as HF's
``Trainer`` does. FSDP2 shards it layer by layer (``model.model.layers``, found without
configuration), tied input/output embeddings stay in one unit, and tensor parallelism takes
``placements: auto`` from ``train_hf.yaml``: the table derived from the model's own HF plan
(printed on rank 0; the YAML keeps it as a comment).

Needs the ``hf`` extra: ``pip install -e '.[hf]'`` (``transformers``; spmdgt's core never
imports it).

One process:    python examples/train_hf.py --steps 20
N processes:    torchrun --nproc_per_node=2 examples/train_hf.py --strategy fsdp
Tensor parallel: torchrun --nproc_per_node=2 examples/train_hf.py --strategy placements
                (``placements: auto``: Qwen3's and Llama's tables derived from their HF
                plans; GPT-2's ``Conv1D`` layers are not ``nn.Linear``, so GPT-2 trains with
                ddp or fsdp)
2-D mesh:       torchrun --nproc_per_node=4 examples/train_hf.py --tp 2
                (torchtitan's recipe: the placements table inside each pair of neighbouring
                ranks, FSDP per decoder layer across them; --dp-shard and --dp-replicate set
                the data dims, e.g. --dp-replicate 2 --dp-shard 2 --strategy fsdp for HSDP;
                --global-batch is split over the data-parallel ranks only, then into the
                config's gradient_accumulation_steps micro-batches)
Check:          python examples/train_hf.py --reference   (a plain one-process HF loop over
                the same global batches: the losses every strategy must reproduce)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

MODELS = ("qwen3", "llama", "gpt2")
EXAMPLE_YAML = Path(__file__).with_suffix(".yaml")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small ``transformers`` causal LM from a config: the same weights on every rank
    (seeded), ``--tie`` ties the input embedding and the LM head."""
    import transformers

    torch.manual_seed(args.seed)
    common = {"vocab_size": args.vocab, "tie_word_embeddings": args.tie}
    if args.model == "gpt2":  # no dropout: its random draws would differ from the reference
        cfg = transformers.GPT2Config(
            n_embd=args.dim, n_layer=args.layers, n_head=args.heads, n_positions=args.seq_len,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            loss_type="ForCausalLM", **common,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cls = {"qwen3": "Qwen3", "llama": "Llama"}[args.model]
    cfg = getattr(transformers, f"{cls}Config")(
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        max_position_embeddings=args.seq_len,
        **common,
    )
    return getattr(transformers, f"{cls}ForCausalLM")(cfg)


class TokenDataset(Dataset):
    """Synthetic token rows with structure to learn (a noisy repeating pattern), as HF dicts;
    the labels are the inputs (the model shifts them)."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, vocab, (17,), generator=g)
        tokens = base.repeat(rows * seq_len // 17 + 1)[: rows * seq_len].view(rows, seq_len)
        noise = torch.rand(rows, seq_len, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, vocab, (rows, seq_len), generator=g), tokens)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _train_config(args: argparse.Namespace):
    """``--config`` (else ``train_hf.yaml`` beside this file) with the flags given applied
    through ``spmdgt.train.override`` (validated like the YAML: a bad value is a
    ``ConfigError`` naming the key). ``--tp`` > 1 without ``--strategy`` means ``fsdp`` over
    the data dims with the placements table inside each tp group (torchtitan's 2-D recipe).
    The example YAML's table is ``auto``: derived from the model (Qwen3's and Llama's HF
    plans); a model it finds nothing in (GPT-2) is refused here, before any rank builds a
    mesh."""
    from spmdgt.config import ConfigError
    from spmdgt.train import load_train_config, override

    cfg = load_train_config(args.config or EXAMPLE_YAML)
    tp = args.tp if args.tp is not None else cfg.parallelism.tp
    strategy = args.strategy or ("fsdp" if args.tp not in (None, 1) else None)
    cfg = override(
        cfg,
        strategy=strategy,
        tp=args.tp,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        sequence_parallel=args.sequence_parallel,
        max_grad_norm=args.max_grad_norm,
        use_amp=args.amp or None,
        compile=args.compile or None,
    )
    if (cfg.strategy == "placements" or tp != 1) and cfg.placements == "auto":
        from spmdgt.train import derive_placements

        try:  # the trainer derives it again when it wraps the model: the same table
            derive_placements(build_model(args))
        except ConfigError:  # GPT-2: Conv1D, not nn.Linear, and no HF plan
            flag = f"--tp {tp}" if tp != 1 else "--strategy placements"
            raise ConfigError(
                f"{flag}: placements: auto finds no tensor-parallel layers in --model "
                f"{args.model} (GPT-2's Conv1D layers are not nn.Linear: train it with ddp or "
                "fsdp, no --tp)",
                file=str(args.config or EXAMPLE_YAML),
                key="placements",
            ) from None
    return cfg


def run_trainer(args: argparse.Namespace) -> dict:
    """The example: ``DistributedTrainer`` on the HF model, no loss function given. Each
    data-parallel rank reads ``--global-batch`` / its data-parallel size rows of every step,
    in ``gradient_accumulation_steps`` micro-batches (the tensor-parallel ranks of a data
    group read the same rows)."""
    from spmdgt.train import DistributedTrainer, OptimizedDataLoader

    cfg = _train_config(args)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    trainer = DistributedTrainer(
        model, opt, config=cfg, log_every=args.log_every, logdir=args.logdir
    )
    # the same on every rank: the same decision everywhere
    dp, accum = trainer.data_parallel_size, trainer.accum
    if args.global_batch % (dp * accum):
        raise SystemExit(
            f"--global-batch {args.global_batch} must divide by the {dp} data-parallel ranks "
            f"x {accum} accumulation steps"
        )
    data = TokenDataset(args.steps * args.global_batch, args.seq_len, args.vocab, args.seed)
    # written as for one process: the trainer shards it over its data-parallel ranks; each
    # optimizer step reads `accum` micro-batches (a planner's YAML sets the accumulation)
    loader = OptimizedDataLoader.create(data, args.global_batch // (dp * accum), shuffle=False)
    return trainer.train(loader, epochs=1, max_steps=args.steps)


def run_reference(args: argparse.Namespace) -> dict:
    """A plain one-process HF loop over the same global batches: the numbers to reproduce,
    and the step time the trainer is measured against (on the GPU when there is one)."""
    cuda = torch.cuda.is_available() and os.environ.get("GT_DEVICE", "") != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = TokenDataset(args.steps * args.global_batch, args.seq_len, args.vocab, args.seed)
    clip = _train_config(args).training.max_grad_norm
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        rows = range(step * args.global_batch, (step + 1) * args.global_batch)
        batch = torch.utils.data.default_collate([data[i] for i in rows])
        with amp:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises: the step's time is complete
        times.append(time.perf_counter() - t0)
    warm = min(2, len(times) - 1)
    avg = sum(times[warm:]) / len(times[warm:])
    return {
        "num_steps": args.steps,
        "final_loss": losses[-1],
        "losses": losses,
        "avg_step_time": avg,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from spmdgt.train import add_dry_run_args, add_parallelism_args

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, default="qwen3", help="transformers family")
    p.add_argument("--config", help="training YAML; None: train_hf.yaml beside this script")
    p.add_argument("--strategy", choices=["ddp", "fsdp", "placements"], help="None: the config's")
    add_parallelism_args(p)  # --tp, --dp-shard, --dp-replicate, --sequence-parallel
    p.add_argument("--tie", action="store_true", help="tie input embedding and LM head")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (Qwen3, Llama)")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per row")
    p.add_argument("--global-batch", type=int, default=8, help="rows per step, all ranks")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=None, help="None: the config's")
    p.add_argument("--log-every", type=int, default=5, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=0, help="model init and data")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (training.use_amp)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--reference", action="store_true", help="plain one-process HF loop")
    p.add_argument("--logdir", help="TensorBoard logdir (compare_runs reads its train/loss)")
    add_dry_run_args(p)  # --dry-run, --world, --device, --interconnect
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dry_run:  # e.g. --dry-run --world 64 --device h100 --interconnect ib-ndr
        from spmdgt.train import dry_run_call

        run = lambda: run_trainer(args)  # noqa: E731
        report = dry_run_call(run, args.world, device=args.device, interconnect=args.interconnect)
        print(report)
        return report.to_dict()
    if args.reference:
        out = run_reference(args)
        print("Plain HF loop, one process: losses " + " ".join(f"{x:.6f}" for x in out["losses"]))
        print(f"avg_step_time: {out['avg_step_time']:.4f}")
        return out
    from spmdgt.config import ConfigError

    try:
        out = run_trainer(args)
    except ConfigError as e:  # the same error on every rank; rank 0 says it
        if os.environ.get("RANK", "0") in ("", "0"):
            print(f"train_hf.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("RANK", "0") in ("", "0"):
        print("losses " + " ".join(f"{x:.6f}" for x in out["losses"]))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
