"""Random creation drawn in blocks: the same numbers as one torch call, the generator left where
one call leaves it, and no rank holding the whole tensor (``spmdgt/tensor/_draw.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdgt.tensor import _draw, _mt19937
from tests._calls import CreationShapes
from tests._dist import run_ranks


def _slices(length: int, world: int) -> list[tuple[int, int]]:
    """(offset, size) per rank by the torch.chunk rule DTensor's Shard uses (empty at the end)."""
    size = -(-length // world)
    return [
        (min(r * size, length), max(0, min(length, (r + 1) * size) - r * size))
        for r in range(world)
    ]


@pytest.mark.parametrize("fill", [torch.randn, torch.rand])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape, dim",
    [((1003,), 0), ((37, 29), 0), ((37, 29), 1), ((200, 3), 1), ((100, 2), 1), ((9, 3, 5), 2)],
)
def test_blocks_draw_what_one_call_draws(monkeypatch, fill, dtype, shape, dim):
    monkeypatch.setattr(_draw, "BLOCK", 64)  # many blocks; rows of 2-3 take the strided path
    torch.manual_seed(7)
    ref = fill(shape, dtype=dtype)
    after = torch.rand(4)
    for world in (1, 2, 3, 4):
        for off, size in _slices(shape[dim], world):
            local_shape = (*shape[:dim], size, *shape[dim + 1 :])
            offset = tuple(off if d == dim else 0 for d in range(len(shape)))
            torch.manual_seed(7)
            part = _draw.draw_part(fill, shape, dtype, local_shape, offset, dim)
            assert torch.equal(part, ref.narrow(dim, off, size)), (world, off, size)
            assert torch.equal(torch.rand(4), after)  # the generator moved as far as one call
    torch.manual_seed(7)  # a rank outside the mesh keeps nothing but still draws everything
    assert _draw.draw_part(fill, shape, dtype, (0,), (), dim).numel() == 0
    assert torch.equal(torch.rand(4), after)


@pytest.mark.parametrize("skip", ["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1003, 1024, 40, 17])
def test_a_row_split_draws_only_its_rows_with_randn(monkeypatch, skip, dtype, n):
    """The numbers outside a rank's rows are skipped (no Box-Muller), by the compiled twist or
    by torch's ``random_()`` where it is not available: randn draws at most the rank's own
    part rounded out to 16s (32 more), and the values and the generator are still one call's."""
    if skip == "compiled":
        monkeypatch.setattr(_mt19937, "MIN_WORDS", 1)
        assert _mt19937.skip(0), _mt19937.error()  # this machine has a C compiler
    else:
        monkeypatch.setattr(_mt19937, "skip", lambda words: False)
    drawn = []
    randn = torch.randn

    def counting(*size, **kw):
        drawn.append(math.prod(size[0] if isinstance(size[0], tuple) else size))
        return randn(*size, **kw)

    torch.manual_seed(5)
    ref, after = torch.randn(n, dtype=dtype), torch.rand(4)
    for off, size in _slices(n, 4):
        drawn.clear()
        torch.manual_seed(5)
        monkeypatch.setattr(torch, "randn", counting)
        part = _draw.draw_part(counting, (n,), dtype, (size,), (off,), 0)
        monkeypatch.setattr(torch, "randn", randn)
        assert torch.equal(part, ref[off : off + size]) and torch.equal(torch.rand(4), after)
        assert sum(drawn) <= max(size + 32, 16 + 16), (off, size, drawn)


@pytest.mark.parametrize("seed", [0, 29])
def test_the_compiled_skip_moves_the_generator_as_torch_draws(seed):
    """From every position between two twists (just seeded, mid-state, at the edge), past
    nothing, one word, a whole state and many: the next numbers are the ones torch's own
    draws leave (float32 ``rand`` takes one 32-bit word a number)."""
    for before in (0, 1, 5, 623, 624, 625, 1000):
        for words in (0, 1, 2, 623, 624, 625, 1247, 1248, 100_001):
            ref, got = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            torch.rand(before, generator=ref)
            torch.rand(before, generator=got)
            torch.rand(words, generator=ref)
            assert _mt19937.skip(words, got), _mt19937.error()
            assert torch.equal(torch.randn(40, generator=got), torch.randn(40, generator=ref))


def test_without_a_compiler_the_skip_is_refused_and_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_mt19937, "_tried", False)
    monkeypatch.setattr(_mt19937, "_fn", None)
    monkeypatch.setattr(_mt19937, "_error", None)
    g = torch.Generator().manual_seed(1)
    before = g.get_state()
    assert not _mt19937.skip(5000, g) and "no-such-cc" in _mt19937.error()
    assert torch.equal(g.get_state(), before)  # untouched: the caller draws to skip


def _sharded_random(rank, world):
    import spmdgt as gt
    from spmdgt.tensor import _draw as draw

    draw.MIN_NUMEL, draw.BLOCK = 0, 64  # the block path at test sizes
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    gt.register_config("pair", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[1, 2])))
    out = []
    for sig, shape, fill in [
        ("rows", (41, 7), gt.randn),
        ("cols", (13, 35), gt.rand),
        ("pair", (30, 5), gt.randn),
    ]:
        gt.manual_seed(3)
        with gt.signal.context(sig), CreationShapes(torch.randn, torch.rand) as shapes:
            x = fill(*shape, requires_grad=True)
        after = torch.rand(3)  # every rank's generator where one full call leaves it
        # no call drew the whole tensor (a rank off the mesh skips it all, drawing nothing)
        assert type(x) is gt.Tensor and max(map(math.prod, shapes), default=0) < math.prod(shape)
        (x * x).sum().backward()
        out.append((sig, shape, x.numpy(), x.grad.numpy(), after))
    return out


def test_sharded_random_creation_matches_one_process(tmp_path):
    for rows in run_ranks(_sharded_random, 3, tmp_path):
        for sig, shape, value, grad, after in rows:
            torch.manual_seed(3)
            ref = (torch.randn if sig != "cols" else torch.rand)(shape)
            assert torch.equal(torch.from_numpy(value), ref), sig
            assert torch.equal(torch.from_numpy(grad), 2 * ref), sig
            assert torch.equal(after, torch.rand(3)), sig
