"""``torch.func`` transforms and forward-mode AD meeting a ``gt.Tensor``: refused, clearly.

spmdgt's exactness lives in ``gt.Tensor.__torch_function__`` (each op's route: tied maxima,
empty shards, random draws, losses over uneven shards) and in its autograd Functions (moves,
lifts). Under a functorch transform (``vmap``, ``grad``, ``grad_and_value``, ``vjp``, ``jvp``,
``jacrev``, ``jacfwd``, ``hessian``) an op on a wrapped ``gt.Tensor`` reaches DTensor at the
aten level only, past those routes: ``torch.func.grad(lambda x: x.amax())`` of a tensor whose
maximum is tied across ranks gave another gradient than one process, and ``vmap`` of a matmul
failed deep in DTensor. Forward-mode AD's tangents likewise pass by the routes and through
moves that define no forward derivative. So each is refused where a ``gt.Tensor`` meets it,
before any data moves, with the same error on every rank (every rank runs the same program,
and the checks read only types and torch's transform state):

- a ``gt.Tensor`` handed to a transform (functorch's ``_wrap_for_grad`` and ``_add_batch_dim``,
  wrapped at import: every transform wraps its inputs through one of the two);
- an op on a ``gt.Tensor`` while a transform is active (a sharded tensor the transformed
  function closes over; ``check`` from ``__torch_function__``);
- an op on a ``gt.Tensor`` that is, or meets, a dual tensor of ``torch.autograd.forward_ad``.

The ways out, named in the error, are exact: reverse mode (``torch.autograd.grad``, which
takes ``create_graph``; ``torch.autograd.functional``, whose ``jvp``/``hvp`` use the double
backward) or the transform over the plain global value (``x.full_tensor()``, differentiable).
While torch.compile traces, ``gt.Tensor`` is the DTensor it is (``_dynamo``): no check then.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad
from torch.distributed.tensor import DTensor

__all__ = ["active", "check", "install"]

_functorch_active = torch._C._are_functorch_transforms_active
_cls: list[type] = []  # gt.Tensor, registered by install()

_WAY_OUT = (
    "use torch.autograd.grad (create_graph=True for higher orders) or "
    "torch.autograd.functional (jacobian, hessian, vjp, jvp, hvp, vhp; vectorize=False), "
    "which are exact on sharded tensors, or run the transform on the plain global value "
    "(x.full_tensor(), differentiable)"
)


def _transform_error(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} on a sharded spmdgt tensor: torch.func transforms (vmap, grad, "
        "grad_and_value, vjp, jvp, jacrev, jacfwd, hessian) bypass spmdgt's per-op routes, "
        f"so they cannot be exact over sharded values; {_WAY_OUT}"
    )


def _dual_error(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what}: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported "
        "with sharded spmdgt tensors (tangents bypass spmdgt's per-op routes); use "
        "torch.autograd.functional.jvp (exact, by double backward) or "
        "make_dual on the plain global value (x.full_tensor())"
    )


def active() -> bool:
    """Is a functorch transform running, or a forward-AD dual level open? (Two cheap reads,
    on every op: the checks below run only then.)"""
    return _fwad._current_level >= 0 or _functorch_active()


def _tracing() -> bool:
    # torch.compile's tracing: gt.Tensor behaves as DTensor then (_dynamo swaps its hook)
    return _cls[0].__dict__["__torch_function__"] is torch._C._disabled_torch_function_impl


def _is_dual(a) -> bool:
    if not isinstance(a, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return _fwad.unpack_dual(a).tangent is not None


def check(func, args, kwargs) -> None:
    """Raise for an op on a ``gt.Tensor`` under a functorch transform, or one that involves a
    forward-AD dual tensor (``active()`` was true). The same on every rank."""
    from spmdgt.tensor._fallback import op_name

    name = op_name(func)
    if _functorch_active():
        raise _transform_error(f"{name} inside a torch.func transform")
    if _fwad._current_level < 0:
        return
    if name in ("_make_dual", "make_dual"):
        raise _dual_error(f"make_dual of a sharded tensor ({name})")
    flat = [*args, *kwargs.values()]
    for a in flat:
        if (type(a) is list or type(a) is tuple) and any(_is_dual(b) for b in a):
            raise _dual_error(f"{name} of a dual tensor and a sharded tensor")
        if _is_dual(a):
            raise _dual_error(f"{name} of a dual tensor and a sharded tensor")


def _guard_inputs(wrap, what: str):
    """``wrap`` (functorch's per-input wrapper) refusing a ``gt.Tensor``."""

    def guarded(x, *rest, **kw):
        if isinstance(x, DTensor) and type(x) is _cls[0] and not _tracing():
            raise _transform_error(what)
        return wrap(x, *rest, **kw)

    guarded.__wrapped__ = wrap  # type: ignore[attr-defined]
    return guarded


def install(cls: type) -> None:
    """Refuse ``cls`` (``gt.Tensor``) as a transform's input: functorch wraps every input of
    ``grad``/``vjp``/``jvp``/``jacrev`` through ``eager_transforms._wrap_for_grad`` and of
    ``vmap`` (``jacfwd``, ``hessian``) through ``vmap._add_batch_dim`` (module globals, read
    at each call). Once per process."""
    if _cls:
        return
    _cls.append(cls)
    from torch._functorch import eager_transforms, vmap

    eager_transforms._wrap_for_grad = _guard_inputs(
        eager_transforms._wrap_for_grad, "a torch.func transform (grad, vjp, jvp, jacrev...)"
    )
    vmap._add_batch_dim = _guard_inputs(vmap._add_batch_dim, "torch.func.vmap")
