"""``GT_AUTO_SHARD=plan``: each signal-less creation placed by pricing the ops that use it.

``GT_AUTO_SHARD=1`` splits every new tensor on axis 0. That suits a batch and is the worst
choice for the right operand of a product: ``rows @ rows`` all-gathers the right operand at
every product, which a replicated operand never does. With ``plan``:

1. **Record.** The first pass of the program runs as ``GT_AUTO_SHARD=1`` places it while the
   ops that use its creations are recorded (a before-op hook of the compile pass's hook
   mode, ``compile/_before_op``: one mode, no second tracer): which tensor feeds which op,
   with the global shapes. A *site* is one creation: the user's line, the shape, and how many
   creations of that shape the line made before in this pass (``[gt.randn(*s) for s in
   shapes]`` makes two sites).
2. **Price.** A pass ends when its first site is created again (the program repeats itself:
   a loop's next iteration, a benchmark's next run), or after ``_MAX_OPS`` recorded ops. Every
   choice of placement for the pass's sites (axis 0, any other axis the world divides, or
   replicated) is priced on the recorded ops with the model below, and the cheapest kept.
3. **Keep.** The choice holds for the rest of the run, and rank 0 prints it as signal YAML the
   user can keep (one signal per site, the line it belongs to in a comment). A site met later
   for the first time starts a new pass of its own.

The model prices one rank's time: communication at ``bytes / link + latency`` per collective,
matmul FLOPs over the device's peak, other ops' bytes over its memory bandwidth. Products
(``matmul``, ``mm``, ``bmm``, ``linear``) take the strategy DTensor takes (the least
communication, then the least compute): rows x replicated and replicated x columns are free,
contraction x contraction all-reduces the result, anything else is redistributed first. Other
ops follow their first sharded input of the output's shape and redistribute the rest to it;
an op whose output shape no input has (a reduction) is charged an all-reduce of its output
when an input is sharded. Host reads are not priced: they gather any sharded result alike.
Ties go to less replicated memory, then to axis 0.

Every rank records the same ops of the same program and prices them with the same constants
(no clock, no rank), so every rank keeps the same plan, which each creation's agreement point
then compares. Only creations outside any signal are planned; a signal's placement is the
user's and is never changed. Values never depend on the plan (principle 4): only placements.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["R", "active", "created", "placement_for", "reset", "yaml_of"]

_MAX_OPS = 4096  # recorded ops per pass; then the pass is priced as it stands
_EXHAUSTIVE = 512  # choices tried one by one up to this many; coordinate descent above

# (link bytes/s, latency s, peak FLOP/s, memory bytes/s) per device type: constants, alike on
# every rank (a measured figure would differ per rank and split the plan)
_DEVICE = {
    "cpu": (1.0e9, 50e-6, 5.0e10, 1.0e10),
    "cuda": (1.0e11, 20e-6, 5.0e13, 2.0e12),
}

_PRODUCTS = {"matmul", "__matmul__", "mm", "bmm", "linear"}
R = "R"  # replicated; an int d is Shard(d); "P" a partial sum


@dataclass
class _Site:
    key: tuple  # (the user's line, shape)
    shape: tuple[int, ...]
    itemsize: int
    options: list  # placements it may take: ints (axes) and R, axis 0's rule first
    node: int = -1


@dataclass
class _Pass:
    first: tuple  # the (line, shape) of its first creation
    sites: list[_Site] = field(default_factory=list)  # by position in the pass
    ops: list = field(default_factory=list)  # (name, [(node, shape, itemsize)], [(node, shape)])
    nodes: int = 0


_plans: dict[tuple, list] = {}  # a pass's first (line, shape) -> placement by position
_orders: dict[tuple, list] = {}  # ... -> the (line, shape) of each position
_cursor: tuple | None = None  # (first, next position) of the planned pass being followed
_pass: _Pass | None = None
_hook_added = False


def active() -> bool:
    """Whether a pass is being recorded (a creation then tags its tensor: ``created``)."""
    return _pass is not None


def reset() -> None:
    """Forget every plan (``gt.shutdown``, a forked child)."""
    global _pass, _cursor
    _stop_recording()
    _pass, _cursor = None, None
    _plans.clear()
    _orders.clear()


def _options(shape: tuple[int, ...], world: int) -> list:
    """Axis 0's rule first (axis 0 if the world divides it, else replicated), then every other
    axis the world divides, then replicated."""
    axes = [d for d, n in enumerate(shape) if n >= world and n % world == 0]
    first = 0 if axes[:1] == [0] else R
    return [first, *(a for a in axes if a != first), *([R] if first != R else [])]


def placement_for(site: str, shape, dtype: torch.dtype, world: int):
    """The placement of a creation at ``site`` (the user's line): an axis to shard, ``R``
    (replicated: a plain tensor), or None for axis 0's rule (a pass is being recorded)."""
    global _pass, _cursor
    key = (site, tuple(shape))
    if _pass is not None:
        if key == _pass.first and _pass.ops:
            _finish(world)  # the program came round again: price what the pass did
        else:
            _pass.sites.append(_Site(key, key[1], dtype.itemsize, _options(key[1], world)))
            return None
    if _cursor is not None:
        first, pos = _cursor
        order = _orders[first]
        if pos < len(order) and order[pos] == key:
            _cursor = (first, pos + 1)
            return _plans[first][pos]
    if key in _plans:
        _cursor = (key, 1)
        return _plans[key][0]
    _cursor = None  # a creation no pass has seen: a new pass begins here
    _pass = _Pass(first=key)
    _pass.sites.append(_Site(key, key[1], dtype.itemsize, _options(key[1], world)))
    _start_recording()
    return None


def created(t: torch.Tensor) -> None:
    """Tag the tensor the pass's last site made, so the ops using it are recorded."""
    if _pass is None or not _pass.sites or _pass.sites[-1].node >= 0:
        return
    site = _pass.sites[-1]
    site.node = _new_node()
    t._gt_plan = site.node


def _new_node() -> int:
    _pass.nodes += 1
    return _pass.nodes - 1


def _register() -> None:
    from spmdgt._core.session import session

    session.register("autoplan", reset)


# -- recording ---------------------------------------------------------------------------------
def _start_recording() -> None:
    global _hook_added
    from spmdgt.compile._before_op import add_before_op_hook

    add_before_op_hook(_record)
    _hook_added = True


def _stop_recording() -> None:
    global _hook_added
    if _hook_added:
        from spmdgt.compile._before_op import remove_before_op_hook

        remove_before_op_hook(_record)
        _hook_added = False


def _tensors(args, kwargs) -> list:
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            out += [b for b in a if isinstance(b, torch.Tensor)]
    return out


def _record(func, types, args, kwargs):
    """Before-op hook: run an op that reads a tagged tensor and record it; pass the rest."""
    from spmdgt.compile._before_op import PASS

    p = _pass
    if p is None:
        return PASS
    ins = _tensors(args, kwargs or {})
    nodes = [getattr(t, "_gt_plan", None) for t in ins]
    if all(n is None for n in nodes):
        return PASS
    inputs = [(n, tuple(t.shape), t.dtype.itemsize) for n, t in zip(nodes, ins)]
    out = func(*args, **kwargs) if kwargs else func(*args)
    if p is not _pass:  # the op itself ended the pass
        return out
    if isinstance(out, torch.Tensor):
        outs = [out]
    elif type(out) is tuple or type(out) is list:
        outs = [o for o in out if isinstance(o, torch.Tensor)]
    else:  # an attribute read (``t.shape``), a number: no tensor flows on
        return out
    recorded = []
    for o in outs:
        if any(o is t for t in ins):  # in place: the tensor keeps its node
            continue
        node = _new_node()
        o._gt_plan = node
        recorded.append((node, tuple(o.shape)))
    p.ops.append((getattr(func, "__name__", str(func)), inputs, recorded))
    if len(p.ops) >= _MAX_OPS:
        from spmdgt.runtime._state import get_runtime

        _finish(get_runtime().world_size)
    return out


# -- pricing -----------------------------------------------------------------------------------
class _Cost:
    __slots__ = ("collectives", "comm", "flops", "moved")

    def __init__(self) -> None:
        self.comm = self.flops = self.moved = 0.0
        self.collectives = 0


def _redistribute(src, dst, nbytes: float, world: int, cost: _Cost) -> None:
    """What moving a tensor of ``nbytes`` from placement ``src`` to ``dst`` costs a rank."""
    if src == dst or dst == "P":
        return
    if src == R:  # replicated -> a shard: each rank keeps its slice, nothing moves
        return
    share = nbytes * (world - 1) / world
    cost.collectives += 1
    if src == "P":  # all-reduce (to R) or reduce-scatter (to a shard)
        cost.comm += 2 * share if dst == R else share
    elif dst == R:  # all-gather
        cost.comm += share
    else:  # shard -> another shard: all-to-all
        cost.comm += share / world


def _product(name, ins, out_shape, place, world, cost: _Cost):
    """A product's output placement and cost, as DTensor's strategy picks it."""
    (na, sa, ia), (nb, sb, ib) = ins[0], ins[1]
    pa, pb = place.get(na, R), place.get(nb, R)
    a_bytes, b_bytes = math.prod(sa) * ia, math.prod(sb) * ib
    linear = name == "linear"
    if linear:  # weight (n, k): its axis 0 is the output's columns, axis 1 the contraction
        pb = {0: 1, 1: 0}.get(pb, pb)
    ka, nd = len(sa) - 1, len(out_shape) - 1
    k = sa[-1]
    n = out_shape[-1] if out_shape else 1
    flops = 2.0 * math.prod(out_shape) * k
    kb = len(sb) - 2 if len(sb) >= 2 and not linear else 0
    col_b = len(sb) - 1 if not linear else 1
    strategies = []  # (needs of a, needs of b, output, extra partial reduce)
    for d in range(ka):
        if sa[d] >= world:
            strategies.append((d, R, d if d < nd else R, False))
    if n >= world:
        strategies.append((R, col_b, nd, False))
    if k >= world:
        strategies.append((ka, kb, "P", True))
    strategies.append((R, R, R, False))
    best = None
    for need_a, need_b, out, partial in strategies:
        c = _Cost()
        _redistribute(pa, need_a, a_bytes, world, c)
        _redistribute(pb, need_b, b_bytes, world, c)
        split = out != R
        key = (c.comm, 0 if split else 1)
        if best is None or key < best[0]:
            best = (key, c, out, split, partial)
    _, c, out, split, partial = best
    cost.comm += c.comm
    cost.collectives += c.collectives
    cost.flops += flops / world if split else flops
    if partial:  # resolved when read or used elementwise: an all-reduce of the output
        _redistribute("P", R, math.prod(out_shape) * ia, world, cost)
        out = R
    return out


def _elementwise(ins, out_shape, itemsize, place, world, cost: _Cost):
    """A non-product op: its output follows its first sharded input of the output's shape."""
    out = R
    for node, shape, _ in ins:
        p = place.get(node, R)
        if p != R and shape == out_shape:
            out = p
            break
    for node, shape, isz in ins:
        p = place.get(node, R)
        nbytes = math.prod(shape) * isz
        if shape == out_shape:
            _redistribute(p, out, nbytes, world, cost)
        elif p != R and out == R:  # a sharded input of another shape (a reduction)
            _redistribute("P", R, math.prod(out_shape) * itemsize, world, cost)
            return R
        elif p != R and len(shape) != len(out_shape):
            _redistribute(p, R, nbytes, world, cost)
    numel = math.prod(out_shape)
    cost.moved += numel * itemsize / (world if out != R else 1)
    return out


def _price(p: _Pass, choice: dict[int, Any], world: int, device: str) -> float:
    """One rank's time for the recorded ops when the sites take ``choice`` (node -> place)."""
    link, latency, peak, membw = _DEVICE.get(device, _DEVICE["cpu"])
    place = dict(choice)
    cost = _Cost()
    for name, ins, outs in p.ops:
        if not outs:
            continue
        out_node, out_shape = outs[0]
        itemsize = ins[0][2] if ins else 4
        if name in _PRODUCTS and len(ins) >= 2 and len(ins[0][1]) >= 1 and len(ins[1][1]) >= 1:
            place[out_node] = _product(name, ins, out_shape, place, world, cost)
        else:
            place[out_node] = _elementwise(ins, out_shape, itemsize, place, world, cost)
    return cost.comm / link + cost.collectives * latency + cost.flops / peak + cost.moved / membw


def _choose(p: _Pass, world: int, device: str) -> list:
    """The cheapest placement per position of pass ``p``: exhaustive when the choices are
    few, coordinate descent from axis 0's rule otherwise. Ties: less replicated memory, then
    axis 0's rule."""
    sites = [s for s in p.sites if s.node >= 0]

    def score(values) -> tuple:
        time = _price(p, {s.node: v for s, v in zip(sites, values)}, world, device)
        replicated = sum(math.prod(s.shape) * s.itemsize for s, v in zip(sites, values) if v == R)
        moved = sum(1 for s, v in zip(sites, values) if v != s.options[0])
        return (time, replicated, moved)

    if math.prod(len(s.options) for s in sites) <= _EXHAUSTIVE:
        best = min(itertools.product(*(s.options for s in sites)), key=score, default=())
    else:
        best = [s.options[0] for s in sites]
        for _ in range(3):
            for i, s in enumerate(sites):
                best[i] = min(s.options, key=lambda v, i=i: score([*best[:i], v, *best[i + 1 :]]))
    chosen = dict(zip((id(s) for s in sites), best))
    return [chosen.get(id(s), s.options[0]) for s in p.sites]


def _finish(world: int) -> None:
    """Price the pass being recorded, keep its choice, print it (rank 0) and stop recording."""
    global _pass, _cursor
    p = _pass
    _pass = None
    _stop_recording()
    from spmdgt.runtime._state import get_runtime

    rt = get_runtime()
    _plans[p.first] = _choose(p, world, rt.device.type)
    _orders[p.first] = [s.key for s in p.sites]
    _cursor = None
    if rt.rank == 0:  # printing only: the plan itself was chosen alike on every rank
        print(yaml_of(p.sites, _plans[p.first], world), file=sys.stderr, flush=True)


def yaml_of(sites: list[_Site], placements: list, world: int) -> str:
    """A pass's plan as signal YAML: one signal per creation, its line in a comment."""
    lines = [
        f"# GT_AUTO_SHARD=plan: placements chosen for {world} ranks. To keep them, save this as",
        "# GT_CONFIG and wrap each creation in gt.signal.context(<its name>).",
    ]
    for i, (s, v) in enumerate(zip(sites, placements)):
        where = s.key[0].rsplit(" in ", 1)[0]
        stem = where.rsplit("/", 1)[-1].replace(".py", "").replace(":", "_")
        lines.append(f"plan_{stem}_{i}:  # {where}: {list(s.shape)}")
        lines.append("  shard: {replicated: true}" if v == R else f"  shard: {{axis: {v}}}")
    return "\n".join(lines)


_register()
