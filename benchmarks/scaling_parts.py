"""Where a ``scaling.py`` +read run spends its time: the parts of one ``rows @ rows`` row.

``python benchmarks/scaling_parts.py [M K N] [--gloo]`` (default 512 512 512) forks 2 gloo
ranks, one thread each, and times apart, after a barrier each: making both inputs (spmdgt:
``gt.randn`` under a ``rows`` signal; raw DTensor: each rank's block drawn alone,
``from_local``), the matmul, and the host read (``.numpy()``; DTensor:
``full_tensor().numpy()``). Median of ``ROUNDS`` (env, default 20) rounds, per rank, in
milliseconds. Set ``GT_CHECK_SHAPES=0`` to take the creations' agreement points out
(``docs/benchmarks.md``: the +read breakdown).

A third side, ``no move``, is the product's floor: each rank multiplies its row block by the
whole second operand already in its memory (plain tensors, no collective), the time of
``rows @ rows`` if gathering the second operand cost nothing. ``spmdgt``'s matmul over it is
all that hiding the gather behind the multiply (issue 25's overlapped gather) could win.
``--gloo``: spmdgt's data moves over gloo, as ranks on more than one host do (shared memory
off).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, path: str, q, m: int, k: int, n: int, gloo: bool) -> None:
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor, Shard

    import spmdgt as gt
    from spmdgt.runtime import _shm

    _shm.ENABLED = not gloo
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    mesh = gt.device_mesh()

    def rows(size: int) -> int:
        return size // world + (1 if rank < size % world else 0)

    def dtensor_inputs() -> list:
        out = []
        for a, b in ((m, k), (k, n)):
            local = torch.randn(rows(a), b)
            shape = torch.Size((a, b))
            out.append(
                DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=shape, stride=(b, 1)
                )
            )
        return out

    def spmdgt_inputs() -> list:
        with gt.signal.context("rows"):
            return [gt.randn(m, k), gt.randn(k, n)]

    def floor_inputs() -> list:
        return [torch.randn(rows(m), k), torch.randn(k, n)]

    sides = {
        "DTensor": (dtensor_inputs, lambda y: y.full_tensor().numpy()),
        "spmdgt": (spmdgt_inputs, lambda y: y.numpy()),
        "no move": (floor_inputs, lambda y: y.numpy()),
    }
    rounds = int(os.environ.get("ROUNDS", "20"))
    times: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    clock = time.perf_counter
    with torch.no_grad():
        for r in range(rounds + 2):
            for side, (make, read) in sides.items():
                dist.barrier()
                t0 = clock()
                x, w = make()
                t1 = clock()
                dist.barrier()
                t2 = clock()
                y = x @ w
                t3 = clock()
                dist.barrier()
                t4 = clock()
                read(y)
                t5 = clock()
                if r >= 2:  # two warm-up rounds
                    for part, t in (("make", t1 - t0), ("matmul", t3 - t2), ("read", t5 - t4)):
                        times[side].setdefault(part, []).append(t)
    medians = {s: {p: statistics.median(v) for p, v in d.items()} for s, d in times.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, medians)
    if rank == 0:
        q.put(everyone)
    dist.barrier()
    gt.shutdown()


def main() -> None:
    gloo = "--gloo" in sys.argv
    sizes = [a for a in sys.argv[1:] if a != "--gloo"]
    m, k, n = (int(x) for x in (sizes[:3] if len(sizes) > 2 else (512, 512, 512)))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    path = tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, 2, path, q, m, k, n, gloo)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=900)
    for p in procs:
        p.join()
    how = "gloo" if gloo else "shared memory on one host"
    print(f"({m},{k})@({k},{n}), 2 ranks, spmdgt's moves over {how}, median ms per part")
    for r, sides in enumerate(out):
        for side, parts in sides.items():
            text = "  ".join(f"{p} {t * 1e3:7.2f}" for p, t in parts.items())
            print(f"rank {r}  {side:8s} {text}")
        floor = sides["no move"]["matmul"]
        print(
            f"rank {r}  matmul over no move's: spmdgt {sides['spmdgt']['matmul'] / floor:.3f}"
            f"  DTensor {sides['DTensor']['matmul'] / floor:.3f}"
        )


if __name__ == "__main__":
    main()
