"""Draw this rank's slice of ``torch.randn(shape)`` / ``torch.rand(shape)`` on the CPU without
ever holding the whole tensor, and leave the generator exactly where one full call leaves it.

Every rank still moves its generator over every number (that keeps the generators of all ranks
in step and makes the values independent of placement and world size), but in blocks: it keeps
the part of each block that falls in its slice and drops the rest, so memory is the slice plus
one block. A slice that is one flat range (a split of the first dim that is longer than 1)
draws only its range with ``fill``; the numbers before and after it are skipped: the
generator's state is twisted past them in C (``_mt19937``: ~5% of ``randn``'s cost per skipped
number), or, where that cannot be compiled, moved by an int64 ``random_()`` (~60%).

Why blocks reproduce one call: torch's CPU kernels draw sequentially. ``rand`` fills element by
element; ``randn`` (``normal_fill``) fills uniforms in order, turns each aligned group of 16
into normals, and, when the size is not a multiple of 16, redraws the last 16 elements. So
blocks that start at multiples of 16, with a last block of at least 16 that ends the tensor,
draw the same numbers in the same order as one call. ``tests/core/test_draw.py``
checks this against one call for every dtype and layout used, generator state included;
CUDA's Philox generator has no such property, so CUDA (and anything else) draws in full.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from spmdgt.tensor import _mt19937

__all__ = ["BLOCK", "MIN_NUMEL", "drawable", "draw_part"]

BLOCK = 1 << 20  # elements per block (4 MB of fp32); a multiple of 16
MIN_NUMEL = 1 << 12  # below this a full draw costs less than the blocks' Python
_SEQUENTIAL = (torch.randn, torch.rand)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def drawable(
    fill: Callable, shape: tuple[int, ...], dtype, device: torch.device, target
) -> int | None:
    """The one tensor dim along which ``fill(shape)`` can be drawn in blocks for ``target``,
    or None. Every ``Shard`` of ``target`` must split that same dim (``Shard(0)`` on a 1-D
    mesh; ``(Shard(0), Replicate())`` or ``(Shard(0), Shard(0))`` on a 2-D one): a rank's
    part is then one contiguous range of that dim. Two dims split (``(Shard(0), Shard(1))``)
    draw in full, each rank keeping its slice."""
    from torch.distributed.tensor import Replicate, Shard

    dims = {p.dim for p in target.placements if isinstance(p, Shard)}
    if (
        fill in _SEQUENTIAL
        and device.type == "cpu"
        and (dtype or torch.get_default_dtype()) in _DTYPES
        and math.prod(shape) >= max(MIN_NUMEL, 16)
        and len(dims) == 1
        and all(isinstance(p, (Shard, Replicate)) for p in target.placements)
    ):
        return dims.pop()
    return None


def draw_part(
    fill: Callable,
    shape: tuple[int, ...],
    dtype,
    local_shape: tuple[int, ...],
    offset: tuple[int, ...],
    dim: int,
) -> torch.Tensor:
    """This rank's part (``local_shape`` at ``offset``, split along ``dim``) of ``fill(shape)``.

    ``offset`` is empty for a rank outside the mesh: it draws and keeps nothing.
    """
    n = math.prod(shape)
    length = shape[dim]
    inner = math.prod(shape[dim + 1 :])
    row = length * inner  # elements of one index of the dims before ``dim``
    local = torch.empty(local_shape, dtype=dtype)
    mine = bool(offset) and local.numel() > 0
    lo = offset[dim] * inner if mine else 0
    hi = lo + local_shape[dim] * inner if mine else 0
    if row == n and fill is torch.randn:  # one flat range: draw it, skip the rest
        _draw_range(fill, n, local.dtype, lo, hi, local.view(-1))
        return local
    out = local.view(-1, hi - lo) if mine else None  # one row per index before ``dim``
    whole_rows = row < BLOCK // 16

    def keep(block: torch.Tensor, start: int) -> None:
        # copy the parts of block [start, start + len) that fall in this rank's columns
        end = start + block.numel()
        first, last = start // row, (end - 1) // row
        if whole_rows:  # blocks hold whole rows (see _blocks): one strided copy
            out[first : last + 1] = block.view(last - first + 1, row)[:, lo:hi]
            return
        for r in range(first, last + 1):  # long rows: at most 17 per block
            a, b = max(start, r * row + lo), min(end, r * row + hi)
            if a < b:
                out[r, a - r * row - lo : b - r * row - lo] = block[a - start : b - start]

    for start, size in _blocks(n, row):
        block = fill(size, dtype=dtype)
        if mine:
            keep(block, start)
    return local


def _consumed(n: int, dtype) -> int:
    """The generator draws ``torch.randn(n)`` (``n >= 16``) takes: one per element, plus its
    last group of 16 drawn again when ``n`` is not a multiple of 16 (float32/64), or rounded
    up to a whole group (bfloat16/float16; measured, and checked by tests/core/test_draw)."""
    if n % 16 == 0:
        return n
    return n + 16 if dtype in (torch.float32, torch.float64) else n + (-n) % 16


# 32-bit words of the CPU generator (mt19937) one uniform of these dtypes takes: a float32,
# bfloat16 or float16 uniform one (``random()``), a float64 one two (``random64()``); checked
# against torch's draws by tests/core/test_draw
_WORDS = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 1, torch.float16: 1}


def _advance(count: int, dtype) -> None:
    """Move the generator ``count`` uniform draws, as ``randn``'s fill would.

    As ``count`` uniforms' worth of 32-bit words: twisted past in C when that is available
    (``_mt19937.skip``, ~10x cheaper than any draw), else taken two a number by an int64
    ``random_()`` in blocks (one ``random64()`` each: the same words a ``rand`` would take, in
    about 0.6 of its time; one float32 ``rand`` takes an odd last word)."""
    count *= _WORDS[dtype]
    if count >= _mt19937.MIN_WORDS and _mt19937.skip(count):
        return
    if count >= 2:
        scratch = torch.empty(min(count // 2, BLOCK), dtype=torch.int64)
        pairs = count // 2
        while pairs > 0:
            k = min(pairs, BLOCK)
            scratch[:k].random_()
            pairs -= k
    if count % 2:
        torch.rand(1)


def _draw_range(fill: Callable, n: int, dtype, lo: int, hi: int, out) -> None:
    """Elements ``[lo, hi)`` of ``fill(n)`` into ``out``: the aligned range around them drawn,
    the rest skipped (a rank with an empty part skips everything)."""
    if hi <= lo:
        _advance(_consumed(n, dtype), dtype)
        return
    a, b = lo // 16 * 16, min(n, -(-hi // 16) * 16)
    if n % 16 and hi > n - 16:  # the last 16 come from randn's redraw: only a call ending at n
        b = n
    if b == n and b - a < 16:  # the last call must be 16 long (a shorter one draws otherwise)
        a = (n - 16) // 16 * 16
    _advance(a, dtype)
    for start, size in _blocks(b - a, b - a):
        s, e = max(a + start, lo), min(a + start + size, hi)
        if (s, e) == (a + start, a + start + size):  # all of it is ours: drawn in place
            fill(size, out=out[s - lo : e - lo])
            continue
        block = fill(size, dtype=dtype)
        if s < e:
            out[s - lo : e - lo] = block[s - a - start : e - a - start]
    if b < n:  # the draws after the range, the tail's included
        _advance(_consumed(n, dtype) - b, dtype)


def _blocks(n: int, row: int) -> list[tuple[int, int]]:
    """(start, size) of the draws: starts at multiples of 16, the last at least 16 long; whole
    rows per block when rows are short (so a block is one strided copy), at most ``BLOCK``."""
    if row < BLOCK // 16:
        per = 16 // math.gcd(row, 16)  # rows per block: a multiple of this is a multiple of 16
        step = BLOCK // row // per * per * row
    else:
        step = BLOCK
    out = [(s, min(step, n - s)) for s in range(0, n, step)]
    if len(out) > 1 and out[-1][1] < 16:  # torch redraws the last 16: keep them in one call
        (s0, z0), (_, z1) = out[-2], out.pop()
        out[-1] = (s0, z0 + z1)
    return out
