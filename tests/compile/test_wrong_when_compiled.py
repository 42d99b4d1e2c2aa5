"""Calls torch.compile computes wrongly: the compile pass and compiled trainer blocks run a
graph that makes one as dynamo traced it (eagerly), so the program sees eager's values.

torch 2.13 has two, both found by the parity sweep with both compile halves on: AOTAutograd
drops the write of ``torch.linalg.matrix_rank(..., out=out)`` (zeros read back), and the
decomposition of ``multilabel_margin_loss`` scores target slots after the first -1 (torch
#141017). The tests below fail once torch computes them right. The slow test sweeps every
OpInfo op that takes ``out=`` and checks that the ``out=`` calls guarded are exactly those
torch.compile loses.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import spmdgt.compile as gt_compile
from spmdgt.compile import _refusals
from spmdgt.interceptor import _control
from spmdgt.train._compile import _guarded_backend


def _hermitian() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 5, generator=g)
    a = a + a.transpose(-1, -2)
    a[1, :, 0] = 0  # rank 4: the values are not all alike
    a[1, 0, :] = 0
    return a


def _rank_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.linalg.matrix_rank(x, hermitian=True, out=out)


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        gt_compile.disable()
        _control.disable()
        torch._dynamo.reset()


def test_torch_compile_still_loses_the_write(fresh_dynamo):
    # Why the guard exists. When this fails, torch keeps the write: drop matrix_rank from
    # ``_refusals._known_wrong`` (and the slow sweep below will say the same).
    a = _hermitian()
    out = torch.zeros(3, dtype=torch.int64)
    torch.compile(_rank_into, backend="aot_eager")(a, out)
    assert out.tolist() == [0, 0, 0]
    assert torch.linalg.matrix_rank(a, hermitian=True).tolist() == [5, 4, 5]


def test_hot_function_with_a_lost_out_runs_as_traced(fresh_dynamo):
    a = _hermitian()
    want = torch.linalg.matrix_rank(a, hermitian=True)
    gt_compile.enable(backend="aot_eager", every=2, hot_at=4)
    for _ in range(30):  # hot, compiled, then cached runs: each must write out
        out = torch.zeros(3, dtype=torch.int64)
        got = _rank_into(a, out)
        assert got is out
        assert out.tolist() == want.tolist()
    st = gt_compile.stats()
    assert st["compiled"] == 1 and st["graph_runs"] >= 2, st
    [why] = st["fallbacks"]
    assert (
        why.startswith("graph runs as traced: linalg_matrix_rank(out=): ")
        and st["fallbacks"][why] == 1
    ), st


def test_trainer_block_backend_runs_a_lost_out_as_traced(fresh_dynamo):
    a = _hermitian()
    out = torch.zeros(3, dtype=torch.int64)
    torch.compile(_rank_into, backend=_guarded_backend("aot_eager"))(a, out)
    assert out.tolist() == torch.linalg.matrix_rank(a, hermitian=True).tolist()


def test_graphs_without_a_lost_out_are_compiled(fresh_dynamo):
    def fn(x, out):
        torch.linalg.matrix_rank(x, hermitian=True)  # no out=: compiled as usual
        return torch.abs(x, out=out)  # an out= torch.compile keeps

    graphs = []

    def spy(gm, example_inputs):
        graphs.append(_refusals.wrong_when_compiled(gm))
        return gm.forward

    out = torch.zeros(3, 5, 5)
    torch.compile(fn, backend=spy)(_hermitian(), out)
    assert graphs == [None]
    assert torch.equal(out, _hermitian().abs())


def _margin_case():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g)
    y = torch.tensor(
        [[0, 3, -1, 2, 1, 5], [1, -1, 0, 0, 0, 0], [5, 4, 3, 2, 1, 0], [2, 2, -1, 4, 1, 1]]
    )
    return x, y


def _margin(x, y):
    # the ops around the loss make the function, not its caller, hot
    return torch.nn.functional.multilabel_margin_loss(x * 1.0, y, reduction="sum") * 1.0


def test_torch_compile_still_scores_padded_targets(fresh_dynamo):
    # Why the guard exists (torch #141017). When this fails, drop multilabel_margin_loss from
    # ``_refusals._known_wrong``.
    x, y = _margin_case()
    got = torch.compile(_margin, backend="aot_eager")(x, y)
    assert not torch.allclose(got, _margin(x, y))


def test_hot_function_with_a_padded_margin_loss_is_exact(fresh_dynamo):
    x, y = _margin_case()
    x.requires_grad_(True)
    want = _margin(x, y)
    (want_g,) = torch.autograd.grad(want, x)
    gt_compile.enable(backend="aot_eager", every=2, hot_at=4)
    for _ in range(30):  # hot, compiled, then cached runs: forward and gradient each time
        got = _margin(x, y)
        (g,) = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(g, want_g, rtol=0, atol=0)
    st = gt_compile.stats()
    assert st["compiled"] == 1 and st["graph_runs"] >= 2, st
    assert any("multilabel_margin_loss: " in why for why in st["fallbacks"]), st


def _tmap(x, f):
    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_tmap(y, f) for y in x)
    return x


def _same(a, b) -> bool:
    a = a if isinstance(a, (list, tuple)) else [a]
    b = b if isinstance(b, (list, tuple)) else [b]
    return all(
        torch.equal(x, y)
        or (x.is_floating_point() and torch.allclose(x, y, atol=1e-5, equal_nan=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.slow
def test_every_opinfo_out_kept_by_compile_or_guarded(fresh_dynamo):
    """Every OpInfo op with ``out=`` (first float32 sample, 340-odd ops, ~45 s): compiled with
    ``aot_eager`` it writes eager's value, or it is one of the functions the backend guards."""
    import torch._dynamo
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")
    lost, checked = set(), 0
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=10**6):
        for op in op_db:
            if not op.supports_out or "rand" in op.name or op.name in ("bernoulli", "normal"):
                continue
            try:
                s = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)))
                want = op(s.input, *s.args, **s.kwargs)
                out = _tmap(want, torch.zeros_like)
                op(s.input, *s.args, **s.kwargs, out=out)
                if not _same(out, want):
                    continue  # not deterministic (multinomial...): nothing to compare
            except Exception:
                continue  # no usable sample or no out= for it on CPU
            got = _tmap(want, torch.zeros_like)

            def fn(x, out, s=s, op=op):
                with torch.no_grad():
                    return op(x, *s.args, **s.kwargs, out=out)

            torch._dynamo.reset()
            try:
                torch.compile(fn, backend="aot_eager")(s.input, got)
            except Exception:
                continue  # torch.compile raises: loud, not a silent wrong number
            checked += 1
            if not _same(got, out):
                lost.add(op.op)
    assert checked > 300
    guarded = {f for f, (out_only, _) in _refusals._known_wrong().items() if out_only}
    assert lost == guarded


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


def _close(a, b) -> bool:
    a, b = _flat(a), _flat(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return False
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, atol=1e-4, rtol=1e-4, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


@pytest.mark.slow
def test_every_opinfo_forward_agrees_compiled_or_guarded(fresh_dynamo):
    """Every OpInfo op's first two float32 samples (1,300-odd, ~2.5 min): compiled with
    ``aot_eager`` the value is eager's (to 1e-4), or the op is one the backend guards. Samples
    whose eager runs disagree with each other (random ops, uninitialised memory) say nothing
    and are left out; so is a compile that raises (loud, not a silent wrong number)."""
    import torch._dynamo
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")
    wrong, checked = set(), 0
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=10**6):
        for op in op_db:
            if "empty" in op.name:  # uninitialised values: two eager runs may even agree
                continue
            try:
                samples = list(op.sample_inputs("cpu", torch.float32))[:2]
            except Exception:
                continue
            for s in samples:

                def fn(x, s=s, op=op):
                    return op(x, *s.args, **s.kwargs)

                try:
                    torch.manual_seed(0)
                    want = fn(s.input)
                    torch.manual_seed(0)
                    if not _close(want, fn(s.input)):
                        continue
                except Exception:
                    continue
                torch._dynamo.reset()
                try:
                    torch.manual_seed(0)
                    got = torch.compile(fn, backend="aot_eager")(s.input)
                    ok = _close(want, got)
                except Exception:
                    continue
                checked += 1
                if not ok:
                    wrong.add(op.op)
    assert checked > 1000
    assert wrong <= set(_refusals._known_wrong()), wrong
