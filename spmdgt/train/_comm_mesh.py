"""Communication on an N-D mesh, one mesh dim at a time: probes and estimates per dim.

On a 2-D mesh TP's collectives run inside ``tp`` (fast links, inside a node) and FSDP's on
``dp_shard`` (across nodes), so one latency and one bandwidth for the world would price one of
them wrongly. ``probe_dims`` measures each dim on its own process group: per dim, in the mesh's
dim order, a small message per kind (latency) and a large one (bus bandwidth), each a
collective on that dim's group, so every rank makes the same calls in the same order (each in
its own group of that dim). Then one world all-reduce (MAX) makes every number the slowest
group's, so every rank plans with the same numbers and takes the same decisions.

``CommunicationProfiler`` (``_comm``) holds the tables and prices counted collectives with
them (``estimate_counted_by_dim``); this module only measures and names the dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmdgt.interceptor._groups import WORLD

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
    from spmdgt.train._comm import _RING_FACTOR, _probe_seconds

    if not dims:
        return {}, {}
    raw: list[float] = []
    for _, _, group in dims:  # the same calls in the same order on every rank
        for kind in kinds:
            raw.append(_probe_seconds(kind, latency_bytes, latency_iters, group))
            raw.append(_probe_seconds(kind, bandwidth_bytes, bandwidth_iters, group))
    # Each number is its group's slowest rank; the world's MAX makes it the slowest group's.
    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(raw, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed = t.tolist()
    latency: dict[str, dict[str, float]] = {}
    bandwidth: dict[str, dict[str, float]] = {}
    i = 0
    for name, n, _ in dims:
        lat, bw = latency.setdefault(name, {}), bandwidth.setdefault(name, {})
        for kind in kinds:
            small, large = agreed[i], agreed[i + 1]
            i += 2
            moved = _RING_FACTOR[kind](n) * (max(bandwidth_bytes // 4, n) // n * n) * 4
            if large <= small:  # the same on every rank: the numbers are the world's
                raise ValueError(
                    f"mesh dim {name!r}: the {bandwidth_bytes}-byte {kind} took "
                    f"{large * 1e6:.1f} us, not more than the {latency_bytes}-byte one "
                    f"({small * 1e6:.1f} us): probe bandwidth with a larger message "
                    "(CommunicationProfiler(probe_bytes=...))"
                )
            lat[kind] = small
            bw[kind] = moved / (large - small)
    return latency, bandwidth
