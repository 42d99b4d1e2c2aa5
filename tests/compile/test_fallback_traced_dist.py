"""A write, inside a compiled graph, into a view spmdgt's exact fallback made as a copy:
refused.

``torch.kron(a, b, out=out)`` writes ``out`` through an ``_unsafe_view`` of it; on a ``Shard(0)``
``out`` of uneven rows DTensor has no rule for that view, and the exact fallback makes it a
copy of the gathered value. Eagerly spmdgt routes the whole ``out=`` call first (and writes
through such views); traced, the op reaches the aten level, and the write landed in the copy:
compiled, ``out`` stayed all zeros, silently (found by the parity sweep with both compile
halves on, 3 ranks). Now the write raises while torch traces
(``spmdgt.tensor._fallback.NotTraceable``), at the same op on every rank: a ``torch.compile``
of the user's fails with the op's name, and a hot function of the compile pass runs eagerly,
exactly. A view that is only read (an ``nn.Linear`` on unevenly sharded rows) still compiles:
``tests/core/test_attention_dist.py``.
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks
from tests.compile._both import with_both_halves


def kron_into(a, b, out):
    with torch.no_grad():
        return torch.kron(a, b, out=out)


def _values():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g)


def _ranked(rank, world):
    import spmdgt as gt

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    x, y = _values()

    def call(fn):
        with gt.signal.context("rows"):
            a, b, out = gt.tensor(x), gt.tensor(y), gt.zeros(15, 16)
        got = fn(a, b, out)
        return got is out, out.numpy().copy()

    try:
        call(torch.compile(kron_into, backend="aot_eager"))
        error = ""
    except Exception as e:
        error = str(e)

    def hot():
        return [call(kron_into) for _ in range(6)]

    got, stats = with_both_halves(hot, every=1, hot_at=2, batch=16)
    return error, got, stats["fallbacks"], stats["status"]


def test_a_fallback_traced_by_torch_compile_raises_and_hot_functions_stay_eager(tmp_path):
    want = torch.kron(*_values()).numpy()
    for error, got, fallbacks, status in run_ranks(_ranked, 3, tmp_path):
        assert "mul.out: it writes into a view of a sharded tensor" in error
        assert len(got) == 6
        for same, out in got:
            assert same
            assert (out == want).all()
        assert fallbacks, status  # the hot function was compiled, refused, and ran eagerly
