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

A graph the pass must not compile (``_refusals``: a graph whose compiled run differs from
eager's) fails its compile, agreed by every rank, and its function runs eagerly; a graph that
calls a function torch.compile is known to compute wrongly (``wrong_when_compiled``:
``matrix_rank``'s ``out=`` write lost, ``multilabel_margin_loss`` with padded targets) runs as
dynamo traced it, eagerly, each call torch's own.
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
from spmdgt.compile._refusals import mutated_inputs, refusal, wrong_when_compiled
from spmdgt.compile._stats import CompileStats, first_line

__all__ = [
    "CountingBackend",
    "dead_collectives_dropped",
    "eager_random",
    "refuse_double_backward",
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
        self._mutated = mutated_inputs(gm)
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
