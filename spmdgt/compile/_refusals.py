"""Which graphs the compile pass must not compile: each reason is a graph whose compiled run
differs from eager's, found by a sweep and written down where it is checked.

``CountingBackend`` (``_backend``) asks ``refusal(gm, example_inputs)`` before it compiles a
graph of a hot function; a reason makes the compile fail, every rank agrees on the failure,
and the function runs eagerly from then on, each call spmdgt's own. ``wrong_when_compiled``
names a torch function that ``torch.compile`` is known to compute wrongly (its graph runs as
dynamo traced it, eagerly); the trainer's ``compile=True`` asks it too.

Every check reads the traced graph and its fake tensors only, so it costs compile time, never
a call; over-matching costs speed only. Ranks may decide apart where the fakes differ by rank
(uneven shards): the compile's result is agreed by every rank after it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

__all__ = ["mutated_inputs", "refusal", "wrong_when_compiled"]


def refusal(gm: Any, example_inputs: list) -> str | None:
    """Why ``gm`` must not be compiled at all, its function running eagerly instead (its
    compile fails, and the compile's result is agreed by every rank), or None. Each reason is
    a graph whose compiled run differs from eager's: its function below says how."""
    if _reentrant_checkpoint(gm):
        return (
            "checkpoint(use_reentrant=True): dynamo compiles it as the non-reentrant kind, "
            "whose gradients differ"
        )
    if not _on_ranks(example_inputs):
        return None
    drawn = _draws(gm)
    if drawn is not None:
        return (
            f"{drawn} on sharded tensors: a compiled graph draws per shard, spmdgt draws one "
            "process's numbers"
        )
    transform = _transform(gm)
    if transform is not None:
        return f"{transform}: a torch.func transform over spmdgt tensors, which spmdgt refuses"
    written = _view_write(gm)
    if written is not None:
        return (
            f"{written} writes through a view of a sharded tensor: the compiled graph's "
            "write-back of the view into its base gives other values than eager's"
        )
    piece = _piece_output(gm)
    if piece is not None:
        return (
            f"output {piece} is one of several views of a sharded tensor: the compiled "
            "graph's output does not write through to its base as eager's does"
        )
    grad_written = _grad_input_written(gm)
    if grad_written is not None:
        return (
            f"input {grad_written} needs grad and is written in place: AOTAutograd's backward "
            "of such a sharded input expects a plain gradient and raises"
        )
    copied = _copied_view_output(gm)
    if copied is not None:
        return (
            f"output {copied} is a view DTensor had to copy: the compiled graph's output "
            "neither writes through to its base nor sees the base's later writes, as eager's does"
        )
    view = _view_of_input(gm)
    if view is not None:
        return (
            f"output {view} is a view of a sub-mesh input: AOTAutograd would make it again "
            "with as_strided, which DTensor refuses on the ranks holding data"
        )
    return None


@functools.cache
def _known_wrong() -> dict[Any, tuple[bool, str]]:
    """torch functions torch.compile computes wrongly, silently: function -> (wrong only when
    called with ``out=``, why). Each is watched by ``tests/compile/test_wrong_when_compiled.py``,
    which fails once torch computes it right (then drop it here)."""
    import torch
    import torch.nn.functional as F

    lost = "AOTAutograd drops its out= write (zeros read back; torch 2.13)"
    # the decomposition scores the target slots after the first -1 (class 0 in their place)
    padded = "a wrong value where the target holds -1 (torch #141017; fixed after 2.13)"
    return {
        torch.linalg.matrix_rank: (True, lost),
        F.multilabel_margin_loss: (False, padded),
        torch._C._nn.multilabel_margin_loss: (False, padded),
    }


def wrong_when_compiled(gm: Any) -> str | None:
    """Why ``gm`` must not be compiled: the first call in it of a function torch.compile
    computes wrongly (``name: why``), or None. Such a graph runs as dynamo traced it (eagerly,
    each call torch's own), never compiled: a compiled one returns a silent wrong number."""
    table = _known_wrong()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        try:
            known = table.get(n.target)
        except TypeError:  # an unhashable target
            continue
        if known is not None and (not known[0] or n.kwargs.get("out") is not None):
            name = getattr(n.target, "__name__", str(n.target))
            return f"{name}{'(out=)' if known[0] else ''}: {known[1]}"
    return None


# what a draw's name holds (dynamo's graphs keep ``F.dropout``, ``F.rrelu``; ``nn.init`` and
# ``gumbel_softmax`` come inlined, as ``uniform_``, ``normal_``, ``exponential_``...)
_DRAWS = (
    "rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson",
    "exponential", "geometric", "cauchy", "rrelu", "random_", "fractional_max_pool", "gumbel",
)  # fmt: skip


def _dtensor_value(node: Any) -> Any:
    """The DTensor a graph node's traced value is (its fake), or None (another value, or an
    argument that is no node)."""
    from torch.distributed.tensor import DTensor

    v = node.meta.get("example_value") if hasattr(node, "meta") else None
    return v if isinstance(v, DTensor) else None


def _call_name(node: Any) -> str | None:
    """The name a graph node calls (a method's, or a function's ``__name__``), or None when
    the node calls nothing (an input, an output, an attribute)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return None


def _draws(gm: Any) -> str | None:
    """The first call in ``gm`` that draws random numbers (by name), or None.

    On sharded tensors spmdgt draws one process's numbers: every rank moves the generator
    past the whole tensor and keeps its own rows (``tensor/_random``). A compiled graph draws
    on each rank's shard with its own offsets, so ranks held different values and different
    generator states (``nn.init`` on a sharded parameter, ``Dropout`` on a sharded batch in a
    hot function: the random scenario sweep with both halves on). Such a graph is not
    compiled: its compile fails, on every rank alike (the graph is the same on every rank),
    and the function runs eagerly, each call spmdgt's own. Only a draw whose tensor is a
    DTensor counts: on plain tensors (a data-parallel model's dropout) each rank draws its
    own numbers, compiled as eagerly (``eager_random``). Over-matching costs speed only.
    The trace itself leaves DTensor's sharding of the draw in DTensor's cache; spmdgt clears
    it before its next call (``tensor/_random``, ``note_outside``), or the eager run that
    follows the refusal would draw per shard from it (``F.gumbel_softmax``)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    for n in gm.graph.nodes:
        name = _call_name(n)
        if name is None or not any(d in name for d in _DRAWS):
            continue
        first = n.args[0] if n.args else None
        value = first.meta.get("example_value") if hasattr(first, "meta") else None
        if dtensor is not None and isinstance(value, dtensor.DTensor):
            return name  # a draw on a sharded tensor (on plain ones each rank draws its own)
    return None


def _transform(gm: Any) -> str | None:
    """The first step of a ``torch.func`` transform or forward-mode AD in ``gm`` (its name),
    or None.

    Eagerly, spmdgt refuses those on sharded tensors on every rank (``tensor/_transforms``):
    they bypass its per-op routes, so nothing makes them exact. Dynamo inlines a transform
    (``_grad_increment_nesting``, ``_vmap_increment_nesting``, ``_jvp_increment_nesting``,
    ``_enter_dual_level``) and the graph traced it through DTensor, past the refusal: some
    returned one process's value, with nothing to promise it (the scenario sweep with both
    halves: 35 ``torch.func`` rows). Such a graph is not compiled: the function runs eagerly
    and is refused as eagerly. Over-matching (a transform over plain tensors in a graph with a
    sharded input) costs speed only."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            name = getattr(n.target, "__name__", "")
            if name.endswith("_increment_nesting") or name == "_enter_dual_level":
                return name
    return None


def _reentrant_checkpoint(gm: Any) -> bool:
    """Does ``gm`` hold a reentrant ``torch.utils.checkpoint.checkpoint``?

    Dynamo turns every checkpoint into its ``tag_activation_checkpoint`` operator, which
    differentiates like the non-reentrant kind: gradients reach the parameters used inside
    whatever the inputs are. The reentrant kind runs its forward without grad, so only its
    explicit inputs connect it to the graph: with no input needing grad its parameters get no
    gradient (torch warns), and ``autograd.grad`` with respect to them raises ("appears to
    not have been used in the graph"); compiled, both returned values (the scenario sweep
    with both halves: ``autograd.checkpoint.reentrant_grad``). The user's own
    ``torch.compile`` does the same; spmdgt's pass runs such a function eagerly instead."""
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"
            and n.kwargs.get("use_reentrant")
        ):
            return True
    return False


def _view_write(gm: Any) -> str | None:
    """The first call in ``gm`` (its name) that writes in place into a DTensor that is a view
    (``y[:, 1:].mul_(3)``, ``z[3][0] = 2``), or any ``setitem`` on a DTensor (``y[3, 0] = 2``
    writes through the view it indexes), or None.

    AOTAutograd functionalizes such a write: the view's new value is scattered back into its
    base, and on DTensors that write-back gives wrong values (column shards over 2 ranks:
    ``y[:, 1:].mul_(3)``, ``y[3, 0] = 2.0`` and ``z[:, 1:].mul_(3)`` of an intermediate were
    right eagerly and wrong once the hot function compiled; torch 2.13, 2026-11-30). Such a
    graph is not compiled: each call is spmdgt's own, eagerly. An in-place op on a tensor
    that is no view (``y.mul_(3)``) compiles. Read off the traced fake tensors, the same
    on every rank; over-matching costs speed only."""
    import operator

    if sys.modules.get("torch.distributed.tensor") is None:
        return None
    value = _dtensor_value
    for n in gm.graph.nodes:
        name = _call_name(n)
        first = value(n.args[0]) if name is not None and n.args else None
        if first is None:
            continue
        if n.target is operator.setitem:
            return "setitem"
        mutates = (name.endswith("_") and not name.endswith("__")) or n.kwargs.get(
            "inplace"
        ) is True
        if mutates and first._is_view():
            return name
    return None


_PIECES = ("unbind", "split", "chunk", "tensor_split", "split_with_sizes", "hsplit", "vsplit")


def _piece_output(gm: Any) -> str | None:
    """The first output of ``gm`` (its name) that is a DTensor view made by an op returning
    several views (``y.unbind(1)[4]``), or None.

    AOTAutograd makes such an output again from its base at run time, not by replaying the
    op, and on a sharded base the result no longer writes through: a hot function returning
    ``y.unbind(1)[4]`` of column shards, its caller writing ``.mul_(3)`` into it, left ``y``
    as it was once the function compiled (torch 2.13, 2026-11-30; ``y[:, 1:]`` and
    ``split`` pieces wrote through). Such a graph is not compiled. Over-matching (every
    multi-view op) costs speed only."""
    import operator

    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return None
    out = next(iter(gm.graph.find_nodes(op="output")))
    for n in out.all_input_nodes:
        value = n.meta.get("example_value")
        if not isinstance(value, dtensor.DTensor) or not value._is_view():
            continue
        node = n
        while (name := _call_name(node)) is not None:
            if any(name == p or name.endswith("." + p) for p in _PIECES):
                return n.name
            if node.target is not operator.getitem and not node.all_input_nodes:
                break
            node = node.args[0] if node.args and hasattr(node.args[0], "op") else None
            if node is None:
                break
    return None


def _grad_input_written(gm: Any) -> str | None:
    """The first input of ``gm`` (its name), a DTensor that needs grad, that a call in ``gm``
    writes in place, or None.

    AOTAutograd returns such an input's new value from the graph and guesses its gradient a
    plain tensor; the DTensor gradient that arrives made every backward raise ("we guessed its
    metadata incorrectly"): a hot ``def act(v): v.mul_(3)`` on ``v = y * 2`` of row shards,
    2 ranks, torch 2.13, 2026-11-30, where eager and one process compute. Such a graph is not
    compiled; an input that needs no grad (data, a detached tensor) is written in the graph,
    and so is any input of a function entered without grad (``torch.no_grad()`` around a hot
    optimizer loop: the graph has no backward)."""
    if sys.modules.get("torch.distributed.tensor") is None or not torch.is_grad_enabled():
        return None
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    for i in mutated_inputs(gm):
        value = _dtensor_value(inputs[i])
        if value is not None and value.requires_grad:
            return inputs[i].name
    return None


def _copied_view_output(gm: Any) -> str | None:
    """The first output of ``gm`` (its name) made by view ops alone from an input or another
    output, a DTensor, whose shard memory it does not share, or None.

    Such a view is one DTensor had to copy (``y.view(-1)`` of 7 rows over 2 ranks: the
    shards' rows do not split 35 elements as DTensor's flat shards would). Eagerly spmdgt
    tags it, so a write through it reaches its base and a read after a write to the base sees
    the write (``_views.tag_views``); the compiled graph returns the copy untagged: the
    caller's ``clamp_`` on it left the base as it was, and its gradient wrong, once the
    function turned hot (row shards, 2 ranks, torch 2.13, 2026-11-30). A view of an
    intermediate nobody else sees is harmless. Read off the traced fake tensors; over-matching
    (a tensor index, a copy in torch too) costs speed only."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from spmdgt.tensor import _registry

    if sys.modules.get("torch.distributed.tensor") is None:
        return None
    value = _dtensor_value

    def is_view(node: Any) -> bool:
        name = _call_name(node)
        if name is None or not node.args or value(node.args[0]) is None:
            return False
        return name == "getitem" or _registry.classify(name) == _registry.VIEW

    out = next(iter(gm.graph.find_nodes(op="output")))
    outputs = set(out.all_input_nodes)
    for n in out.all_input_nodes:
        node = n
        while is_view(node):
            node = node.args[0]
        if node is n or not (node.op == "placeholder" or node in outputs):
            continue
        view, root = value(n), value(node)
        if view is None or root is None:
            continue
        storage = StorageWeakRef(view._local_tensor.untyped_storage())
        if storage != StorageWeakRef(root._local_tensor.untyped_storage()):
            return n.name
    return None


def _view_of_input(gm: Any) -> str | None:
    """The first output of ``gm`` (its name) that is a view, of another shape, of a DTensor
    input on a sub-mesh (a mesh without every rank), or None.

    AOTAutograd does not return such an output from the compiled graph: it makes it again
    from the input at run time (``gen_alias_from_base``), replaying the view or, failing that,
    with ``as_strided``, which DTensor refuses unless the view is the whole tensor
    (``x[:, 0]``; ``x.t()`` replays). On a mesh of every rank each rank fails alike and the
    graph falls back to eager on all (``_Runner``). On a sub-mesh the ranks outside it hold no
    data, DTensor makes them no view, and only the ranks inside failed:
    ``autograd.functional.hessian(f, x[:, 0])`` in a hot function ended the process groups on
    one rank (the both-halves scenario sweep, ``subrep``). Such a graph is not compiled. Read
    off the traced fake tensors (a view shares its input's storage), so the ranks may decide
    apart; the compile's result is agreed by every rank after it. Over-matching (a replayable
    view on a sub-mesh) costs speed only."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from spmdgt.runtime import get_runtime

    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return None
    world = get_runtime().world_size

    def local(node: Any) -> Any:
        value = node.meta.get("example_value") if hasattr(node, "meta") else None
        return value._local_tensor if isinstance(value, dtensor.DTensor) else None

    inputs = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        t = local(n)
        if t is not None and n.meta["example_value"].device_mesh.size() < world:
            inputs[StorageWeakRef(t.untyped_storage())] = n.meta["example_value"]
    if not inputs:
        return None
    out = next(iter(gm.graph.find_nodes(op="output")))
    for n in out.all_input_nodes:
        t = local(n)
        if t is None:
            continue
        base = inputs.get(StorageWeakRef(t.untyped_storage()))
        value = n.meta["example_value"]
        if base is not None and (base.size() != value.size() or base.stride() != value.stride()):
            return n.name
    return None


def _on_ranks(example_inputs: list) -> bool:
    """More than one rank and a DTensor input, on any mesh (a sub-mesh of one rank too: the
    ranks off it move their generators as the ranks on it do, in spmdgt's draws)."""
    from spmdgt.runtime import _agree

    dtensor = sys.modules.get("torch.distributed.tensor")
    return (
        dtensor is not None
        and _agree.active()
        and any(isinstance(x, dtensor.DTensor) for x in example_inputs)
    )


def mutated_inputs(gm: Any) -> tuple[int, ...]:
    """Positions of ``gm``'s inputs that a call in it writes in place (an in-place method or
    function, ``setitem``, ``inplace=True``, ``out=``)."""
    import operator

    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    found = set()
    for n in gm.graph.nodes:
        name = _call_name(n)
        if name is None:
            continue
        out = n.kwargs.get("out")
        if hasattr(out, "op") and out in index:
            found.add(index[out])
        first = n.args[0] if n.args else None
        if not hasattr(first, "op") or first not in index:
            continue
        if (
            n.target is operator.setitem
            or (name.endswith("_") and not name.endswith("__"))
            or n.kwargs.get("inplace") is True
        ):
            found.add(index[first])
    return tuple(sorted(found))
