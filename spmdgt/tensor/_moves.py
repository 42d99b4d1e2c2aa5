"""Moving values between layouts: the global value of a sharded tensor, laying a global value
out, differentiable moves between meshes and placements, and the arguments of an op brought
onto one mesh. Below both ``gt.Tensor`` (``_tensor``) and the exact fallback (``_fallback``),
which use them; nothing here decides how an op runs.

Results are handed out as ``gt.Tensor``: the class is registered by ``_tensor`` at import
(``set_tensor_class``), so this module does not import the one that uses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree
from spmdgt.runtime._state import get_runtime
from spmdgt.tensor._meshes import mesh_ranks, spans_world

__all__ = [
    "align_meshes",
    "gather",
    "global_value",
    "lift_grad_plain",
    "map_tensors",
    "move",
    "place",
    "place_local",
    "refresh",
    "scatter",
    "set_tensor_class",
    "signal_mesh",
    "target_of",
]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_cls: list[type] = [DTensor]  # what results are handed out as: gt.Tensor, once registered


def set_tensor_class(cls: type) -> None:
    """Hand results out as ``cls`` (``gt.Tensor``, registered by its module at import)."""
    _cls[0] = cls


def global_value(t: torch.Tensor) -> torch.Tensor:
    """The full, detached value of ``t`` on every rank (plain tensors are returned detached).

    A collective over the tensor's mesh; for a mesh that excludes some ranks, rank
    ``mesh[0]`` then broadcasts it over the world, so every rank must call it.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    if getattr(t, "_gt_view", None) is not None:
        refresh(t)
    with _DisableSubclass(), torch.no_grad():
        mesh = t.device_mesh
        rt = get_runtime()
        if spans_world(mesh):
            return t.full_tensor()
        members = mesh_ranks(mesh)
        if rt.rank in members:
            # laid out as the receivers' fresh tensor is, stride for stride: ``contiguous``
            # keeps any stride on a size-1 dim (a 1-D ``nonzero``'s ``[n, 1]`` is ``(1, n)``),
            # and a stride that differs by rank fails dynamo's guards on some ranks only: a
            # hot function fed the value then recompiled, and waited in its compile agreement,
            # on the receivers alone (found by the parity sweep, both halves on)
            value = t.full_tensor().resolve_conj().resolve_neg()
            value = value.clone(memory_format=torch.contiguous_format)
        else:
            value = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if _agree.checking():
            _agree.before_collective(f"broadcast of a {list(t.shape)} value from rank {members[0]}")
        # gloo broadcasts no complex dtype (a receiver waits forever): send the real view
        dist.broadcast(torch.view_as_real(value) if value.is_complex() else value, members[0])
        return value


def place(full: torch.Tensor, target) -> torch.Tensor:
    """Lay out ``full`` (the same global value on every rank) as ``target`` says, without
    communication: each rank keeps its slice. ``target`` None means a plain tensor."""
    if target is None:
        return full
    placements = [Replicate() if isinstance(p, Partial) else p for p in target.placements]
    with _DisableSubclass():
        # contiguous: DTensor keeps the global value's strides as the spec's but makes each
        # shard contiguous, so a permuted result (attention's output, laid out as its kernel
        # writes it) would be seen as viewable where the shard is not ("view size is not
        # compatible" on a later flatten)
        out = distribute_tensor(full.contiguous(), target.mesh, placements, src_data_rank=None)
    out.__class__ = _cls[0]
    return out


def place_local(make, shape: tuple[int, ...], target) -> torch.Tensor:
    """Lay out ``shape`` as ``target`` says from this rank's part alone, which
    ``make(local_shape, global_offset)`` builds (``global_offset`` is empty on a rank outside
    the mesh): no rank holds the whole tensor, no communication.

    The part is wrapped with DTensor's constructor and a spec kept per shape, dtype, mesh and
    placements (a new input each step has the same ones): ``DTensor.from_local``'s autograd
    function, spec building and offset arithmetic cost about a quarter of drawing a 512 x 512
    input's part on 2 ranks. The part is a fresh tensor that needs no gradient history."""
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in target.placements)
    where = _local_shapes.get((shape, target.mesh, placements))
    if where is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(shape, target.mesh, placements)
        where = (tuple(local_shape), tuple(offset))
        _bounded(_local_shapes)[(shape, target.mesh, placements)] = where
    local = make(*where)
    if local.device.type != target.mesh.device_type:  # as from_local: onto the mesh's device
        local = local.to(target.mesh.device_type)
    key = (shape, local.dtype, target.mesh, placements)
    spec = _local_specs.get(key)
    if spec is None:
        stride = [1] * len(shape)  # contiguous, as one process's tensor is
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * max(shape[d + 1], 1)
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        spec = _bounded(_local_specs)[key] = DTensorSpec(target.mesh, placements, meta)
    with _DisableSubclass():
        return _new(_cls[0], local, spec, requires_grad=False)


_SPECS_MAX = 256  # distinct creations kept; a program with more starts the tables again
_local_shapes: dict[tuple, tuple] = {}  # (shape, mesh, placements) -> (local shape, offset)
_local_specs: dict[tuple, DTensorSpec] = {}  # (shape, dtype, mesh, placements) -> spec
_new = torch.Tensor._dtensor__new__


def _bounded(table: dict) -> dict:
    if len(table) >= _SPECS_MAX:
        table.clear()
    return table


class _Move(torch.autograd.Function):
    """Move a value to another mesh/placement; the gradient takes the way back."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.source = (x.device_mesh, x.placements) if isinstance(x, DTensor) else None
        return place(global_value(x), target)

    @staticmethod
    def backward(ctx, grad):
        from spmdgt.tensor._placement import Target

        if grad is None:
            return None, None
        target = None if ctx.source is None else Target(*ctx.source)
        if torch.is_grad_enabled():
            # create_graph (a gradient penalty, MAML): the way back is a move too, recorded,
            # so the gradient can be differentiated again
            with _DisableSubclass():
                return _Move.apply(grad, target), None
        return place(global_value(grad), target), None


class _Gather(_Move):
    """``_Move`` to a plain global value, for the exact fallback: the plain op after it runs
    alike on every rank, so a gradient it leaves undefined (``norm(p=0)``) is undefined on
    every rank, and stays so (torch leaves ``.grad`` None there, not zeros). ``_Move`` itself
    materialises: after DTensor ops, ranks outside a sub-mesh can see an undefined gradient
    where members see a tensor, and every rank must join the collective."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.set_materialize_grads(False)
        # detached: a replicated value's global value is its own memory, a view of it, and a
        # custom Function's output that is a view may not be used once its base was written
        # in place (autograd's view+inplace rule). A plain parameter lifted into the op
        # (``embedding(max_norm=)`` renormalises its weight in place, then reads it) stays
        # the same memory, so the write still reaches it, as in one process
        return _Move.forward(ctx, x, target).detach()


def move(x: torch.Tensor, target) -> torch.Tensor:
    """Differentiably put ``x`` where ``target`` says (same mesh: a DTensor redistribute)."""
    if target is None and not isinstance(x, DTensor):
        return x
    if target is not None and isinstance(x, DTensor) and x.device_mesh is target.mesh:
        if tuple(x.placements) == tuple(target.placements):
            return x
        with _DisableSubclass():
            out = x.redistribute(target.mesh, target.placements)
        out.__class__ = _cls[0]
        return out
    if _debuglog.SHARDING:
        src = (mesh_ranks(x.device_mesh), tuple(x.placements)) if isinstance(x, DTensor) else "all"
        dst = (mesh_ranks(target.mesh), tuple(target.placements)) if target else "all"
        _debuglog.debug("sharding", f"move {tuple(x.shape)}: ranks {src} -> ranks {dst}")
    with _DisableSubclass():
        return _Move.apply(x, target)


def signal_mesh():
    """The active signal's mesh and config (None, None when the signal places nothing)."""
    from spmdgt.config._signals import lookup
    from spmdgt.tensor._placement import signal_mesh_of

    cfg = lookup(_scope.stack[-1][0])
    if cfg is None or cfg.shard is None:
        return None, None
    return signal_mesh_of(cfg), cfg


def _mutated(args, kwargs, writes_self: bool):
    """The DTensor an op writes into (self of an in-place op, else ``out=``), or None."""
    out = kwargs.get("out")
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if isinstance(out, DTensor):
        return out
    if writes_self and args and isinstance(args[0], DTensor):
        return args[0]
    return None


def align_meshes(args, kwargs, writes_self: bool = False):
    """Bring every DTensor argument onto one mesh: the mesh of the tensor the op writes into
    (moving it would write into a copy, and the write would be lost), else the active
    signal's, else the largest."""
    from spmdgt.tensor._placement import Target, signal_target

    written = _mutated(args, kwargs, writes_self)
    if written is not None:
        dst, cfg = written.device_mesh, None
    else:
        dst, cfg = signal_mesh() if _scope.stack else (None, None)
    if dst is None:
        meshes = {}
        map_tensors(
            lambda a: (
                meshes.setdefault(id(a.device_mesh), a.device_mesh) if isinstance(a, DTensor) else a
            ),
            args,
            kwargs,
        )
        if len(meshes) == 1:
            return args, kwargs
        dst = max(meshes.values(), key=lambda m: m.size())

    def fix(a):
        if isinstance(a, DTensor) and a.device_mesh is not dst:
            target = signal_target(cfg, a.shape) if cfg is not None else None
            if target is None or target.mesh is not dst:
                target = Target(dst, tuple(Replicate() for _ in dst.shape))
            return move(a, target)
        return a

    return map_tensors(fix, args, kwargs)


class _Lift(torch.autograd.Function):
    """A plain (world-replicated) tensor entering an op as Replicate on ``mesh``; its gradient
    is gathered to every rank, so the plain tensor's ``.grad`` is the same full value
    everywhere: partial gradients summed, on a sub-mesh too (ranks outside it hold no part of
    it), and for 0-d tensors, whose gradient a backward formula may hand back plain.

    Not ``DTensor.from_local``: its backward sums a partial gradient outside autograd, so a
    gradient w.r.t. a plain parameter taken with ``create_graph`` (a gradient penalty, a MAML
    inner step) had no graph. Here, under ``create_graph``, the gather is a recorded move."""

    @staticmethod
    def forward(ctx, a, mesh):
        return DTensor.from_local(a.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled() and isinstance(grad, DTensor):  # create_graph
            return gather(grad), None
        return global_value(grad), None


def lift_grad_plain(mesh, args, kwargs, written=None):
    """Plain tensors that need gradients enter as Replicate DTensors (``_Lift``), whose
    backward sums partial gradients, so they get plain, correct ``.grad``.

    Not ``written``, a plain tensor the op mutates (``out[:, 3:] = y[:, 3:]`` into a plain
    ``out`` that needs a gradient since an earlier write): a lifted copy shares its memory,
    so the write reached ``out``'s values, but autograd recorded it on the copy, and
    ``out``'s gradient skipped it (a silently wrong gradient, 2026-11-30). It is written by
    the op itself, on global values, where autograd records it on ``out``."""

    def lift(a):
        if (
            not isinstance(a, torch.Tensor)
            or isinstance(a, DTensor)
            or not a.requires_grad
            or a is written
        ):
            return a
        # A plain DTensor: it lives for this one call (outputs are re-tagged). It knows its
        # source: a rank outside a sub-mesh holds nothing of it, so a function run on global
        # values that writes it (``_fallback._write_side_effects``) writes the source.
        with _DisableSubclass():
            lifted = _Lift.apply(a, mesh)
        lifted._gt_lifted = a
        return lifted

    return map_tensors(lift, args, kwargs)


def map_tensors(fn, args, kwargs):
    """Apply ``fn`` to tensor arguments, one list/tuple level deep (``torch.cat``'s list)."""

    def one(a):
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            return type(a)([fn(b) for b in a])
        return fn(a)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def target_of(mesh, placements):
    """``mesh`` and ``placements`` as a ``Target`` (a ``Partial`` placement as ``Replicate``)."""
    from spmdgt.tensor._placement import Target

    return Target(mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in placements))


def gather(a):
    """The global value of DTensor ``a`` on every rank, as a plain tensor (differentiable)."""
    with _DisableSubclass():
        return _Gather.apply(a, None)


def scatter(full: torch.Tensor, target):
    """Lay out ``full`` (the same on every rank) as ``target`` (differentiable); None: plain."""
    if target is None:
        return full
    with _DisableSubclass():
        out = _Move.apply(full, target)
    return out


def refresh(view: DTensor) -> None:
    """Bring a tagged view up to date if its base was written since (a torch view would show
    the write at once). Versions advance alike on every rank, so all refresh together.

    The view's gradient must reach the base as it is now, as a torch view's does after its
    base was written. Where the view's wrapper is autograd's view of the base (the usual
    case: DTensor's view ops run below autograd's view tracking), autograd rebuilds the
    view's history from the base's by itself (they share a version counter), so the value is
    copied in behind its back. Copying it in through autograd there recorded a ``CopySlices``
    on the base whose backward writes the gradient through a view of the base's gradient,
    which on a sharded gradient is a copy: the view's part counted twice (a silently wrong
    gradient, 2026-11-30). Elsewhere, where the base needs a gradient, the value goes in
    through autograd (``copy_``): behind its back it left the view's history at the old
    base."""
    base, replay, version = view._gt_view
    if base._version == version:
        return
    grad = (
        torch.is_grad_enabled()
        and base.requires_grad
        and (
            view._base is None or view._base is not (base._base if base._base is not None else base)
        )
    )
    with torch.set_grad_enabled(grad):
        full = gather(base)
        with _DisableSubclass():
            new_view = replay(full)
        if tuple(new_view.shape) == tuple(view.shape):
            new = scatter(
                new_view.contiguous().to(view.dtype), target_of(view.device_mesh, view.placements)
            )
            if grad:
                with _DisableSubclass():
                    view.copy_(new)
            else:
                view._local_tensor.copy_(new._local_tensor)
    view._gt_view = (base, replay, base._version)
