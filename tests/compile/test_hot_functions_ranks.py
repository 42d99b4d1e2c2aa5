"""Hot functions on several ranks: op counts differ between ranks, decisions do not.

A rank outside a sub-mesh, an empty shard or a fallback's gather runs ops the other ranks do
not, so each rank finds a function hot at a different op. Hotness is then a proposal, settled
at the next agreement point (a creation or a host read of a spmdgt tensor): every rank
compiles the union at the same next call, and none raises ``RankDivergenceError``.
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks


def _work(a, b, extra):
    c = torch.zeros_like(a)
    for _ in range(4):
        c = c * b + a
    for _ in range(extra):  # this rank's own additional ops: its samples come sooner
        c = c + 0.0
    return c


def _uneven_ranks(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    extra = 12 if rank == 1 else 0
    a, b = torch.full((8, 8), 0.5), torch.full((8, 8), 0.25)
    ref = _work(a, b, extra)
    gt_compile.enable(backend="aot_eager", every=2, hot_at=4)
    try:
        outs, compiled_at = [], []
        for _ in range(8):
            outs.append(_work(a, b, extra))
            compiled_at.append(gt_compile.stats()["compiled"])
            gt.zeros(2)  # an agreement point
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return compiled_at, st["compiled"], all(torch.equal(o, ref) for o in outs)


def test_ranks_that_count_different_ops_compile_at_the_same_call(tmp_path):
    (at0, n0, ok0), (at1, n1, ok1) = run_ranks(_uneven_ranks, 2, tmp_path, timeout=240)
    assert ok0 and ok1
    assert n0 == n1 == 1
    assert at0 == at1, (at0, at1)  # the same call on both ranks
    assert at0[0] == 0  # proposed during the first calls, compiled only after an agreement


def _through_a_generator(a, b, extra):
    parts = (a * b + a for _ in range(4 + extra))  # the ops run in the generator's frame
    return list(parts)


def _generator_hot_on_one_rank(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    extra = 12 if rank == 1 else 0  # rank 1 finds the generator hot first, and proposes it
    a, b = torch.full((8, 8), 0.5), torch.full((8, 8), 0.25)
    ref = _through_a_generator(a, b, extra)
    gt_compile.enable(backend="aot_eager", every=2, hot_at=4)
    try:
        ok = True
        for _ in range(6):
            got = _through_a_generator(a, b, extra)
            ok = ok and all(torch.equal(x, y) for x, y in zip(got, ref))
            gt.zeros(2)  # an agreement point
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return ok, dict(st["skipped"])


def test_a_generator_hot_on_another_rank_is_refused_there_too(tmp_path):
    """A generator is never compiled; the rank that finds it hot says so. A rank that learnt
    of it through another rank's proposal compiled it without asking, and waited in a compile
    agreement the finder never reached (the parity sweep's ``partial`` layout with both
    halves on: ``partial_parts``' generator expression, a hang). Both refuse it now."""
    (ok0, skipped0), (ok1, skipped1) = run_ranks(
        _generator_hot_on_one_rank, 2, tmp_path, timeout=120
    )
    assert ok0 and ok1
    assert skipped0.get("a generator or coroutine", 0) >= 1, skipped0
    assert skipped1.get("a generator or coroutine", 0) >= 1, skipped1


def _runtime_failure_on_one_rank(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    def backend(gm, example_inputs):  # rank 1's graphs fail when they run, rank 0's do not
        def run(*args):
            if rank == 1:
                raise RuntimeError("kernel failed on rank 1")
            return gm.forward(*args)

        return run

    a, b = torch.full((8, 8), 0.5), torch.full((8, 8), 0.25)
    ref = _work(a, b, 0)
    gt_compile.enable(backend=backend, every=2, hot_at=4)
    try:
        ok = True
        for _ in range(8):
            ok = ok and torch.equal(_work(a, b, 0), ref)
            gt.zeros(2)  # an agreement point
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return ok, st["fallbacks"], st["graph_runs"]


def test_a_runtime_failure_on_one_rank_is_a_fallback_on_every_rank(tmp_path):
    (ok0, fb0, runs0), (ok1, fb1, runs1) = run_ranks(
        _runtime_failure_on_one_rank, 2, tmp_path, timeout=240
    )
    assert ok0 and ok1  # eager's values on both ranks, before and after the fallback
    assert fb1 == {"runtime error: RuntimeError: kernel failed on rank 1": 1}, fb1
    assert fb0 == {"another rank's graph failed at run time": 1}, fb0
    assert runs0 == runs1 == 1  # the one failing run; eager on both ranks from then on


def test_a_function_that_fell_back_is_never_made_hot_again():
    # A rank whose first compile of a function came through another rank's proposal has not
    # ruled on it itself. Once the function fell back (dynamo's recompile limit, a fallback
    # every rank took at the same call), its own samples could make it hot there again: the
    # rank unmarked it alone and its next call waited in a compile agreement that no other
    # rank reached (the both-halves parity sample, 3 ranks: a hang). In one process the
    # rank's side is enough to show it: a fallen code stays fallen and is not made hot.
    from spmdgt.compile._hot_functions import HotFunctionPass

    def f(x):
        return x + 1

    p = HotFunctionPass(backend="aot_eager")
    try:
        p.hook.fall_back(f.__code__)  # compiled through a proposal, then fell back
        p.on_hot([f.__code__])  # its own samples reach the threshold afterwards
        assert f.__code__ not in p.hook.hot
        assert f.__code__ in p.hook.fallen
        assert not p.hook.installed
    finally:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
        set_code_exec_strategy(f.__code__, default)


def _column(x):
    return x[:, 0]  # a view of the input, of another shape


def _pushforward(x):
    return torch.func.jvp(lambda a: (a**2).sum(), (x,), (torch.ones_like(x),))


def _pullback(x):
    for _ in range(4):  # ops enough to turn hot, though each call raises
        x = x + 1.0
    return torch.func.vjp(lambda a: (a**2).sum(), x)[1](torch.tensor(1.0))


def _two(w):
    return w * 2.0, w * 3.0  # two outputs needing grad: the graph's are joined (``Join``)


def _on_a_sub_mesh(rank, world):
    from torch.distributed.tensor import Replicate, Shard

    import spmdgt as gt
    import spmdgt.compile as gt_compile
    from spmdgt.tensor._meshes import mesh_for
    from spmdgt.tensor._placement import Target
    from spmdgt.tensor._tensor import place

    x = place(torch.arange(12.0).reshape(4, 3), Target(mesh_for([1]), (Replicate(),)))
    rows = Target(mesh_for(None), (Shard(0),))
    gt_compile.enable(backend="aot_eager", every=1, hot_at=2)
    try:
        columns, errors, grads = [], [], []
        for _ in range(4):
            columns.append(_column(x).numpy().tolist())
            try:
                _pushforward(x)
            except Exception as e:
                errors.append(type(e).__name__)
            try:  # row-sharded: dynamo traced the transform through DTensor, past the refusal
                _pullback(place(torch.arange(15.0).reshape(5, 3), rows))
            except Exception as e:
                errors.append(type(e).__name__)
            w = place(torch.arange(15.0).reshape(5, 3), rows).requires_grad_()
            a, b = _two(w)
            a.add_(1.0)  # in place into a hot function's output (a differentiable optimizer)
            (a * b).sum().backward()
            grads.append(w.grad.numpy().tolist())
            gt.zeros(2)  # an agreement point: the ranks are still in step
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return columns, errors, grads, dict(st["fallbacks"]), st["compiled"]


def test_hot_functions_on_sharded_values_run_as_eagerly(tmp_path):
    """Three hot functions, from the both-halves scenario sweep. On a value on a sub-mesh
    (rank 1 only), one returns a view of it (``x[:, 0]``): AOTAutograd makes such an output
    again with ``as_strided``, which DTensor refuses on the ranks holding data only, and rank
    1 alone raised and ended the process groups; its graph is now refused on every rank. One
    calls ``torch.func.jvp`` (refused over spmdgt tensors): dynamo printed a traced tensor
    for its own error, a broadcast on rank 0 only (a hang), or a failure decided by an
    exchange while exchanges are closed. Both now run as eagerly on every rank. The third
    returns two row-sharded outputs that need grad, which the program then writes in place:
    "Output 0 of Join is a view and is being modified inplace" (every ``*.differentiable``
    optimizer row); it compiles and gives eager's gradient. A ``torch.func.vjp`` over a
    row-sharded value compiled and returned a value where eager refuses the transform; it
    runs eagerly now, refused on every rank."""
    results = run_ranks(_on_a_sub_mesh, 2, tmp_path, timeout=240)
    w = torch.arange(15.0).reshape(5, 3).requires_grad_()
    a, b = _two(w)
    a.add_(1.0)
    (a * b).sum().backward()
    for rank, (columns, errors, grads, fallbacks, compiled) in enumerate(results):
        assert columns == [[0.0, 3.0, 6.0, 9.0]] * 4, (rank, columns)
        assert errors == ["NotImplementedError"] * 8, (rank, errors)
        assert grads == [w.grad.tolist()] * 4, (rank, grads)
        assert sum(fallbacks.values()) == 3, (rank, fallbacks)  # each refused function, once
        assert compiled >= 1, (rank, compiled)  # _two
    # decided on rank 1, which holds the data; rank 0 follows ("another rank's compile")
    assert any("view of a sub-mesh input" in k for k in results[1][3]), results[1][3]
