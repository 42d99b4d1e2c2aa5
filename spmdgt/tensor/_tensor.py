"""``gt.Tensor``: a DTensor that keeps GT's contract.

What it adds to ``torch.distributed.tensor.DTensor``, and nothing else:

- plain torch tensors mix in as replicated values (a plain ``nn.Linear`` on a sharded input
  works, and its parameters get plain, all-reduced gradients);
- values on different meshes (GT's pipeline stages) move to the mesh of the active signal;
- the subclass survives every op, so ``.numpy()``, ``.item()``, ``.tolist()`` and ``print``
  give the global value on every rank, whatever the placement.

Sharding propagation, redistribution and autograd are DTensor's and torch's. Replicated
tensors are never ``gt.Tensor``: they are plain torch tensors, the cheapest form there is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from spmdgt._core import debuglog as _debuglog
from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree
from spmdgt.runtime._state import get_runtime
from spmdgt.tensor import _dynamo, _fallback, _optable
from spmdgt.tensor._meshes import mesh_ranks

__all__ = ["Tensor", "global_value", "move", "place", "place_local"]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_get_implicit = torch._C._get_dtensor_allow_implicit_replication
_set_implicit = torch._C._set_dtensor_allow_implicit_replication


class Tensor(DTensor):
    """A sharded spmdgt tensor (a ``DTensor`` subclass); see the module docstring."""

    # (base weakref, replay, base version) on a view DTensor had to copy (see _fallback)
    _gt_view = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # The per-op path: one pass over the arguments (one list level deep, for torch.cat)
        # notes meshes and plain tensors and turns our tensors into plain DTensors for the
        # call, so DTensor's C++ fast path dispatches them; then the classes are restored.
        swapped = []
        views = None
        plain = False
        mesh = None
        many = False
        for a in args:
            if isinstance(a, DTensor):
                if type(a) is Tensor:
                    if a._gt_view is not None:  # a copy DTensor made for a view: fresh?
                        views = [a] if views is None else [*views, a]
                    a.__class__ = DTensor
                    swapped.append(a)
                m = a._spec.mesh
                if mesh is None:
                    mesh = m
                elif m is not mesh:
                    many = True
            elif isinstance(a, torch.Tensor):
                if a.dim() or a.requires_grad:  # a 0-d one is a scalar unless it learns
                    plain = True
            elif type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, DTensor):
                        if type(b) is Tensor:
                            b.__class__ = DTensor
                            swapped.append(b)
                        m = b._spec.mesh
                        if mesh is None:
                            mesh = m
                        elif m is not mesh:
                            many = True
                    elif isinstance(b, torch.Tensor) and (b.dim() or b.requires_grad):
                        plain = True
        if kwargs:
            for a in kwargs.values():
                if isinstance(a, DTensor):
                    if type(a) is Tensor:
                        a.__class__ = DTensor
                        swapped.append(a)
                elif isinstance(a, torch.Tensor) and (a.dim() or a.requires_grad):
                    plain = True
        else:
            kwargs = {}
        route = _routes.get(func)
        if route is None:
            route = _optable.route(func)
        implicit = _get_implicit()
        if not implicit:
            # plain tensors are replicated values, only inside our calls; the flag also tells
            # the propagation hook (_optable) that a missing rule means the exact fallback
            _set_implicit(True)
        try:
            if views is not None:
                for v in views:
                    _fallback.refresh(v)
            if mesh is not None and (many or _scope._stack):
                args, kwargs = _align_meshes(args, kwargs, route)
            if plain and mesh is not None and torch.is_grad_enabled():
                args, kwargs = _lift_grad_plain(mesh, args, kwargs)
            if route == 0 and "out" not in kwargs:  # DTENSOR, the common case: inlined
                try:
                    out = func(*args, **kwargs)
                except _optable.NoRule as e:
                    out = _fallback.run_global(func, args, kwargs, _no_rule(e))
            else:
                out = _run(func, args, kwargs, route)
        except Exception as e:  # a collective's timeout names the op (GT_TIMEOUT); free if none
            raise _agree.translate(e, func)  # noqa: B904 (e, or a timeout error caused by e)
        finally:
            if not implicit:
                _set_implicit(False)
            for a in swapped:
                a.__class__ = Tensor
        if type(out) is DTensor:
            out.__class__ = Tensor
        elif isinstance(out, (tuple, list)):
            for o in out:
                if type(o) is DTensor:
                    o.__class__ = Tensor
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached by ops the autograd engine runs on saved gt.Tensors (backward): take
        # DTensor's C++ fast path as the forward does, and keep what comes out (gradients) a
        # gt.Tensor, so ``.grad`` and ``torch.autograd.grad`` answer ``.numpy()``. Also
        # reached by ``Tensor.set_``, which offers no ``__torch_function__``.
        swapped = _swap_to_base(args, kwargs)
        kwargs = kwargs or {}
        implicit = _get_implicit()
        _set_implicit(True)
        try:
            if _optable.route(func) is _optable.ASSIGN:
                out = _assign(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except _optable.NoRule as e:  # e.g. aten.hardtanh_backward on this layout
            if func._schema.is_mutable:
                out = _fallback.run_inplace(func, args, kwargs, _no_rule(e))
            else:
                out = _fallback.run_global(func, args, kwargs, _no_rule(e))
        finally:
            _set_implicit(implicit)
            for a in swapped:
                a.__class__ = Tensor
        return _retag(out)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        # torch.compile rebuilds tensors from their parts: keep them gt.Tensors (see _dynamo)
        out = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
        out.__class__ = Tensor
        return out

    # -- a pending result of a lazy region (spmdgt.compile) is filled before it is read -----
    def to_local(self, *, grad_placements=None):
        """DTensor's ``to_local``, after a pending result is filled."""
        if _scope.lazy_sync is not None and "_gt_lazy" in self.__dict__:
            _scope.lazy_sync("to_local")
        return DTensor.to_local(self, grad_placements=grad_placements)

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """DTensor's ``redistribute`` (``full_tensor`` too), after a pending result is filled."""
        if _scope.lazy_sync is not None and "_gt_lazy" in self.__dict__:
            _scope.lazy_sync("redistribute")
        return DTensor.redistribute(self, device_mesh, placements, **kwargs)

    # -- GT's contract: the global value, on every rank ------------------------------------
    # Each host read is an agreement point (runtime._agree): the ranks compare the read, the
    # tensor and the call site before any data moves, so a rank that reads another tensor,
    # or none, is an error on every rank instead of a wrong value or a hang.
    def numpy(self, *, force: bool = False):
        """The global value as a numpy array (a collective: every rank must call it)."""
        return _read(self, "numpy()").cpu().numpy(force=force)

    def item(self):
        """The global scalar value (a collective)."""
        return _read(self, "item()").item()

    def tolist(self):
        """The global value as nested lists (a collective)."""
        return _read(self, "tolist()").tolist()

    def __array__(self, dtype=None, copy=None):
        arr = _read(self, "numpy.asarray()").cpu().numpy()
        return arr.astype(dtype) if dtype is not None else arr

    def __repr__(self, *, tensor_contents=None) -> str:
        value = repr(_read(self, "print()/repr()"))
        placements = tuple(self.placements)
        return f"{value[:-1]}, placements={placements!r})" if value.endswith(")") else value

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return _read(self, "format()").item().__format__(spec)
        return repr(self)

    def __float__(self) -> float:
        return float(_read(self, "float()").item())

    def __int__(self) -> int:
        return int(_read(self, "int()").item())

    def __bool__(self) -> bool:
        return bool(_read(self, "bool()").item())


def _tracing(t: DTensor) -> bool:
    # torch.compile prints tensors while it traces (fake tensors, no data): not a host read
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    return fake or type(t._local_tensor).__name__ == "FakeTensor"


def _read(t: DTensor, what: str) -> torch.Tensor:
    """A host read of ``t``: an agreement point on its read, global shape, dtype, placement
    and mesh, and the user's call site; then its global value."""
    if _scope.lazy_sync is not None and "_gt_lazy" in t.__dict__:
        _scope.lazy_sync(what)
    if _agree._group is not None and not _tracing(t):
        dtype = str(t.dtype).removeprefix("torch.")
        members = mesh_ranks(t.device_mesh)
        placements = f" {tuple(t.placements)}"
        # on a sub-mesh, a rank outside it keeps no placement alike: shown, not compared
        whole = len(members) == get_runtime().world_size
        spec = f"{dtype}{list(t.shape)}{placements if whole else ''} on ranks {members}"
        _agree.agree(f"{what} of {spec}", detail="" if whole else placements)
    try:
        return global_value(t)
    except Exception as e:
        raise _agree.translate(e, what)  # noqa: B904 (e, or a timeout error caused by e)


def global_value(t: torch.Tensor) -> torch.Tensor:
    """The full, detached value of ``t`` on every rank (plain tensors are returned detached).

    A collective over the tensor's mesh; for a mesh that excludes some ranks, rank
    ``mesh[0]`` then broadcasts it over the world, so every rank must call it.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    if getattr(t, "_gt_view", None) is not None:
        _fallback.refresh(t)
    with _DisableSubclass(), torch.no_grad():
        mesh = t.device_mesh
        rt = get_runtime()
        if mesh.size() == rt.world_size:
            return t.full_tensor()
        members = mesh_ranks(mesh)
        if rt.rank in members:
            value = t.full_tensor().resolve_conj().resolve_neg().contiguous()
        else:
            value = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if _agree._check:
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
    out.__class__ = Tensor
    return out


def place_local(make, shape: tuple[int, ...], target) -> torch.Tensor:
    """Lay out ``shape`` as ``target`` says from this rank's part alone, which
    ``make(local_shape, global_offset)`` builds (``global_offset`` is empty on a rank outside
    the mesh): no rank holds the whole tensor, no communication."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [Replicate() if isinstance(p, Partial) else p for p in target.placements]
    local_shape, offset = compute_local_shape_and_global_offset(shape, target.mesh, placements)
    stride = torch.empty(shape, device="meta").stride()
    with _DisableSubclass():
        out = DTensor.from_local(
            make(tuple(local_shape), tuple(offset)),
            target.mesh,
            placements,
            shape=torch.Size(shape),
            stride=stride,
        )
    out.__class__ = Tensor
    return out


_data = torch._C.TensorBase.data  # torch's own ``.data`` (a C getset)


def _set_data(t: DTensor, value) -> None:
    """``t.data = value`` for a ``gt.Tensor`` ``t``: ``t`` takes ``value``'s values, shape and
    dtype, as in torch (where DTensor's C++ setter changes the wrapper's shape alone and
    keeps the old shards: old values, or a shape that does not match them).

    A DTensor ``value``: ``t`` takes its layout and its shards themselves, so the two share
    memory as torch's would (a copy DTensor made for a view keeps its tie to the view's base,
    see ``_fallback.tag_views``). A plain ``value`` (the same on every rank, as every plain
    tensor is): laid out as ``t`` is, a shard dim the new shape lacks replicated; a copy, so
    later writes to ``value`` do not reach ``t`` (no rank holds a sharded tensor's memory
    whole). Ties between parameters: assign the parameter itself (``b.weight = a.weight``)"""
    from spmdgt.tensor._placement import Target

    for x in (t, value):
        if _scope.lazy_sync is not None and "_gt_lazy" in getattr(x, "__dict__", ()):
            _scope.lazy_sync(".data =")
    if isinstance(value, DTensor):
        if getattr(value, "_gt_view", None) is not None:
            _fallback.refresh(value)
        new = value
    elif isinstance(value, torch.Tensor):
        ndim = value.dim()
        placements = tuple(
            Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in t.placements
        )
        with torch.no_grad():
            new = place(value.detach(), Target(t.device_mesh, placements))
    else:
        new = value  # torch's own error: "Variable data has to be a tensor, but got int"
    with _DisableSubclass():
        _data.__set__(t, new)  # torch's checks (dtype and requires_grad); the new metadata
    t._local_tensor = new._local_tensor.detach()  # the same memory, no autograd history
    t._spec = new._spec
    # a copy DTensor made for a view stays tied to the view's base, as a torch view would
    t._gt_view = getattr(new, "_gt_view", None)


def _data_get(self):
    return _data.__get__(self)


def _data_set(self, value):
    if isinstance(self, Tensor):
        return _set_data(self, value)
    if isinstance(value, DTensor) and not isinstance(self, DTensor):
        raise RuntimeError(
            f"cannot set .data of a plain {type(self).__name__} to a sharded tensor (placements "
            f"{tuple(value.placements)}): torch would give it the sharded tensor's wrapper, "
            "which holds no values. To make a module's parameter sharded, assign a parameter: "
            "`module.weight = torch.nn.Parameter(value)` (or tie: `module.weight = "
            "other.weight`); to keep it plain with the global value: `with torch.no_grad(): "
            "module.weight.copy_(value)`"
        )
    _data.__set__(self, value)


def _install_data_setter() -> None:
    """``.data =`` on every torch tensor through ``_data_set``: a ``gt.Tensor`` takes the value
    (``_set_data``), a plain tensor refuses a sharded one at the assignment. torch's setter
    offers ``__torch_function__`` only to the tensor assigned to, so a sharded value given
    to a plain parameter (``lin.weight.data = t``) never reaches spmdgt, and the parameter
    fails later (a crash, or "data is not allocated yet"). Reads stay torch's own."""
    if isinstance(torch.Tensor.__dict__.get("data"), property):
        return
    torch.Tensor.data = property(_data_get, _data_set, doc=_data.__doc__)


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
        full = global_value(grad)
        if ctx.source is None:
            return full, None
        return place(full, Target(*ctx.source)), None


class _Gather(_Move):
    """``_Move`` to a plain global value, for the exact fallback: the plain op after it runs
    alike on every rank, so a gradient it leaves undefined (``norm(p=0)``) is undefined on
    every rank, and stays so (torch leaves ``.grad`` None there, not zeros). ``_Move`` itself
    materialises: after DTensor ops, ranks outside a sub-mesh can see an undefined gradient
    where members see a tensor, and every rank must join the collective."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.set_materialize_grads(False)
        return _Move.forward(ctx, x, target)


def move(x: torch.Tensor, target) -> torch.Tensor:
    """Differentiably put ``x`` where ``target`` says (same mesh: a DTensor redistribute)."""
    if target is None and not isinstance(x, DTensor):
        return x
    if target is not None and isinstance(x, DTensor) and x.device_mesh is target.mesh:
        if tuple(x.placements) == tuple(target.placements):
            return x
        with _DisableSubclass():
            out = x.redistribute(target.mesh, target.placements)
        out.__class__ = Tensor
        return out
    if _debuglog.SHARDING:
        src = (mesh_ranks(x.device_mesh), tuple(x.placements)) if isinstance(x, DTensor) else "all"
        dst = (mesh_ranks(target.mesh), tuple(target.placements)) if target else "all"
        _debuglog.debug("sharding", f"move {tuple(x.shape)}: ranks {src} -> ranks {dst}")
    with _DisableSubclass():
        return _Move.apply(x, target)


def _signal_mesh():
    from spmdgt.config._signals import lookup
    from spmdgt.tensor._meshes import mesh_for

    cfg = lookup(_scope._stack[-1][0])
    if cfg is None or cfg.shard is None:
        return None, None
    return mesh_for(cfg.shard.workers, cfg.name), cfg


def _mutated(args, kwargs, route):
    """The DTensor an op writes into (self of an in-place op, else ``out=``), or None."""
    out = kwargs.get("out")
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if isinstance(out, DTensor):
        return out
    if route == _optable.INPLACE and args and isinstance(args[0], DTensor):
        return args[0]
    return None


def _align_meshes(args, kwargs, route=None):
    """Bring every DTensor argument onto one mesh: the mesh of the tensor the op writes into
    (moving it would write into a copy, and the write would be lost), else the active
    signal's, else the largest."""
    from spmdgt.tensor._placement import Target, signal_target

    written = _mutated(args, kwargs, route)
    if written is not None:
        dst, cfg = written.device_mesh, None
    else:
        dst, cfg = _signal_mesh() if _scope._stack else (None, None)
    if dst is None:
        meshes = {}
        _map_tensors(
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

    return _map_tensors(fix, args, kwargs)


class _Lift(torch.autograd.Function):
    """A plain (world-replicated) tensor entering an op as Replicate on ``mesh``; its gradient
    is gathered to every rank, so the plain tensor's ``.grad`` is the same full value
    everywhere: on a sub-mesh (ranks outside it hold no part of it), and for 0-d tensors,
    whose gradient a backward formula may hand back plain (``from_local``'s backward
    expects a DTensor there)."""

    @staticmethod
    def forward(ctx, a, mesh):
        return DTensor.from_local(a.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return global_value(grad), None


def _lift_grad_plain(mesh, args, kwargs):
    """Plain tensors that need gradients enter as Replicate DTensors through ``from_local``,
    whose backward all-reduces partial gradients, so they get plain, correct ``.grad``."""
    world = mesh.size() == get_runtime().world_size

    def lift(a):
        if not isinstance(a, torch.Tensor) or isinstance(a, DTensor) or not a.requires_grad:
            return a
        # A plain DTensor: it lives for this one call (outputs are re-tagged).
        if world and a.dim():
            return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
        with _DisableSubclass():
            return _Lift.apply(a, mesh)

    return _map_tensors(lift, args, kwargs)


def _map_tensors(fn, args, kwargs):
    """Apply ``fn`` to tensor arguments, one list/tuple level deep (``torch.cat``'s list)."""

    def one(a):
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            return type(a)([fn(b) for b in a])
        return fn(a)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _swap_to_base(args, kwargs) -> list:
    """Make our arguments plain ``DTensor`` for the length of one call, and list them.

    DTensor dispatches its own exact type on a C++ fast path; any subclass takes a Python path
    that re-wraps every argument (~10 us per op). The class is restored right after the call.
    """
    swapped = []
    for a in args:
        if type(a) is Tensor:
            a.__class__ = DTensor
            swapped.append(a)
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if type(b) is Tensor:
                    b.__class__ = DTensor
                    swapped.append(b)
    if kwargs:
        for a in kwargs.values():
            if type(a) is Tensor:
                a.__class__ = DTensor
                swapped.append(a)
    return swapped


def _retag(out):
    """Hand out sharded results as ``gt.Tensor`` (one level deep: tuples of outputs)."""
    if type(out) is DTensor:
        out.__class__ = Tensor
    elif isinstance(out, (tuple, list)):
        for o in out:
            if type(o) is DTensor:
                o.__class__ = Tensor
    return out


def _run(func, args, kwargs, r):
    """Run ``func`` the way its route ``r`` (``_optable.route``) says: DTensor's path, or an
    exact fallback."""
    if r is _optable.AUTOGRAD:
        return func(*args, **kwargs)
    if kwargs.get("out") is not None:
        return _fallback.run_inplace(func, args, kwargs, "out= on a sharded operand")
    if r is _optable.DTENSOR:
        return _dtensor(func, args, kwargs)
    if r is _optable.VIEW:
        out = _dtensor(func, args, kwargs)
        src = args[0] if args else None
        if isinstance(src, DTensor) and out is not src:
            _fallback.tag_views(func, args, kwargs, out, src)
        return out
    if r is _optable.INPLACE:
        self = args[0] if args else None
        if isinstance(self, DTensor):
            if getattr(self, "_gt_view", None) is not None:
                out = _fallback.write_through(func, args, kwargs, self)
                if out is not NotImplemented:
                    return out
            if _optable.is_pointwise_inplace(func):
                return _dtensor(func, args, kwargs, inplace=True)
        return _fallback.run_inplace(func, args, kwargs, "in-place op outside the pointwise table")
    if r is _optable.GLOBAL:
        _optable.check_supported(func, args)
        if kwargs.get("inplace") is True:  # F.dropout(x, inplace=True): a mutation of x
            return _fallback.run_inplace(func, args, kwargs, "random op in place")
        return _fallback.run_global(func, args, kwargs, "data-dependent shape or random op")
    if r is _optable.IRREGULAR:
        if any(isinstance(a, DTensor) and _optable.is_irregular(a) for a in args):
            return _fallback.run_global(func, args, kwargs, "DTensor's rule needs even shards")
        return _dtensor(func, args, kwargs)
    if r is _optable.GUARDED:
        why = _optable.guard(func, args, kwargs)
        if why is not None:
            return _fallback.run_global(func, args, kwargs, why)
        return _dtensor(func, args, kwargs)
    if r is _optable.BATCH_ONLY:
        if any(isinstance(a, DTensor) and not _optable.batch_sharded_evenly(a) for a in args):
            return _fallback.run_global(func, args, kwargs, "DTensor's rule needs batch shards")
        return _dtensor(func, args, kwargs)
    empty = any(isinstance(a, DTensor) and _optable.has_empty_shard(a) for a in args)
    if empty:
        return _fallback.run_global(func, args, kwargs, "reduction over an empty shard")
    if (
        r is _optable.TIES
        and torch.is_grad_enabled()
        and any(isinstance(a, DTensor) and a.requires_grad for a in args)
        and _optable.ties_matter(func, args, kwargs)
    ):
        return _fallback.run_global(func, args, kwargs, "gradient shared among tied values")
    return _dtensor(func, args, kwargs)


def _assign(func, args, kwargs):
    """``aten.set_.source_Tensor`` (route ``ASSIGN``), below autograd (which has made its
    checks): a ``gt.Tensor`` self takes the source as ``.data =`` does (``_set_data``), after
    torch's dtype check. A plain self cannot hold a sharded source's shards: the in-place
    fallback gives it the global value."""
    self, src = args
    if not isinstance(self, DTensor):
        return _fallback.run_inplace(func, args, kwargs, "set_ of a plain tensor")
    if src.dtype != self.dtype:  # torch's error, from metadata alike on every rank
        torch.empty(0, dtype=self.dtype, device="meta").set_(
            torch.empty(0, dtype=src.dtype, device="meta")
        )
    _set_data(self, src)
    return self


def _no_rule(e) -> str:
    return f"no DTensor rule for {e.op} on this layout"


def _dtensor(func, args, kwargs, inplace: bool = False):
    """DTensor's path; where its sharding propagation has no rule for this layout (decided
    from metadata, on every rank alike, before any data moves), the exact fallback."""
    try:
        out = func(*args, **kwargs)
    except _optable.NoRule as e:
        why = _no_rule(e)
        if inplace:
            return _fallback.run_inplace(func, args, kwargs, why)
        return _fallback.run_global(func, args, kwargs, why)
    return out


_routes = _optable._routes  # read on every op: one dict lookup
assert _optable.DTENSOR == 0
_optable.install_propagation_hook(_fallback.run_global)
_dynamo.install(Tensor)
_install_data_setter()
