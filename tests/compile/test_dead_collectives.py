"""A compiled backward issues the collectives its values need, on every rank alike.

AOTAutograd's min-cut partitioner may recompute a saved value in one rank's backward and read
it saved in another's (uneven shards: a slice of a reduce-scatter's output saved on one rank,
the output itself on the other); the recomputation drags a collective into that rank's
backward, unused, and DCE keeps it as a side effect: a hang (the 2-D parity sweep with both
halves on, ``aminmax`` on ``mesh_s0s1``). The compile pass's backends drop such dead
functional collectives while they compile (``_backend.dead_collectives_dropped``)."""

from __future__ import annotations

import torch
from torch._functorch import partitioners

from spmdgt.compile._backend import _drop_dead_collectives, dead_collectives_dropped

_all_reduce = torch.ops._c10d_functional.all_reduce.default
_wait = torch.ops._c10d_functional.wait_tensor.default
_sum = torch.ops.aten.sum.default


def _backward_like() -> tuple[torch.fx.Graph, list]:
    """A graph with a dead collective (and its wait), a live one, and a dead non-collective."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(_sum, (x,))  # dead, no collective: left as it is
    dead = g.call_function(_all_reduce, (x, "sum", "0"))
    g.call_function(_wait, (dead,))  # its result read by nothing
    live = g.call_function(_all_reduce, (x, "sum", "0"))
    g.output((g.call_function(_wait, (live,)),))
    return g, [n.target for n in g.nodes if n.op == "call_function"]


def test_a_dead_collective_and_its_wait_are_dropped_and_nothing_else() -> None:
    g, before = _backward_like()
    assert before == [_sum, _all_reduce, _wait, _all_reduce, _wait]
    assert _drop_dead_collectives(g)
    assert [n.target for n in g.nodes if n.op == "call_function"] == [_sum, _all_reduce, _wait]
    assert not _drop_dead_collectives(g)  # nothing left to drop


def test_the_partitioner_is_wrapped_while_a_backend_compiles_and_restored_after() -> None:
    real = partitioners._extract_fwd_bwd_modules
    with dead_collectives_dropped():
        wrapped = partitioners._extract_fwd_bwd_modules
        assert wrapped is not real
        with dead_collectives_dropped():  # nested: not wrapped twice
            assert partitioners._extract_fwd_bwd_modules is wrapped
        assert partitioners._extract_fwd_bwd_modules is wrapped
    assert partitioners._extract_fwd_bwd_modules is real


def test_a_compiled_backward_through_the_wrapper_is_still_exact(monkeypatch) -> None:
    # the wrapper on a real partition (min-cut, aot_eager): it sees the backward graph, and a
    # backward with nothing to drop is the same graph; values and gradients equal eager's
    import spmdgt.compile._backend as backend

    seen = []
    real_drop = backend._drop_dead_collectives
    monkeypatch.setattr(backend, "_drop_dead_collectives", lambda g: seen.append(g) or real_drop(g))
    x = torch.randn(5, 7, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        a, b = torch.aminmax(t.sin(), dim=1)
        return (a * 2 + b).sum()

    with dead_collectives_dropped():
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        (gx,) = torch.autograd.grad(got, x)
    assert len(seen) == 1  # the one backward graph went through it
    want = f(x)
    (wx,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, wx)
