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
import torch.autograd.forward_ad as _fwad
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Shard

from spmdgt._core import scope as _scope
from spmdgt.runtime import _agree, _rank_errors
from spmdgt.runtime._state import get_runtime
from spmdgt.tensor import (
    _assign,
    _contract,
    _dynamo,
    _fallback,
    _fastpath,
    _hook,
    _moves,
    _optable,
    _random,
    _registry,
    _transforms,
)
from spmdgt.tensor._fallback import _traced_copies
from spmdgt.tensor._meshes import describe_mesh, mesh_ranks
from spmdgt.tensor._moves import global_value, move, place, place_local

__all__ = ["Tensor", "global_value", "move", "place", "place_local"]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_functorch_active = torch._C._are_functorch_transforms_active
_get_implicit = torch._C._get_dtensor_allow_implicit_replication
_set_implicit = torch._C._set_dtensor_allow_implicit_replication


class Tensor(DTensor):
    """A sharded spmdgt tensor (a ``DTensor`` subclass); see the module docstring."""

    # (base, replay, base version) on a view DTensor had to copy (see _views.tag_views)
    _gt_view = None
    # (root's storage offset, root's spec then, replay) on a real view (see _views.alias_of)
    _gt_alias = None
    # such a copy made by ``detach`` (or a view of one): written behind autograd's back
    _gt_detached = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # A key seen before whose op was proven local runs on the local shards (_fastpath);
        # a new key learns under a record; everything else takes the usual path below.
        if _fp_on[0] and not _rng[1]:
            route = _routes.get(func)
            if route is None:
                route = _optable.route(func)  # also notes a rows_at_rows record
            if func in _rows_at_rows and not kwargs:  # rows @ rows, run directly
                out = _contract.direct(func, args, cls)
                if out is not NotImplemented:
                    return out
            if route == 0 or route == _INPLACE:  # DTENSOR, or a pointwise one proven
                key, entry = _fastpath.lookup(func, args, kwargs)
                if key is not None:
                    if entry is _FP_MISSING:
                        inplace = route == _INPLACE
                        return _fastpath.learn(key, func, args, kwargs, _dispatch, inplace)
                    if entry is not None:
                        return _fastpath.replay(entry, func, args, kwargs)
        return _dispatch(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached by ops the autograd engine runs on saved gt.Tensors (backward): take
        # DTensor's C++ fast path as the forward does, and keep what comes out (gradients) a
        # gt.Tensor, so ``.grad`` and ``torch.autograd.grad`` answer ``.numpy()``. Also
        # reached by ``Tensor.set_``, which offers no ``__torch_function__``.
        if not _compiling() and _soon:  # creations being agreed on: checked before data moves
            _agree.settle()
        if _traced_copies[0] and func._schema.is_mutable:  # a write into a traced copy?
            _fallback.refuse_traced_write(func, args, kwargs)
        swapped = _swap(args, kwargs)[0]
        kwargs = kwargs or {}
        implicit = _get_implicit()
        _set_implicit(True)
        try:
            # Tensor.set_ offers no torch function: its route is taken here
            call = _assign.assign if _optable.route(func) == _optable.ASSIGN else None
            # e.g. aten.hardtanh_backward without a rule for this layout: the exact fallback
            out = _dtensor_path(func, args, kwargs, func._schema.is_mutable, call)
        finally:
            _set_implicit(implicit)
            if not implicit:
                _rng[0] = False
            _restore(swapped)
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
        if not _compiling() and _soon:  # a creation still being agreed on
            _agree.settle()
        return DTensor.to_local(self, grad_placements=grad_placements)

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """DTensor's ``redistribute`` (``full_tensor`` too), after a pending result is filled."""
        if _scope.lazy_sync is not None and "_gt_lazy" in self.__dict__:
            _scope.lazy_sync("redistribute")
        if not _compiling() and _soon:
            _agree.settle()
        return DTensor.redistribute(self, device_mesh, placements, **kwargs)

    # -- GT's contract: the global value, on every rank ------------------------------------
    # Each host read is an agreement point (runtime._agree): the ranks compare the read, the
    # tensor and the call site before any data moves, so a rank that reads another tensor,
    # or none, is an error on every rank instead of a wrong value or a hang.
    def numpy(self, *, force: bool = False):
        """The global value as a read-only numpy array (a collective: every rank must call it).

        torch's ``.numpy()`` shares the tensor's memory, so writing into the array changes the
        tensor. No rank holds a sharded tensor's memory whole: the array is a copy, and a
        write into it could not reach the tensor. It is read-only, so such a write raises
        (numpy's "assignment destination is read-only") instead of silently differing from
        one process; ``.numpy().copy()`` gives an array to write to."""
        return _read_only(_read(self, "numpy()").cpu().numpy(force=force))

    def item(self):
        """The global scalar value (a collective)."""
        return _read(self, "item()").item()

    def tolist(self):
        """The global value as nested lists (a collective)."""
        return _read(self, "tolist()").tolist()

    def __array__(self, dtype=None, copy=None):
        # read-only as .numpy() is; a copy numpy asks for (np.array) is the caller's to write
        arr = _read_only(_read(self, "numpy.asarray()").cpu().numpy())
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        return arr.copy() if copy else arr

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


def _dispatch(func, args, kwargs):
    """The usual path of an op on ``gt.Tensor``s (``Tensor.__torch_function__``)."""
    swapped, views, plain, mesh, many = _swap(args, kwargs)
    if not kwargs:
        kwargs = {}
    route = _routes.get(func)
    if route is None:
        route = _optable.route(func)
    if route == 0 and kwargs.get("inplace") is True:
        route = _INPLACE  # F.relu(x, inplace=True), nn.ReLU(inplace=True): a mutation of x
    implicit = _get_implicit()
    if not implicit:
        # plain tensors are replicated values, only inside our calls; the flag also tells
        # the propagation hook (_optable) that a missing rule means the exact fallback
        _set_implicit(True)
        if _rng[1]:  # DTensor drew outside our calls: its cached sharding goes (_random)
            _random.settle()
    try:
        if not _compiling() and _soon:  # creations being agreed on: checked before data moves
            _agree.settle()
        if _fwad._current_level >= 0 or _functorch_active():  # two cheap reads
            _transforms.check(func, args, kwargs)  # torch.func / dual tensors: refused
        if views is not None:
            for v in views:
                _moves.refresh(v)
        # backward()/autograd.grad take their tensors as they are: a moved or lifted copy
        # of an input is not the tensor asked about (grad w.r.t. a plain parameter)
        if mesh is not None and (many or _scope.stack) and route != _AUTOGRAD:
            args, kwargs = _moves.align_meshes(args, kwargs, route == _optable.INPLACE)
        if plain and mesh is not None and torch.is_grad_enabled() and route != _AUTOGRAD:
            written = args[0] if route == _INPLACE and args else None
            args, kwargs = _moves.lift_grad_plain(mesh, args, kwargs, written)
        if route == 0 and "out" not in kwargs:  # DTENSOR, the common case
            if func in _rows_at_rows and not kwargs:  # rows @ rows: gather the second
                args = _contract.gather_second(args)
            out = _dtensor_path(func, args, kwargs)
        else:
            out = _optable.run(func, args, kwargs, route)
    except Exception as e:  # a collective's timeout names the op (GT_TIMEOUT); free if none
        raise _rank_errors.translate(e, func)  # noqa: B904 (e, or a timeout error caused by e)
    finally:
        if not implicit:
            _set_implicit(False)
            _rng[0] = False  # the next call starts with nothing drawn (_random.drew)
        _restore(swapped)
    return _retag(out)


def _tracing(t: DTensor) -> bool:
    # torch.compile prints tensors while it traces (fake tensors, no data): not a host read
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    return fake or type(t._local_tensor).__name__ == "FakeTensor"


def _read(t: DTensor, what: str) -> torch.Tensor:
    """A host read of ``t``: an agreement point on its read, global shape, dtype, placement
    and mesh, and the user's call site; then its global value."""
    if _scope.lazy_sync is not None and "_gt_lazy" in t.__dict__:
        _scope.lazy_sync(what)
    tracing = _tracing(t)
    if _agree.active() and not tracing:
        text, detail, _ = _spec_text(t._spec)
        _agree.agree(f"{what} of {text}", detail=detail)
    if tracing:
        # dynamo prints a traced tensor in its messages (one rank's error only, sometimes):
        # no data to show, and no collective to run for it (a sub-mesh value's broadcast
        # was a real one on the ranks outside the mesh, which waited for the others)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    try:
        return _host_value(t)
    except Exception as e:
        raise _rank_errors.translate(e, what)  # noqa: B904 (e, or a timeout error caused by e)


def _spec_text(spec) -> tuple[str, str, bool]:
    """What a read compares of a tensor with DTensor spec ``spec``: ``float32[1000, 1000]
    (Shard(dim=0),) on ranks [0, 1]``; what it shows without comparing (on a sub-mesh, a rank
    outside it keeps no placement alike: the placements); whether the mesh is 1-D over every
    rank, more than one. Read from the spec's own fields (a tensor's ``.shape`` and ``.dtype``
    each take the per-op hop) and kept on the spec with the fields it was made from: a read
    in a loop formats nothing."""
    meta, placements, mesh = spec.tensor_meta, spec.placements, spec.mesh
    kept = spec.__dict__.get("_gt_read")
    if kept is not None and kept[0] is meta and kept[1] is placements and kept[2] is mesh:
        return kept[3]
    dtype = str(meta.dtype).removeprefix("torch.")
    shown = f" {tuple(placements)}"
    whole = len(mesh_ranks(mesh)) == get_runtime().world_size
    text = f"{dtype}{list(meta.shape)}{shown if whole else ''} on {describe_mesh(mesh)}"
    kept = (text, "" if whole else shown, whole and mesh.ndim == 1 and mesh.size() > 1)
    spec.__dict__["_gt_read"] = (meta, placements, mesh, kept)
    return kept


def _host_value(t: DTensor) -> torch.Tensor:
    """``global_value(t)`` for a host read, by DTensor's own step where one step does it.

    A 1-D mesh over every rank holding a ``Shard``: the value is what ``full_tensor()`` gets,
    the same ``Shard._to_replicate_tensor`` (pad, all-gather, unpad) that
    ``redistribute_local_tensor`` runs for this layout, without the autograd function, plan
    and wrapping around it, which cost a 1000x1000 read ~20% (docs/benchmarks.md); rows by
    c10d's all-gather itself (``_contract.gather_rows``), without the functional layer, or
    through shared memory where every rank is on one host. A ``Partial`` sum, max or min on
    such a mesh is reduced through shared memory (``_agree.reduce``) where it can be. Every
    other layout (a sub-mesh, n-D, a stale view) takes ``global_value``.
    Decided from the spec, the same on every rank."""
    spec = t._spec
    placements = spec.placements
    one_step = len(placements) == 1 and getattr(t, "_gt_view", None) is None and _spec_text(spec)[2]
    if one_step and type(placements[0]) is Shard:
        if _agree.checking():  # GT_CHECK_RANKS: as DTensor's redistribution is checked
            _agree.before_collective(f"the all-gather of a host read of {_spec_text(spec)[0]}")
        shape = spec.tensor_meta.shape
        with torch.no_grad():
            if placements[0].dim == 0:  # rows: c10d's all-gather, no functional layer
                k = shape[0]
                rows = -(-k // spec.mesh.size())
                return _contract.gather_rows(t._local_tensor, spec.mesh.get_group(), rows, k)
            out = placements[0]._to_replicate_tensor(t._local_tensor, spec.mesh, 0, shape)
        return out.wait() if isinstance(out, AsyncCollectiveTensor) else out
    if one_step and type(placements[0]) is Partial and not _agree.checking():
        # a Partial value (a loss summed over rows): reduced through shared memory on one host
        with torch.no_grad():
            out = _agree.reduce(t._local_tensor, spec.mesh.get_group(), placements[0].reduce_op)
        if out is not None:
            return out
    return global_value(t)


def _read_only(arr):
    """``arr`` made read-only: see ``Tensor.numpy``."""
    arr.flags.writeable = False
    return arr


def _swap(args, kwargs) -> tuple:
    """Make our arguments plain ``DTensor`` for the length of one call (``_restore`` after),
    in one pass over the arguments (one list level deep, for torch.cat and
    ``backward(inputs=[...])``) that also notes what ``_dispatch`` needs.

    DTensor dispatches its own exact type on a C++ fast path; any subclass takes a Python path
    that re-wraps every argument (~10 us per op). Returns ``(swapped, views, plain, mesh,
    many)``: the tensors swapped; the positional ones that are views spmdgt had to copy
    (``_gt_view``: refreshed before the op) or None; whether a plain tensor that is not a
    scalar (a 0-d one is a scalar unless it learns) takes part; the mesh of the first
    positional DTensor; whether positional DTensors sit on more than one mesh."""
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
            elif isinstance(a, torch.Tensor):
                if a.dim() or a.requires_grad:
                    plain = True
            elif type(a) is list or type(a) is tuple:  # backward(inputs=[...])
                for b in a:
                    if type(b) is Tensor:
                        b.__class__ = DTensor
                        swapped.append(b)
    return swapped, views, plain, mesh, many


def _restore(swapped: list) -> None:
    """Give the tensors ``_swap`` made plain ``DTensor`` their class back."""
    for a in swapped:
        a.__class__ = Tensor


def _retag(out):
    """Hand out sharded results as ``gt.Tensor`` (one level deep: tuples of outputs)."""
    if type(out) is DTensor:
        out.__class__ = Tensor
    elif isinstance(out, (tuple, list)):
        for o in out:
            if type(o) is DTensor:
                o.__class__ = Tensor
    return out


_routes = _optable._routes  # read on every op: one dict lookup
_rows_at_rows = _registry.rows_at_rows_funcs  # filled with _routes, emptied in place with it
_soon = _agree._soon  # agreement points in flight (a list, emptied in place by settle)
# read first, so dynamo tracing an op never reads (or guards on) the list above
_compiling = torch.compiler.is_compiling
_dtensor_path = _optable.dtensor_path
_AUTOGRAD = _optable.AUTOGRAD
_INPLACE = _optable.INPLACE
_fp_on = _fastpath.enabled
_FP_MISSING = _fastpath._MISSING
_rng = _random.state  # [drew in this call, DTensor drew outside our calls]: read per call
assert _optable.DTENSOR == 0
_moves.set_tensor_class(Tensor)
_fastpath.set_tensor_class(Tensor)
_hook.install()
_dynamo.install(Tensor)
_transforms.install(Tensor)
_assign.install_data_setter()
