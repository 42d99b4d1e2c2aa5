"""Plans for Llama-3-8B- and 70B-shaped models on H100s at world 8, 64 and 512 (the tables in
docs/planner.md): meta-device models built from a ``transformers.LlamaConfig`` (nothing is
downloaded or allocated), one 8192-token row per GPU per step (torchtitan's recipes: 8B
``local_batch_size = 1`` on 8 GPUs; 70B ``local_batch_size = 8`` per data-parallel rank, TP 8
on 64 GPUs: 64 rows), NVLink 4 inside a node of 8, InfiniBand NDR across.

    PYTHONPATH=. python benchmarks/plan_llama.py [--top 8] [--sizes 8b,70b]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
}
SEQ = 8192


def llama(size: str):
    import torch
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=SEQ,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **SHAPES[size],
    )
    with torch.device("meta"):
        return T.LlamaForCausalLM(cfg)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--sizes", default="8b,70b")
    p.add_argument("--worlds", default="8,64,512")
    args = p.parse_args()
    import torch

    from spmdgt.train._plan import plan

    for size in args.sizes.split(","):
        model = llama(size)
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids}
        mem = None
        for world in [int(w) for w in args.worlds.split(",")]:
            t0 = time.perf_counter()
            result = plan(
                model,
                batch,
                world=world,
                device="h100",
                global_batch=world,
                memory_model=mem,
                progress=lambda s: print(s, file=sys.stderr),
            )
            mem = result.memory_model
            print(
                f"\n### Llama-3-{size.upper()} shape, world {world}, global batch {world} x {SEQ} "
                f"tokens ({time.perf_counter() - t0:.1f}s)\n"
            )
            print("```")
            print(result.summary())
            print(result.table(limit=args.top, dropped=3))
            print("```", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
