"""Hugging Face heads that compute their own token cross-entropy (T5's conditional
generation, BERT's masked-LM and token-classification heads, BART, RoBERTa, ...): the trainer
recomputes their loss from the output's logits as the step's global token mean.

Such a head's forward builds ``CrossEntropyLoss()`` itself and takes no
``num_items_in_batch``, so its loss is the mean over its own micro-batch's label tokens, and
data-parallel ranks or accumulated micro-batches with different ``-100`` padding would average
means of different weights. The trainer has the labels and the logits: it takes the sum of
the per-token cross-entropy of ``logits`` against ``labels`` (``ignore_index=-100``) and divides
it by the step's label tokens over every data-parallel rank and micro-batch
(``_batches.step_label_tokens``), which is what one process's head computes on the global batch.

Which forwards qualify is read from the class's code (:func:`computes_token_ce`): exactly one
``CrossEntropyLoss()`` (no weight, reduction or smoothing; ``ignore_index`` only -100), called
once as ``loss_fct(L.view(-1, ...), labels.view(-1))`` on the unshifted ``labels`` argument,
with ``L`` the output's ``logits=`` and the call's result its ``loss=``. A shifted, weighted
or combined loss (``BertForPreTraining``'s two terms, sequence classification's three losses)
does not match and keeps its own mean. The first counted micro-step then checks, on every
rank, that the model's own loss equals the recomputation's local mean
(:func:`check_token_ce`), so a forward that reads right but computes otherwise is refused
rather than trained on a different loss.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmdgt.config import ConfigError

__all__ = ["RULE", "check_token_ce", "computes_token_ce", "token_ce_sum"]

RULE = "logits"  # _batches.loss_token_rule's name for these heads: labels != -100, recomputed
IGNORE = -100


def computes_token_ce(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model whose forward computes its loss as
    ``CrossEntropyLoss()`` of its output's logits against the unshifted ``labels``: a token
    mean the trainer can recompute as the global one. Read from the class's source (the same
    on every rank; no source: not recognised); ``transformers`` is read only when the model's
    code already imported it."""
    hf = sys.modules.get("transformers")
    base = getattr(hf, "PreTrainedModel", None)
    if base is None or not isinstance(model, base):
        return False
    try:
        src = inspect.getsource(inspect.unwrap(type(model).forward))
        tree = ast.parse(textwrap.dedent(src))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0] if tree.body else None
    return isinstance(fn, ast.FunctionDef) and _is_token_ce(fn)


def _is_token_ce(fn: ast.FunctionDef) -> bool:
    """The forward's AST matches the one pattern (module docstring); strict on purpose: a
    form not matched keeps the model's own mean, a form wrongly matched would train on the
    wrong loss (the first step's check is the second guard)."""
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    if "labels" not in {a.arg for a in args}:
        return False
    assigned = _assignments(fn)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    ce = [c for c in calls if _callee(c.func) == "CrossEntropyLoss"]
    if len(ce) != 1 or ce[0].args:
        return False
    if any(k.arg != "ignore_index" or not _const(k.value, IGNORE) for k in ce[0].keywords):
        return False
    fct = [name for name, values in assigned.items() if any(v is ce[0] for v in values)]
    if len(fct) != 1 or len(assigned[fct[0]]) != 1:
        return False
    uses = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == fct[0]]
    if len(uses) != 1 or uses[0].keywords or len(uses[0].args) != 2:
        return False
    logits = _flattened(uses[0].args[0], keep_last=True)
    if logits is None or _flattened(uses[0].args[1], keep_last=False) != "labels":
        return False
    # labels as given (a device move aside: T5 moves them to the logits' device); the logits
    # bound once, so the loss's logits are the output's
    if not all(_is_move(v, "labels") for v in assigned.get("labels", [])):
        return False
    if _mutated(fn, "labels"):
        return False
    if len(assigned.get(logits, [])) != 1:
        return False
    loss = [name for name, values in assigned.items() if any(v is uses[0] for v in values)]
    if len(loss) != 1 or not all(v is uses[0] or _const(v, None) for v in assigned[loss[0]]):
        return False
    return any(_returns(r, loss[0], logits) for r in ast.walk(fn) if isinstance(r, ast.Return))


def _assignments(fn: ast.FunctionDef) -> dict[str, list[ast.expr | None]]:
    """Every value each local name is bound to (``None``: bound some other way: augmented,
    unpacked, a loop or ``with`` target, a walrus)."""
    out: dict[str, list[ast.expr | None]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                _bind(out, t, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            _bind(out, node.target, node.value if isinstance(node, ast.AnnAssign) else None)
        elif isinstance(node, (ast.For, ast.comprehension)):
            _bind(out, node.target, None)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            _bind(out, node.optional_vars, None)
        elif isinstance(node, ast.NamedExpr):
            _bind(out, node.target, None)
    return out


def _bind(out: dict, target: ast.expr, value: ast.expr | None) -> None:
    if isinstance(target, ast.Name):
        out.setdefault(target.id, []).append(value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            _bind(out, t, None)
    elif isinstance(target, ast.Starred):
        _bind(out, target.value, None)


def _mutated(fn: ast.FunctionDef, name: str) -> bool:
    """``name`` changed in place (``labels[mask] = -100``, ``labels.masked_fill_(...)``): the
    model's loss would not read the labels the trainer counted before the forward."""
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            while isinstance(t, (ast.Subscript, ast.Attribute)):
                t = t.value
                if isinstance(t, ast.Name) and t.id == name:
                    return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            inplace = f.attr.endswith("_") and not f.attr.startswith("_")
            if inplace and isinstance(f.value, ast.Name) and f.value.id == name:
                return True
    return False


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _const(node: ast.expr | None, value: int | None) -> bool:
    """``node`` is the literal ``value`` (``None``, or an int such as ``-1``, ``-100``)."""
    if value is not None and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _const(node.operand, -value)
    if not isinstance(node, ast.Constant):
        return False
    if value is None:
        return node.value is None
    return type(node.value) is int and node.value == value


def _flattened(node: ast.expr, *, keep_last: bool) -> str | None:
    """``X`` of ``X.view(-1, d)`` (``keep_last``) or ``X.view(-1)``, ``reshape`` alike."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr not in ("view", "reshape") or node.keywords:
        return None
    if not isinstance(node.func.value, ast.Name) or not node.args:
        return None
    if not _const(node.args[0], -1) or len(node.args) != (2 if keep_last else 1):
        return None
    return node.func.value.id


def _is_move(node: ast.expr | None, name: str) -> bool:
    """``name.to(...)``: the same values on another device."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "to"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == name
    )


def _returns(ret: ast.Return, loss: str, logits: str) -> bool:
    """``return SomeOutput(loss=<loss>, logits=<logits>, ...)``."""
    if not isinstance(ret.value, ast.Call):
        return False
    kw = {k.arg: k.value for k in ret.value.keywords}
    return all(
        isinstance(kw.get(key), ast.Name) and kw[key].id == name
        for key, name in (("loss", loss), ("logits", logits))
    )


def _field(out: object, name: str) -> object:
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def token_ce_sum(out: object, labels: torch.Tensor, model: str) -> torch.Tensor:
    """The summed cross-entropy of the output's ``logits`` against ``labels`` over the
    non-ignored tokens, in fp32 (as HF's counted losses upcast; the same value as the head's
    own loss times its count for fp32 logits). Tensor-parallel logits are gathered first."""
    logits = _field(out, "logits")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"{model}'s loss is recomputed from its output's logits as the step's global "
            f"token mean, but it returned {type(out).__name__} without logits; return a "
            "ModelOutput (return_dict=True), or pass loss_fn=..."
        )
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    flat = logits.reshape(-1, logits.size(-1)).float()
    return F.cross_entropy(
        flat, labels.reshape(-1).to(flat.device), ignore_index=IGNORE, reduction="sum"
    )


def check_token_ce(
    own: torch.Tensor,
    total: torch.Tensor,
    labels: torch.Tensor,
    *,
    model: str,
    world_size: int,
    comm_device: torch.device,
) -> None:
    """Refuse, on every rank alike, a model whose own loss is not the recomputation's
    local mean (``total`` over this micro-batch's label tokens): its forward matched the
    pattern but computes something else. Collective over the world when it is larger than
    one (one all-reduce of one number, on the first counted micro-step only). A micro-batch
    without label tokens (the head's mean is 0/0) checks nothing."""
    if hasattr(own, "full_tensor"):
        own = own.full_tensor()
    count = (labels != IGNORE).sum()
    mine = total.detach() / count.clamp(min=1)
    # the head's CE runs in the logits' dtype; the recomputation in fp32
    tol = 1e-4 if own.dtype == torch.float32 else 2e-2
    own = own.detach().float()
    gap = torch.where(count > 0, (own - mine).abs() / mine.abs().clamp(min=1.0), 0.0)
    gap = torch.nan_to_num(gap, nan=float("inf")).reshape(1).to(comm_device)
    if world_size > 1:
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(gap):  # a dry run: the collective is counted, there is nothing to read
        return
    if gap.item() > tol:
        raise ConfigError(
            f"{model}'s forward reads as a token cross-entropy of its logits against labels "
            "(ignore_index -100), which the trainer recomputes as the step's global token "
            f"mean, but its own loss differs from that by {gap.item():.3g} (relative); pass "
            "loss_fn=... with the loss it computes, or set "
            f"{model}.accepts_loss_kwargs = False to keep its own per-micro-batch mean"
        )
