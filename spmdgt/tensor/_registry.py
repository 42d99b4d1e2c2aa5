"""One record per op: every per-op decision spmdgt takes about an op on ``gt.Tensor``s.

An op is known by its name: the torch function's (``op_name``: ``mse_loss``, ``__getitem__``,
``T``), which is also the name of the aten overload packet where aten has one
(``torch.ops.aten.mse_loss``), so one record holds both levels of one op:

- the torch-function level (``gt.Tensor.__torch_function__``): its **route** (``route``; the
  routes and their handlers are ``_optable``'s) and what the route reads per call: a guard
  (``GUARDED``), whether tied maxima share a gradient (``TIES``), NaN kept (``keep_nan``), a
  dropout's default of ``training``, an in-place dunder's aten op, whether a matrix product
  of two row-sharded operands gathers the second (``rows_at_rows``: ``_contract``);
- the aten level (the propagation hook, ``_hook``): a size-reading decomposition run on the
  DTensors (``decompose``, for the whole packet), and per overload an exact rewrite, a check
  raised before propagation, or an intercept that answers the op itself.

Decisions are registered next to the function that implements them, DTensor-style
(``_optable``'s handlers and guards, ``_hook``'s rewrites and checks, ``_attention``'s mask),
and a field set twice for one op raises at import: no op is decided in two places. The route
table in docs/design.md is generated from here (``python -m spmdgt.tensor._routedoc
--markdown``; tests/core/test_registry.py fails when they disagree).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

__all__ = [
    "ROUTES",
    "Op",
    "Plan",
    "aten_name",
    "classify",
    "draws",
    "intervenes",
    "names",
    "plan",
    "record",
    "register",
    "register_aten",
    "register_route",
]

(
    DTENSOR,
    VIEW,
    INPLACE,
    GLOBAL,
    EMPTY_SENSITIVE,
    IRREGULAR,
    TIES,
    BATCH_ONLY,
    AUTOGRAD,
    GUARDED,
    ASSIGN,
    ATTENTION,
) = range(12)


@dataclass(slots=True)
class Op:
    """Everything decided about one op (see the module docstring). None/False: not set."""

    name: str
    route: int | None = None
    guard: Callable | None = None  # GUARDED: (func, args, kwargs) -> why the fallback, or None
    ties: Callable | None = None  # TIES: (func, args, kwargs) -> do tied maxima share a grad?
    keep_nan: bool = False  # DTensor's max/min all-reduce drops NaN where torch keeps it
    draws: bool = False  # draws random numbers without a Generator argument
    dropout_training: bool | None = None  # a dropout: the default of ``training``
    inplace_as: str | None = None  # an in-place dunder: the aten op it runs (``add_``)
    mutates: bool | None = None  # False: ends in ``_`` but changes no values
    # a 2-D matrix product: ``rows @ rows`` gathers the second operand (``_contract``)
    rows_at_rows: bool = False
    decompose: bool = False  # aten: the decomposition reads a size; run it on the DTensors
    aten: dict = field(default_factory=dict)  # OpOverload -> {intercept/rewrite/check/partial: v}


class Plan(NamedTuple):
    """What the propagation hook does for one aten overload (``plan``)."""

    intercept: Callable | None  # (op, args, kwargs) -> the result, or None to go on
    decomposition: Callable | None  # run on the DTensors instead of the op
    rewrite: tuple | None  # (when(args) -> bool, fn(op, args, kwargs) -> out | NotImplemented)
    check: tuple | None  # (fn(op, args, specs, data), data): raise before propagation
    # (when, fn) as ``rewrite``, on every DTensor op of the process, inside spmdgt's calls or
    # not: DTensor's rules that keep a ``Partial`` through an op not linear in it (``_partials``)
    partial: tuple | None = None


class Route(NamedTuple):
    label: str  # the doc's name for the route
    handler: Callable  # runs an op of this route (``_optable.run``)
    patterns: str  # the ops it takes by pattern, not by record (doc text)
    how: str  # what it does (doc text)


_records: dict[str, Op] = {}
ROUTES: dict[int, Route] = {}
_routes: dict[object, int] = {}  # torch function -> route (``classify``'s cache)
# the torch functions seen whose record says ``rows_at_rows``: filled with ``_routes``
# (``_optable.route``), emptied with it, read per call as ``func in rows_at_rows_funcs``
rows_at_rows_funcs: set[object] = set()
_plans: dict[object, Plan] = {}  # aten overload -> Plan
_DEFAULTS = {f.name: f.default for f in fields(Op) if f.name not in ("name", "aten")}
_OP_FIELDS = frozenset(_DEFAULTS)
_ATEN_FIELDS = frozenset({"intercept", "rewrite", "check", "partial"})


def record(name: str) -> Op | None:
    """The record of the op named ``name``, or None."""
    return _records.get(name)


def _set(name: str, key: str, value: Any, where: dict, unset: Any = None) -> None:
    old = where.get(key, unset)
    if old != unset and old != value:
        raise RuntimeError(
            f"spmdgt op registry: {name}.{key} is decided twice ({old!r}, then {value!r})"
        )
    where[key] = value


def register(names: Iterable[str], **values: Any) -> None:
    """Set fields of the records of ``names`` (created on first use). A field already set to
    another value raises: one decision per op."""
    unknown = set(values) - _OP_FIELDS
    if unknown:
        raise TypeError(f"no such op field: {sorted(unknown)}")
    for name in names:
        rec = _records.get(name)
        if rec is None:
            rec = _records[name] = Op(name)
        for key, value in values.items():
            current = {key: getattr(rec, key)}
            _set(name, key, value, current, _DEFAULTS[key])
            setattr(rec, key, value)
    _routes.clear()
    rows_at_rows_funcs.clear()
    _plans.clear()


def register_aten(ops: Iterable[Any] | dict, key: str, value: Any = None) -> None:
    """Set an overload-level field (``intercept``, ``rewrite``, ``check``, ``partial``) of each aten
    overload in ``ops``; for ``check``, ``ops`` may map each overload to the data its check
    reads, and the stored value is ``(fn, data)``."""
    if key not in _ATEN_FIELDS:
        raise TypeError(f"no such aten field: {key}")
    items = ops.items() if isinstance(ops, dict) else ((op, None) for op in ops)
    for op, data in items:
        name = aten_name(op)
        register([name])
        v = (value, data) if key == "check" else value
        _set(str(op), key, v, _records[name].aten.setdefault(op, {}))
    _plans.clear()


def register_route(route: int, label: str, how: str, patterns: str = "", names=()) -> Callable:
    """Decorator: the function below runs ops of ``route``; ``names`` take that route."""

    def deco(fn: Callable) -> Callable:
        if route in ROUTES:
            raise RuntimeError(f"spmdgt op registry: route {label} has two handlers")
        ROUTES[route] = Route(label, fn, patterns, how)
        register(names, route=route)
        return fn

    return deco


def names(**match: Any) -> frozenset:
    """The names of the records whose fields equal ``match`` (``names(route=TIES)``); a
    field given as True matches any set value."""

    def ok(rec: Op) -> bool:
        for k, v in match.items():
            got = getattr(rec, k)
            if (v is True and got in (None, False)) or (v is not True and got != v):
                return False
        return True

    return frozenset(n for n, rec in _records.items() if ok(rec))


# -- the torch-function level: the route ----------------------------------------------------


def draws(name: str) -> bool:
    """Does the torch function named ``name`` draw random numbers: its record says so (the
    dropouts, which take no Generator), or an aten op of that name takes a ``Generator``
    (``_random.always_draws``)?"""
    rec = _records.get(name)
    if rec is not None and rec.draws:
        return True
    from spmdgt.tensor._random import always_draws

    return always_draws(name)


def classify(name: str) -> int:
    """The route of the torch function named ``name``. Record routes, and three patterns: a
    name ending in ``_`` mutates (unless its record says not); one that draws (``draws``:
    ``draws``) or starts ``fft_`` runs on global
    values; a ``*_copy`` view needs even shards."""
    rec = _records.get(name)
    r = rec.route if rec is not None else None
    if r in (AUTOGRAD, ASSIGN, INPLACE):
        return r
    if name.endswith("_") and not name.endswith("__") and (rec is None or rec.mutates is not False):
        return INPLACE  # random in-place ops too: not in the pointwise table, so exact
    if draws(name) or name.startswith("fft_"):  # fft: complex results, gradients diverged
        return GLOBAL
    if r is not None:
        return r
    if name.endswith("_copy"):  # squeeze_copy & co: even shards only
        return IRREGULAR
    return DTENSOR


# -- the aten level: what the propagation hook does -------------------------------------------


def aten_name(op: Any) -> str:
    """The record name of aten overload ``op``: its schema's name without the namespace."""
    return op._schema.name.split("::")[-1]


def registered(op: Any) -> bool:
    """Does DTensor have a sharding strategy or rule registered for ``op``?"""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    return (
        op in prop.op_strategy_funcs
        or op in prop.op_single_dim_strategy_funcs
        or op in prop.op_to_rules
    )


_NOTHING = Plan(None, None, None, None)


def plan(op: Any) -> Plan:
    """What the propagation hook does for aten overload ``op`` (cached). Its decomposition is
    the one DTensor would derive ``op``'s sharding from (no strategy registered) where the
    record says it reads a size (``decompose``): see ``_hook``."""
    p = _plans.get(op)
    if p is None:
        rec = _records.get(aten_name(op))
        if rec is None:
            p = _NOTHING
        else:
            own = rec.aten.get(op, {})
            decomp = None
            if rec.decompose and not registered(op):
                from torch._decomp import decomposition_table

                decomp = decomposition_table.get(op)
            p = Plan(
                own.get("intercept"),
                decomp,
                own.get("rewrite"),
                own.get("check"),
                own.get("partial"),
            )
            if p == _NOTHING:
                p = _NOTHING
        _plans[op] = p
    return p


def intervenes(op: Any, args: tuple | None = None) -> bool:
    """Might the hook run aten ``op`` otherwise than DTensor's rule says (an intercept, a
    decomposition, a rewrite)? The dispatch fast path (``_fastpath``) never caches such an op.
    Given the call's ``args``, a rewrite counts only where its condition holds for them (it
    reads global metadata, which the fast path's key fixes): ``mean`` over a dim that is not
    sharded unevenly stays DTensor's plain local op."""
    p = plan(op)
    if p.intercept is not None or p.decomposition is not None:
        return True
    rewrites = [r for r in (p.rewrite, p.partial) if r is not None]
    return bool(rewrites) and (args is None or any(r[0](args) for r in rewrites))
