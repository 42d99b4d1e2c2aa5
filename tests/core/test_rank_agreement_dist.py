"""Ranks that stop running the same program (the README's table, ``tests/e2e/_diverge.py``):
every rank raises ``gt.RankDivergenceError`` naming each rank's call, before any value is
computed; by default and with ``GT_CHECK_RANKS=1``. Forked ranks; the e2e tests run some of
the same programs as real processes, for exit codes, timeouts and torchrun's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_ranks

CONFIG = Path(__file__).resolve().parents[1] / "e2e" / "_diverge.yaml"

# case -> a phrase every rank's error must hold (it names the disagreement)
TABLE = {
    "item": "rank 1: the end of the program",  # rank 0 reads .sum().item(), rank 1 skips it
    "numpy": "rank 1: numpy() of float32[5, 3] (Shard(dim=0),) on ranks [0, 1] at ",
    "dtype": "rank 1: gt.randn of float64[5, 3]",
    "signal": "rank 1: gt.randn of float32[6, 4], signal 'cols'",
    "dims16": "rank 1: gt.zeros of float32[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]",
    "outside": "rank 1: gt.randn of float32[6, 4], replicated on every rank (no signal)",
}


def _case(rank, world, name):
    import spmdgt as gt
    from tests.e2e import _diverge

    shown = []
    try:
        _diverge.CASES[name](rank, shown.append)
        gt.shutdown()  # the program's end: an agreement point too
    except gt.RankDivergenceError as e:
        return {"error": str(e), "rows": e.rows, "shown": shown}
    return {"error": None, "shown": shown}


# "op" (a gather on one rank only) needs GT_CHECK_RANKS: by default nothing pairs a gather
# with a read, and GT_TIMEOUT bounds the wait (tests/e2e/test_rank_agreement.py)
CASES = [(n, c) for n in (*TABLE, "agree") for c in ("0", "1")] + [("op", "1")]


@pytest.mark.parametrize(("name", "check"), CASES, ids=[f"{n}-check{c}" for n, c in CASES])
def test_every_rank_names_the_disagreement(tmp_path, name, check):
    env = {"GT_CONFIG": str(CONFIG), "GT_CHECK_RANKS": check}
    results = run_ranks(_case, 2, tmp_path, name, env=env, timeout=90)
    if name == "agree":
        assert results[0]["error"] is None and results[1]["error"] is None
        assert results[0]["shown"] == results[1]["shown"] != []
        return
    phrase = TABLE.get(name, "rank 0: TensorBase.matmul: redistribute float32[4, 6]")
    for r in results:
        assert r["error"] is not None and r["shown"] == [], r  # raised, and before any value
        assert phrase in r["error"], (phrase, r["error"])
        assert sorted(r["rows"]) == [0, 1]
    assert results[0]["error"] == results[1]["error"]  # one message, the same on every rank


def _over(transport, rank, world):
    """Make the agreement exchange go through ``transport``: shared memory (``runtime._shm``,
    ranks on one host, the default here) or gloo (ranks on several hosts)."""
    from spmdgt.runtime import _agree, _shm

    if transport == "gloo":
        _shm.ENABLED = False
        _agree.forget()
        _agree.setup(rank, world)  # a new side group, and now no shared memory
    assert (_agree._words is not None) == (transport == "shm"), transport


def _one_word(rank, world, transport):
    """The exchange is one OR-reduced word a rank (``_agree._exchange``): what it must carry."""
    import torch

    import spmdgt as gt
    from spmdgt.runtime import _agree

    _over(transport, rank, world)
    out = {}
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("sub", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1])))
    torch.manual_seed(0)
    full = torch.randn(7, 3)  # 4/3 rows on 2 ranks, 3/3/1 on 3
    with gt.signal.context("rows"):
        x = gt.tensor(full)
    with gt.signal.context("sub"):
        s = gt.tensor(full)
    # reads in a loop: the second and later hit the kept fingerprint and spec text
    out["reads"] = [bool((x.numpy() == full.numpy()).all()) for _ in range(3)]
    out["sub reads"] = [bool((s.numpy() == full.numpy()).all()) for _ in range(2)]
    out["item"] = abs(x.sum().item() - full.sum().item()) < 1e-5  # summed in another order
    # any_rank's flag travels in the same word: set on the last rank alone, seen everywhere
    out["any"] = [
        _agree.any_rank(rank == world - 1, "flag on the last rank", "here"),
        _agree.any_rank(False, "flag nowhere", "here"),
    ]
    # a proposal of some ranks reaches every rank's listener at the next point
    got = []
    handle = _agree.on_agreed(lambda keys: got.append(sorted(keys)))
    if rank != 1:
        _agree.propose(f"hot on rank {rank}")
    _agree.agree("settle", site="here")
    handle.remove()
    out["proposals"] = got
    # fingerprints whose bits one rank's covers (3 and 1): an OR of the fingerprints alone
    # equals rank 0's and would let it go on while the others raise; every rank must raise
    real = _agree._fingerprint
    x_of_rank = 3 if rank == 0 else 1
    _agree._fingerprint = lambda text: (
        (x_of_rank ^ ((_agree._count + 1) * _agree._GOLDEN)) & (_agree._MASK)
    )
    try:
        _agree.agree("bits of one rank's covering the others'", site="here")
        out["subset"] = "agreed"
    except gt.RankDivergenceError as e:
        out["subset"] = sorted(e.rows)
    finally:
        _agree._fingerprint = real
    # every rank raised there, so the exchanges still pair: the next read agrees
    out["after"] = bool((x.numpy() == full.numpy()).all())
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_one_word_carries_fingerprint_flag_and_proposals(tmp_path, world, transport):
    for r in run_ranks(_one_word, world, tmp_path, transport, timeout=90):
        assert r["reads"] == [True] * 3 and r["sub reads"] == [True] * 2 and r["item"], r
        assert r["any"] == [True, False], r
        assert r["proposals"] == [[f"hot on rank {k}" for k in range(world) if k != 1]], r
        assert r["subset"] == list(range(world)), r
        assert r["after"], r


def _reads(rank, world, transport):
    """Host reads of sharded layouts, each equal to one process's value on every rank. Rows
    are gathered through shared memory on one host (``_agree.gather_rows``), else by gloo;
    reads past the staging segment's first size make it grow (a collective, every rank)."""
    import torch

    import spmdgt as gt

    _over(transport, rank, world)
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("cols", gt.SignalConfig(shard=gt.ShardConfig(axis=1)))
    torch.manual_seed(0)
    values = {
        "float rows 7x3": ("rows", torch.randn(7, 3)),
        "float cols 3x7": ("cols", torch.randn(3, 7)),
        "an empty shard 2x3": ("rows", torch.randn(2, 3)),  # 1/1/0 rows on 3 ranks
        "int64 rows": ("rows", torch.arange(21).reshape(7, 3)),
        "bool rows": ("rows", torch.arange(7) % 3 == 0),
        "complex rows": ("rows", torch.randn(7, 2, dtype=torch.complex64)),
        "rows past 1 MiB": ("rows", torch.randn(701, 500)),  # the staging segment grows
        "float rows again": ("rows", torch.randn(5, 3)),
    }
    out = {}
    for name, (signal, full) in values.items():
        with gt.signal.context(signal):
            x = gt.tensor(full)
        out[name] = [
            bool((x.numpy() == full.numpy()).all()),
            x.tolist() == full.tolist(),
            # a transposed view: its shard is not contiguous (Shard(0) <-> Shard(1))
            bool((x.mT.numpy() == full.mT.numpy()).all()) if full.dim() == 2 else True,
        ]
    # Partial values read on the host (a sum over the sharded rows: reduced through shared
    # memory on one host, in rank order), against one process to float rounding
    full = torch.randn(7, 3, dtype=torch.float64)
    with gt.signal.context("rows"):
        x = gt.tensor(full)
    for name, of in {
        "sum": lambda t: t.sum(),
        "column sums": lambda t: t.sum(0),
        "max": lambda t: t.amax(),
        "min of columns": lambda t: t.amin(0),
        "int sum": lambda t: (t > 0).long().sum(),
    }.items():
        got, want = of(x), of(full)
        out[f"partial {name}"] = [
            "max" in name or "min" in name or str(got.placements) == "(Partial(sum),)",
            torch.allclose(torch.as_tensor(got.numpy()), want, rtol=1e-12, atol=1e-12),
            abs(got.sum().item() - want.sum().item()) < 1e-9,
        ]
    from spmdgt.runtime import _agree

    return out, (_agree._words._half if _agree._words is not None else 0)


@pytest.mark.parametrize(
    ("world", "check", "transport"),
    [(2, "0", "shm"), (3, "0", "shm"), (3, "1", "shm"), (2, "0", "gloo"), (3, "0", "gloo")],
)
def test_host_reads_of_sharded_layouts_equal_torch(tmp_path, world, check, transport):
    env = {"GT_CHECK_RANKS": check}
    for r, half in run_ranks(_reads, world, tmp_path, transport, env=env, timeout=90):
        assert all(all(v) for v in r.values()), {k: v for k, v in r.items() if not all(v)}
        # rows went through the staging segment, grown past 1 MiB for 701 x 500 float32
        assert half == (2 << 20 if transport == "shm" else 0), half
