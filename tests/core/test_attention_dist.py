"""Attention on sharded inputs is each rank's own work (``spmdgt/tensor/_attention.py``).

``F.scaled_dot_product_attention`` on inputs sharded on the batch dim, or on the head dim of
``[B, H, L, E]`` inputs, runs on each rank's shard with no gather and gives one process's
values, forward and backward: with a mask (sharded alike, replicated, or broadcast), causal,
grouped-query heads, the math kernel, under ``inference_mode``, on 2 ranks and on 3 with
uneven shards. Layouts where a row needs other ranks' values (sharded on the sequence dim,
grouped-query heads whose shards do not line up) and dropout inside attention take the exact
fallback: the counter that says "no gather" is seen to count. A dropout that draws nothing
(``p=0``, eval) is the identity on each shard. A tiny Hugging Face Llama and GPT-2 train on a
batch-sharded signal with no fallback, and ``torch.compile`` of an attention module on
batch-sharded input finishes (it once searched DTensor's sharding rules for minutes) and
equals eager.

Every rank computes the one-process reference itself and compares.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks
from tests._hf import tiny_gpt2, tiny_llama

TOL = {"rtol": 1e-5, "atol": 1e-6}

# name, signal (the dim q, k, v are sharded on; None: plain), shapes (q, k, v, mask), mask
# signal, keyword arguments, expected ("local": no fallback; "fallback": exactly one)
B, H, L, E = 4, 4, 6, 8
QKV = [(B, H, L, E)] * 3
GQA = [(B, H, L, E), (B, 2, L, E), (B, 2, L, E)]
CASES_2 = [
    ("rows", "rows", QKV, None, None, {}, "local"),
    ("rows causal", "rows", QKV, None, None, {"is_causal": True}, "local"),
    ("rows, plain [B,1,L,L] mask", "rows", QKV, (B, 1, L, L), None, {}, "local"),
    ("rows, sharded mask", "rows", QKV, (B, 1, L, L), "rows", {}, "local"),
    ("rows, sharded bool mask", "rows", QKV, (B, 1, L, L), "rows", {"bool": True}, "local"),
    ("rows, broadcast [L,L] mask", "rows", QKV, (L, L), None, {}, "local"),
    ("rows, grouped-query", "rows", GQA, None, None, {"enable_gqa": True}, "local"),
    ("rows, 3-d inputs", "rows", [(B, L, E)] * 3, None, None, {"is_causal": True}, "local"),
    ("rows, key plain", "rows+plain_k", QKV, None, None, {}, "local"),
    ("rows, math kernel", "rows", QKV, (B, 1, L, L), "rows", {"math": True}, "local"),
    ("rows, inference_mode", "rows", QKV, (B, 1, L, L), None, {"inference": True}, "local"),
    ("heads", "heads", QKV, None, None, {}, "local"),
    ("heads, [1,H,L,L] mask", "heads", QKV, (1, H, L, L), None, {"is_causal": False}, "local"),
    ("heads, grouped-query", "heads", GQA, None, None, {"enable_gqa": True}, "local"),
    ("heads causal, inference", "heads", QKV, None, None, {"inference": True}, "local"),
    # a row needs every key, or the op draws random numbers: the exact fallback
    ("sequence", "seq", QKV, None, None, {}, "fallback"),
    ("rows, dropout", "rows", QKV, None, None, {"dropout_p": 0.3}, "fallback"),
]
# 3 ranks: 7 rows (3, 3, 1), 5 heads (2, 2, 1); grouped-query heads 6 over 3 key/value
# heads line up (2 and 1 a rank), 6 over 2 do not (a rank would hold no key/value head)
B3, H3 = 7, 5
QKV3 = [(B3, H3, L, E)] * 3
CASES_3 = [
    ("rows, uneven", "rows", QKV3, None, None, {"is_causal": True}, "local"),
    ("rows, uneven, mask", "rows", QKV3, (B3, 1, L, L), None, {}, "local"),
    ("rows, uneven, grouped", "rows", [(B3, 6, L, E), *[(B3, 3, L, E)] * 2], None, None,
     {"enable_gqa": True}, "local"),
    ("heads, uneven", "heads", QKV3, (1, H3, L, L), None, {}, "local"),
    ("heads, grouped, aligned", "heads", [(B3, 6, L, E), *[(B3, 3, L, E)] * 2], None, None,
     {"enable_gqa": True}, "local"),
    ("heads, grouped, not aligned", "heads", [(B3, 6, L, E), *[(B3, 2, L, E)] * 2], None,
     None, {"enable_gqa": True}, "fallback"),
]  # fmt: skip


def _signals(gt) -> None:
    for name, axis in (("rows", 0), ("heads", 1), ("seq", 2)):
        gt.register_config(name, gt.SignalConfig(shard=gt.ShardConfig(axis=axis)))


def _attention_cases(rank, world, cases):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import spmdgt as gt
    from spmdgt.tensor import _fallback
    from spmdgt.tensor._tensor import global_value

    _signals(gt)
    failures = []
    for name, signal, shapes, mask_shape, mask_signal, kw, expect in cases:
        kw = dict(kw)
        is_bool, math, inference = kw.pop("bool", 0), kw.pop("math", 0), kw.pop("inference", 0)
        gen = torch.Generator().manual_seed(len(name))
        full = [torch.randn(s, generator=gen) for s in shapes]
        mask = torch.randn(mask_shape, generator=gen) if mask_shape else None
        if is_bool:
            mask = mask > -0.5
        grad_out = torch.randn(shapes[0][:-1] + shapes[2][-1:], generator=gen)

        def context(math=math, inference=inference):
            if inference:
                return torch.inference_mode()
            return sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()

        # one process
        ref = [t.clone().requires_grad_(not inference) for t in full]
        torch.manual_seed(7)
        with context():
            want = F.scaled_dot_product_attention(*ref, attn_mask=mask, **kw)
        if not inference:
            want.backward(grad_out)

        # sharded
        sig, plain_k = signal.split("+")[0], signal.endswith("+plain_k")
        with gt.signal.context(sig):
            xs = [gt.tensor(t, requires_grad=not inference) for t in full]
            if plain_k:
                xs[1] = full[1].clone().requires_grad_(True)
        m = mask
        if mask is not None and mask_signal is not None:
            with gt.signal.context(mask_signal):
                m = gt.tensor(mask)
        _fallback.counts.clear()
        torch.manual_seed(7)
        with context():
            got = F.scaled_dot_product_attention(*xs, attn_mask=m, **kw)
        if not inference:
            with gt.signal.context(sig):
                g = gt.tensor(grad_out)
            got.backward(g)
        fallbacks = sum(_fallback.counts.values())
        if fallbacks != (0 if expect == "local" else 1):
            failures.append(f"{name}: {fallbacks} fallbacks ({dict(_fallback.counts)})")
        try:
            torch.testing.assert_close(global_value(got), want.detach(), **TOL)
            if not inference:
                for x, r in zip(xs, ref):
                    torch.testing.assert_close(global_value(x.grad), r.grad, **TOL)
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[:4]}")
    return failures


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (3, CASES_3)], ids=["2", "3"])
def test_batch_and_head_sharded_attention_runs_locally_and_exactly(tmp_path, world, cases):
    results = run_ranks(_attention_cases, world, tmp_path, cases, timeout=240)
    assert results == [[]] * world, "\n".join(f for r in results for f in r)


def _dropouts(rank, world):
    import spmdgt as gt
    from spmdgt.tensor import _fallback
    from spmdgt.tensor._tensor import global_value

    _signals(gt)
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    with gt.signal.context("rows"):
        x = gt.tensor(full, requires_grad=True)
    module = nn.Dropout(0.5).eval()
    _fallback.counts.clear()
    outs = [
        F.dropout(x, 0.0),
        F.dropout(x, 0.5, training=False),
        torch.dropout(x, 0.0, True),
        module(x),
        F.alpha_dropout(x, 0.5),  # training=False by default
    ]
    identity = sum(_fallback.counts.values())
    torch.manual_seed(3)
    drawn = F.dropout(x, 0.5)  # draws: the exact fallback, one process's numbers
    random = sum(_fallback.counts.values()) - identity
    torch.manual_seed(3)
    want = F.dropout(full, 0.5)
    sum(o.sum() for o in outs).backward()
    return (
        identity,
        random,
        all(torch.equal(global_value(o), full) for o in outs),
        torch.equal(global_value(drawn), want),
        torch.equal(global_value(x.grad), torch.full_like(full, 5.0)),
    )


def test_a_dropout_that_draws_nothing_stays_on_each_shard(tmp_path):
    for identity, random, same, drawn, grad in run_ranks(_dropouts, 2, tmp_path):
        assert identity == 0 and random == 1  # the counter counts: the drawing one gathers
        assert same and drawn and grad


def _hf_models():
    return {"llama": tiny_llama(), "gpt2": tiny_gpt2()}  # GPT-2: dropout p=0, no draw


def _hf_steps(rank, world):
    import copy
    import warnings

    import spmdgt as gt
    from spmdgt.tensor import _fallback
    from spmdgt.tensor._tensor import global_value

    warnings.simplefilter("ignore")  # transformers' notices
    _signals(gt)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 128, (4, 16), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding in one row
        batches.append((ids, mask))
    failures, counts = [], {}
    for name, model in _hf_models().items():
        ref = copy.deepcopy(model)
        model.train(), ref.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        _fallback.counts.clear()
        for step, (ids, mask) in enumerate(batches):
            with gt.signal.context("rows"):
                gids, gmask = gt.tensor(ids), gt.tensor(mask)
            out = model(input_ids=gids, attention_mask=gmask, labels=gids)
            out.loss.backward()
            want = ref(input_ids=ids, attention_mask=mask, labels=ids)
            want.loss.backward()
            try:
                torch.testing.assert_close(global_value(out.logits), want.logits, **TOL)
                torch.testing.assert_close(global_value(out.loss), want.loss, **TOL)
                for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(
                        global_value(p.grad), q.grad, **TOL, msg=lambda m, n=pname: f"{n}: {m}"
                    )
            except AssertionError as e:
                failures.append(f"{name} step {step}: {str(e).splitlines()[:4]}")
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        counts[name] = dict(_fallback.counts)
    return failures, counts


def test_hugging_face_models_train_on_a_batch_signal_with_no_gather(tmp_path):
    for failures, counts in run_ranks(_hf_steps, 2, tmp_path, timeout=240):
        assert failures == []
        assert counts == {"llama": {}, "gpt2": {}}  # attention and dropout(p=0): no fallback


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 3 * 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).flatten(-2))


def _compiled(rank, world):
    import spmdgt as gt
    from spmdgt.tensor import _fallback
    from spmdgt.tensor._tensor import global_value

    _signals(gt)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(5, 6, 8, generator=gen)  # 3 and 2 rows: local shapes differ
    mask = torch.randn(5, 1, 6, 6, generator=gen)
    torch.manual_seed(0)
    model = _Attention()
    ref = _Attention()
    ref.load_state_dict(model.state_dict())
    with gt.signal.context("rows"):
        x, m = gt.tensor(full, requires_grad=True), gt.tensor(mask)
    _fallback.counts.clear()
    start = time.perf_counter()
    y = torch.compile(model, backend="aot_eager")(x, m)
    y.pow(2).sum().backward()
    seconds = time.perf_counter() - start
    rx = full.clone().requires_grad_(True)
    want = ref(rx, mask)
    want.pow(2).sum().backward()
    pairs = [(global_value(y), want.detach()), (global_value(x.grad), rx.grad)]
    pairs += [(global_value(p.grad), q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    return seconds, dict(_fallback.counts), type(y).__name__, pairs


def test_torch_compile_of_attention_on_a_batch_signal_finishes_and_equals_eager(tmp_path):
    # before the strategies, DTensor's sharding search for the CPU attention kernel ran for
    # minutes inside dynamo's trace; the rank's timeout (120 s) stands for "it finishes"
    for seconds, counts, kind, pairs in run_ranks(_compiled, 2, tmp_path, timeout=120):
        # no attention op fell back (the Linear's view of 5 rows over 2 ranks does: reshaping
        # an unevenly sharded dim has no DTensor rule)
        assert not [op for op in counts if "attention" in op], counts
        assert kind == "Tensor"
        for got, want in pairs:
            torch.testing.assert_close(got, want, **TOL)
        assert seconds < 90, seconds


def _strategies_round_trip(rank, world):
    from torch.distributed.tensor import DTensor

    import spmdgt.tensor._tensor  # noqa: F401  (installs the hook, as gt.Tensor's first use)
    from spmdgt.tensor import _attention, _hook

    prop = DTensor._op_dispatcher.sharding_propagator
    ops = (_attention.CPU_FLASH, _attention.CPU_FLASH_BACKWARD, _attention.MATH, _attention.SDPA)

    def state():
        return [op in prop.op_strategy_funcs for op in ops] + [
            "_get_candidate_placements" in vars(prop.decomp_strategy)
        ]

    seen = [state()]
    _hook.uninstall()  # DTensor as torch has it: no rule of ours, its own search
    seen.append(state())
    _hook.install()
    seen.append(state())
    return seen


def test_the_strategies_go_in_and_out_with_the_hook(tmp_path):
    # in a forked rank: the hook put back in this process would differ from what dynamo's
    # caches saw in earlier tests (see tests/core/test_hook.py)
    (seen,) = run_ranks(_strategies_round_trip, 1, tmp_path)
    assert seen == [[True] * 5, [False] * 5, [True] * 5]
