"""An op spmdgt runs exactly on gathered global values, inside a compiled graph: refused.

The exact fallback gathers global values and writes each rank's part back into its shard with
plain copies; traced, the write-back was left out of the graph, which ran on the shards
alone: ``torch.kron(a, b, out=out)`` on ``Shard(0)`` inputs, compiled, left ``out`` all
zeros, silently (found by the parity sweep with both compile halves on, 3 ranks). Now the
fallback raises while torch traces (``spmdgt.tensor._fallback.NotTraceable``), at the same op
on every rank: a ``torch.compile`` of the user's fails with the op's name, and a hot function
of the compile pass runs eagerly, exactly.
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
        assert "gathered global values" in error and "_unsafe_view" in error
        assert len(got) == 6
        for same, out in got:
            assert same
            assert (out == want).all()
        assert fallbacks, status  # the hot function was compiled, refused, and ran eagerly
