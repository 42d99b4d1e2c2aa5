"""The ``cpu`` device profile on disk: measured once by forked ranks, saved as JSON, reused.

``probe_cpu`` (``_cpuprobe``) is a collective: the ranks that will train measure it at once,
about 15 s for 4 ranks. A plan is made many times for the same machine (another model, batch
or budget), so the profile is kept in a file and read back:

    python -m spmdgt.scripts.plan --world 4 --device cpu --cpu-profile cpu.json train.py
        # the first time: 4 gloo ranks forked here measure the profile, saved to cpu.json
        # later: cpu.json is read, nothing is measured
    spmdgt.train.plan(model, batch, world=4, device="cpu", device_profile="cpu.json")

The file carries when and under what load average it was measured: the figures are the
machine's at that moment (on a shared machine they move with the load), not constants.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from multiprocessing import connection as mp_connection
from pathlib import Path

__all__ = ["load_profile", "measure_profile", "save_profile"]

FORMAT = "spmdgt cpu profile"
VERSION = 1
_KEYS = {
    "ranks": int,
    "threads": int,
    "links": list,
    "op_seconds": float,
    "peak_fp32": float,
    "unit_seconds": float,
    "tp_module_seconds": float,
    "ac_block_seconds": float,
}


def save_profile(profile: dict, path: str | os.PathLike) -> None:
    """Write ``profile`` (``probe_cpu``'s) to ``path`` as JSON, with the time and the load
    average it was measured under."""
    check_profile(profile, str(path))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": list(load) if load else None,
        "profile": profile,
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def check_profile(profile: object, where: str) -> dict:
    """``profile`` when it holds every figure ``cpu_spec`` prices with; else a ValueError
    naming ``where`` and what is missing or wrong."""
    if not isinstance(profile, dict):
        raise ValueError(f"cpu profile {where}: expected a mapping, got {type(profile).__name__}")
    for key, kind in _KEYS.items():
        value = profile.get(key)
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if not ok or isinstance(value, bool):
            raise ValueError(
                f"cpu profile {where}: {key!r} is {value!r}, expected {kind.__name__} "
                "(measure it again: --cpu-profile with a new path, or delete the file)"
            )
    links = profile["links"]
    if not links or not all(isinstance(x, (list, tuple)) and len(x) == 3 for x in links):
        raise ValueError(
            f"cpu profile {where}: 'links' must be [[group size, latency s, bandwidth B/s], ...]"
        )
    return profile


def load_profile(path: str | os.PathLike) -> dict:
    """The profile saved at ``path`` (``save_profile``'s file); a ValueError naming the file
    when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cpu profile {path}: cannot read it ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"cpu profile {path}: not a file save_profile wrote (no {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise ValueError(
            f"cpu profile {path}: version {doc.get('version')!r}, this spmdgt reads {VERSION}"
            " (measure it again)"
        )
    return check_profile(doc.get("profile"), str(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(conn, rank: int, world: int, port: int, threads: int, repeats: int) -> None:
    """One forked rank: join a gloo group of ``world``, probe, send rank 0's profile."""
    try:
        import torch
        import torch.distributed as dist

        from spmdgt.train._plan._cpuprobe import probe_cpu

        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            got = probe_cpu(repeats=repeats)
        finally:
            dist.destroy_process_group()
        conn.send(("ok", got))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers of the parent's state in the copy


def measure_profile(
    world: int, *, threads: int = 1, repeats: int = 5, timeout: float = 600.0
) -> dict:
    """The ``cpu`` profile measured by ``world`` ranks forked on this machine (gloo,
    ``threads`` torch threads each, as ``torchrun`` ranks on a CPU run): ``probe_cpu`` run by
    all of them at once. Call it before this process starts threads of its own (a fork
    copies only the calling thread)."""
    if world < 1:
        raise ValueError(f"measure_profile: world must be >= 1, got {world}")
    ctx = mp.get_context("fork")
    port = _free_port()
    procs, pipes = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank, args=(send, rank, world, port, threads, repeats))
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            ready = mp_connection.wait([c for c in pipes if pipes.index(c) not in results], left)
            if not ready:
                raise RuntimeError(f"measuring the cpu profile: ranks past {timeout:.0f}s")
            for c in ready:
                i = pipes.index(c)
                try:
                    results[i] = c.recv()
                except EOFError:
                    results[i] = ("error", f"rank {i} died (exit code {procs[i].exitcode})")
                if results[i][0] == "error":
                    raise RuntimeError(f"measuring the cpu profile, rank {i}:\n{results[i][1]}")
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world:
                p.kill()
            p.join()
    return check_profile(results[0][1], "measured")
