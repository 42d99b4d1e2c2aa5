"""Creation ops: ``gt.randn/zeros/ones/...``, ``gt.tensor``, ``gt.from_numpy``, ``gt.cat``.

Every rank draws the same global value (same program, same seed) and keeps only its slice,
so the numbers never depend on the placement or the world size: removing the YAML changes
where values live, never what they are. Constant fills build only the rank's part, CPU random
fills draw in blocks (``_draw``), so no rank holds the whole tensor there. A world of one
returns plain torch tensors.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import env as _env
from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree
from spmdgt.runtime._state import get_runtime
from spmdgt.tensor import _autoplan, _draw
from spmdgt.tensor._dtypes import to_dtype
from spmdgt.tensor._placement import creation_target, intent, signal_target, will_shard

__all__ = [
    "arange",
    "cat",
    "empty",
    "eye",
    "from_numpy",
    "full",
    "manual_seed",
    "ones",
    "rand",
    "randn",
    "tensor",
    "zeros",
]


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"shape must be non-negative ints, got {size!r}")
    return tuple(size)


def agree_on_creation(
    what: str, shape: Sequence[int], dtype: torch.dtype, digest: str = "", where: str | None = None
) -> None:
    """Every rank creates the same global tensor, or every rank raises, naming each rank's.

    An agreement point (``runtime._agree``): global shape, dtype, signal and placement (and a
    digest of the data for ``gt.tensor``/``gt.from_numpy``) are compared before any mesh is
    made, for plain creations too, so a rank outside a scope or on another dtype is an error
    on both ranks, not a wait on one. ``GT_CHECK_SHAPES=0`` skips it on every rank."""
    if not _env.flag("GT_CHECK_SHAPES"):
        return
    name = str(dtype).removeprefix("torch.")
    place = intent(shape) if where is None else where
    point = f"{what} of {name}{list(shape)}{digest}, {place}"
    if where is None and will_shard(shape) and not _compiled_code_may_run():
        # a sharded result is read only through agreement points and ops that settle first
        _agree.agree_soon(point)
    else:  # a replicated one is a plain tensor, readable at once: checked now
        _agree.agree(point)


def _compiled_code_may_run() -> bool:
    """Whether compiled code may run ops before the next check of an in-flight point: the
    compile pass on (its graphs run ops, collectives too, that no eager ``settle`` sees), or
    any frame compiled by ``torch.compile`` in this process. Then creations agree at once."""
    c = sys.modules.get("spmdgt.compile")
    if c is not None and (c.is_enabled() or c.regions_enabled()):
        return True
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo is not None and dynamo.counters["frames"]["ok"] > 0


def _digest(base: torch.Tensor) -> str:
    # Data given to gt.tensor/gt.from_numpy must be the same global value on every rank: a
    # checksum of its bytes joins the creation's agreement point (CPU data; ~GB/s).
    if get_runtime().world_size == 1 or base.device.type != "cpu" or base.is_complex():
        return ""
    data = base.detach().contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    raw = data.view(torch.uint8).numpy() if data.numel() else b""
    return f" (data crc {zlib.crc32(raw):08x})"


def _note_placement(what: str, shape: tuple[int, ...], target) -> None:
    from torch.distributed.tensor import Shard

    from spmdgt.tensor._meshes import describe_mesh

    msg = f"{what}{tuple(shape)} -> {tuple(target.placements)} on {describe_mesh(target.mesh)}"
    for i, p in enumerate(target.placements):  # mesh dim i splits axis p.dim (torch.chunk)
        n = target.mesh.size(i)
        if isinstance(p, Shard) and shape[p.dim] % n:
            sizes = [len(c) for c in torch.arange(shape[p.dim]).chunk(n)]
            sizes += [0] * (n - len(sizes))
            msg += f" (uneven: axis {p.dim} split {sizes} over mesh dim {i}, torch.chunk rule)"
    if target.signal:
        msg += f" [signal {target.signal!r}]"
    _debuglog.debug("tensor", msg)


def _current_backward() -> str | None:
    """The backward signal of the innermost scope: its override, else its config's."""
    top = _scope.innermost()
    if top is None:
        return None
    name, override, _ = top
    if override is not None:
        return override
    from spmdgt.config._signals import lookup

    cfg = lookup(name)
    return cfg.backward_signal if cfg is not None else None


def _backward_hook(t: torch.Tensor) -> None:
    """Give the gradients of ``t`` the placement of the scope's backward signal."""
    name = _current_backward()
    if name is None or not t.requires_grad:
        return
    from spmdgt.config._signals import lookup

    cfg = lookup(name)
    if cfg is None or cfg.shard is None:
        return
    target = signal_target(cfg, t.shape)
    if target is None:
        return
    from spmdgt.tensor._tensor import move

    t.register_hook(lambda g: move(g, target))


def _create(
    shape: tuple[int, ...],
    make: Callable[[torch.device], torch.Tensor],
    requires_grad: bool,
    what: str,
    make_part: Callable[..., torch.Tensor | None] | None = None,
    *,
    dtype: torch.dtype | None = None,
    digest: str = "",
) -> torch.Tensor:
    """Make a tensor of ``shape`` where the scope says. ``make(device)`` builds the global
    value; ``make_part(target, device)``, when given, returns a builder of this rank's part
    alone (``(local_shape, offset) -> tensor``, see ``place_local``), or None where it cannot
    (then ``make`` runs and each rank keeps its slice)."""
    rt = get_runtime()
    if rt.world_size > 1:
        agree_on_creation(what, shape, dtype or torch.get_default_dtype(), digest)
    target = creation_target(shape, dtype or torch.get_default_dtype())
    if target is None:
        t = make(rt.device)
    else:
        from spmdgt.tensor._tensor import place, place_local

        part = make_part(target, rt.device) if make_part is not None else None
        t = place_local(part, shape, target) if part is not None else place(make(rt.device), target)
        if _debuglog.TENSOR:
            _note_placement(what, shape, target)
    if _autoplan.active():  # GT_AUTO_SHARD=plan is recording: the ops using t are priced
        _autoplan.created(t)
    if requires_grad:
        t.requires_grad_(True)
        if _scope.stack and rt.world_size > 1:
            _backward_hook(t)
    return t


def _factory(fill: Callable[..., torch.Tensor], name: str, doc: str, *, constant: bool = False):
    """A GT creation op over ``fill`` (``torch.randn``, ``torch.zeros``...). Each rank builds
    only its own part: a ``constant`` fill directly, a random one (CPU) by drawing in blocks."""

    def create(*size: int, dtype=None, requires_grad: bool = False) -> torch.Tensor:
        shape, dt = _shape(size), to_dtype(dtype)

        def part(target, device):
            if constant:
                return lambda s, _: fill(s, dtype=dt, device=device)
            dim = _draw.drawable(fill, shape, dt, device, target)
            if dim is not None:
                return lambda s, off: _draw.draw_part(fill, shape, dt, s, off, dim)
            return None

        make = lambda d: fill(shape, dtype=dt, device=d)  # noqa: E731
        return _create(shape, make, requires_grad, name, part, dtype=dt)

    create.__name__ = create.__qualname__ = name.removeprefix("gt.")
    create.__doc__ = doc
    return create


randn = _factory(
    torch.randn,
    "gt.randn",
    "Standard normal values; the same global values whatever the placement or world size.",
)
rand = _factory(torch.rand, "gt.rand", "Uniform [0, 1) values; placement-independent.")
zeros = _factory(
    torch.zeros, "gt.zeros", "Zeros, placed by the active signal / auto-shard.", constant=True
)
ones = _factory(
    torch.ones, "gt.ones", "Ones, placed by the active signal / auto-shard.", constant=True
)
empty = _factory(
    torch.empty, "gt.empty", "Uninitialised memory, placed like any new tensor.", constant=True
)


def full(size, fill_value, *, dtype=None, requires_grad: bool = False) -> torch.Tensor:
    """A tensor filled with ``fill_value``."""
    shape, dt = _shape((size,)), to_dtype(dtype)
    return _create(
        shape,
        lambda d: torch.full(shape, fill_value, dtype=dt, device=d),
        requires_grad,
        "gt.full",
        lambda target, d: lambda s, _: torch.full(s, fill_value, dtype=dt, device=d),
        dtype=torch.full((), fill_value, dtype=dt, device="meta").dtype,
    )


def arange(*args, dtype=None, requires_grad: bool = False) -> torch.Tensor:
    """``torch.arange``, placed like any created tensor."""
    dt = to_dtype(dtype)
    probe = torch.arange(*args, dtype=dt, device="meta")
    return _create(
        tuple(probe.shape),
        lambda d: torch.arange(*args, dtype=dt, device=d),
        requires_grad,
        "gt.arange",
        dtype=probe.dtype,
    )


def eye(n: int, m: int | None = None, *, dtype=None, requires_grad: bool = False):
    """Identity matrix."""
    dt = to_dtype(dtype)
    shape = (n, n if m is None else m)
    make = lambda d: torch.eye(*shape, dtype=dt, device=d)  # noqa: E731
    return _create(shape, make, requires_grad, "gt.eye", dtype=dt)


def tensor(data, dtype=None, requires_grad: bool = False) -> torch.Tensor:
    """A tensor from Python data, a numpy array or a tensor (GT's ``gt.tensor``).

    Under N ranks every rank must pass the same global data; a shape mismatch is an error.
    """
    dt = to_dtype(dtype)
    if isinstance(data, torch.Tensor):
        base = _global_value(data)  # a sharded input contributes its global value
        base = base.to(dtype=dt) if dt is not None else base
        shape = tuple(base.shape)
        make = lambda d: base.to(d, copy=True)  # noqa: E731
        digest = _digest(base)
        return _create(shape, make, requires_grad, "gt.tensor", dtype=base.dtype, digest=digest)
    base = torch.as_tensor(np.asarray(data) if isinstance(data, np.ndarray) else data, dtype=dt)
    shape = tuple(base.shape)
    make = lambda d: base.to(d)  # noqa: E731
    return _create(shape, make, requires_grad, "gt.tensor", dtype=base.dtype, digest=_digest(base))


def _global_value(t: torch.Tensor) -> torch.Tensor:
    # No DTensor can exist before torch.distributed.tensor is imported: skip the import then.
    if "torch.distributed.tensor" not in sys.modules:
        return t.detach()
    from spmdgt.tensor._tensor import global_value

    return global_value(t)


def from_numpy(array: np.ndarray, *, requires_grad: bool = False) -> torch.Tensor:
    """A tensor from a numpy array (shares memory when it stays a plain CPU tensor, as
    ``torch.from_numpy`` does); ``requires_grad`` as GT's ``gt.from_numpy(a, requires_grad=)``."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"gt.from_numpy expects a numpy.ndarray, got {type(array).__name__}")
    base = torch.from_numpy(array)
    shape, digest = tuple(base.shape), _digest(base)
    make = lambda d: base.to(d)  # noqa: E731
    return _create(shape, make, requires_grad, "gt.from_numpy", dtype=base.dtype, digest=digest)


def cat(tensors: Sequence[torch.Tensor], axis: int = 0, *, dim: int | None = None):
    """Concatenate along ``axis`` (GT's spelling; torch's ``dim=`` works too)."""
    return torch.cat(list(tensors), dim=axis if dim is None else dim)


def manual_seed(seed: int) -> None:
    """Seed every rank's generators alike: the same program then draws the same values."""
    torch.manual_seed(seed)
