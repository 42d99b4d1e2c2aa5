"""The path each common op of a training step takes, and the collectives it issues.

A value test passes an op that slid from DTensor's sharding propagation to the exact gather
fallback (the values are the same; the cost is a gather of every sharded argument). Here,
on 2 and 3 ranks with 7 rows (4/3 and 3/3/1), each op's forward and backward is checked
for the path it took (``spmdgt.tensor._paths.watch``: fast, dtensor, rewrite, fallback,
raised), the collectives ``CommDebugMode`` counts, and one process's values and gradients.
``x`` is sharded by rows and needs a gradient; the weights are plain (replicated) tensors
that need gradients, so their gradients are all-reduced in backward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks

ROWS, COLS, OUT, VOCAB, DIM = 7, 5, 4, 10, 3
AR, AG = "c10d_functional.all_reduce", "c10d_functional.all_gather_into_tensor"


def _ops() -> dict:
    """name -> op on (x, y, w, b, t, ids, emb, lw, lb): x, y, t, ids sharded by rows; w, b,
    emb, lw, lb plain parameters."""
    return {
        "matmul": lambda x, y, w, b, t, ids, e, lw, lb: x @ w,
        "linear": lambda x, y, w, b, t, ids, e, lw, lb: F.linear(x, w.T, b),
        "add": lambda x, y, w, b, t, ids, e, lw, lb: x + y,
        "mul": lambda x, y, w, b, t, ids, e, lw, lb: x * y,
        "relu": lambda x, y, w, b, t, ids, e, lw, lb: torch.relu(x),
        "gelu": lambda x, y, w, b, t, ids, e, lw, lb: F.gelu(x),
        "softmax": lambda x, y, w, b, t, ids, e, lw, lb: torch.softmax(x, -1),
        "layer_norm": lambda x, y, w, b, t, ids, e, lw, lb: F.layer_norm(x, (COLS,), lw, lb),
        "cross_entropy": lambda x, y, w, b, t, ids, e, lw, lb: F.cross_entropy(x, t),
        "sum": lambda x, y, w, b, t, ids, e, lw, lb: x.sum(),
        "sum_dim": lambda x, y, w, b, t, ids, e, lw, lb: x.sum(1),
        "mean": lambda x, y, w, b, t, ids, e, lw, lb: x.mean(),
        "mean_dim": lambda x, y, w, b, t, ids, e, lw, lb: x.mean(1),
        "view": lambda x, y, w, b, t, ids, e, lw, lb: x.view(ROWS, 1, COLS),
        "reshape": lambda x, y, w, b, t, ids, e, lw, lb: x.reshape(ROWS, COLS, 1),
        "flatten": lambda x, y, w, b, t, ids, e, lw, lb: x.reshape(-1),
        "transpose": lambda x, y, w, b, t, ids, e, lw, lb: x.transpose(0, 1),
        "embedding": lambda x, y, w, b, t, ids, e, lw, lb: F.embedding(ids, e),
    }


NONE: dict[str, int] = {}
# name -> (forward path, its collectives, backward path, its collectives, path under no_grad).
# Under autograd the fast path is never taken (it has no tape to record), nor under a dispatch
# mode such as CommDebugMode: "dtensor" there. A plain weight's gradient is a partial sum on
# each rank: one all-reduce in backward per weight.
EXPECTED = {
    "matmul": ("dtensor", NONE, "dtensor", {AR: 1}, "fast"),
    "linear": ("dtensor", NONE, "dtensor", {AR: 2}, "fast"),  # w and b
    "add": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "mul": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "relu": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "gelu": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "softmax": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "layer_norm": ("dtensor", NONE, "dtensor", {AR: 2}, "fast"),  # lw and lb
    # the losses' guard (_losses.py): DTensor's path on uneven rows, proven exact by
    # tests/core/test_losses_uneven_dist.py; nll_loss's mean is _hook's rewrite (a sum over
    # the global weight sum): an all-reduce of the weight sum each way, no gather
    "cross_entropy": ("rewrite", {AR: 1}, "dtensor", {AR: 1}, "rewrite"),
    "sum": ("dtensor", NONE, "dtensor", NONE, "fast"),  # a Partial result: reduced when read
    "sum_dim": ("dtensor", NONE, "dtensor", NONE, "fast"),
    # DTensor's rule would replicate an unevenly sharded dim before a mean over it (an
    # all-gather); _hook's rewrite sums instead (Partial: one all-reduce when read)
    "mean": ("rewrite", NONE, "dtensor", NONE, "rewrite"),
    "mean_dim": ("dtensor", NONE, "dtensor", NONE, "fast"),
    "view": ("dtensor", NONE, "dtensor", NONE, "dtensor"),  # views: aliasing stays DTensor's
    "reshape": ("dtensor", NONE, "dtensor", NONE, "dtensor"),
    # flattening uneven row shards has no DTensor rule: the gathered value, replicated
    "flatten": ("fallback", {AG: 1}, "dtensor", NONE, "fallback"),
    "transpose": ("dtensor", NONE, "dtensor", NONE, "dtensor"),
    # _optable's GUARDED route (a weight sharded over several mesh dims takes the fallback):
    # never the fast path, which only DTensor's own route takes
    "embedding": ("dtensor", NONE, "dtensor", {AR: 1}, "dtensor"),
}


def _data():
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(ROWS, COLS, generator=g),  # x
        torch.randn(ROWS, COLS, generator=g),  # y
        torch.randn(COLS, OUT, generator=g),  # w
        torch.randn(OUT, generator=g),  # b
        torch.randint(0, COLS, (ROWS,), generator=g),  # t
        torch.randint(0, VOCAB, (ROWS,), generator=g),  # ids
        torch.randn(VOCAB, DIM, generator=g),  # emb
        torch.randn(COLS, generator=g),  # lw
        torch.randn(COLS, generator=g),  # lb
    )


_GRADS = (0, 2, 3, 6, 7, 8)  # x, w, b, emb, lw, lb: the inputs that need gradients


def _close(ours, ref) -> bool:
    if ours is None or ref is None:
        return ours is None and ref is None
    return np.allclose(np.asarray(ours), ref.detach().numpy(), atol=1e-5)


def _comms(mode) -> dict[str, int]:
    return {str(k): v for k, v in mode.get_comm_counts().items() if v}


def _step(rank, world):
    from torch.distributed.tensor.debug import CommDebugMode

    import spmdgt as gt
    from spmdgt.tensor._moves import place, target_of
    from spmdgt.tensor._paths import watch

    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    data = _data()
    out = {}
    for name, op in _ops().items():
        ref_in = [v.clone().requires_grad_(i in _GRADS) for i, v in enumerate(data)]
        ref = op(*ref_in)
        g_full = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
        ref.backward(g_full if ref.dim() else None)

        with gt.signal.context("rows"):  # x, y, t, ids sharded by rows (4/3, 3/3/1)
            x = gt.tensor(data[0], requires_grad=True)
            y, t, ids = gt.tensor(data[1]), gt.tensor(data[4]), gt.tensor(data[5])
        w, b, e, lw, lb = (data[i].clone().requires_grad_() for i in (2, 3, 6, 7, 8))
        args = (x, y, w, b, t, ids, e, lw, lb)
        with watch() as fwd, CommDebugMode() as fwd_comms:
            res = op(*args)
        grad = place(g_full, target_of(res.device_mesh, res.placements)) if res.dim() else None
        with watch() as bwd, CommDebugMode() as bwd_comms:
            res.backward(grad)
        with torch.no_grad(), watch() as quiet:  # no autograd, no mode: the fast path may run
            op(*args)
        grads = [a.grad for a in args if a.requires_grad]
        out[name] = {
            "paths": (fwd.path, bwd.path, quiet.path),
            "comms": (_comms(fwd_comms), _comms(bwd_comms)),
            "value": _close(res.detach().numpy(), ref),
            "grads": all(
                _close(None if g is None else g.numpy() if hasattr(g, "numpy") else g, r.grad)
                for g, r in zip(grads, [ref_in[i] for i in _GRADS])
            ),
        }
    out["checks"] = _rewrite_and_raise(rank, world)
    return out


def _rewrite_and_raise(rank, world):
    """The two other paths: an exact rewrite of DTensor's rule, and an op that raises (here
    spmdgt's refusal of a sharded tensor inside a torch.func transform)."""
    import spmdgt as gt
    from spmdgt.tensor._paths import watch

    # nll_loss's mean on even row shards (6 rows): DTensor's path with spmdgt's rewrite of the
    # weighted mean (_hook._nll_mean); uneven rows too (cross_entropy above)
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(6, COLS, generator=g).log_softmax(-1)
    target = torch.randint(0, COLS, (6,), generator=g)
    weight = torch.rand(COLS, generator=g) + 0.5
    with gt.signal.context("rows"):
        glogp, gtarget = gt.tensor(logp), gt.tensor(target)
    with watch() as rewrite:
        loss = F.nll_loss(glogp, gtarget, weight)
    same = bool(np.allclose(loss.numpy(), F.nll_loss(logp, target, weight).numpy(), atol=1e-6))
    with gt.signal.context("rows"):
        x = gt.tensor(torch.ones(ROWS, COLS))
    error = ""
    with watch() as raised:
        try:
            torch.func.grad(lambda v: (v * x).sum())(torch.ones(ROWS, COLS))
        except NotImplementedError as exc:
            error = type(exc).__name__
    return {"rewrite": (rewrite.path, same), "raised": (raised.path, error)}


@pytest.mark.parametrize("world", [2, 3])
def test_training_step_ops_paths_and_collectives(tmp_path, world):
    results = run_ranks(_step, world, tmp_path)
    for rank, out in enumerate(results):
        checks = out.pop("checks")
        assert checks["rewrite"] == ("rewrite", True), (rank, checks)
        assert checks["raised"] == ("raised", "NotImplementedError"), (rank, checks)
        assert set(out) == set(EXPECTED)
        for name, r in out.items():
            fwd, fwd_comms, bwd, bwd_comms, quiet = EXPECTED[name]
            where = f"{name} on rank {rank}/{world}: {r}"
            assert r["value"] and r["grads"], where
            assert r["paths"] == (fwd, bwd, quiet), where
            assert r["comms"] == (fwd_comms, bwd_comms), where
