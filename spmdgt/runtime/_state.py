"""Process-wide runtime state: who am I, how many of us, which device, which mesh.

Read from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). Without a
launcher the world is one process and nothing touches the network: no process group is made
until something (a 1-rank DeviceMesh, say) asks for one, and then it uses an in-memory store.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdgt._core import env as _env
from spmdgt._core.session import session
from spmdgt.runtime import _agree, _rank_errors

__all__ = ["Runtime", "get_runtime", "init", "shutdown"]


@dataclass(frozen=True, slots=True)
class Runtime:
    """What every rank knows about itself; frozen once ``init`` ran."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None in a world of one that never needed a process group

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


_lock = threading.Lock()
_runtime: Runtime | None = None
_owns_process_group = False
_world_mesh = None


def _want_cuda() -> bool:
    """CUDA when there is one, unless ``GT_DEVICE=cpu`` keeps this process on the CPU (a GPU
    machine running CPU ranks, or a forked child that must not touch its parent's CUDA)."""
    choice = _env.text("GT_DEVICE")  # None, "cpu" or "cuda"; anything else raises
    if choice == "cpu":
        return False
    # A child forked after its parent started CUDA cannot use CUDA (torch refuses): such a
    # process (a DataLoader worker, a forked test rank) runs on the CPU instead of crashing.
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)()
    if choice is None and bad_fork:
        return False
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("GT_DEVICE=cuda, but torch sees no CUDA device")
    return torch.cuda.is_available()


def _default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(backend: str | None = None) -> Runtime:
    """Set up this rank once; later calls return the same state.

    Under torchrun (WORLD_SIZE > 1) this joins the process group with ``backend`` (default: NCCL
    when CUDA is present, else gloo). A process group the user created first is adopted as is.
    Every rank then takes rank 0's default generator states (``_seed``), so values that are
    meant to be replicated are: a collective, as joining the group is.
    """
    global _runtime, _owns_process_group
    if _runtime is not None:
        return _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        use_cuda = _want_cuda()
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            gpus = torch.cuda.device_count() if use_cuda else 1
            local_rank = _env.launcher_int("LOCAL_RANK", rank % max(gpus, 1))
            backend_used: str | None = dist.get_backend()
        else:
            rank, world = _env.launcher_int("RANK", 0), _env.launcher_int("WORLD_SIZE", 1)
            local_rank = _env.launcher_int("LOCAL_RANK", 0)
            backend_used = None
        if use_cuda:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            backend_used = backend or _env.text("GT_BACKEND") or _default_backend(device)
            kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
            # joined with torch's default timeout: GT_TIMEOUT bounds a collective's wait for
            # a rank, not the start, where ranks of a cluster job arrive minutes apart
            dist.init_process_group(backend=backend_used, **kwargs)
            limit = _rank_errors.timeout()
            if limit is not None:
                dist.distributed_c10d._set_pg_timeout(limit)
            _owns_process_group = True
            atexit.register(_destroy_at_exit)
        _runtime = Runtime(rank, world, local_rank, device, backend_used)
        # torch's fake process group (a dry run, ``spmdgt.train._dryrun``) is one process
        # standing in for the world: there are no peers to agree with or take seeds from.
        if world > 1 and backend_used != "fake":
            from spmdgt.runtime._seed import agree_at_init

            _per_rank_compile_cache(rank)
            agree_at_init(device)  # every rank draws what rank 0 would: replicated values agree
            _agree.setup(rank, world)  # the side group for agreement points (see _agree)
        return _runtime


def _per_rank_compile_cache(rank: int) -> None:
    """Give each rank its own inductor cache folder
    (``TORCHINDUCTOR_CACHE_DIR``/spmdgt-<code>/rank<r>).

    A compiled graph over sharded tensors runs on each rank's local shard, whose shape differs
    between ranks when a size does not divide evenly; torch's compile caches key such graphs
    by the global shapes, so a rank could load another rank's kernel and fail its shape check
    (seen with inductor on 5 rows over 2 ranks). Nor do torch's keys know spmdgt's code, which
    decides what a traced graph over ``gt.Tensor``s looks like: an AOTAutograd entry written by
    another spmdgt version was served to this one and its backward left the leaves' ``.grad``
    None. So the folder is keyed by spmdgt's source too (``_code_key``). Set here, before
    anything compiles."""
    import tempfile

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:
        try:
            import getpass

            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        base = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    leaf = f"rank{rank}"
    if os.path.basename(os.path.normpath(base)) != leaf:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"spmdgt-{_code_key()}", leaf)


def _code_key() -> str:
    """A short hash of spmdgt's own source files and torch's version (~2 ms, once per rank):
    a compile cache written by other code is never read."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha1(torch.__version__.encode())
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def current_runtime() -> Runtime | None:
    """The runtime if ``init()`` ran, else None: nothing is initialised by asking."""
    return _runtime


def get_runtime() -> Runtime:
    """The runtime, initialising it on first use (``gt.init()`` is implicit)."""
    return _runtime if _runtime is not None else init()


def world_mesh():
    """The 1-D DeviceMesh over every rank, made on first use.

    In a world of one this makes a 1-rank gloo/NCCL group over an in-memory store: no network.
    """
    global _world_mesh, _runtime, _owns_process_group
    if _world_mesh is not None:
        return _world_mesh
    from torch.distributed.device_mesh import DeviceMesh

    rt = get_runtime()
    with _lock:
        if _world_mesh is None:
            if not dist.is_initialized():
                backend = _default_backend(rt.device)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                _owns_process_group = True
                _runtime = Runtime(rt.rank, rt.world_size, rt.local_rank, rt.device, backend)
            _agree.settle()  # a mesh may make groups: the points in flight are checked first
            _world_mesh = DeviceMesh(rt.device_type, list(range(rt.world_size)))
    return _world_mesh


def _destroy_at_exit() -> None:
    # Each rank tears its own group down (no collective) on the main thread, before the
    # interpreter's teardown. Left to finalization, the last reference to a gloo group (held
    # by leftover work objects: FSDP's, a comm hook's futures) could drop on one of the group's
    # own threads, which cannot join itself: "terminate called without an active exception",
    # SIGABRT after a clean run (4 of 8 FSDP example runs, 2 of 6 short scripts; 0 of 16 and
    # 0 of 16 with this). The collects free those objects here, on this thread.
    if _owns_process_group and dist.is_initialized():
        import gc

        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def _forget_after_fork() -> None:
    # A forked child (a test rank, a benchmark rank, a DataLoader worker) is a new process:
    # it re-reads its rank from the environment and owns no process group of its parent's.
    global _runtime, _owns_process_group, _world_mesh
    _runtime, _owns_process_group, _world_mesh = None, False, None
    _agree.forget()  # (the meshes forget themselves after a fork: tensor/_meshes)


os.register_at_fork(after_in_child=_forget_after_fork)


def _forget_inductor_threads_after_fork() -> None:
    # A compile in a forked child hangs forever when its parent compiled before the fork:
    # inductor's C++ kernels compile on a cached ThreadPoolExecutor (``AsyncCompile.pool``)
    # whose threads a fork does not copy, and torch's own after-fork hook forgets its process
    # pool but not this one, so the child queues work no thread will run. Seen as the hang of
    # ``bench_compile.py --both``'s forked ``scope2`` ranks after three compiled cases, with a
    # cold inductor cache. Forgetting it lets the child make its own on first use.
    # (read defensively: a fork hook that raised would fail every fork, DataLoader's too)
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    forget = getattr(pool, "cache_clear", None)
    if forget is not None:
        forget()


os.register_at_fork(after_in_child=_forget_inductor_threads_after_fork)


def _reset() -> None:
    # the session's part: a process group spmdgt made is destroyed (not a collective: no
    # end-of-program agreement, so one rank may reset alone), then everything is forgotten
    _agree.forget()
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _forget_after_fork()


session.register("runtime", _reset)


def shutdown() -> None:
    """Destroy the process group spmdgt made (not one the user made) and forget all state.

    The end of the program is an agreement point (``_agree.end``): a peer still waiting in a
    host read raises instead of waiting forever, and so does this rank."""
    global _runtime, _owns_process_group, _world_mesh
    try:
        _agree.end()
    finally:
        if "meshes" in session.parts():  # the meshes on this group go with it
            session.reset("meshes")
        if _owns_process_group and dist.is_initialized():
            import gc

            gc.collect()
            dist.destroy_process_group()
            gc.collect()
        _runtime, _owns_process_group, _world_mesh = None, False, None
