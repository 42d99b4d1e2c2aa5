"""Where a ``scaling.py`` +read run spends its time: the parts of one row.

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

``--mlp B,I,H,O``: an MLP row instead (``scaling.py``'s: two ``Linear`` + ReLU layers, the
weights replicated, the batch in rows): the parts are then the input, the forward and the read,
and ``no move`` is each rank's forward on its own rows with plain tensors, where no data moves
on either side. What a gap on an MLP row of ``scaling.py`` is made of (20 runs there are few
for a row where both sides run the same local ops: more rounds here).
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, path: str, q, dims: tuple, mlp: bool, gloo: bool) -> None:
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import spmdgt as gt
    from spmdgt.runtime import _shm

    _shm.ENABLED = not gloo
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    mesh = gt.device_mesh()

    def rows(size: int) -> int:
        return size // world + (1 if rank < size % world else 0)

    m, k = dims[:2]
    shapes = [(m, k)] if mlp else [(m, k), (k, dims[2])]
    torch.manual_seed(0)  # the MLP's weights: the same on every rank
    layers = [torch.nn.Linear(i, o) for i, o in itertools.pairwise(dims[1:])] if mlp else []
    dt_layers = [
        [DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False) for p in lay]
        for lay in ((la.weight, la.bias) for la in layers)
    ]

    def dtensor_inputs() -> list:
        out = []
        for a, b in shapes:
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
            return [gt.randn(*s) for s in shapes]

    def floor_inputs() -> list:
        return [torch.randn(rows(m), k)] + ([] if mlp else [torch.randn(*shapes[1])])

    def forward(side: str, inputs: list):
        if not mlp:
            return inputs[0] @ inputs[1]
        x = inputs[0]
        if side == "DTensor":
            f = torch.nn.functional
            for w, b in dt_layers:
                x = f.relu(f.linear(x, w, b))
            return x
        for layer in layers:
            x = layer(x).relu()
        return x

    sides = {
        "DTensor": (dtensor_inputs, lambda y: y.full_tensor().numpy()),
        "spmdgt": (spmdgt_inputs, lambda y: y.numpy()),
        "no move": (floor_inputs, lambda y: y.numpy()),
    }
    op = "forward" if mlp else "matmul"
    rounds = int(os.environ.get("ROUNDS", "20"))
    times: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    clock = time.perf_counter
    with torch.no_grad():
        for r in range(rounds + 2):
            for side, (make, read) in sides.items():
                dist.barrier()
                t0 = clock()
                inputs = make()
                t1 = clock()
                dist.barrier()
                t2 = clock()
                y = forward(side, inputs)
                t3 = clock()
                dist.barrier()
                t4 = clock()
                read(y)
                t5 = clock()
                if r >= 2:  # two warm-up rounds
                    for part, t in (("make", t1 - t0), (op, t3 - t2), ("read", t5 - t4)):
                        times[side].setdefault(part, []).append(t)
    medians = {s: {p: statistics.median(v) for p, v in d.items()} for s, d in times.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, medians)
    if rank == 0:
        q.put(everyone)
    dist.barrier()
    gt.shutdown()


def main() -> None:
    argv = sys.argv[1:]
    gloo, mlp = "--gloo" in argv, "--mlp" in argv
    if mlp:
        dims = tuple(int(x) for x in argv[argv.index("--mlp") + 1].split(","))
        name, op = f"MLP batch {dims[0]}, {'-'.join(map(str, dims[1:]))}", "forward"
    else:
        sizes = [a for a in argv if not a.startswith("--")]
        dims = tuple(int(x) for x in (sizes[:3] if len(sizes) > 2 else (512, 512, 512)))
        name, op = "({},{})@({},{})".format(*dims[:2], *dims[1:]), "matmul"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    path = tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, 2, path, q, dims, mlp, gloo)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=900)
    for p in procs:
        p.join()
    how = "gloo" if gloo else "shared memory on one host"
    print(f"{name}, 2 ranks, spmdgt's moves over {how}, median ms per part")
    for r, sides in enumerate(out):
        for side, parts in sides.items():
            text = "  ".join(f"{p} {t * 1e3:7.2f}" for p, t in parts.items())
            print(f"rank {r}  {side:8s} {text}")
        floor = sides["no move"][op]
        print(
            f"rank {r}  {op} over no move's: spmdgt {sides['spmdgt'][op] / floor:.3f}"
            f"  DTensor {sides['DTensor'][op] / floor:.3f}"
        )


if __name__ == "__main__":
    main()
