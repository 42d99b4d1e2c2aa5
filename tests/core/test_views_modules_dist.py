"""Modules whose plain code mixes a sharded batch with memory torch reads or writes itself.

- ``nn.LSTM`` on ``pack_padded_sequence`` of a batch sharded on its rows (batch first, lengths
  plain): the packed sequence's batch sizes stay a plain CPU tensor, which the RNN kernel
  reads on the host (a sharded wrapper holds no data: "data is not allocated yet").
- ``nn.Embedding(max_norm=...)`` on sharded indices: the weight is renormalised in place, in
  the module's own parameter, before it is read (the gathered weight was an autograd view of
  the parameter, which may not be read after that write: "Output 0 of _Gather is a view and
  its base ... modified inplace").

Each against the same module in one process: outputs, the parameters after the forward, and
every gradient, on 2 and 3 ranks with 7 rows (4/3, 3/3/1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from tests._dist import run_ranks

ROWS = 7


def _start(gt) -> None:
    gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))


def _lstm_pass(lstm, x, lengths, enforce_sorted):
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    out, (h, c) = lstm(packed)
    padded, lens = pad_packed_sequence(out, batch_first=True)
    loss = (padded * padded).sum() + (h * c).sum()
    loss.backward()
    values = [padded, lens, h, c, x.grad]
    grads = [p.grad for p in lstm.parameters()]
    return [torch.as_tensor(v.detach().numpy()).clone() for v in (*values, *grads)]


def _lstm(rank, world):
    import spmdgt as gt

    _start(gt)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 5, 3, generator=gen)
    results = {}
    for enforce_sorted, lengths in (
        (False, torch.tensor([3, 5, 1, 4, 5, 2, 2])),
        (True, torch.tensor([5, 5, 4, 3, 2, 2, 1])),
    ):
        torch.manual_seed(1)
        lstm = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True)
        ref = copy.deepcopy(lstm)
        with gt.signal.context("data"):
            xs = gt.tensor(x)
            xs.requires_grad_()
            ours = _lstm_pass(lstm, xs, lengths, enforce_sorted)
        ref_x = x.clone().requires_grad_()
        results[enforce_sorted] = (ours, _lstm_pass(ref, ref_x, lengths, enforce_sorted))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_lstm_on_packed_sharded_batch(world, tmp_path):
    for results in run_ranks(_lstm, world, tmp_path):
        for ours, ref in results.values():
            assert len(ours) == len(ref)
            for a, r in zip(ours, ref):
                torch.testing.assert_close(a, r)


def _embedding_steps(emb, idx, coef):
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    seen = []
    for _ in range(3):
        opt.zero_grad()
        y = emb(idx)
        renormed = emb.weight.detach().clone()  # max_norm wrote the rows idx names, in place
        (y * coef).sum().backward()
        seen += [torch.as_tensor(y.detach().numpy()).clone(), renormed, emb.weight.grad.clone()]
        opt.step()
    return seen


def _embedding(rank, world):
    import spmdgt as gt

    _start(gt)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 10, (ROWS, 2), generator=gen)
    coef = torch.randn(ROWS, 2, 4, generator=gen)
    torch.manual_seed(3)
    emb = torch.nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(2)  # every row longer than max_norm: each one read is renormalised
    ref = copy.deepcopy(emb)
    with gt.signal.context("data"):
        ours = _embedding_steps(emb, gt.tensor(idx), coef)
    return ours, _embedding_steps(ref, idx, coef)


@pytest.mark.parametrize("world", [2, 3])
def test_embedding_max_norm_on_sharded_indices(world, tmp_path):
    for ours, ref in run_ranks(_embedding, world, tmp_path):
        assert len(ours) == len(ref)
        for a, r in zip(ours, ref):
            torch.testing.assert_close(a, r)
        # the renorm acted: the rows read have norm max_norm, the others kept theirs
        assert not torch.equal(ref[1], ref[4])
