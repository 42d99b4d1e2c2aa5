"""Would hiding ``rows @ rows``'s gather behind the multiply pay? Measured, not assumed.

    python benchmarks/overlap_gather.py [--ranks 2] [--chunks 2,4,8] [--rounds 20]
                                        [--shapes 2048x2048x2048,2048x512x512]
                                        [--device cpu|cuda]

``rows @ rows`` (``tensor/_contract.direct``) gathers the second operand's row shards and then
multiplies: the gather and the product run one after the other. Issue 25 asks for the async-TP
idea (the product of one chunk while the next chunk moves) where it pays. Each rank holds an
``(m / r, k)`` row block of the first operand and a ``(k / r, n)`` row shard of the second, and
times, side by side in alternating order after a barrier each (median of ``--rounds``):

- ``no move``: its block times a whole second operand already in memory: the product's floor,
  what any hiding of the gather could at best reach;
- ``gather, then multiply``: one all-gather of the second operand, then one ``mm`` (what
  ``direct`` does where ranks have no shared memory: several hosts, or GPUs);
- ``overlapped, c chunks``: the second operand's columns in ``c`` chunks, each chunk's
  all-gather started (``async_op``) before the previous chunk's product runs, every product
  written into its columns of the result. Each element stays one full-length dot product, as
  in one ``mm``; the result is checked against the plain side's (1e-5) before timing.

On a CPU the collectives are gloo's (its own threads); on CUDA, NCCL's on its own stream (one
GPU per rank: a machine with ``--ranks`` GPUs). Prints per shape and rank the medians in ms and
each side's time over the floor's. Figures and the decision in ``docs/benchmarks.md``
("Overlapping the gather").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_ranks


def _gather(dist):
    """c10d's all-gather into one tensor (torch 2.13 renamed it; the old name warns)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _chunked(a: torch.Tensor, b: torch.Tensor, k: int, chunks: int) -> torch.Tensor:
    """``a @ gathered(b)`` with chunk ``i + 1``'s all-gather in flight while chunk ``i``'s
    product runs."""
    import torch.distributed as dist

    n = b.shape[1]
    cols = [slice(i * n // chunks, (i + 1) * n // chunks) for i in range(chunks)]
    out = a.new_empty(a.shape[0], n)
    fulls: list[torch.Tensor] = []
    works: list = []

    def start(i: int) -> None:
        piece = b[:, cols[i]].contiguous()
        full = piece.new_empty(k, piece.shape[1])
        works.append(_gather(dist)(full, piece, async_op=True))
        fulls.append(full)

    start(0)
    for i in range(chunks):
        if i + 1 < chunks:
            start(i + 1)
        works[i].wait()
        torch.mm(a, fulls[i], out=out[:, cols[i]])
    return out


def _rank(rank: int, world: int, shapes: list, chunk_counts: list, rounds: int) -> dict:
    import torch.distributed as dist

    dev = torch.device("cuda", rank) if torch.cuda.is_available() and _on_cuda() else "cpu"
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    got: dict = {}
    for m, k, n in shapes:
        if m % world or k % world:
            raise SystemExit(f"overlap_gather: m={m} and k={k} must divide by {world} ranks")
        a = torch.randn(m // world, k, device=dev)
        b = torch.randn(k // world, n, device=dev)
        whole = torch.randn(k, n, device=dev)

        def plain(a=a, b=b, k=k, n=n):
            full = b.new_empty(k, n)
            _gather(dist)(full, b)
            return a @ full

        sides = {"no move": lambda a=a, w=whole: a @ w, "gather, then multiply": plain}
        for c in chunk_counts:
            sides[f"overlapped, {c} chunks"] = lambda a=a, b=b, k=k, c=c: _chunked(a, b, k, c)
        want = plain()
        for name, fn in sides.items():
            if name != "no move":
                torch.testing.assert_close(fn(), want, rtol=1e-5, atol=1e-5, msg=name)
        times: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(rounds + 2):
            order = list(sides) if r % 2 else list(reversed(sides))
            for name in order:
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                sides[name]()
                sync()
                if r >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        got[f"({m},{k})@({k},{n})"] = {s: statistics.median(v) for s, v in times.items()}
    return got


def _on_cuda() -> bool:
    return os.environ.get("GT_DEVICE", "cpu") != "cpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--chunks", default="2,4,8")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--shapes", default="2048x2048x2048,2048x512x512")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    chunks = [int(c) for c in a.chunks.split(",")]
    out = run_ranks(_rank, a.ranks, shapes, chunks, a.rounds, device=a.device)
    backend = "NCCL" if a.device == "cuda" else "gloo"
    print(f"{a.ranks} ranks, {backend}, median ms of {a.rounds} rounds; (x) = time / no move's")
    for shape in out[0]:
        print(shape)
        for rank, got in enumerate(out):
            floor = got[shape]["no move"]
            text = "  ".join(f"{s} {t * 1e3:.2f} ({t / floor:.2f})" for s, t in got[shape].items())
            print(f"  rank {rank}: {text}")


if __name__ == "__main__":
    main()
