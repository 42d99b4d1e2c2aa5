"""The op registry (``spmdgt/tensor/_registry.py``): one record per op, the route table in
docs/design.md generated from it, a decision made twice refused at import, and the ops the
old tables held in two places decided once, as before."""

from __future__ import annotations

import pytest
import torch

import spmdgt.tensor._tensor  # noqa: F401  (imports every module that registers decisions)
from spmdgt.tensor import _attention, _losses, _optable, _registry, _routedoc
from spmdgt.tensor._registry import (
    EMPTY_SENSITIVE,
    GLOBAL,
    GUARDED,
    IRREGULAR,
    TIES,
    record,
    register,
)

aten = torch.ops.aten


def test_doc_route_table_is_the_registry():
    doc = _routedoc.DOC.read_text()
    assert _routedoc.in_doc(doc) == _routedoc.markdown(), (
        "docs/design.md's route table differs from the registry: "
        "python -m spmdgt.tensor._routedoc --write"
    )


def test_doc_check_fails_on_a_stale_table(tmp_path, monkeypatch):
    stale = _routedoc.DOC.read_text().replace("`mse_loss`, ", "", 1)
    doc = tmp_path / "design.md"
    doc.write_text(stale)
    monkeypatch.setattr(_routedoc, "DOC", doc)
    with pytest.raises(SystemExit):
        _routedoc.main(["--check"])
    assert _routedoc.write()  # --write mends it
    _routedoc.main(["--check"])


def test_a_decision_made_twice_raises():
    with pytest.raises(RuntimeError, match=r"max\.route is decided twice"):
        register(["max"], route=EMPTY_SENSITIVE)
    assert record("max").route == TIES  # unchanged
    with pytest.raises(RuntimeError, match="decided twice"):
        _registry.register_aten([aten.item.default], "intercept", print)
    with pytest.raises(TypeError, match="no such op field"):
        register(["max"], routes=TIES)


def test_ops_once_in_two_tables_decided_once():
    # max/min/amax/amin sat in the empty-sensitive set too, behind the ties one: ties, as
    # before, with NaN kept (one record each)
    for name in ("max", "min", "amax", "amin"):
        rec = record(name)
        assert (rec.route, rec.keep_nan) == (TIES, True), name
    assert (record("aminmax").route, record("aminmax").keep_nan) == (EMPTY_SENSITIVE, True)
    # the losses: the route at the torch-function level, the size-reading decomposition at
    # the aten level, in one record
    for name in ("mse_loss", "huber_loss", "binary_cross_entropy", "multi_margin_loss"):
        rec = record(name)
        assert (rec.route, rec.decompose) == (GUARDED, True), name
        assert rec.guard is _losses.why_not_dtensor, name
    for name in ("var", "std", "var_mean", "std_mean"):
        assert (record(name).route, record(name).decompose) == (EMPTY_SENSITIVE, True), name
    assert record("embedding").route == GUARDED
    assert _optable.route(torch.Tensor.item) == GLOBAL
    assert _registry.plan(aten.item.default).intercept is not None


def test_routes_of_patterns():
    assert _optable.route(torch.Tensor.add_) == _registry.INPLACE
    assert _optable.route(torch.Tensor.requires_grad_) == _registry.DTENSOR  # changes nothing
    assert _optable.route(torch.nn.functional.dropout) == GLOBAL  # draws, no Generator
    assert _optable.route(torch.bernoulli) == GLOBAL  # a Generator argument
    assert _optable.route(torch.fft.fft) == GLOBAL
    assert _optable.route(torch.squeeze_copy) == IRREGULAR
    assert _optable.route(torch.add) == _registry.DTENSOR


def test_fastpath_reads_the_registry():
    for op in (
        aten.item.default,  # an intercept: a scalar read
        aten.nll_loss_forward.default,  # a rewrite
        _attention.CPU_FLASH,  # an intercept: the mask placed
    ):
        assert _registry.intervenes(op), op
    assert not _registry.intervenes(aten.add.Tensor)
    assert not _registry.intervenes(aten.mm.default)  # a check only: DTensor's rule or NoRule
    # a rewrite with the call's arguments: only where its condition holds (nll_loss: mean)
    assert not _registry.intervenes(aten.nll_loss_forward.default, (None, None, None, 2, -100))
    assert _registry.intervenes(aten.nll_loss_forward.default, (None, None, None, 1, -100))


def test_rows_at_rows_is_a_record_field():
    # the products ``rows @ rows`` gathers the second operand of (``_contract``) are decided
    # by their records alone: the five torch functions a 2-D product arrives through, by name
    from spmdgt.tensor import _contract

    assert _registry.names(rows_at_rows=True) == {"matmul", "mm", "__matmul__"}
    assert not hasattr(_contract, "FUNCS")  # no second table beside the registry
    products = (torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
    for func in (*products, torch.Tensor.__matmul__):
        assert _optable.route(func) == _registry.DTENSOR, func  # DTensor's route otherwise
        assert func in _registry.rows_at_rows_funcs, func  # noted with the route
    for func in (torch.add, torch.linalg.matmul, torch.Tensor.__rmatmul__, torch.bmm):
        _optable.route(func)
        assert func not in _registry.rows_at_rows_funcs, func
    with pytest.raises(RuntimeError, match=r"mm\.rows_at_rows is decided twice"):
        register(["mm"], rows_at_rows=False)
