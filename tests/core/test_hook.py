"""The one place spmdgt reaches into DTensor (``spmdgt/tensor/_hook.py``): it goes in and out
through one function each, and a torch whose private entry point moved is named at import,
with its version, instead of breaking somewhere else."""

from __future__ import annotations

import re

import pytest

from tests._dist import run_ranks

_ENTRY = "_propagate_op_sharding_dispatch_slow_path"


def _round_trip(rank, world):
    from torch.distributed.tensor import DTensor

    import spmdgt.tensor._tensor  # noqa: F401  (installs the hook, as gt.Tensor's first use)
    from spmdgt.tensor import _hook

    dispatcher = DTensor._op_dispatcher
    seen = [_hook.installed() and _ENTRY in vars(dispatcher)]  # ours, on the instance
    _hook.uninstall()
    seen.append(not _hook.installed() and _ENTRY not in vars(dispatcher))  # torch's own again
    _hook.install()
    _hook.install()  # once only
    seen.append(_hook.installed() and _ENTRY in vars(dispatcher))
    return seen


def test_install_and_uninstall_round_trip(tmp_path):
    # in a forked rank: a hook put back in this process would differ from the one dynamo's
    # caches saw in earlier tests (a later compiled test then lost a gradient)
    assert run_ranks(_round_trip, 1, tmp_path) == [[True, True, True]]


def _hook_and_dispatcher_class():
    # imported here, not at collection: gt.Tensor's module loaded in the test process before
    # the hot-function tests ran made a later forked torch.compile test lose a gradient
    from torch.distributed.tensor import DTensor

    from spmdgt.tensor import _hook

    return _hook, type(DTensor._op_dispatcher)


def test_a_moved_entry_point_is_named_with_torch_version(monkeypatch):
    import torch

    _hook, cls = _hook_and_dispatcher_class()
    monkeypatch.delattr(cls, _ENTRY)
    version = re.escape(torch.__version__)
    with pytest.raises(ImportError, match=rf"{_ENTRY}\(op_call.*torch {version} has no such"):
        _hook.check_torch()


def test_a_changed_signature_is_named(monkeypatch):
    _hook, cls = _hook_and_dispatcher_class()
    monkeypatch.setattr(cls, _ENTRY, lambda self, op_call, args, kwargs: None)
    with pytest.raises(ImportError, match=r"has \(op_call, args, kwargs\)"):
        _hook.check_torch()
