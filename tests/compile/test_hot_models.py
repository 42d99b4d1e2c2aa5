"""Hot functions where training spends its time: a model's forward, even from site-packages.

A Hugging Face model lives in site-packages, which the sampler skips as library code; a
module's ``forward`` is the user's code all the same, and a hot one stands for the outermost
module forward on its stack (the model the loop calls). On two ranks a loop that never reads
a value on the host settles hotness at its optimizer steps (``compile/_steps.py``). A host read
on one rank while the other goes into a compile is an error on both at once, before the
compile's time is spent. ``aot_eager`` keeps the compiles to seconds and eager's numerics.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_ranks
from tests._hf import tiny_llama


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (4, 16), generator=g) for _ in range(n)]


def _train(batches, progress=None):
    """The plain loop: no creation, no host read. Losses detached (read after the loop).
    (It turns hot too, from the backward's and the optimizer's ops, but it is called once
    with the pass on: a second call would compile the loop itself.)"""
    m = tiny_llama()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for ids in batches:
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
        if progress is not None:
            progress()
    return _values(losses)


def _train_sharded(batches):
    """``_train`` again, a function of its own (see ``_train``)."""
    m = tiny_llama()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for ids in batches:
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
    return _values(losses)


def _values(losses):
    return [float(x.full_tensor() if hasattr(x, "full_tensor") else x) for x in losses]


def test_a_site_packages_model_forward_is_compiled_whole_and_matches_eager():
    import torch._dynamo

    import spmdgt.compile as gt_compile
    from spmdgt.interceptor import _control

    batches = _batches(6)
    ref = _train(batches)
    torch._dynamo.reset()
    gt_compile.enable(backend="aot_eager", every=4, hot_at=4)
    try:
        got = _train(batches)
        st = gt_compile.stats()
        # a DataLoader worker forked from this process decides nothing (it inherits the pass,
        # and its stack below the worker loop is this one: it printed "hot main" again)
        import torch.utils.data._utils.worker as worker

        p = gt_compile._hot
        worker._worker_info = object()
        try:
            p.on_hot([_values.__code__])
        finally:
            worker._worker_info = None
        assert _values.__code__ not in p.hook.hot and "DataLoader worker" in p.status()
    finally:
        gt_compile.disable()
        _control.disable()
        torch._dynamo.reset()
    names = [n.split(" ")[0] for n in st["compiled_functions"]]
    assert names == ["LlamaForCausalLM.forward"], st  # the whole model, not its layers
    assert st["status"].startswith("compiled: LlamaForCausalLM.forward"), st["status"]
    assert st["fallbacks"] == {} and st["cache_hits"] >= 3, st
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # aot_eager: eager's ops


def _two_ranks(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    plain = _batches(6)
    gt.register_config("batch", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    with gt.signal.context("batch"):
        sharded = [gt.tensor(b) for b in plain]  # made before the loop: no creation inside
    ref_plain, ref_sharded = _train(plain), _train(sharded)
    gt_compile.enable(backend="aot_eager", every=4, hot_at=4)
    try:
        compiled_at: list[int] = []
        got_plain = _train(plain, lambda: compiled_at.append(gt_compile.stats()["compiled"]))
        st_plain = gt_compile.stats()
        got_sharded = _train_sharded(sharded)
        st = gt_compile.stats()
    finally:
        gt_compile.disable()
    return ref_plain, got_plain, ref_sharded, got_sharded, compiled_at, st_plain, st


@pytest.mark.slow
def test_two_ranks_compile_the_model_at_a_training_step_plain_and_batch_sharded(tmp_path):
    results = run_ranks(_two_ranks, 2, tmp_path, timeout=300)
    for ref_p, got_p, ref_s, got_s, compiled_at, st_plain, st in results:
        torch.testing.assert_close(got_p, ref_p, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_s, ref_s, rtol=1e-6, atol=1e-6)
        # hot in step 1's forward, settled at its optimizer step, compiled at step 2's call
        assert compiled_at[:2] == [0, 1], (compiled_at, st_plain["status"])
        assert st_plain["training_steps"] == 6 and st_plain["pending"] == []
        names = {n.split(" ")[0] for n in st["compiled_functions"]}
        assert "LlamaForCausalLM.forward" in names, st
        assert st["fallbacks"] == {} and st["recompiles"] >= 1, st  # the sharded inputs'
    assert results[0][4] == results[1][4]  # the same call on both ranks


def _f(x, w):
    for _ in range(6):
        x = x * w + 1.0
    return x


def _read_on_one_rank(rank, world):
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    def slow_backend(gm, example_inputs):  # a compile that takes a minute
        time.sleep(60)
        return gm.forward

    gt.register_config("batch", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    with gt.signal.context("batch"):
        x = gt.randn(8, 8)
    w = torch.full((8, 8), 0.5)
    gt_compile.enable(backend=slow_backend, every=2, hot_at=4)
    t0 = time.perf_counter()
    try:
        y = _f(x, w)  # _f turns hot here
        gt.zeros(2)  # an agreement point: _f compiles at its next call, on every rank
        if rank == 0:
            y.sum().item()  # a host read on rank 0 only; rank 1 goes on into the compile
        _f(x, w)
    except gt.RankDivergenceError as e:
        return str(e), time.perf_counter() - t0
    finally:
        gt_compile.disable()
    return "no error", time.perf_counter() - t0


def test_a_host_read_on_one_rank_while_the_other_compiles_raises_on_both_at_once(tmp_path):
    results = run_ranks(_read_on_one_rank, 2, tmp_path, timeout=120)
    for message, seconds in results:
        assert "item()" in message and "compile of _f" in message, message
        assert seconds < 30, seconds  # before the minute-long compile, not after it
