"""The state family of the scenario sweep: patterns whose result lives in some state beside
an op's outputs.

A generator's state saved and restored around a draw (``get_rng_state``/``set_rng_state``,
``fork_rng``, ``manual_seed`` again), activation checkpointing that recomputes a dropout,
modules that write their own state in place (``nn.Embedding(max_norm=)``, BatchNorm's running
statistics, spectral norm's power iteration), custom ``autograd.Function``s (saved tensors,
``mark_dirty``), hooks that change a gradient or an input, gradients accumulated over
backward calls, and tensors that share memory with numpy. Compared with one process
(``tests/parity/scenarios.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._functions import Cube, DoubleInPlace
from tests.parity.scenarios import Case, Scenario

__all__ = ["PLANTED", "SCENARIOS"]

COLS = 5


def _data(case: Case, cols: int = COLS, seed: int = 0, grad: bool = False) -> torch.Tensor:
    """A laid-out ``(case.rows(7), cols)`` tensor from a generator of its own."""
    g = torch.Generator().manual_seed(seed)
    return case.put(torch.randn(case.rows(7), cols, generator=g), requires_grad=grad)


def _weight(case: Case, rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return case.put(torch.randn(rows, cols, generator=g), requires_grad=True)


# -- generator states ----------------------------------------------------------------------


def _restore(draw):
    """Draw, restore the state saved before it, draw again: the two draws are equal."""

    def run(case: Case) -> dict:
        x = _data(case)
        state = torch.get_rng_state()
        a = draw(x)
        torch.set_rng_state(state)
        b = draw(x)
        return {"a": a, "b": b, "after": torch.rand(3)}

    return run


def _fork_rng(case: Case) -> dict:
    x = _data(case)
    with torch.random.fork_rng(devices=[]):
        a = F.dropout(x, 0.5)
    return {"a": a, "b": F.dropout(x, 0.5), "after": torch.rand(3)}


def _seed_again(case: Case) -> dict:
    x = _data(case)
    torch.manual_seed(7)
    a = torch.randn_like(x) + F.dropout(x, 0.5)
    torch.manual_seed(7)
    return {"a": a, "b": torch.randn_like(x) + F.dropout(x, 0.5)}


def _generator_restore(case: Case) -> dict:
    x = _data(case)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    a = x.clone().uniform_(0, 1, generator=g)
    g.set_state(state)
    b = x.clone().uniform_(0, 1, generator=g)
    return {"a": a, "b": b, "g": g.get_state()}


def _checkpoint_dropout(reentrant: bool):
    """A dropout recomputed by checkpointing draws the forward's mask again."""

    def run(case: Case) -> dict:
        x = _data(case, grad=True)
        w = _weight(case, COLS, 3)

        def block(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(F.dropout(x, 0.5) @ w)

        out = checkpoint(block, x, use_reentrant=reentrant)
        (out * out).sum().backward()
        return {"out": out, "x": x.grad, "w": w.grad, "after": torch.rand(3)}

    return run


# -- modules writing their own state --------------------------------------------------------


def _embedding_max_norm(sharded_weight: bool):
    def run(case: Case) -> dict:
        g = torch.Generator().manual_seed(2)
        emb = nn.Embedding(9, COLS, max_norm=1.0)
        with torch.no_grad():
            emb.weight.copy_(torch.randn(9, COLS, generator=g) * 2)
        if sharded_weight:
            emb.weight = nn.Parameter(case.put(emb.weight.detach()))
        idx = torch.tensor([[0, 3, 3], [5, 8, 0]])
        idx = idx if sharded_weight else case.put(idx)
        out = emb(idx)
        out.pow(2).sum().backward()
        return {"out": out, "weight": emb.weight, "grad": emb.weight.grad}

    return run


def _embedding_bag_max_norm(case: Case) -> dict:
    g = torch.Generator().manual_seed(2)
    bag = nn.EmbeddingBag(9, COLS, max_norm=1.0, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(torch.randn(9, COLS, generator=g) * 2)
    bag.weight = nn.Parameter(case.put(bag.weight.detach()))
    out = bag(torch.tensor([[0, 3, 3], [5, 8, 0]]))
    out.pow(2).sum().backward()
    return {"out": out, "weight": bag.weight, "grad": bag.weight.grad}


def _batchnorm(case: Case) -> dict:
    bn = nn.BatchNorm1d(COLS, momentum=0.3)
    outs = [bn(_data(case, seed=s, grad=True)) for s in range(3)]
    sum(o.pow(3).sum() for o in outs).backward()
    bn.eval()
    return {
        "outs": outs,
        "eval": bn(_data(case, seed=9)),
        "mean": bn.running_mean,
        "var": bn.running_var,
        "n": bn.num_batches_tracked,
        "gw": bn.weight.grad,
    }


def _instance_norm(case: Case) -> dict:
    """Running statistics of an instance norm: averaged over the batch's instances."""
    norm = nn.InstanceNorm1d(COLS, momentum=0.3, track_running_stats=True, affine=True)
    outs = [norm(_data(case, 4 * COLS, seed=s, grad=True).view(-1, COLS, 4)) for s in range(2)]
    sum(o.pow(3).sum() for o in outs).backward()
    norm.eval()
    return {
        "outs": outs,
        "eval": norm(_data(case, 4 * COLS, seed=9).view(-1, COLS, 4)),
        "mean": norm.running_mean,
        "var": norm.running_var,
        "gw": norm.weight.grad,
    }


def _spectral_norm(case: Case) -> dict:
    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(COLS, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, COLS, generator=g))
    torch.manual_seed(0)  # spectral norm draws u and v at registration
    lin = nn.utils.parametrizations.spectral_norm(lin)
    x = _data(case)
    outs = [lin(x) for _ in range(2)]
    sum(o.sum() for o in outs).backward()
    p = lin.parametrizations.weight
    return {"outs": outs, "u": p[0]._u, "v": p[0]._v, "g": p.original.grad}


def _buffer_writes(case: Case) -> dict:
    """A module's own plain buffers updated in its forward from a sharded batch: an EMA
    (``mul_`` then ``add_``), ``copy_``, a slice assignment, ``out=``, ``torch.lerp_``."""
    x = _data(case, grad=True)
    ema, last, total, out, lerp = (torch.zeros(COLS) for _ in range(5))
    with torch.no_grad():
        for _ in range(2):
            ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        last.copy_(x[-1])
        total[1:] = x.sum(0)[1:]
        torch.add(out, x.amax(0), out=out)
        lerp.lerp_(x.amin(0), 0.25)
    loss = (x * ema).sum()
    loss.backward()
    return {"ema": ema, "last": last, "total": total, "out": out, "lerp": lerp, "x": x.grad}


# -- autograd.Function, hooks, accumulation --------------------------------------------------


def _function(case: Case) -> dict:
    x = _data(case, grad=True)
    y = Cube.apply(x * 1.5)
    z = DoubleInPlace.apply(y.clone())
    (z * torch.arange(COLS)).sum().backward()
    return {"y": y, "z": z, "x": x.grad}


def _tensor_hooks(case: Case) -> dict:
    x = _data(case, grad=True)
    w = _weight(case, COLS, 3)
    h = x * 2
    h.register_hook(lambda g: g * torch.arange(COLS))
    w.register_hook(lambda g: g.clamp(-1, 1))
    (torch.tanh(h @ w) ** 2).sum().backward()
    return {"x": x.grad, "w": w.grad}


def _module_hooks(case: Case) -> dict:
    lin = nn.Linear(COLS, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, COLS, generator=torch.Generator().manual_seed(5)))
        lin.bias.zero_()
    seen = []
    lin.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    lin.register_forward_hook(lambda m, args, out: out + 1)
    lin.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].sum().item()))
    x = _data(case, grad=True)
    out = lin(x)
    (out**2).sum().backward()
    return {"out": out, "x": x.grad, "w": lin.weight.grad, "seen": seen}


def _accumulate(case: Case) -> dict:
    w = _weight(case, COLS, 3)
    x = _data(case)
    (x @ w).sum().backward()
    first = w.grad.clone()
    (x @ w).pow(2).sum().backward()
    second = w.grad.clone()
    w.grad = None
    (x @ w).pow(3).sum().backward()
    return {"first": first, "second": second, "third": w.grad}


def _optimizer_in_backward(case: Case) -> dict:
    """Each parameter stepped by its own SGD in a post-accumulate-grad hook (the
    optimizer-in-backward pattern), its gradient dropped after."""
    w1, w2 = _weight(case, COLS, 4, seed=1), _weight(case, 4, 3, seed=2)
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in (w1, w2)}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in (w1, w2):
        p.register_post_accumulate_grad_hook(step)
    x = _data(case)
    for _ in range(2):
        (torch.tanh(x @ w1) @ w2).pow(2).sum().backward()
    return {"w1": w1, "w2": w2, "grads": [w1.grad, w2.grad]}


def _saved_on_cpu(case: Case) -> dict:
    """Saved activations through pack/unpack hooks (``save_on_cpu``, and a hook that
    scales and unscales what it saves)."""
    x, w = _data(case, grad=True), _weight(case, COLS, 3)
    with torch.autograd.graph.save_on_cpu():
        a = torch.tanh(x @ w)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t / 2):
        b = (a * a).sin()
    b.sum().backward()
    return {"b": b, "x": x.grad, "w": w.grad}


def _weight_norm(case: Case) -> dict:
    lin = nn.Linear(COLS, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, COLS, generator=torch.Generator().manual_seed(6)))
    lin = nn.utils.parametrizations.weight_norm(lin)
    out = lin(_data(case))
    out.pow(2).sum().backward()
    p = lin.parametrizations.weight
    return {"out": out, "g": p.original0.grad, "v": p.original1.grad}


def _autocast(case: Case) -> dict:
    """CPU autocast to bfloat16 around a sharded matmul and a loss (tolerance: bf16's)."""
    x, w = _data(case, grad=True), _weight(case, COLS, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        loss = F.mse_loss(h.float(), torch.ones_like(h, dtype=torch.float32))
    loss.backward()
    return {"h": h, "dtype": str(h.dtype), "x": x.grad, "w": w.grad}


def _inference_tensor(case: Case) -> dict:
    """A value made under ``inference_mode`` saved for backward: torch's own error."""
    w = _weight(case, COLS, 3)
    with torch.inference_mode():
        x = _data(case) * 2
    (x @ w).sum().backward()
    return {"w": w.grad}


def _save_load(case: Case) -> dict:
    """``torch.save`` then ``torch.load`` of a sharded tensor (and a dict holding it) in
    memory, then used: the same values, and a write into the loaded copy leaves the original."""
    import io

    x = _data(case)
    buf = io.BytesIO()
    torch.save({"x": x, "n": 3}, buf)
    buf.seek(0)
    got = torch.load(buf, weights_only=False)
    y = got["x"]
    y.mul_(2)
    return {"x": x, "y": y, "sum": (y + x).sum(), "n": got["n"]}


def _deepcopy(case: Case) -> dict:
    """``copy.deepcopy`` of a sharded tensor and of a module holding a sharded parameter,
    then each trained one step apart from the original."""
    import copy

    w = _weight(case, COLS, 3)
    lin = nn.Linear(COLS, 3, bias=False)
    lin.weight = nn.Parameter(case.put(torch.randn(3, COLS, generator=torch.Generator())))
    twin, w2 = copy.deepcopy(lin), copy.deepcopy(w)
    x = _data(case)
    (twin(x).sum() + (x @ w2).sum()).backward()
    with torch.no_grad():
        twin.weight.sub_(0.1 * twin.weight.grad)
    return {"w": w, "w2": w2, "g": w2.grad, "orig": lin.weight, "twin": twin.weight}


def _state_dicts(case: Case) -> dict:
    """A plain state dict loaded into a module whose weight is sharded, and the sharded
    module's state dict loaded into a plain module; then ``double()``."""
    g = torch.Generator().manual_seed(8)
    plain = nn.Linear(COLS, 3)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(3, COLS, generator=g))
    sharded = nn.Linear(COLS, 3)
    sharded.weight = nn.Parameter(case.put(torch.zeros(3, COLS)))
    sharded.load_state_dict(plain.state_dict())
    with torch.no_grad():
        sharded.weight.mul_(3)
    back = nn.Linear(COLS, 3)
    back.load_state_dict({k: case.value(v) for k, v in sharded.state_dict().items()})
    sharded.double()
    x = _data(case).double()
    return {"w": sharded.weight, "dtype": str(sharded.weight.dtype), "back": back.weight,
            "out": sharded(x), "plain": plain.weight}  # fmt: skip


def _flat_params(case: Case) -> dict:
    """``parameters_to_vector`` of plain and sharded parameters, a step on the flat vector,
    ``vector_to_parameters`` back (it assigns each parameter's ``.data``)."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    w, lin = _weight(case, COLS, 3), nn.Linear(3, 2)
    params = [w, *lin.parameters()]
    (lin(torch.tanh(_data(case) @ w)) ** 2).sum().backward()
    flat = parameters_to_vector(params)
    grads = parameters_to_vector([p.grad for p in params])
    vector_to_parameters(flat - 0.1 * grads, params)
    return {"flat": flat, "w": w, "lin": lin.weight, "after": parameters_to_vector(params)}


def _grad_scaler(case: Case) -> dict:
    """``torch.amp.GradScaler`` on the CPU: a step whose gradient holds an inf is skipped and
    the scale backs off; a finite one steps (``_amp_foreach_non_finite_check_and_unscale_``
    writes ``found_inf``, an argument beside its gradients)."""
    w = _weight(case, COLS, 3)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    x = _data(case)
    seen = []
    for poison in (True, False):
        opt.zero_grad()
        loss = (x @ w).sum() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        seen.append((scaler.get_scale(), case.value(w).clone()))
    return {"seen": seen}


def _prune(case: Case) -> dict:
    """``nn.utils.prune.l1_unstructured`` on a sharded weight (the mask from the smallest
    magnitudes of the whole weight), trained one step through the mask, then made permanent."""
    from torch.nn.utils import prune

    lin = nn.Linear(COLS, 7, bias=False)
    lin.weight = nn.Parameter(_data(case, seed=5))
    prune.l1_unstructured(lin, "weight", amount=0.4)
    out = lin(_data(case, seed=6))
    out.pow(2).sum().backward()
    grad = lin.weight_orig.grad
    prune.remove(lin, "weight")
    return {"out": out, "grad": grad, "weight": lin.weight}


def _swa(case: Case) -> dict:
    """``torch.optim.swa_utils.AveragedModel`` over a module with a sharded weight: its
    running average after three updates, and ``update_bn`` of a BatchNorm on sharded data."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    net = nn.Sequential(nn.Linear(COLS, 4), nn.BatchNorm1d(4))
    net[0].weight = nn.Parameter(case.put(torch.randn(4, COLS, generator=torch.Generator())))
    avg = AveragedModel(net)
    for step in range(3):
        with torch.no_grad():
            net[0].weight.mul_(0.5).add_(step)
        avg.update_parameters(net)
    update_bn([_data(case, seed=s) for s in range(2)], avg)
    bn = avg.module[1]
    return {"w": avg.module[0].weight, "n": avg.n_averaged, "mean": bn.running_mean,
            "var": bn.running_var}  # fmt: skip


# -- numpy sharing memory -------------------------------------------------------------------


def _numpy_write(case: Case) -> dict:
    """torch's array shares the tensor's memory; a sharded value's is a read-only copy, so
    the write raises on every rank (``gt.Tensor.numpy``)."""
    x = _data(case)
    x.numpy()[0, 0] = 100.0
    return {"x": x}


SCENARIOS: list[Scenario] = [
    Scenario("state.rng.restore.randn_like", _restore(torch.randn_like)),
    Scenario("state.rng.restore.dropout", _restore(lambda x: F.dropout(x, 0.5))),
    Scenario("state.rng.restore.uniform_", _restore(lambda x: x.clone().uniform_())),
    Scenario("state.rng.fork_rng", _fork_rng),
    Scenario("state.rng.manual_seed_again", _seed_again),
    Scenario("state.rng.generator_restore", _generator_restore),
    Scenario("state.checkpoint.dropout.reentrant", _checkpoint_dropout(True)),
    Scenario("state.checkpoint.dropout.non_reentrant", _checkpoint_dropout(False)),
    Scenario("state.embedding.max_norm.sharded_weight", _embedding_max_norm(True)),
    Scenario("state.embedding.max_norm.sharded_ids", _embedding_max_norm(False)),
    Scenario("state.embedding_bag.max_norm", _embedding_bag_max_norm),
    Scenario("state.batchnorm.running_stats", _batchnorm),
    Scenario("state.instance_norm.running_stats", _instance_norm),
    Scenario("state.spectral_norm", _spectral_norm),
    Scenario("state.buffer_writes", _buffer_writes),
    Scenario("state.function.saved_and_dirty", _function),
    Scenario("state.hooks.tensor", _tensor_hooks),
    Scenario("state.hooks.module", _module_hooks),
    Scenario("state.grad.accumulate", _accumulate),
    Scenario("state.optimizer_in_backward", _optimizer_in_backward),
    Scenario("state.saved_tensors_hooks", _saved_on_cpu),
    Scenario("state.weight_norm", _weight_norm),
    Scenario("state.autocast.cpu_bf16", _autocast, atol=2e-2, rtol=2e-2),
    Scenario("state.inference_mode", _inference_tensor),
    Scenario("state.save_load", _save_load),
    Scenario("state.deepcopy", _deepcopy),
    Scenario("state.state_dicts", _state_dicts),
    Scenario("state.flat_params", _flat_params),
    Scenario("state.grad_scaler", _grad_scaler),
    Scenario("state.prune.l1_unstructured", _prune),
    Scenario("state.swa.averaged_model", _swa),
    Scenario("state.numpy.write", _numpy_write),
]


def _planted_stale_stats(case: Case) -> dict:
    """Right outputs, but the running statistics left where they were on sharded inputs, as
    DTensor's rule for a feature-sharded input leaves them: ``differs``."""
    out = _batchnorm(case)
    if case.layout is not None:
        out["mean"] = torch.zeros_like(out["mean"])
    return out


PLANTED: list[Scenario] = [
    Scenario("state.planted.stale_running_stats", _planted_stale_stats, layouts=("shard1",))
]
