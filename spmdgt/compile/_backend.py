"""The backend dynamo hands each graph of a hot function: the real one, counted and guarded.

``CountingBackend(name)`` compiles with torch's backend of that name (``inductor`` by default,
``aot_eager`` in tests), forward and backward at once (``force_non_lazy_backward_lowering``:
the backward is not left to the first ``backward()``), and wraps the compiled graph in a
``_Runner`` that counts runs and ops.
A compiled graph that raises at run time is rerun eagerly (the FX graph dynamo traced, same
inputs): if eager raises too, the error is the program's and propagates as it would without the
pass; if eager succeeds, its result is returned, the graph runs eagerly from then on and the
function falls back (``on_runtime_error``). So a compiler bug costs speed, never a wrong answer
or a crash that eager would not have.

A graph that may move data between ranks (a sharded ``gt.Tensor`` input, a collective in the
graph) is rerun only where every rank's run raised: a rerun on one rank alone would issue its
collectives against whatever the other ranks run next. Whether every rank raised is decided as
for an op's error (``runtime._rank_errors.translate``): if one rank alone did, every rank
raises the same :class:`RankFailedError`, naming it.

A graph that calls a function torch.compile is known to compute wrongly (``wrong_when_compiled``:
``matrix_rank``'s ``out=`` write lost, ``multilabel_margin_loss`` with padded targets) is not
compiled at all: it runs as dynamo traced it, eagerly, each call torch's own.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spmdgt._core import scope as _scope
from spmdgt.compile._stats import CompileStats, first_line

__all__ = [
    "CountingBackend",
    "dead_collectives_dropped",
    "eager_random",
    "refusal",
    "refuse_double_backward",
    "wrong_when_compiled",
]

_OP_NODES = ("call_function", "call_method", "call_module")


class CountingBackend:
    """A dynamo backend: ``backend(gm, example_inputs) -> callable``; ``name`` is a registered
    backend's name or a backend callable."""

    def __init__(
        self,
        name: Any,
        stats: CompileStats,
        on_runtime_error: Callable[[Any, str], None],
    ) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.name = name
        self._real = lookup_backend(name)
        self._stats = stats
        self._on_runtime_error = on_runtime_error
        self.code: Any = None  # the hot code being compiled (set by the frame hook)

    def __call__(self, gm: Any, example_inputs: list) -> Callable[..., Any]:
        import torch._functorch.config as functorch_config

        # the backward too, now: a failure is then a compile error of this frame (agreed on
        # every rank, run eagerly), never an error inside the program's backward(), and its
        # time is the compile's; random ops draw eager's numbers (``eager_random``)
        refused = refusal(gm, example_inputs)
        if refused is not None:  # a compile error: every rank runs the function eagerly
            raise RuntimeError(f"{refused} (the function runs eagerly)")
        wrong = wrong_when_compiled(gm)
        if wrong is not None:
            compiled = gm  # as traced: each call torch's own
            self._stats.fallbacks[f"graph runs as traced: {wrong}"] += 1
        else:
            with (
                functorch_config.patch(force_non_lazy_backward_lowering=True),
                eager_random(),
                dead_collectives_dropped(),
            ):
                compiled = self._real(gm, example_inputs)
        ops = sum(1 for n in gm.graph.nodes if n.op in _OP_NODES)
        self._stats.graphs += 1
        self._stats.graph_ops += ops
        return _Runner(compiled, gm, ops, self.code, self, _moves_data(gm, example_inputs))


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
    for i in _mutated_inputs(gm):
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


def _moves_data(gm: Any, example_inputs: list) -> bool:
    """Whether the graph may take part in a collective: more than one rank, and a DTensor
    input on a mesh of more than one rank or a collective op of its own."""
    from spmdgt.runtime import _agree

    if not _agree.active():
        return False
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(
        isinstance(x, dtensor.DTensor) and x.device_mesh.size() > 1 for x in example_inputs
    ):
        return True
    return any(n.op == "call_function" and _is_collective(n.target) for n in gm.graph.nodes)


def _is_collective(target: Any) -> bool:
    """A c10d op (``torch.ops._c10d_functional.*``) or a ``torch.distributed`` function."""
    module = getattr(target, "__module__", None) or ""
    return "c10d" in (getattr(target, "namespace", None) or "") or module.startswith(
        "torch.distributed"
    )


def eager_random() -> Any:
    """Inductor lowers random ops (dropout, ``rand``...) with eager's kernels, reading torch's
    generator as eager does (``fallback_random``): by default it draws from its own seeds, so a
    compiled dropout would keep other elements than one process does. A context manager around
    a backend's compile; a no-op where inductor is not installed."""
    import contextlib

    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return contextlib.nullcontext()
    return inductor_config.patch(fallback_random=True)


def refuse_double_backward(out: Any, what: Callable[[], str]) -> Any:
    """``out`` (a compiled graph's outputs), each output's autograd node made to refuse a
    backward that builds a graph (``create_graph=True``) with a clear error.

    A compiled graph's backward is not differentiable again (AOTAutograd), and where none of
    its saved tensors needs grad its gradients reach no input: ``torch.autograd.grad`` then
    says the input was unused, and ``torch.autograd.functional.hessian`` and the like, which
    take an unused input's gradient as zero, returned zeros where eager gives the Hessian
    (found by the autograd scenario sweep with both halves on). The program did not ask for
    the compile, so the error says what to do (``what()`` names the graph, called only
    then). A backward without ``create_graph`` (the common one) passes untouched; the node
    runs with grad mode on only under it."""
    if not torch.is_grad_enabled():
        return out
    seen: set[Any] = set()
    for t in out if isinstance(out, (list, tuple)) else (out,):
        node = getattr(t, "grad_fn", None)
        if node is not None and node not in seen:
            seen.add(node)
            node.register_prehook(functools.partial(_refuse_twice, what))
    return out


def _refuse_twice(what: Callable[[], str], grad_outputs: Any) -> None:
    if torch.is_grad_enabled():  # the engine runs a node in grad mode under create_graph
        raise RuntimeError(
            f"spmdgt: a backward with create_graph=True reached {what()}, which spmdgt's compile "
            "pass compiled, and a compiled graph cannot be differentiated twice: its second "
            "derivatives would be missing (zeros). Run that forward as plain torch: without "
            "GT_AUTO_COMPILE / GT_WORKER_BATCH_SIZE, or inside "
            "spmdgt.compile.plain_torch(fn, *args)."
        )


@contextlib.contextmanager
def dead_collectives_dropped() -> Iterator[None]:
    """While a backend compiles: a backward graph keeps no collective whose result nothing
    reads. AOTAutograd's min-cut partitioner may recompute a saved value in the backward on
    one rank and read it saved on another (uneven shards: one rank saves a slice of a
    reduce-scatter's output, the other the output itself); the recomputation drags the
    collective along, and DCE keeps it as a side effect, unused. That rank's backward then
    issues a collective the others do not: a hang (found by the 2-D parity sweep with both
    halves on, ``aminmax`` on ``mesh_s0s1``: ranks 0 and 1 in a reduce-scatter and an
    all-gather against each other, torch 2.13). Torch's default partitioner drops such dead
    functional collectives (``is_not_collective``), the min-cut one does not; this does it
    there too, so every rank's backward issues the collectives its values need, the same on
    every rank. Dropping one is exact: a functional collective's only effect is its result."""
    from torch._functorch import partitioners

    real = getattr(partitioners, "_extract_fwd_bwd_modules", None)
    if real is None or getattr(real, "_gt_dead_collectives", False):
        yield
        return

    def extract(*args: Any, **kwargs: Any) -> Any:
        fw, bw = real(*args, **kwargs)
        if _drop_dead_collectives(bw.graph):
            bw.recompile()
        return fw, bw

    extract._gt_dead_collectives = True  # type: ignore[attr-defined]
    partitioners._extract_fwd_bwd_modules = extract
    try:
        yield
    finally:
        partitioners._extract_fwd_bwd_modules = real


def _is_functional_collective(node: Any) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def _drop_dead_collectives(graph: Any) -> bool:
    """Erase the functional collectives (and their waits) whose results nothing reads;
    whether any was. Every other node stays as it is, dead or not."""
    return graph.eliminate_dead_code(is_impure_node=lambda n: not _is_functional_collective(n))


class _Runner:
    """One compiled graph: counts runs (the first is the compile's, the rest are cache hits)
    and falls back to the traced graph on a run-time error that eager does not raise."""

    def __init__(
        self, compiled: Any, gm: Any, ops: int, code: Any, owner: CountingBackend, comm: bool
    ):
        self._fn = compiled
        self._gm = gm
        self._ops = ops
        self._code = code
        self._owner = owner
        self._first = True
        self._comm = comm  # may take part in a collective: rerun only where every rank failed
        self._mutated = _mutated_inputs(gm)
        self._sharded = _dtensor_inputs(gm)

    def __call__(self, *args: Any) -> Any:
        sync = _scope.lazy_sync
        if sync is not None:
            # lazy regions run too: an input may be a pending placeholder, which the graph
            # would read from C++ unfilled. Dynamo picked this graph by guards on the
            # placeholder's metadata, which equals the filled result's (``_region``)
            sync("a hot function's graph")
            from spmdgt.compile._before_op import without_hooks

            return without_hooks(self._run, args)
        return self._run(args)

    def _where(self) -> str:
        return f"the graph of {_where_code(self._code)}"

    def _run(self, args: tuple) -> Any:
        st = self._owner._stats
        st.graph_runs += 1
        st.compiled_ops += self._ops
        first, self._first = self._first, False
        if not first:
            st.cache_hits += 1
        copies = [args[i] for i in self._sharded if getattr(args[i], "_gt_view", None) is not None]
        if copies:
            # an input is a view DTensor had to copy, which the compiled graph knows no tie
            # to its base for: it is brought up to date first, as eagerly before each op
            # (its base may have been written since), and where the graph writes an input in
            # place, a write to either would reach the copy only, or read it stale: this call
            # runs as dynamo traced it, op by op, where spmdgt writes through. The tags are
            # alike on every rank, so are the refreshes and the choice
            from spmdgt.tensor import _moves

            for t in copies:
                _moves.refresh(t)
            if self._mutated:
                return self._gm(*args)
        try:
            out = self._fn(*args)
            if self._fn is not self._gm:
                refuse_double_backward(out, self._where)
            return _join(out)
        except Exception as e:
            if self._fn is self._gm:
                raise  # already eager: the program's own error
            if self._comm:
                from spmdgt.runtime import _rank_errors

                where = getattr(self._code, "co_name", "a hot function")
                err = _rank_errors.translate(e, f"the compiled graph of {where}")
                if err is not e:  # not every rank failed: no rank reruns alone
                    raise err from e
            t0 = time.perf_counter_ns()
            out = self._gm(*args)  # raises the program's error if it is one
            st.compile_ns += time.perf_counter_ns() - t0
            self._fn = self._gm
            reason = f"runtime error: {type(e).__name__}: {first_line(e)}"
            self._owner._on_runtime_error(self._code, reason)
            return out


def _dtensor_inputs(gm: Any) -> tuple[int, ...]:
    """Positions of ``gm``'s inputs that are DTensors (the traced fake values say)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return ()
    return tuple(
        i
        for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
        if isinstance(n.meta.get("example_value"), dtensor.DTensor)
    )


def _mutated_inputs(gm: Any) -> tuple[int, ...]:
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


def _where_code(code: Any) -> str:
    name = getattr(code, "co_name", None)
    if name is None:
        return "a hot function"
    return f"hot function {name} ({code.co_filename}:{code.co_firstlineno})"


def _join(out: Any) -> Any:
    """A graph's outputs, with ``_sharded.Join`` between them and the program where two or
    more need grad and one is a DTensor (a ``gt.Tensor``): a model's forward returns the loss
    and the logits, and ``loss.backward()`` leaves the logits' gradient undefined, which the
    engine then hands AOTAutograd as a plain tensor where the graph traced a DTensor (an error
    inside ``backward()``). ``Join`` hands it DTensor zeros of the output's placements."""
    import torch

    if not isinstance(out, (list, tuple)) or not torch.is_grad_enabled():
        return out
    need = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(need) < 2:
        return out
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not any(isinstance(out[i], dtensor.DTensor) for i in need):
        return out
    from spmdgt.compile._sharded import Join, implicit

    with torch._C.DisableTorchFunction(), implicit():
        joined = Join.apply(*(out[i] for i in need))
    fixed = list(out)
    for i, o in zip(need, joined, strict=True):
        if type(o) is not type(out[i]):  # keep the class (gt.Tensor), as a graph gave it
            o.__class__ = type(out[i])
        fixed[i] = o
    return type(out)(fixed) if isinstance(out, tuple) else fixed
