"""The agreement exchange through shared memory (``runtime._shm``), in one process: threads play
the ranks on one segment, so what a waiting rank learns (the OR of every word, a peer that
ended the exchange, a peer whose process exited, its own deadline) is checked without a
process group. The ranks' own use is in ``test_rank_agreement_dist.py`` and every
``*_dist`` test (the default on one host)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from spmdgt.runtime import _shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (Linux only)")


@pytest.fixture
def segment():
    """(lib, base, size) of a fresh segment for 3 ranks, unmapped afterwards."""
    lib = _shm._load()
    size = 64 * 4
    name = f"/dev/shm/spmdgt-test-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        base = lib.gt_map(fd, size)
    finally:
        os.close(fd)
        os.unlink(name)
    yield lib, base, size
    lib.gt_unmap(base, size)


def _me():
    return (os.getpid(), _shm._start_time(os.getpid()))


def _ranks(segment, world, pids=None):
    lib, base, size = segment
    pids = pids or [_me()] * world
    return [_shm.Words(lib, base, size, r, world, pids) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_or_of_every_word_round_after_round(segment, world):
    ranks = _ranks(segment, world)
    rounds = 3000  # both word slots reused many times; the ranks run at their own pace
    got = [[] for _ in range(world)]

    def run(r):
        for i in range(rounds):
            got[r].append(ranks[r].exchange(((i * 7919 + r) % 97) << (8 * r)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = [0] * rounds
    for i in range(rounds):
        for r in range(world):
            want[i] |= ((i * 7919 + r) % 97) << (8 * r)
    assert all(g == want for g in got)


def test_a_rank_that_ends_the_exchange_wakes_the_waiting_ones(segment):
    ranks = _ranks(segment, 3)
    errors = []

    def wait(r):
        try:
            ranks[r].exchange(1)
        except _shm.PeersMissing as e:
            errors.append((r, e.who))

    threads = [threading.Thread(target=wait, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    ranks[2].end()  # rank 2's op failed alone: it never posts this exchange
    for t in threads:
        t.join(30)
    assert sorted(errors) == [(0, "a rank ended the exchange"), (1, "a rank ended the exchange")]


def test_a_rank_whose_process_exited_is_named(segment):
    # rank 1's "process" is a child that has exited (and been reaped) by the exchange
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    start = _shm._start_time(child.pid)
    assert start is not None
    child.wait()
    ranks = _ranks(segment, 2, pids=[_me(), (child.pid, start)])
    with pytest.raises(_shm.PeersMissing) as e:
        ranks[0].exchange(1)
    assert e.value.who == "rank(s) [1] exited"


def test_a_rank_that_does_not_arrive_times_out_by_name(segment):
    ranks = _ranks(segment, 3)
    ranks[0].set_timeout(0.2)
    done = threading.Thread(target=ranks[2].exchange, args=(4,))
    done.start()  # rank 2 arrives; rank 1 (alive: this process) never does
    with pytest.raises(_shm.PeersMissing) as e:
        ranks[0].exchange(1)
    assert e.value.who == "rank(s) [1] did not arrive"
    assert "within 0.2 s" in str(e.value)
    ranks[1].exchange(2)  # let rank 2 go
    done.join(30)


def _staged(world: int, half: int):
    """(lib, size, half, bases, ranks): ``world`` thread-ranks on a fresh word segment and a
    staging segment of two ``half``-byte halves (unmapped by the caller)."""
    lib = _shm._load()
    size = 64 * (world + 1)
    bases = []
    for n in (size, 2 * half):
        name = f"/dev/shm/spmdgt-test-{os.getpid()}-{threading.get_ident()}-{n}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, n)
        bases.append(lib.gt_map(fd, n))
        os.close(fd)
        os.unlink(name)
    ranks = [_shm.Words(lib, bases[0], size, r, world, [_me()] * world) for r in range(world)]
    for w in ranks:
        w.attach_stage(bases[1], half)
    return lib, size, half, bases, ranks


def _as_ranks(world: int, run) -> None:
    """``run(r)`` for every rank ``r`` on its own thread, all at once, joined."""
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.mark.parametrize("world", [2, 3])
def test_rows_gathered_through_the_staging_segment_equal_torch(world):
    """Each rank writes its row shard (``torch.chunk``'s cut: uneven, some empty), the ranks
    exchange "written", each copies the matrix out; the two halves alternate, so a rank that
    runs ahead never overwrites rows another rank is still copying."""
    import torch

    lib, size, half, bases, ranks = _staged(world, 1 << 16)
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(7, 3, generator=g),  # 3/3/1 on 3 ranks, 4/3 on 2
        torch.randn(2, 5, generator=g),  # 1/1/0 on 3 ranks: an empty shard
        torch.randint(-9, 9, (9, 2, 2), generator=g),
        torch.rand(5, 4, generator=g) > 0.5,
        torch.randn(6, 2, dtype=torch.complex64, generator=g),
        torch.randn(0, 3, generator=g),
    ] * 40
    got = [[] for _ in range(world)]

    def run(r):
        for full in cases:
            rows = -(-full.shape[0] // world)
            mine = full[r * rows : (r + 1) * rows].contiguous()
            got[r].append(ranks[r].gather(mine, rows, full.shape[0]))

    _as_ranks(world, run)
    for r in range(world):
        assert len(got[r]) == len(cases)
        for full, out in zip(cases, got[r]):
            assert out.dtype == full.dtype and torch.equal(out, full), (r, full.shape)
    lib.gt_unmap(bases[1], 2 * half)
    lib.gt_unmap(bases[0], size)


@pytest.mark.parametrize("world", [2, 3])
def test_a_gather_read_in_place_is_the_matrix_until_the_next_exchange(world):
    """``gather(copy=False)`` (a product's second operand, ``_contract.direct``) hands back
    the staging segment itself, not a copy; read at once, as the product does, it is the
    whole matrix on every rank, however far a rank runs ahead: the half it lies in is
    written again only after every rank has passed the call in between."""
    import ctypes

    import torch

    lib, size, half, bases, ranks = _staged(world, 1 << 14)
    g = torch.Generator().manual_seed(1)
    seconds = [torch.randn(5 + i % 4, 3, generator=g) for i in range(120)]  # uneven shards
    firsts = [torch.randn(4, s.shape[0], generator=g) for s in seconds]
    got = [[] for _ in range(world)]
    in_place = [[] for _ in range(world)]
    start = ctypes.cast(bases[1], ctypes.c_void_p).value
    end = start + 2 * half

    def run(r):
        for a, full in zip(firsts, seconds):
            rows = -(-full.shape[0] // world)
            mine = full[r * rows : (r + 1) * rows].contiguous()
            view = ranks[r].gather(mine, rows, full.shape[0], copy=False)
            in_place[r].append(start <= view.data_ptr() < end)
            got[r].append(torch.mm(a, view))

    _as_ranks(world, run)
    for r in range(world):
        assert len(got[r]) == len(seconds) and all(in_place[r])
        for a, full, out in zip(firsts, seconds, got[r]):
            assert torch.equal(out, torch.mm(a, full)), (r, full.shape)
    lib.gt_unmap(bases[1], 2 * half)
    lib.gt_unmap(bases[0], size)
