"""Random ops on sharded values draw what one process draws, and leave every generator where
one process leaves it.

The ranks' generators agree (``runtime/_seed``), so an op that draws on the *global* values on
every rank draws one process's numbers and advances each rank's generator alike. Two levels
see random ops:

- **torch functions** (``gt.Tensor.__torch_function__``): a function named like an aten op
  that takes a ``Generator`` (``bernoulli``, ``normal``, ``poisson``, ``multinomial``,
  ``rand_like``, ``_standard_gamma``...) always draws: ``_optable`` routes it to the global
  values (``always_draws``), as it does the dropouts and ``rrelu``. In-place draws
  (``uniform_``, ``nn.init.*``) take the in-place fallback, which also runs on global values.
- **aten ops inside a composite.** A Python composite (``F.gumbel_softmax``, a user's own
  function) reaches ``__torch_function__`` as itself and runs on DTensors, whose ops reach
  DTensor's dispatcher at the aten level: ``empty_like(x).exponential_()`` there drew per
  shard, other numbers than one process, and advanced each rank's generator by its own shard's
  size, so every later draw differed between ranks. ``_hook`` asks ``draws`` about every aten
  op inside spmdgt's calls: an op tagged ``nondeterministic_seeded`` that takes a
  ``Generator``, or whose dropout probability is not 0 (and ``train`` not False), runs here on
  global values (``run``). The tag is torch's own list of ops that consume a generator, so
  nothing is listed by name. DTensor's sharding propagation is never asked about such an op
  inside spmdgt's calls, so its answer is never cached for them either.

A composite that drew and then meets an op DTensor has no rule for would, by the usual rule,
be run again from the start on global values, drawing a second time. After a draw in the
current call (``drew``), ``_hook`` runs that op alone on global values instead (``run``,
exact too), and the composite goes on where it was.

DTensor used directly (outside spmdgt's calls: the trainer's tensors) keeps DTensor's own
random ops, whose sharding DTensor's C++ dispatcher caches by op and layout, whatever
spmdgt's flag says; a later spmdgt call on that layout would be served from that cache, never
asking ``_hook``. ``_hook`` notes such a draw (``note_outside``) and the next spmdgt call
clears DTensor's cache first (``settle``).

Inside ``torch.compile`` tracing (fake tensors) nothing here runs: the compiled graph draws as
DTensor does (docs/exactness.md, "Random numbers: composite ops"). The trace leaves DTensor's
sharding of the draw in that same cache, so it is noted as an outside draw too: a hot
function refused for its draw runs eagerly next, and drew per shard from the cache.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from spmdgt.tensor._fallback import (
    _layout_outputs,
    _note,
    _write_back,
    in_layout_of,
    op_name,
    written,
)
from spmdgt.tensor._moves import global_value

__all__ = ["always_draws", "draws", "drew", "forget", "note_outside", "run", "settle", "state"]

# [drew in the current spmdgt call, DTensor drew outside spmdgt's calls since the last settle]
state = [False, False]

_always: dict[str, bool] = {}
# aten op -> None (draws nothing) or (takes a Generator, (index, name) of p, of train)
_seeded: dict[object, object] = {}
_P_NAMES = ("p", "dropout_p", "dropout")
_TRAIN_NAMES = ("train", "training")


def always_draws(name: str) -> bool:
    """Does the torch function ``name`` draw on every call: is it named like an aten op one of
    whose overloads takes a ``Generator``? (``bernoulli``, ``normal``, ``multinomial``,
    ``poisson``, ``rand_like``, ``randint_like``, ``rrelu``, ``binomial``...). Cached."""
    r = _always.get(name)
    if r is None:
        r = False
        if name.isidentifier() and not name.startswith("__"):
            try:
                packet = getattr(torch.ops.aten, name)
            except (AttributeError, RuntimeError):
                packet = None
            if isinstance(packet, torch._ops.OpOverloadPacket):
                r = any(_takes_generator(getattr(packet, o)) for o in packet.overloads())
        _always[name] = r
    return r


def _takes_generator(op) -> bool:
    return any("Generator" in str(a.type) for a in op._schema.arguments)


def _info(op_call):
    r = _seeded.get(op_call, False)
    if r is False:
        r = None
        if torch.Tag.nondeterministic_seeded in op_call.tags:
            arguments = op_call._schema.arguments
            found = {a.name: (i, a) for i, a in enumerate(arguments)}
            p = next((found[n] for n in _P_NAMES if n in found), None)
            train = next((found[n] for n in _TRAIN_NAMES if n in found), None)
            r = (_takes_generator(op_call), p, train)
        _seeded[op_call] = r
    return r


def _value(found, args, kwargs):
    i, a = found
    if a.name in kwargs:
        return kwargs[a.name]
    if i < len(args) and not a.kwarg_only:
        return args[i]
    return a.default_value if a.has_default_value() else None


def draws(op_call, args, kwargs) -> bool:
    """Does aten op ``op_call`` draw random numbers on these arguments? Tagged
    ``nondeterministic_seeded`` by torch, and: takes a ``Generator`` (the distributions,
    ``rand_like``...), or has no dropout probability, or one that is not 0 with ``train`` not
    False (dropouts, RNNs, attention kernels). Reads the arguments only: alike on every rank."""
    info = _info(op_call)
    if info is None:
        return False
    generator, p, train = info
    if generator:
        return True
    if p is not None:
        v = _value(p, args, kwargs)
        if isinstance(v, (int, float)) and v == 0:
            return False
    return train is None or _value(train, args, kwargs) is not False


def drew() -> bool:
    """Did an aten-level op draw on global values during the current spmdgt call?"""
    return state[0]


def forget() -> None:
    """The outermost spmdgt call ended: the next one starts with nothing drawn."""
    state[0] = False


def note_outside() -> None:
    """DTensor ran a random op outside spmdgt's calls: its sharding for that layout is now in
    DTensor's cache, where spmdgt's own calls would find it (see module docstring)."""
    state[1] = True


def settle() -> None:
    """Clear DTensor's sharding cache after a random op it ran outside spmdgt's calls, so
    spmdgt's next random op on that layout reaches ``_hook`` (``run``) again."""
    state[1] = False
    torch._C._clear_DTensor_sharding_propagator_cache()


def run(op_call, args, kwargs, why: str = "random op inside a composite"):
    """Aten op ``op_call`` on the global values of its DTensor arguments, on every rank: one
    process's numbers and generator states. Each DTensor it writes into gets its own part of
    the new value back; other outputs are laid out like the first DTensor argument (as the
    exact fallback does) and handed back as plain DTensors, as DTensor's own op would."""
    state[0] = True
    # self of an in-place op, the noise buffer of rrelu_with_noise, out= (``written`` takes
    # args[0] for a schema that writes nothing: asked of mutating ops only)
    mutates = op_call._schema.is_mutable
    targets = (
        [t for t in written(op_call, args, kwargs) if isinstance(t, DTensor)] if mutates else []
    )
    fulls: dict[int, torch.Tensor] = {}
    like = None

    def full_of(a):
        nonlocal like
        if not isinstance(a, DTensor):
            return a
        if like is None:
            like = a
        f = fulls.get(id(a))
        if f is None:
            f = global_value(a)
            g = in_layout_of(f, a)  # a fill follows memory order: the DTensor's layout
            if g is f and any(a is t for t in targets):  # written: a copy of its own
                g = f.clone()
            f = g
            fulls[id(a)] = f
        return f

    _note(op_call, why, args, kwargs)
    with torch.no_grad():
        full_args = [_map_list(full_of, a) for a in args]
        full_kwargs = {k: _map_list(full_of, v) for k, v in kwargs.items()}
        out = op_call(*full_args, **full_kwargs)
        name = op_name(op_call)
        for t in targets:
            cls = type(t)
            _write_back(t, fulls[id(t)], name)
            t.__class__ = cls  # its copy_ passes gt.Tensor's dispatch, which retags it
    back = {id(fulls[id(t)]): t for t in targets}

    def lay(o):
        if isinstance(o, torch.Tensor) and id(o) in back:
            return back[id(o)]
        if like is None or not isinstance(o, torch.Tensor):
            return o
        r = _layout_outputs(o, like)
        if isinstance(r, DTensor):
            r.__class__ = DTensor
        return r

    if isinstance(out, (tuple, list)):
        return type(out)(lay(o) for o in out)
    return lay(out)


def _map_list(fn, a):
    if isinstance(a, (list, tuple)):
        return type(a)(fn(b) for b in a)
    return fn(a)
