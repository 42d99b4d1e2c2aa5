"""A lazy region's recorded calls made into a ``Plan`` at a sync point, and its results put back.

``Region.take`` (``_region``) ends a region and hands its nodes here: ``build`` keeps the
nodes a live placeholder needs, renumbers their descriptors (nodes, inputs and float slots in
the order the kept nodes use them) and describes them as a ``Plan`` (the graph's structure,
where each input comes from, the inputs' metadata, grad mode, constants: its ``base`` key) for
``_graphs`` to key, compile and run; ``fill`` then puts the results into the placeholders
(``copy_`` where a result needs grad, so the placeholder's ``grad_fn`` leads into the compiled
backward; ``set_`` otherwise).

The region's inputs were held strongly while it recorded; their version counters are checked
here: an input changed in place behind the function layer (C++ code) raises instead of giving
a result computed from the changed value.
"""

from __future__ import annotations

from typing import Any

import torch

from spmdgt.compile import _sharded
from spmdgt.compile._calls import _ARGS, _FUNC, _KWARGS, _META, _REF, _ckey

__all__ = ["Plan", "build", "fill"]


class Plan:
    """What a region computes, ready to be keyed (``base`` and ``floats``) and built."""

    __slots__ = ("base", "comm", "float_dtypes", "floats", "grad", "inplace", "inputs", "mesh",
                 "nodes", "ops", "outputs", "rng", "rng_state", "views")  # fmt: skip

    def __init__(self) -> None:
        self.nodes: list[tuple] = []  # (func, args, kwargs) with descriptors remapped
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[Any] = []  # live placeholders, in output order
        self.grad = False
        self.floats: list[float] = []  # values of the float slots (graph inputs if dynamic)
        self.float_dtypes: list[torch.dtype] = []
        self.base: Any = None
        self.ops = 0
        self.mesh: Any = None  # sharded plans: the inputs' mesh (see _sharded)
        self.comm = False  # a sharded plan holds collectives
        self.rng: Any = None  # random calls: the generator and its state at the first
        self.rng_state: Any = None
        # views (``record_views``): the live view placeholders, whose data comes with their
        # base's (only their tags go at ``fill``), and the ids of the bases among the outputs,
        # filled in place (``copy_``) so that the views see their values
        self.views: list[torch.Tensor] = []
        self.inplace: set[int] = set()


def build(
    nodes: list[tuple],
    inputs: list[torch.Tensor],
    versions: list[int],
    floats: list[float],
    view_root: dict[int, int],
    bases: dict[int, torch.Tensor],
    grad: bool,
) -> Plan | None:
    """The plan of what a region's live placeholders need (None if nothing is live), from its
    recorded state (``Region.take``: its nodes, inputs and their versions when recorded,
    float slots, views' roots and bases, grad mode). The caller sets the plan's mesh,
    ``comm`` and generator."""
    live = {}
    views = []
    for i, n in enumerate(nodes):
        p = n[_REF]()
        if p is not None:
            if i in view_root:  # a view: its base is live and fills it
                views.append(p)
            else:
                live[i] = p
    for i, t in enumerate(inputs):
        if t._version != versions[i]:
            for p in live.values():
                p.__dict__.pop("_gt_lazy", None)
            raise RuntimeError(
                "spmdgt lazy region: an input was changed in place by code the region "
                "cannot see (C++ or a non-torch call) before the region ran; its results "
                "would be wrong, so none are given"
            )
    if not live:
        return None
    needed = set(live)
    for i in range(len(nodes) - 1, -1, -1):
        if i in needed:
            n = nodes[i]
            for d in _flat((*n[_ARGS], *(d for _, d in n[_KWARGS]))):
                if d[0] == "n":
                    needed.add(d[1])
    plan = Plan()
    plan.views = views
    plan.inplace = {id(b) for b in bases.values()}
    plan.grad = grad
    remap: dict[int, int] = {}
    in_map: dict[int, int] = {}
    fl_map: dict[int, int] = {}
    keyed = []

    def desc(d: tuple, n: tuple) -> tuple:
        kind, v = d
        if kind == "L":
            return ("L", tuple(desc(x, n) for x in v))
        if kind == "n":
            return ("n", remap[v])
        if kind == "i":
            if v not in in_map:
                in_map[v] = len(plan.inputs)
                plan.inputs.append(inputs[v])
            return ("i", in_map[v])
        if kind == "f":
            if v not in fl_map:
                fl_map[v] = len(plan.floats)
                plan.floats.append(floats[v])
                plan.float_dtypes.append(n[_META][2])
            return ("f", fl_map[v])
        return d

    outs = []
    for i, n in enumerate(nodes):
        if i not in needed:
            continue
        func = n[_FUNC]
        a = tuple(desc(d, n) for d in n[_ARGS])
        k = tuple((name, desc(d, n)) for name, d in n[_KWARGS])
        remap[i] = len(plan.nodes)
        plan.nodes.append((func, a, k))
        keyed.append((func, tuple(_dkey(d) for d in a), tuple((name, _dkey(d)) for name, d in k)))
        if i in live:
            outs.append(remap[i])
            plan.outputs.append(live[i])
    ins = tuple(_inkey(t) for t in plan.inputs)
    plan.base = (tuple(keyed), ins, tuple(outs), plan.grad, tuple(plan.float_dtypes))
    plan.ops = len(plan.nodes)
    return plan


def _inkey(t: torch.Tensor) -> tuple:
    spec = _sharded.layout(t)
    if spec is not None:  # global shape, stride, dtype, placements and mesh
        return (spec, t.requires_grad)
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _dkey(d: tuple) -> Any:
    if d[0] == "L":
        return ("L", tuple(_dkey(x) for x in d[1]))
    return ("c", _ckey(d[1])) if d[0] == "c" else d


def _flat(descs: Any) -> Any:
    """The descriptors, those inside a list's descriptor included."""
    for d in descs:
        if d[0] == "L":
            yield from d[1]
        else:
            yield d


def fill(plan: Plan, results: Any) -> None:
    """Put ``results`` into the plan's placeholders (which stop being placeholders)."""
    inputs = plan.inputs
    if plan.mesh is not None:  # results that need grad are copied in; the rest by shard
        pairs = _sharded.fill(plan, results)
        inputs = [getattr(t, "_local_tensor", t) for t in inputs]
    else:
        pairs = zip(plan.outputs, results, strict=True)
    # with a backward, a result that needs no grad may still be saved for it: copied, so that
    # an in-place change of the placeholder later cannot reach the saved value unseen
    grad = plan.grad and any(t.requires_grad for t in plan.inputs)
    seen: set[int] = set()
    inplace = plan.inplace
    with torch._C.DisableTorchFunction():
        for v in plan.views:  # views of a base filled below: their data comes with it
            v.__dict__.pop("_gt_lazy", None)
        for p, out in pairs:
            p.__dict__.pop("_gt_lazy", None)
            if not _sharded.release(p, out):  # its history is a custom Function's: values only
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                    p.copy_(out)
                continue
            if out.requires_grad:
                with torch.enable_grad():
                    p.copy_(out)  # grad_fn: CopyBackwards into the graph's backward
                continue
            ptr = out.untyped_storage().data_ptr()
            if (
                id(p) in inplace  # a base of views: their memory is its own, kept
                or grad
                or ptr in seen
                or out.stride() != p.stride()
                or out.storage_offset() != 0
                or any(t.untyped_storage().data_ptr() == ptr for t in inputs)
            ):
                with torch.no_grad():
                    p.copy_(out)
            else:  # the result's memory becomes the placeholder's: no copy
                seen.add(ptr)
                with torch.no_grad():
                    p.set_(out)
