"""The "random" scenario family: every op or module that draws random numbers, on sharded
inputs, against one process: the values drawn, the global generator's state after the call
(``torch.get_rng_state()``), a draw after it, and the state of a user ``torch.Generator``
where one is passed.

A rank whose generator moved otherwise than one process's draws other numbers at every later
draw, and the ranks disagree from then on: the state is compared exactly, so a scenario that
leaves the right values but the generator one draw off comes out ``differs`` (``PLANTED``).

Inputs are built from a generator of their own (``_data``), so the global generator is
touched only by the op under test. Batch dims use ``case.rows(7)``: 7 rows (4/3, 3/3/1), or
``world - 1`` under ``shard0_empty``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.parity.scenarios import Case, Scenario

__all__ = ["PLANTED", "SCENARIOS"]


def _data(case: Case, *shape: int, seed: int = 0, positive: bool = False) -> torch.Tensor:
    """A plain tensor of ``(case.rows(7), *shape)`` from a generator of its own."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(case.rows(7), *shape, generator=g)
    return t.abs() + 0.1 if positive else t


def _after(case: Case, out: dict[str, Any], gen: torch.Generator | None = None) -> dict:
    """``out`` with the generator states after the call and a draw after it."""
    out = {k: case.value(v) for k, v in out.items()}
    out["rng_state"] = torch.get_rng_state()
    if gen is not None:
        out["generator_state"] = gen.get_state()
    out["draw_after"] = torch.rand(4)
    return out


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _op(fn: Callable[[torch.Tensor], Any], *shape: int, positive: bool = False):
    """A scenario body: ``fn`` on one input laid out per the layout."""

    def run(case: Case) -> dict:
        x = case.put(_data(case, *shape, positive=positive))
        return _after(case, {"out": fn(x)})

    return run


def _op_gen(fn: Callable[[torch.Tensor, torch.Generator], Any], *shape: int, positive=False):
    """A scenario body: ``fn(x, generator)`` with a user generator, whose state is compared."""

    def run(case: Case) -> dict:
        x = case.put(_data(case, *shape, positive=positive))
        g = _gen()
        return _after(case, {"out": fn(x, g)}, gen=g)

    return run


def _inplace(fn: Callable[[torch.Tensor], Any], *shape: int, positive: bool = False):
    """A scenario body: in-place ``fn`` on a laid-out input; the input is compared after."""

    def run(case: Case) -> dict:
        x = case.put(_data(case, *shape, positive=positive))
        fn(x)
        return _after(case, {"x": x})

    return run


# -- composites ------------------------------------------------------------------------------


def _gumbel_grad(case: Case) -> dict:
    x = case.put(_data(case, 5), requires_grad=True)
    y = F.gumbel_softmax(x, tau=0.7, hard=True)
    (y * torch.arange(5.0)).sum().backward()
    return _after(case, {"y": y, "grad": x.grad})


def _draws_then_no_rule(x: torch.Tensor) -> torch.Tensor:
    """A user composite (it takes ``__torch_function__`` as itself, as ``F.gumbel_softmax``
    does): it draws, then runs an op DTensor has no rule for (``nonzero``: a data-dependent
    shape), then draws again. Run again from the start, it would draw twice."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_draws_then_no_rule, (x,), x)
    y = x + torch.empty_like(x).exponential_()
    hits = torch.nonzero(y > 1.0)
    return y + torch.rand_like(y), hits


def _two_draws(x: torch.Tensor) -> torch.Tensor:
    """A user composite drawing twice on DTensors, with a user-visible generator."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_two_draws, (x,), x)
    a = torch.empty_like(x).uniform_(-1, 1)
    return x * a + torch.randn_like(x).cauchy_()


def _noise(x: torch.Tensor) -> torch.Tensor:
    """A user function (no ``__torch_function__`` of its own): op by op."""
    return x + 0.1 * torch.randn_like(x) + x.new_empty(x.shape).uniform_()


# -- modules -------------------------------------------------------------------------------


def _module(make: Callable[[], nn.Module], *shape: int, grad: bool = False):
    """A scenario body: module ``make()`` in training mode on a laid-out input (gradient of
    the input too when ``grad``)."""

    def run(case: Case) -> dict:
        torch.manual_seed(7)  # the module's own init draws, alike everywhere
        m = make().train()
        torch.manual_seed(8)
        x = case.put(_data(case, *shape), requires_grad=grad)
        y = m(x)
        y = y[0] if isinstance(y, tuple) else y
        out = {"y": y}
        if grad:
            y.sum().backward()
            out["grad"] = x.grad
        return _after(case, out)

    return run


def _mha(case: Case) -> dict:
    torch.manual_seed(7)
    m = nn.MultiheadAttention(8, 2, dropout=0.4, batch_first=True).train()
    torch.manual_seed(8)
    x = case.put(_data(case, 3, 8))
    y, w = m(x, x, x)
    return _after(case, {"y": y, "w": w})


def _sdpa(case: Case) -> dict:
    q = case.put(_data(case, 2, 3, 4, seed=1))
    k = case.put(_data(case, 2, 3, 4, seed=2))
    v = case.put(_data(case, 2, 3, 4, seed=3))
    return _after(case, {"y": F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)})


# -- nn.init on a sharded parameter ----------------------------------------------------------


def _init(fn: Callable[..., Any], generator: bool = False, cols: int = 5):
    """A scenario body: ``fn`` on a sharded parameter, as a model's ``reset_parameters`` runs
    it (grad enabled: nn.init writes under no_grad itself)."""

    def run(case: Case) -> dict:
        w = nn.Parameter(case.put(_data(case, cols)))
        g = _gen() if generator else None
        fn(w, generator=g) if generator else fn(w)
        return _after(case, {"w": w, "leaf": w.is_leaf, "grad": w.requires_grad}, gen=g)

    return run


# -- data utilities ------------------------------------------------------------------------


def _random_split(case: Case) -> dict:
    x = case.put(_data(case, 5))
    n = x.shape[0]
    parts = torch.utils.data.random_split(x, [n // 2, n - n // 2])
    rows = [torch.stack([p[i] for i in range(len(p))]) if len(p) else None for p in parts]
    g = _gen()
    seeded = torch.utils.data.random_split(range(n), [0.5, 0.5], generator=g)
    return _after(
        case,
        {
            "idx": [list(p.indices) for p in parts],
            "rows": rows,
            "seeded": [list(s) for s in seeded],
        },
        gen=g,
    )


def _samplers(case: Case) -> dict:
    x = case.put(_data(case, 5))
    n = x.shape[0]
    weights = case.put(_data(case, positive=True).reshape(-1))
    return _after(
        case,
        {
            "random": list(torch.utils.data.RandomSampler(x)),
            "replace": list(torch.utils.data.RandomSampler(x, replacement=True, num_samples=5)),
            "subset": list(torch.utils.data.SubsetRandomSampler(range(n))),
            "weighted": list(torch.utils.data.WeightedRandomSampler(weights, 5)),
            "loader": [b for b in torch.utils.data.DataLoader(x, batch_size=3, shuffle=True)],
        },
    )


def _shuffle(case: Case) -> dict:
    x = case.put(_data(case, 5))
    return _after(case, {"out": x[torch.randperm(x.shape[0])]})


# -- distributions -------------------------------------------------------------------------


def _dist(make: Callable[[torch.Tensor], Any], rsample: bool = False, positive=False):
    def run(case: Case) -> dict:
        x = case.put(_data(case, 5, positive=positive))
        d = make(x)
        return _after(case, {"out": d.rsample() if rsample else d.sample()})

    return run


# -- the scenarios -------------------------------------------------------------------------

_D = "random."
SCENARIOS: list[Scenario] = [
    # composites: F.gumbel_softmax draws through empty_like(x).exponential_() on DTensors
    Scenario(_D + "gumbel_softmax", _op(lambda x: F.gumbel_softmax(x, tau=1.0), 5)),
    Scenario(_D + "gumbel_softmax.hard", _op(lambda x: F.gumbel_softmax(x, hard=True), 5)),
    Scenario(_D + "gumbel_softmax.dim0", _op(lambda x: F.gumbel_softmax(x, dim=0), 5)),
    Scenario(_D + "gumbel_softmax.grad", _gumbel_grad),
    Scenario(_D + "composite.exponential_", _op(lambda x: torch.empty_like(x).exponential_(), 5)),
    Scenario(_D + "composite.draws_then_no_rule", _op(_draws_then_no_rule, 5)),
    Scenario(_D + "composite.two_draws", _op(_two_draws, 5)),
    Scenario(_D + "composite.user_noise", _op(_noise, 5)),
    # rrelu
    Scenario(_D + "rrelu.train", _op(lambda x: F.rrelu(x, training=True), 5)),
    Scenario(_D + "rrelu.eval", _op(lambda x: F.rrelu(x, training=False), 5)),
    Scenario(_D + "rrelu.inplace", _inplace(lambda x: F.rrelu(x, training=True, inplace=True), 5)),
    Scenario(_D + "rrelu_", _inplace(lambda x: torch.rrelu_(x, training=True), 5)),
    Scenario(_D + "RReLU.module", _module(nn.RReLU, 5, grad=True)),
    # dropouts
    Scenario(_D + "dropout", _op(lambda x: F.dropout(x, 0.4), 5)),
    Scenario(_D + "dropout.eval", _op(lambda x: F.dropout(x, 0.4, training=False), 5)),
    Scenario(_D + "dropout.p0", _op(lambda x: F.dropout(x, 0.0), 5)),
    Scenario(_D + "dropout.inplace", _inplace(lambda x: F.dropout(x, 0.4, inplace=True), 5)),
    Scenario(_D + "torch.dropout", _op(lambda x: torch.dropout(x, 0.4, True), 5)),
    Scenario(_D + "native_dropout", _op(lambda x: torch.native_dropout(x, 0.4, True), 5)),
    Scenario(_D + "dropout1d", _op(lambda x: F.dropout1d(x, 0.4), 4, 3)),
    Scenario(_D + "dropout2d", _op(lambda x: F.dropout2d(x, 0.4), 4, 3, 2)),
    Scenario(_D + "dropout3d", _op(lambda x: F.dropout3d(x, 0.4), 4, 3, 2, 2)),
    Scenario(_D + "alpha_dropout", _op(lambda x: F.alpha_dropout(x, 0.4, training=True), 5)),
    Scenario(
        _D + "feature_alpha_dropout",
        _op(lambda x: F.feature_alpha_dropout(x, 0.4, training=True), 4, 3),
    ),
    Scenario(_D + "Dropout.module", _module(lambda: nn.Dropout(0.4), 5, grad=True)),
    Scenario(_D + "Dropout.inplace", _module(lambda: nn.Dropout(0.4, inplace=True), 5)),
    Scenario(_D + "Dropout2d.module", _module(lambda: nn.Dropout2d(0.4), 4, 3, 2)),
    Scenario(_D + "AlphaDropout.module", _module(lambda: nn.AlphaDropout(0.4), 5)),
    Scenario(_D + "sdpa.dropout", _sdpa),
    Scenario(_D + "MultiheadAttention.dropout", _mha),
    Scenario(
        _D + "LSTM.dropout",
        _module(lambda: nn.LSTM(4, 3, num_layers=2, dropout=0.5, batch_first=True), 2, 4),
    ),
    Scenario(
        _D + "TransformerEncoderLayer.dropout",
        _module(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True), 3, 8),
    ),
    Scenario(
        _D + "fractional_max_pool2d",
        _op(lambda x: F.fractional_max_pool2d(x, 2, output_size=(2, 2)), 2, 4, 4),
    ),
    # sampling ops
    Scenario(_D + "bernoulli", _op(lambda x: torch.bernoulli(x.sigmoid()), 5)),
    Scenario(_D + "bernoulli.p", _op(lambda x: torch.bernoulli(x, p=0.3), 5)),
    Scenario(
        _D + "bernoulli.generator",
        _op_gen(lambda x, g: torch.bernoulli(x.sigmoid(), generator=g), 5),
    ),
    Scenario(_D + "multinomial", _op(lambda x: torch.multinomial(x, 3), 5, positive=True)),
    Scenario(
        _D + "multinomial.replacement",
        _op(lambda x: torch.multinomial(x, 6, replacement=True), 5, positive=True),
    ),
    Scenario(
        _D + "multinomial.generator",
        _op_gen(lambda x, g: torch.multinomial(x, 2, generator=g), 5, positive=True),
    ),
    Scenario(_D + "normal.mean", _op(lambda x: torch.normal(x, 0.5), 5)),
    Scenario(_D + "normal.std", _op(lambda x: torch.normal(0.5, x), 5, positive=True)),
    Scenario(_D + "normal.both", _op(lambda x: torch.normal(x, x.abs()), 5)),
    Scenario(_D + "normal.generator", _op_gen(lambda x, g: torch.normal(x, 1.0, generator=g), 5)),
    Scenario(_D + "poisson", _op(lambda x: torch.poisson(x * 3), 5, positive=True)),
    Scenario(
        _D + "poisson.generator",
        _op_gen(lambda x, g: torch.poisson(x * 3, generator=g), 5, positive=True),
    ),
    Scenario(_D + "binomial", _op(lambda x: torch.binomial(x * 0 + 5, x.sigmoid()), 5)),
    Scenario(_D + "standard_gamma", _op(lambda x: torch._standard_gamma(x), 5, positive=True)),
    Scenario(_D + "rand_like", _op(torch.rand_like, 5)),
    Scenario(_D + "randn_like", _op(torch.randn_like, 5)),
    Scenario(_D + "randint_like", _op(lambda x: torch.randint_like(x, 10), 5)),
    Scenario(_D + "rand_like.generator", _op_gen(lambda x, g: torch.rand_like(x, generator=g), 5)),
    # in-place draws
    Scenario(_D + "uniform_", _inplace(lambda x: x.uniform_(-2, 2), 5)),
    Scenario(_D + "normal_", _inplace(lambda x: x.normal_(1, 2), 5)),
    Scenario(_D + "exponential_", _inplace(lambda x: x.exponential_(2.0), 5)),
    Scenario(_D + "bernoulli_", _inplace(lambda x: x.bernoulli_(0.3), 5)),
    Scenario(_D + "bernoulli_.tensor", _inplace(lambda x: x.bernoulli_(x.sigmoid()), 5)),
    Scenario(_D + "random_", _inplace(lambda x: x.random_(0, 10), 5)),
    Scenario(_D + "cauchy_", _inplace(lambda x: x.cauchy_(), 5)),
    Scenario(_D + "geometric_", _inplace(lambda x: x.geometric_(0.3), 5)),
    Scenario(_D + "log_normal_", _inplace(lambda x: x.log_normal_(), 5)),
    Scenario(_D + "uniform_.view", _inplace(lambda x: x[1:].uniform_(), 5)),
    Scenario(_D + "normal_.generator", _op_gen(lambda x, g: x.normal_(generator=g), 5)),
    # nn.init on a sharded parameter
    Scenario(_D + "init.uniform_", _init(nn.init.uniform_)),
    Scenario(_D + "init.normal_", _init(nn.init.normal_)),
    Scenario(_D + "init.xavier_uniform_", _init(nn.init.xavier_uniform_)),
    Scenario(_D + "init.xavier_normal_", _init(nn.init.xavier_normal_)),
    Scenario(
        _D + "init.kaiming_uniform_", _init(lambda w: nn.init.kaiming_uniform_(w, math.sqrt(5)))
    ),
    Scenario(_D + "init.kaiming_normal_", _init(nn.init.kaiming_normal_)),
    Scenario(_D + "init.trunc_normal_", _init(nn.init.trunc_normal_)),
    Scenario(_D + "init.orthogonal_", _init(nn.init.orthogonal_)),
    Scenario(_D + "init.sparse_", _init(lambda w: nn.init.sparse_(w, 0.5))),
    Scenario(_D + "init.uniform_.generator", _init(nn.init.uniform_, generator=True)),
    Scenario(
        _D + "init.kaiming_uniform_.generator", _init(nn.init.kaiming_uniform_, generator=True)
    ),
    Scenario(_D + "init.trunc_normal_.generator", _init(nn.init.trunc_normal_, generator=True)),
    # data utilities
    Scenario(_D + "random_split", _random_split),
    Scenario(_D + "samplers", _samplers),
    Scenario(_D + "randperm_shuffle", _shuffle),
    # distributions
    Scenario(_D + "Normal.sample", _dist(lambda x: torch.distributions.Normal(x, 1.0))),
    Scenario(_D + "Normal.rsample", _dist(lambda x: torch.distributions.Normal(x, 1.0), True)),
    Scenario(_D + "Categorical.sample", _dist(lambda x: torch.distributions.Categorical(logits=x))),
    Scenario(
        _D + "Gamma.rsample",
        _dist(lambda x: torch.distributions.Gamma(x, 1.0), True, positive=True),
    ),
    Scenario(
        _D + "Dirichlet.sample",
        _dist(lambda x: torch.distributions.Dirichlet(x), positive=True),
    ),
]


def _planted_extra_draw(case: Case) -> dict:
    """Right values, but the generator advanced once more on sharded inputs: ``differs``."""
    x = case.put(_data(case, 5))
    out = F.gumbel_softmax(x)
    if case.layout is not None:
        torch.rand(1)
    return _after(case, {"out": out})


PLANTED: list[Scenario] = [
    Scenario("random.planted.extra_draw", _planted_extra_draw, layouts=("shard0", "shard1")),
]
