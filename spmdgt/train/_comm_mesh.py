"""Communication on an N-D mesh, one mesh dim at a time: probes and estimates per dim.

On a 2-D mesh TP's collectives run inside ``tp`` (fast links, inside a node) and FSDP's on
``dp_shard`` (across nodes), so one latency and one bandwidth for the world would price one of
them wrongly. ``probe_dims`` measures each dim on its own process group: per dim, in the mesh's
dim order, a small message per kind (latency) and a large one (bus bandwidth), each a
collective on that dim's group, so every rank makes the same calls in the same order (each in
its own group of that dim). Then one world all-reduce (MAX) makes every number the slowest
group's, so every rank plans with the same numbers and takes the same decisions.

``CommunicationProfiler`` (``_comm_cost``) holds the tables and prices counted collectives with
them (``estimate_counted_by_dim``); this module only measures and names the dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdgt.interceptor._groups import WORLD
from spmdgt.train._comm_probe import _RING_FACTOR, _probe_seconds

__all__ = ["mesh_dims", "probe_dims"]


def mesh_dims(mesh: object | None) -> list[tuple[str, int, object]]:
    """``(name, size, process group)`` of every dim of ``mesh`` with more than one rank, in
    the mesh's order; ``None`` (no mesh): the world, named ``world``, when it has peers."""
    if mesh is None:
        on = dist.is_available() and dist.is_initialized()
        n = dist.get_world_size() if on else 1
        return [(WORLD, n, None)] if n > 1 else []
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError(
            "CommunicationProfiler(mesh=...) needs a DeviceMesh with mesh_dim_names (e.g. "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp_shard', 'tp')))"
        )
    out = []
    for name in names:
        sub = mesh[name]  # type: ignore[index]
        if sub.size() > 1:
            out.append((name, sub.size(), sub.get_group()))
    return out


def probe_dims(
    dims: list[tuple[str, int, object]],
    kinds: tuple[str, ...],
    *,
    latency_bytes: int = 8,
    latency_iters: int = 20,
    bandwidth_bytes: int = 8 << 20,
    bandwidth_iters: int = 5,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Latency (seconds per collective) and bus bandwidth (bytes/s, latency taken off) by dim
    and kind: ``({dim: {kind: s}}, {dim: {kind: B/s}})``. Collective over the whole world:
    every rank calls it with the same ``dims`` (``mesh_dims`` of one mesh)."""
    if not dims:
        return {}, {}
    small: dict[tuple[str, str], float] = {}
    large: dict[tuple[str, str], tuple[float, int]] = {}  # -> (seconds, message bytes)
    todo = [(name, n, group, kind) for name, n, group in dims for kind in kinds]
    for name, _, group, kind in todo:  # the same calls in the same order on every rank
        small[(name, kind)] = _probe_seconds(kind, latency_bytes, latency_iters, group)
    nbytes = bandwidth_bytes
    for attempt in range(_RETRIES + 1):
        got = [_probe_seconds(kind, nbytes, bandwidth_iters, g) for _, _, g, kind in todo]
        keys = [(name, kind) for name, _, _, kind in todo]
        agreed = _world_max([small[k] for k in keys] + got)
        for i, key in enumerate(keys):
            small[key] = agreed[i]
            large[key] = (agreed[len(keys) + i], nbytes)
        # A large message no slower than a small one (a busy or oversubscribed host): probe
        # those again with 4x the bytes. The numbers are the world's, so every rank retries
        # the same (dim, kind)s, in the same order.
        todo = [t for t in todo if large[(t[0], t[3])][0] <= small[(t[0], t[3])]]
        if not todo:
            break
        if attempt == _RETRIES:
            name, _, _, kind = todo[0]
            raise ValueError(
                f"mesh dim {name!r}: the {nbytes}-byte {kind} took "
                f"{large[(name, kind)][0] * 1e6:.1f} us, not more than the {latency_bytes}-byte "
                f"one ({small[(name, kind)] * 1e6:.1f} us): probe bandwidth with a larger "
                "message (CommunicationProfiler(probe_bytes=...)) on a quieter machine"
            )
        nbytes *= 4
    latency: dict[str, dict[str, float]] = {}
    bandwidth: dict[str, dict[str, float]] = {}
    for name, n, _ in dims:
        for kind in kinds:
            t_small, (t_large, size) = small[(name, kind)], large[(name, kind)]
            moved = _RING_FACTOR[kind](n) * (max(size // 4, n) // n * n) * 4
            latency.setdefault(name, {})[kind] = t_small
            bandwidth.setdefault(name, {})[kind] = moved / (t_large - t_small)
    return latency, bandwidth


_RETRIES = 2  # bandwidth probes re-run with 4x, then 16x the bytes before giving up


def _world_max(values: list[float]) -> list[float]:
    """Every value as the world's largest (one all-reduce): the slowest group's number."""
    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
