"""Train a small Qwen3-like decoder-only transformer with ``spmdgt.train.DistributedTrainer``.

The model: token embedding, N blocks of (RMSNorm -> grouped-query attention with rotary
embeddings and per-head q/k RMSNorm -> residual, RMSNorm -> SwiGLU MLP -> residual), a final
RMSNorm and an untied LM head. Data: byte-level tokens of a text file (``--text``), or
synthetic tokens with learnable structure (no downloads).

One process:   python examples/train_transformer.py --steps 50
N processes:   torchrun --nproc_per_node=2 examples/train_transformer.py --strategy fsdp
From YAML:     torchrun --nproc_per_node=2 examples/train_transformer.py \
                   --config examples/train_transformer.yaml
Tensor parallel: torchrun --nproc_per_node=2 examples/train_transformer.py --strategy placements
               (the plan is the ``placements`` table of train_transformer.yaml beside this file
               unless --config gives one)
2-D mesh:      torchrun --nproc_per_node=4 examples/train_transformer.py --strategy fsdp --tp 2
               (TP inside each pair of neighbouring ranks, FSDP across: ``parallelism`` in the
               YAML; --dp-shard and --dp-replicate (HSDP) set the data dims; the log names
               each tp group's ranks and node). --batch-size is per data-parallel rank: this
               run's global batch is 2 x --batch-size, and ``python ... --batch-size 2N``
               prints the same losses. 2 nodes x 2, TP inside a node:
               NNODES=2 RDZV_ENDPOINT=host0:29400 launch/run.sh 2 \
                   examples/train_transformer.py --tp 2   (on each node)
Compare runs:  --summary-json run.json on each, then
               python -m spmdgt.scripts.compare_runs one.json four.json --atol 1e-5
Plain torch:   python examples/train_transformer.py --pytorch   (same model, a hand-written
               loop; under torchrun it wraps raw DDP) to compare with the trainer.
CI size:       python examples/train_transformer.py --dim 32 --layers 1 --steps 3 --seq-len 16
Compiled:      python examples/train_transformer.py --compile   (torch.compile of each block in
               torchtitan's order; ``compile: true`` in YAML; GT_COMPILE=0 turns it off)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# ----------------------------------------------------------------------------- the model


@dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; rotate-half convention (as in Qwen/LLaMA).
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention. Head counts are read from the projection widths at run time,
    so the same code runs with q/k/v projections sharded column-wise (tensor parallel)."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.group = a.n_heads // a.n_kv_heads
        self.q_proj = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, a.norm_eps)  # Qwen3's per-head q/k norm
        self.k_norm = RMSNorm(self.head_dim, a.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(self.group, dim=1)
        v = v.repeat_interleave(self.group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.up_proj = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.down_proj = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.mlp_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = SwiGLU(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.dim // a.n_heads, a.max_seq_len, a.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ----------------------------------------------------------------------------- data


class TokenDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens -> (inputs, next-token targets)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


def load_tokens(text: str | None, num_tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """Bytes of ``text`` (vocab 256), or synthetic tokens: a noisy repeating pattern that a
    model can learn, so the loss visibly falls."""
    if text:
        with open(text, "rb") as f:
            data = f.read()
        return torch.tensor(list(data), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    period = 17
    base = torch.randint(0, vocab, (period,), generator=g)
    tokens = base.repeat(num_tokens // period + 1)[:num_tokens]
    noise = torch.rand(num_tokens, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (num_tokens,), generator=g), tokens)


# ----------------------------------------------------------------------------- runs


def build_model(args: argparse.Namespace) -> Transformer:
    """The model, seeded by ``--seed``: the same initial weights in every run."""
    torch.manual_seed(args.seed)
    margs = ModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn_dim or 2 * args.dim,
        max_seq_len=args.seq_len,
    )
    return Transformer(margs)


def build_data(args: argparse.Namespace, data_parallel: int) -> TokenDataset:
    """Tokens for the run, sized by the *global* batch (``--batch-size`` x the
    ``data_parallel`` ranks): a run on 2 data-parallel ranks of 4 rows and one process of 8
    read the same tokens in the same order, so their losses agree."""
    global_batch = args.batch_size * data_parallel
    need = (args.steps * global_batch * args.accum * 2 + 1) * args.seq_len + 1
    tokens = load_tokens(args.text, need, ModelArgs.vocab_size, args.seed)
    return TokenDataset(tokens, args.seq_len)


EXAMPLE_YAML = Path(__file__).with_suffix(".yaml")


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") in ("", "0")


def _train_config(args: argparse.Namespace):
    """The run's ``TrainConfig``: ``--config`` (or the defaults) with the flags given applied
    through ``spmdgt.train.override`` (validated like the YAML; a bad value is a
    ``ConfigError`` naming the key). Tensor parallelism (``--strategy placements`` or
    ``--tp`` > 1) without a ``--config`` takes the placements table of the example YAML
    beside this file (this model's plan); ``--tp`` without a ``--strategy`` or config means
    ``fsdp`` over the data dims, torchtitan's 2-D recipe."""
    from spmdgt.config import ConfigError
    from spmdgt.train import TrainConfig, load_train_config, override

    cfg = load_train_config(args.config) if args.config else None
    tp = args.tp if args.tp is not None else (cfg.parallelism.tp if cfg else 1)
    default = "fsdp" if tp != 1 else "ddp"
    strategy = args.strategy or (cfg.strategy if cfg else default)
    wants_plan = strategy == "placements" or tp != 1
    flag = "--strategy placements" if strategy == "placements" else f"--tp {tp}"
    if wants_plan and cfg is not None and not cfg.placements:
        # the user's file: never swap in another plan behind their back
        raise ConfigError(
            f"{flag} needs a placements table (module-name glob -> colwise | rowwise | "
            f"replicate) in {args.config}; {EXAMPLE_YAML} has one for this model",
            file=args.config,
            key="placements",
        )
    if wants_plan and cfg is None:
        if not EXAMPLE_YAML.is_file():
            raise ConfigError(
                f"{flag} needs a tensor-parallel plan: pass --config with a placements table "
                f"(the example's is examples/train_transformer.yaml, not found at "
                f"{EXAMPLE_YAML})",
                key="placements",
            )
        plan = load_train_config(EXAMPLE_YAML).placements
        if _is_rank0():
            print(f"{flag}: using the placements table of {EXAMPLE_YAML}")
        cfg = TrainConfig(strategy=strategy, placements=plan)
    cfg = cfg or TrainConfig(strategy=strategy)
    cfg = override(
        cfg,
        strategy=strategy,
        tp=args.tp,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        sequence_parallel=args.sequence_parallel,
        compile=args.compile or None,  # a flag given wins; absent, the config's value stays
        compile_backend=args.compile_backend,
        activation_checkpointing=args.activation_checkpointing or None,
    )
    return cfg, strategy


def _tp_size(cfg, strategy: str, world: int) -> int:
    """Ranks one layer's heads are split over: the ``tp`` dim, or the world for
    ``placements`` on the default (1-D) mesh."""
    if cfg.parallelism.is_default:
        return world if strategy == "placements" else 1
    return cfg.parallelism.resolve(world)[2]


def _check_heads_split(args: argparse.Namespace, cfg, strategy: str) -> None:
    """Tensor parallel splits the attention projections by heads (colwise q/k/v): each rank
    needs whole query and key/value heads, else the attention's reshape fails deep in torch.
    The same check on every rank (the world size and config are the same everywhere)."""
    from spmdgt.config import ConfigError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = _tp_size(cfg, strategy, world)
    if tp > 1 and (args.heads % tp or args.kv_heads % tp):
        what = f"--tp {tp}"
        if cfg.parallelism.is_default:
            what = f"--strategy placements on {world} ranks"
        raise ConfigError(
            f"{what} splits the attention heads over {tp} ranks: --heads ({args.heads}) "
            f"and --kv-heads ({args.kv_heads}) must both divide by {tp} (e.g. --dim 48 "
            f"--heads 6 --kv-heads 3 on 3 ranks)",
            key="heads",
            value=(args.heads, args.kv_heads),
        )


def run_trainer(args: argparse.Namespace) -> dict:
    from spmdgt.train import DistributedTrainer, OptimizedDataLoader

    cfg, strategy = _train_config(args)
    _check_heads_split(args, cfg, strategy)
    args.batch_size = args.batch_size or (cfg.training.batch_size if args.config else 8)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    trainer = DistributedTrainer(
        model,
        opt,
        strategy=strategy,
        loss_fn=lm_loss,
        use_amp=args.amp or None,
        gradient_accumulation_steps=args.accum if args.accum > 1 else None,
        max_grad_norm=args.max_grad_norm,
        logdir=args.logdir,
        config=cfg,
    )
    if args.checkpoint_dir:
        trainer.config.checkpoint.dir = args.checkpoint_dir
    # Written as for one process: the trainer shards the loader over its data-parallel ranks
    # (the world on the 1-D mesh, one group for placements), so every tensor-parallel rank of
    # a data group reads the same rows.
    ds = build_data(args, trainer.data_parallel_size)
    loader = OptimizedDataLoader.create(
        ds, args.batch_size, seed=args.seed, num_workers=args.workers
    )
    return trainer.train(
        loader, epochs=args.epochs, profile=args.profile or None, max_steps=args.steps
    )


def run_pytorch(args: argparse.Namespace) -> dict:
    """The same model in a hand-written torch loop (raw DDP under torchrun)."""
    import os

    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    args.batch_size = args.batch_size or 8
    model, ds = build_model(args), build_data(args, world)
    model = model.to(device) if cuda else model
    if args.compile:  # by hand, as torchtitan does: each block, then DDP around the model
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=args.compile_backend or "inductor")
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    amp = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=args.amp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(
        ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers or 0
    )
    times, losses, step = [], [], 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for x, y in loader:
            if cuda:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with amp:
                loss = lm_loss(model(x), y)
            loss.backward()
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            step += 1
            t0 = time.perf_counter()
            if step >= args.steps:
                break
        if step >= args.steps:
            break
    warm = min(2, len(times) - 1)
    avg = sum(times[warm:]) / max(len(times) - warm, 1)
    out = {"num_steps": step, "avg_step_time": avg, "final_loss": losses[-1]}
    if rank == 0:
        print("Plain PyTorch loop (this rank's loss)")
        for k, v in out.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return out


class _Parser(argparse.ArgumentParser):
    """argparse, with one error message under torchrun (rank 0's), not one per rank."""

    def error(self, message: str) -> None:
        if _is_rank0():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from spmdgt.train import add_dry_run_args, add_parallelism_args

    p = _Parser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="training YAML (strategy, fsdp, training, placements, ...)")
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp", "placements"],
        default=None,
        help="None: the config's strategy, else ddp; placements without --config takes the "
        "plan of train_transformer.yaml beside this script",
    )
    add_parallelism_args(p)  # --tp, --dp-shard, --dp-replicate, --sequence-parallel
    p.add_argument("--text", help="train on the bytes of this file; None: synthetic tokens")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks")
    p.add_argument("--heads", type=int, default=4, help="attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query)")
    p.add_argument("--ffn-dim", type=int, default=0, help="MLP width; 0: 2 x dim")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per rank per micro-step; None: the config's training.batch_size, else 8",
    )
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument(
        "--epochs", type=int, default=1, help="passes over the data; --steps can stop earlier"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder block (TrainConfig.compile; GT_COMPILE=0 vetoes)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend; None: the config's, else inductor",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward (checkpoint_wrapper)",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler traces")
    p.add_argument("--logdir", help="TensorBoard directory")
    p.add_argument("--checkpoint-dir", help="DCP checkpoints (resumes when present)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers; None: the trainer picks from the machine, the plain loop 0",
    )
    p.add_argument(
        "--summary-json",
        default=None,
        help="rank 0 writes the training summary (per-step losses too) here, for "
        "python -m spmdgt.scripts.compare_runs A.json B.json",
    )
    p.add_argument("--pytorch", action="store_true", help="plain torch loop for comparison")
    add_dry_run_args(p)  # --dry-run, --world, --device, --interconnect
    args = p.parse_args(argv)
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error("--dim must divide by --heads and --heads by --kv-heads")
    if (args.dim // args.heads) % 2:
        p.error("head dim (dim / heads) must be even for the rotary embedding")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` and train; a bad config exits with status 2 and one message (rank 0's)
    rather than a traceback on every rank (every rank reads the same files and fails alike)."""
    from spmdgt.config import ConfigError
    from spmdgt.train import CheckpointError, DryRunError, dry_run_call

    args = parse_args(argv)
    try:
        if args.dry_run:
            report = dry_run_call(
                lambda: run_trainer(args),
                args.world,
                device=args.device,
                interconnect=args.interconnect,
            )
            print(report)
            return report.to_dict()
        if args.pytorch:
            return run_pytorch(args)
        out = run_trainer(args)
    except (ConfigError, CheckpointError, DryRunError) as e:
        if _is_rank0():
            print(f"train_transformer.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if _is_rank0():
        print("losses " + " ".join(f"{x:.6f}" for x in out["losses"]))
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
