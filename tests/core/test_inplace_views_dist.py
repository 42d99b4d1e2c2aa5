"""In-place views on sharded tensors (``t_``, ``transpose_``, ``swapdims_``, ``swapaxes_``,
``squeeze_``, ``unsqueeze_``): one process's values, shapes, strides and gradients.

Every case runs on a (7, 1, 3, 1) tensor sharded on dim 0 (4/3 over 2 ranks, 3/3/1 over 3)
and on dim 2, inside autograd (a parameter scales it first, a weighted sum is differentiated
after), against the same on a plain tensor. Also: the result is ``self``; no collective runs
and the shard stays the same memory; a leaf raises torch's error;
and the refusals (a sharded size-1 dim squeezed, a tensor a view was copied from) raise the
same error on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from tests._dist import run_ranks

SHAPE = (7, 1, 3, 1)
CASES = {
    "unsqueeze_0": lambda y: y.unsqueeze_(0),
    "unsqueeze_-1": lambda y: y.unsqueeze_(-1),
    "unsqueeze_2": lambda y: y.unsqueeze_(2),
    "squeeze_": lambda y: y.squeeze_(),
    "squeeze_1": lambda y: y.squeeze_(1),
    "squeeze_0_kept": lambda y: y.squeeze_(0),  # not size 1: no change
    "squeeze_dims": lambda y: y.squeeze_((1, 3)),
    "transpose_": lambda y: y.transpose_(0, 2),
    "swapdims_": lambda y: y.swapdims_(0, -2),
    "swapaxes_": lambda y: y.swapaxes_(1, 0),
    "t_": lambda y: y.squeeze_().t_(),
    "chain": lambda y: y.squeeze_(3).t_() if y.dim() == 2 else y.squeeze_(3).transpose_(0, 2),
}


def _run(fn, base, w, make):
    """``fn`` on ``base * w`` (``make`` lays base out), the values, shape, strides and the
    gradient w.r.t. ``w`` of a weighted sum after, or the error."""
    w.grad = None
    y = make(base) * w
    try:
        out = fn(y)
    except Exception as e:
        return ("error", type(e).__name__, str(e).splitlines()[0])
    same = out is y
    c = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / 10
    (y * c).sum().backward()
    values = torch.from_numpy(y.detach().numpy().copy())
    return ("ok", same, tuple(y.shape), tuple(y.stride()), values, w.grad.clone())


def _ranks(rank, world):
    import spmdgt as gt

    for ax in (0, 1, 2):
        gt.register_config(f"s{ax}", gt.SignalConfig(shard=gt.ShardConfig(axis=ax)))
    torch.manual_seed(0)  # the same on every rank, as every plain tensor
    base = torch.randn(SHAPE, dtype=torch.float64)
    out = {}
    for ax in (0, 2):

        def make(t, _ax=ax):
            with gt.signal.context(f"s{_ax}"):
                return gt.tensor(t)

        for name, fn in CASES.items():
            w = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
            ours = _run(fn, base, w, make)
            wp = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
            out[f"s{ax}.{name}"] = (ours, _run(fn, base, wp, lambda t: t.clone()))

        # no data moves: no collective, and the shard is the same memory
        x = make(torch.zeros(7, 1, 3))
        ptr = x._local_tensor.data_ptr()
        with CommDebugMode() as comm:
            x.transpose_(0, 2)
            x.add_(1)
        moved = comm.get_total_counts() + (x._local_tensor.data_ptr() != ptr)
        out[f"s{ax}.alias"] = (moved, float(x.sum()), tuple(x.shape))

    def error(fn):
        try:
            fn()
        except RuntimeError as e:
            return str(e).splitlines()[0]
        return "no error"

    with gt.signal.context("s0"):
        out["leaf"] = error(lambda: gt.tensor(base).requires_grad_().unsqueeze_(0))
        copied = gt.tensor(torch.zeros(7, 3))
        _ = copied[1:]  # uneven rows: DTensor moves data, so this view is a copy
        out["copied"] = error(lambda: copied.t_())
    with gt.signal.context("s1"):  # dim 1 has size 1: one rank holds it, the others nothing
        out["sharded_size_1"] = error(lambda: gt.tensor(base).squeeze_(1))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_inplace_views_on_sharded_tensors_as_torch(world, tmp_path):
    results = run_ranks(_ranks, world, tmp_path)
    for out in results:
        for key in (k for k in out if "." in k and not k.endswith("alias")):
            ours, ref = out[key]
            assert ref[0] == "ok", (key, ref)
            assert ours[0] == "ok", (key, ours)
            assert ours[1] and ours[2:4] == ref[2:4], (key, ours[:4], ref[:4])
            torch.testing.assert_close(ours[4], ref[4], rtol=0, atol=0, msg=key)
            torch.testing.assert_close(ours[5], ref[5], msg=key)
        for ax in (0, 2):
            assert out[f"s{ax}.alias"] == (0, 21.0, (3, 1, 7))
        assert out["leaf"] == (
            "a leaf Variable that requires grad is being used in an in-place operation."
        )
        assert out["copied"].startswith("t_: a view of this sharded tensor was taken as a copy")
        assert "cannot be resized in place" in out["sharded_size_1"]
    errors = [{k: out[k] for k in ("leaf", "copied", "sharded_size_1")} for out in results]
    assert all(e == errors[0] for e in errors)  # the same error on every rank
