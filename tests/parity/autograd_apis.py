"""The autograd family of the scenario sweep: every autograd entry point, and its options.

Each scenario builds one small model: a plain ``nn.Linear`` (plain parameters, as a user's
module holds them) applied to a batch laid out per the layout, then a sharded parameter
``w``, and differentiates it through one entry point: ``backward`` (``inputs=``,
``retain_graph``, ``create_graph``, ``gradient``), ``torch.autograd.grad`` (w.r.t. plain and
sharded parameters and the input, ``allow_unused``, ``grad_outputs``, ``create_graph``: a
gradient penalty, a MAML step), hooks, ``torch.utils.checkpoint``,
``torch.autograd.functional``, ``torch.func`` (each transform, and ``vmap`` over each) and
forward-mode AD. Compared with one process (``tests/parity/scenarios.py``).

spmdgt refuses ``torch.func`` transforms and forward-mode dual tensors over sharded values
(``spmdgt/tensor/_transforms.py``: they bypass its per-op routes), so their rows are
``raises`` where the layout gives a sharded tensor, the same error on every rank.
"""

from __future__ import annotations

import torch
import torch.func as tf
from torch.autograd import forward_ad as fwad
from torch.autograd import functional as AF
from torch.utils.checkpoint import checkpoint

from tests.parity.scenarios import Case, Scenario

__all__ = ["PLANTED", "SCENARIOS"]

ROWS, IN, OUT = 7, 4, 3


class _Model:
    """A plain ``nn.Linear`` and a sharded parameter ``w`` on a laid-out batch ``x``, ``y``."""

    def __init__(self, case: Case, x_grad: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        rows = case.rows(ROWS)
        self.lin = torch.nn.Linear(IN, OUT)
        with torch.no_grad():  # values from g: independent of the global generator
            self.lin.weight.copy_(torch.randn(OUT, IN, generator=g))
            self.lin.bias.copy_(torch.randn(OUT, generator=g))
        self.w = case.put(torch.randn(OUT, OUT, generator=g), requires_grad=True)
        self.x = case.put(torch.randn(rows, IN, generator=g), requires_grad=x_grad)
        self.y = case.put(torch.randn(rows, OUT, generator=g))
        self.v = case.put(torch.randn(rows, IN, generator=g))  # a direction shaped like x
        self.params = [self.lin.weight, self.lin.bias, self.w]

    def out(self, x=None, params=None):
        weight, bias, w = params if params is not None else self.params
        x = self.x if x is None else x
        return torch.tanh(x @ weight.T + bias) @ w

    def loss(self, x=None, params=None):
        return ((self.out(x, params) - self.y) ** 2).sum()

    def grads(self) -> dict:
        return {"weight": self.lin.weight.grad, "bias": self.lin.bias.grad, "w": self.w.grad}


# -- backward ------------------------------------------------------------------------------


def _backward(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    m.loss().backward()
    return {**m.grads(), "x": m.x.grad}


def _backward_inputs_x(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    m.loss().backward(inputs=[m.x])
    return {**m.grads(), "x": m.x.grad}


def _backward_inputs_params(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    m.loss().backward(inputs=[m.lin.weight, m.w])
    return {**m.grads(), "x": m.x.grad}


def _backward_retain_graph(case: Case) -> dict:
    m = _Model(case)
    loss = m.loss()
    loss.backward(retain_graph=True)
    loss.backward()
    return m.grads()


def _backward_no_retain_raises(case: Case) -> dict:
    m = _Model(case)
    loss = m.loss()
    loss.backward()
    loss.backward()  # torch raises: the graph was freed
    return m.grads()


def _backward_create_graph(case: Case) -> dict:
    m = _Model(case)
    m.loss().backward(create_graph=True)
    penalty = sum(p.grad.pow(2).sum() for p in m.params)
    again = torch.autograd.grad(penalty, m.params)
    return {"grads": m.grads(), "again": again}


def _backward_gradient(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    out = m.out()
    out.backward(gradient=torch.ones_like(out) * 0.5)
    return {**m.grads(), "x": m.x.grad}


# -- torch.autograd.grad -------------------------------------------------------------------


def _grad_plain(case: Case) -> dict:
    m = _Model(case)
    return {"g": torch.autograd.grad(m.loss(), [m.lin.weight, m.lin.bias])}


def _grad_sharded(case: Case) -> dict:
    m = _Model(case)
    return {"g": torch.autograd.grad(m.loss(), [m.w])}


def _grad_all(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    return {"g": torch.autograd.grad(m.loss(), [*m.params, m.x]), "leaves": m.grads()}


def _grad_allow_unused(case: Case) -> dict:
    m = _Model(case)
    g = torch.Generator().manual_seed(5)
    unused_plain = torch.randn(OUT, requires_grad=True)
    unused_sharded = case.put(torch.randn(ROWS, IN, generator=g), requires_grad=True)
    got = torch.autograd.grad(
        m.loss(), [m.lin.weight, unused_plain, m.w, unused_sharded], allow_unused=True
    )
    return {"g": got, "none": [a is None for a in got]}


def _grad_materialize(case: Case) -> dict:
    m = _Model(case)
    unused = torch.randn(OUT, requires_grad=True)
    got = torch.autograd.grad(
        m.loss(), [m.lin.bias, unused], allow_unused=True, materialize_grads=True
    )
    return {"g": got}


def _grad_unused_raises(case: Case) -> dict:
    m = _Model(case)
    unused = torch.randn(OUT, requires_grad=True)
    return {"g": torch.autograd.grad(m.loss(), [m.lin.weight, unused])}


def _grad_outputs(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    out = m.out()
    v = torch.ones_like(out) * 0.5
    return {"g": torch.autograd.grad(out, [m.lin.weight, m.w, m.x], grad_outputs=v)}


def _grad_retain_graph(case: Case) -> dict:
    m = _Model(case)
    loss = m.loss()
    first = torch.autograd.grad(loss, m.params, retain_graph=True)
    second = torch.autograd.grad(loss, [m.lin.bias, m.w])
    return {"first": first, "second": second}


def _penalty_params(case: Case) -> dict:
    """A gradient penalty w.r.t. the parameters (create_graph, then backward)."""
    m = _Model(case)
    grads = torch.autograd.grad(m.loss(), m.params, create_graph=True)
    (m.loss() + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
    return m.grads()


def _penalty_input(case: Case) -> dict:
    """WGAN-GP: the norm of the gradient w.r.t. the input, penalised, w.r.t. the parameters."""
    m = _Model(case, x_grad=True)
    (gx,) = torch.autograd.grad(m.out().sum(), [m.x], create_graph=True)
    penalty = ((gx.pow(2).sum(1) + 1e-6).sqrt() - 1).pow(2).sum()
    return {"g": torch.autograd.grad(penalty, m.params)}


def _maml(case: Case) -> dict:
    """One MAML inner step with create_graph, an outer loss, gradients w.r.t. the originals."""
    m = _Model(case)
    grads = torch.autograd.grad(m.loss(), m.params, create_graph=True)
    fast = [p - 0.1 * g for p, g in zip(m.params, grads)]
    outer = ((m.out(m.x.flip(0), fast) - m.y) ** 2).sum()
    return {"g": torch.autograd.grad(outer, m.params)}


def _per_sample_clip(case: Case) -> dict:
    """Per-sample gradients by a loop of autograd.grad, each clipped to norm 1 (DP-SGD)."""
    m = _Model(case)
    total = [torch.zeros_like(p) for p in m.params]
    for i in range(m.x.shape[0]):
        loss = ((m.out(m.x[i : i + 1]) - m.y[i : i + 1]) ** 2).sum()
        grads = torch.autograd.grad(loss, m.params)
        scale = (1.0 / (torch.sqrt(sum(g.pow(2).sum() for g in grads)) + 1e-6)).clamp(max=1.0)
        total = [t + g * scale for t, g in zip(total, grads)]
    return {"g": total}


# -- hooks, checkpointing --------------------------------------------------------------------


def _hooks(case: Case) -> dict:
    m = _Model(case, x_grad=True)
    seen = []
    m.x.register_hook(lambda g: g * 2)
    m.w.register_hook(lambda g: seen.append(g.sum()) or g * 3)
    m.lin.weight.register_hook(lambda g: g - 1)
    hidden = torch.tanh(m.x @ m.lin.weight.T + m.lin.bias)
    hidden.register_hook(lambda g: g * 0.5)
    ((hidden @ m.w - m.y) ** 2).sum().backward()
    return {**m.grads(), "x": m.x.grad, "seen": seen}


def _retain_grad(case: Case) -> dict:
    m = _Model(case)
    hidden = torch.tanh(m.x @ m.lin.weight.T + m.lin.bias)
    hidden.retain_grad()
    ((hidden @ m.w - m.y) ** 2).sum().backward()
    return {**m.grads(), "hidden": hidden.grad}


def _checkpoint(reentrant: bool):
    def run(case: Case) -> dict:
        m = _Model(case, x_grad=True)
        checkpoint(m.loss, m.x, use_reentrant=reentrant).backward()
        return {**m.grads(), "x": m.x.grad}

    return run


def _checkpoint_grad(reentrant: bool):
    def run(case: Case) -> dict:
        m = _Model(case, x_grad=True)
        loss = checkpoint(m.loss, m.x, use_reentrant=reentrant)
        return {"g": torch.autograd.grad(loss, [m.lin.weight, m.w])}  # reentrant: torch raises

    return run


# -- torch.autograd.functional ---------------------------------------------------------------


def _functional(name: str, **kw):
    def run(case: Case) -> dict:
        m = _Model(case)
        cube = lambda a: (a**3).sum()  # noqa: E731
        calls = {
            "jacobian": lambda: AF.jacobian(lambda a: m.out(a).sum(0), m.x, **kw),
            "hessian": lambda: AF.hessian(cube, m.x[:, 0], **kw),
            "vjp": lambda: AF.vjp(m.loss, m.x, **kw),
            "jvp": lambda: AF.jvp(m.loss, m.x, m.v, **kw),
            "hvp": lambda: AF.hvp(cube, m.x, m.v, **kw),
            "vhp": lambda: AF.vhp(cube, m.x, m.v, **kw),
        }
        return {"out": calls[name]()}

    return run


# -- torch.func and forward-mode AD (refused over sharded values) ------------------------------


def _func(name: str, vmapped: bool = False):
    def run(case: Case) -> dict:
        m = _Model(case)
        params = {k: v.detach() for k, v in m.lin.named_parameters()}

        def loss(p, x, y):
            out = torch.tanh(tf.functional_call(m.lin, p, (x,)))
            return ((out - y) ** 2).sum()

        one = lambda x: (x**2).sum()  # noqa: E731
        if vmapped:  # per-sample: the transform over each row
            per = {
                "grad": tf.grad(loss),
                "grad_and_value": tf.grad_and_value(loss),
                "jacrev": tf.jacrev(loss),
                "jacfwd": tf.jacfwd(loss),
                "hessian": lambda p, x, y: tf.hessian(one)(x),
                "vjp": lambda p, x, y: tf.vjp(lambda a: loss(p, a, y), x)[1](torch.tensor(1.0)),
                "jvp": lambda p, x, y: tf.jvp(lambda a: loss(p, a, y), (x,), (x,)),
            }[name]
            return {"out": tf.vmap(per, in_dims=(None, 0, 0))(params, m.x, m.y)}
        calls = {
            "grad": lambda: tf.grad(one)(m.x),
            "grad_and_value": lambda: tf.grad_and_value(one)(m.x),
            "vjp": lambda: tf.vjp(one, m.x)[1](torch.tensor(1.0)),
            "jvp": lambda: tf.jvp(one, (m.x,), (m.v,)),
            "jacrev": lambda: tf.jacrev(lambda a: m.out(a).sum(0))(m.x),
            "jacfwd": lambda: tf.jacfwd(lambda a: m.out(a).sum(0))(m.x),
            "hessian": lambda: tf.hessian(one)(m.x[:, 0]),
            "vmap": lambda: tf.vmap(lambda r: (r @ m.lin.weight.T).relu().sum())(m.x),
            "grad_params": lambda: tf.grad(loss)(params, m.x, m.y),
        }
        return {"out": calls[name]()}

    return run


def _functional_call(case: Case) -> dict:
    m = _Model(case)
    p = {"weight": m.lin.weight * 2, "bias": m.lin.bias}
    out = ((torch.func.functional_call(m.lin, p, (m.x,)) - m.y) ** 2).sum()
    out.backward()
    return {"out": out, **m.grads()}


def _forward_ad(case: Case) -> dict:
    m = _Model(case)
    with fwad.dual_level():
        dual = fwad.make_dual(m.x, m.v)
        return {"tangent": fwad.unpack_dual(m.out(dual)).tangent}


def _forward_ad_params(case: Case) -> dict:
    """A dual plain parameter meeting a sharded batch (the sharded tensor is not dual)."""
    m = _Model(case)
    with fwad.dual_level():
        weight = fwad.make_dual(m.lin.weight.detach(), torch.ones(OUT, IN))
        out = torch.tanh(m.x @ weight.T + m.lin.bias.detach())
        return {"tangent": fwad.unpack_dual(out).tangent}


def _planted_scaled(case: Case) -> dict:
    """Wrong on purpose: the gradient scaled by the world size (1 in the reference)."""
    m = _Model(case)
    (gw,) = torch.autograd.grad(m.loss(), [m.lin.weight])
    return {"g": gw * case.world}


SCENARIOS: list[Scenario] = [
    Scenario("autograd.backward", _backward),
    Scenario("autograd.backward.inputs_x", _backward_inputs_x),
    Scenario("autograd.backward.inputs_params", _backward_inputs_params),
    Scenario("autograd.backward.retain_graph", _backward_retain_graph),
    Scenario("autograd.backward.no_retain_raises", _backward_no_retain_raises),
    Scenario("autograd.backward.create_graph", _backward_create_graph),
    Scenario("autograd.backward.gradient", _backward_gradient),
    Scenario("autograd.grad.plain_params", _grad_plain),
    Scenario("autograd.grad.sharded_param", _grad_sharded),
    Scenario("autograd.grad.params_and_input", _grad_all),
    Scenario("autograd.grad.allow_unused", _grad_allow_unused),
    Scenario("autograd.grad.materialize_grads", _grad_materialize),
    Scenario("autograd.grad.unused_raises", _grad_unused_raises),
    Scenario("autograd.grad.grad_outputs", _grad_outputs),
    Scenario("autograd.grad.retain_graph", _grad_retain_graph),
    Scenario("autograd.grad.create_graph.penalty_params", _penalty_params),
    Scenario("autograd.grad.create_graph.penalty_input", _penalty_input),
    Scenario("autograd.grad.create_graph.maml", _maml),
    Scenario("autograd.grad.per_sample_clipping", _per_sample_clip),
    Scenario("autograd.hooks.register_hook", _hooks),
    Scenario("autograd.hooks.retain_grad", _retain_grad),
    Scenario("autograd.checkpoint.reentrant", _checkpoint(True)),
    Scenario("autograd.checkpoint.non_reentrant", _checkpoint(False)),
    Scenario("autograd.checkpoint.reentrant_grad", _checkpoint_grad(True)),
    Scenario("autograd.checkpoint.non_reentrant_grad", _checkpoint_grad(False)),
    *(
        Scenario(f"autograd.functional.{n}", _functional(n))
        for n in ("jacobian", "hessian", "vjp", "jvp", "hvp", "vhp")
    ),
    Scenario(
        "autograd.functional.jacobian.create_graph", _functional("jacobian", create_graph=True)
    ),
    Scenario("autograd.functional.jacobian.vectorize", _functional("jacobian", vectorize=True)),
    Scenario("autograd.functional.hvp.create_graph", _functional("hvp", create_graph=True)),
    *(
        Scenario(f"autograd.func.{n}", _func(n))
        for n in (
            "grad",
            "grad_and_value",
            "vjp",
            "jvp",
            "jacrev",
            "jacfwd",
            "hessian",
            "vmap",
            "grad_params",
        )
    ),
    *(
        Scenario(f"autograd.func.vmap.{n}", _func(n, vmapped=True))
        for n in ("grad", "grad_and_value", "jacrev", "jacfwd", "hessian", "vjp", "jvp")
    ),
    Scenario("autograd.func.functional_call", _functional_call),
    Scenario("autograd.forward_ad.dual_input", _forward_ad),
    Scenario("autograd.forward_ad.dual_param", _forward_ad_params),
]

PLANTED: list[Scenario] = [Scenario("autograd.planted.grad_times_world", _planted_scaled)]
