"""The optimizer sweep (family ``optim``): every ``torch.optim`` optimizer, in every
implementation torch runs on the CPU, over sharded parameters, against one process.

Each scenario trains three steps (RAdam seven: its rectified update starts at step 6) over
two parameters laid out per the case's layout (``w``: 7 x 5, ``u``: 7 x 4; the rows are
``world - 1`` under ``shard0_empty``) and two plain ones beside them (``m``: 5 x 3, ``b``: 3),
the optimizer's step taking a closure, and returns the weights and ``opt.state_dict()``
(global values). The rows are named ``optim.<Optimizer>.<implementation>[.<flags>]``:

- implementations: ``loop`` (``foreach=False``), ``foreach`` (``foreach=True``), ``fused``
  (``fused=True``: Adam, AdamW, SGD and Adagrad have CPU kernels), ``capturable`` (torch
  refuses it on the CPU with an assertion: a ``raises`` row, the same on every rank);
- flags: the optimizer's variants (``amsgrad``, ``maximize``, ``nesterov``, ``centered``,
  weight decay, a tensor learning rate...), each run in every implementation;
- ``differentiable``: the step recorded by autograd (non-leaf parameters, ``.grad`` set by
  hand), and the gradient of the final weights with respect to the leaves they came from;
- ``state_dict``: two steps, the state dict loaded into a fresh optimizer, a third step
  (``roundtrip``: the state dict as it is; ``global``: its global values, as a checkpoint
  read back from disk holds them);
- LBFGS (one implementation; with and without its strong-Wolfe line search) and Muon (2-D
  parameters only: ``b`` is left out).

SparseAdam is left out: it takes sparse gradients only, and spmdgt has no sparse layout.

``PLANTED`` holds scenarios wrong on purpose (the learning rate times the world size on the
laid-out parameters only), which the harness must find ``differs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.parity.scenarios import Case, Scenario

__all__ = ["PLANTED", "SCENARIOS"]

O = torch.optim  # noqa: E741 (the module, as torch.optim is read everywhere below)


def _draw(case: Case, g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(case.rows(shape[0]), *shape[1:], generator=g)


_LAID_OUT = 2  # the first two parameters are laid out per the case, the others plain


def _leaves(case: Case, matrices_only: bool = False) -> list[torch.Tensor]:
    """The parameters: ``w`` and ``u`` laid out per the case, plain ``m`` and ``b``."""
    g = torch.Generator().manual_seed(1)
    w = case.put(_draw(case, g, 7, 5), requires_grad=True)
    u = case.put(_draw(case, g, 7, 4), requires_grad=True)
    m = torch.randn(5, 3, generator=g).requires_grad_()
    b = torch.randn(3, generator=g).requires_grad_()
    return [w, u, m] if matrices_only else [w, u, m, b]


def _loss(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w, u, m = params[:3]
    h = (w * x) @ m
    if len(params) > 3:
        h = h + params[3]
    return h.tanh().pow(2).sum() + (u.cos() + 0.1 * u.pow(2)).sum()


def _convex_loss(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A separable quadratic (LBFGS): its curvature pairs stay well conditioned, where on
    ``_loss`` a relative change of 1e-7 in the data moved LBFGS's weights by 0.1 within
    three steps, so no two summation orders could agree there."""
    w, u, m, b = params
    return (
        (w * x - 1).pow(2).sum()
        + (u - 0.5).pow(2).sum()
        + 2 * (m + 0.3).pow(2).sum()
        + (b - 0.2).pow(2).sum()
    )


def _result(case: Case, params: list[torch.Tensor], opt: O.Optimizer) -> dict[str, Any]:
    return {
        "params": [case.value(p) for p in params],
        "state": case.value(opt.state_dict()),
    }


def _train(
    case: Case, params, opt: O.Optimizer, steps: int, g: torch.Generator, loss_fn=_loss
) -> None:
    for _ in range(steps):
        x = case.put(_draw(case, g, 7, 5))

        def closure(x=x):
            opt.zero_grad()
            loss = loss_fn(params, x)
            loss.backward()
            return loss

        opt.step(closure)


def _trainer(
    make: Callable, steps: int = 3, matrices_only: bool = False, loss_fn=_loss
) -> Callable:
    """A scenario: ``make(params)`` builds the optimizer; ``steps`` steps; weights and state."""

    def run(case: Case) -> dict[str, Any]:
        params = _leaves(case, matrices_only)
        opt = make(params)
        _train(case, params, opt, steps, torch.Generator().manual_seed(2), loss_fn)
        return _result(case, params, opt)

    return run


def _state_dict(make: Callable, as_global: bool, steps: int = 3) -> Callable:
    """Two steps, then the state dict (as it is, or its global values) loaded into a fresh
    optimizer over the same parameters, which takes the remaining steps."""

    def run(case: Case) -> dict[str, Any]:
        params = _leaves(case)
        g = torch.Generator().manual_seed(2)
        opt = make(params)
        _train(case, params, opt, 2, g)
        saved = opt.state_dict()
        if as_global:
            saved = case.value(saved)
        fresh = make(params)
        fresh.load_state_dict(saved)
        _train(case, params, fresh, steps - 2, g)
        return _result(case, params, fresh)

    return run


def _differentiable(make: Callable) -> Callable:
    """The step recorded by autograd: parameters are non-leaf copies of leaves, gradients
    set by hand; returns the weights, the state and d(final weights . r)/d(leaves)."""

    def run(case: Case) -> dict[str, Any]:
        leaves = _leaves(case)
        params = [p.clone() for p in leaves]
        opt = make(params)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, generator=g)
                p.grad = case.put(grad) if i < _LAID_OUT else grad
            opt.step()
        r = [torch.randn(p.shape, generator=g) for p in params]
        r = [case.put(t) if i < _LAID_OUT else t for i, t in enumerate(r)]
        total = sum((p * ri).sum() for p, ri in zip(params, r))
        grads = torch.autograd.grad(total, leaves)
        out = _result(case, params, opt)
        out["grads"] = [case.value(gr) for gr in grads]
        return out

    return run


# optimizer -> (keyword arguments always passed, {flags name: extra keywords},
#               implementations torch offers on the CPU, steps)
_LR = {"lr": 0.05}
_TABLE: dict[type, tuple[dict, dict[str, dict], tuple[str, ...], int]] = {
    O.Adam: (
        _LR,
        {
            "": {},
            "amsgrad": {"amsgrad": True},
            "maximize.wd": {"maximize": True, "weight_decay": 0.1},
            "decoupled": {"weight_decay": 0.1, "decoupled_weight_decay": True},
            "tensor_lr": {"lr": torch.tensor(0.05)},
        },
        ("loop", "foreach", "fused", "capturable"),
        3,
    ),
    O.AdamW: (
        _LR,
        {"": {}, "amsgrad": {"amsgrad": True}, "maximize": {"maximize": True}},
        ("loop", "foreach", "fused", "capturable"),
        3,
    ),
    O.SGD: (
        {"lr": 0.1},
        {
            "": {},
            "momentum": {"momentum": 0.9, "dampening": 0.1},
            "nesterov.wd": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
            "maximize": {"momentum": 0.5, "maximize": True},
        },
        ("loop", "foreach", "fused"),
        3,
    ),
    O.Adagrad: (
        _LR,
        {
            "": {},
            "decay": {"lr_decay": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.5},
            "maximize": {"maximize": True},
        },
        ("loop", "foreach", "fused"),
        3,
    ),
    O.Adamax: (
        _LR,
        {"": {}, "maximize.wd": {"maximize": True, "weight_decay": 0.1}},
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.ASGD: (
        {"lr": 0.05, "t0": 1},  # averaging from step 2: ``ax`` moves within 3 steps
        {"": {}, "maximize.wd": {"maximize": True, "weight_decay": 0.1}},
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.NAdam: (
        _LR,
        {
            "": {},
            "decoupled": {"weight_decay": 0.1, "decoupled_weight_decay": True},
            "maximize": {"maximize": True, "momentum_decay": 0.01},
        },
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.RAdam: (
        _LR,
        {
            "": {},
            "decoupled.maximize": {
                "weight_decay": 0.1,
                "decoupled_weight_decay": True,
                "maximize": True,
            },
        },
        ("loop", "foreach", "capturable"),
        7,
    ),
    O.RMSprop: (
        {"lr": 0.01},
        {
            "": {},
            "centered.momentum": {"centered": True, "momentum": 0.9},
            "maximize.wd": {"maximize": True, "weight_decay": 0.1},
        },
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.Rprop: (
        {"lr": 0.05},
        {"": {}, "maximize": {"maximize": True, "step_sizes": (1e-3, 1.0)}},
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.Adadelta: (
        {"lr": 1.0},
        {"": {}, "maximize.wd": {"maximize": True, "weight_decay": 0.1}},
        ("loop", "foreach", "capturable"),
        3,
    ),
    O.Adafactor: (
        {"lr": 0.05},
        {"": {}, "maximize.wd": {"maximize": True, "weight_decay": 0.1}},
        ("loop", "foreach"),
        3,
    ),
}
_IMPL_KW = {
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
}


def _maker(cls: type, **kw: Any) -> Callable:
    return lambda params: cls(params, **kw)


def _table_scenarios() -> list[Scenario]:
    out = []
    for cls, (base, flags, impls, steps) in _TABLE.items():
        name = f"optim.{cls.__name__}"
        for impl in impls:
            for flag, extra in flags.items():
                if impl == "capturable" and flag:
                    continue  # torch refuses capturable on the CPU: one row says so
                kw = {**base, **_IMPL_KW[impl], **extra}
                full = f"{name}.{impl}" + (f".{flag}" if flag else "")
                out.append(Scenario(full, _trainer(_maker(cls, **kw), steps)))
        kw = {**base, "foreach": False}
        if cls is not O.Adafactor:  # Adafactor has no differentiable mode
            diff = _maker(cls, **kw, differentiable=True)
            out.append(Scenario(f"{name}.differentiable", _differentiable(diff)))
        for as_global in (False, True):
            tag = "global" if as_global else "roundtrip"
            make = _maker(cls, **base)  # the default implementation
            out.append(Scenario(f"{name}.state_dict.{tag}", _state_dict(make, as_global, steps)))
    return out


SCENARIOS: list[Scenario] = [
    *_table_scenarios(),
    # LBFGS divides by curvature pairs: on ``_convex_loss`` a relative change of 1e-7 in the
    # data still moves its weights by 9e-6 within three steps, so sums over shards (another
    # order) are held to 1e-4
    Scenario(
        "optim.LBFGS.loop",
        _trainer(_maker(O.LBFGS, lr=0.1, max_iter=4), loss_fn=_convex_loss),
        atol=1e-4,
        rtol=1e-4,
    ),
    Scenario(
        "optim.LBFGS.loop.strong_wolfe",
        _trainer(
            _maker(O.LBFGS, lr=1.0, max_iter=4, line_search_fn="strong_wolfe"),
            loss_fn=_convex_loss,
        ),
        atol=1e-4,
        rtol=1e-4,
    ),
    Scenario("optim.Muon.loop", _trainer(_maker(O.Muon, lr=0.05), matrices_only=True)),
    Scenario(
        "optim.Muon.loop.nesterov_off",
        _trainer(_maker(O.Muon, lr=0.05, nesterov=False, weight_decay=0.1), matrices_only=True),
    ),
]


def _planted_lr(impl: str) -> Callable:
    """Adam whose laid-out parameters take the learning rate times the world size (the
    plain ones the right one): a bug a per-rank learning-rate scaling would make."""

    def run(case: Case) -> dict[str, Any]:
        params = _leaves(case)
        groups = [
            {"params": params[:2], "lr": 0.05 * case.world},
            {"params": params[2:], "lr": 0.05},
        ]
        opt = O.Adam(groups, **_IMPL_KW[impl])
        _train(case, params, opt, 3, torch.Generator().manual_seed(2))
        return _result(case, params, opt)

    return run


PLANTED: list[Scenario] = [
    Scenario(f"optim.planted.lr_times_world.{impl}", _planted_lr(impl))
    for impl in ("loop", "fused")
]
