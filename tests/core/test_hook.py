"""The one place spmdgt reaches into DTensor (``spmdgt/tensor/_hook.py``): it goes in and out
through one function each, and a torch whose private entry point moved is named at import,
with its version, instead of breaking somewhere else."""

from __future__ import annotations

import re

import pytest
from torch.distributed.tensor import DTensor

import spmdgt.tensor._tensor  # noqa: F401  (installs the hook, as gt.Tensor's first use does)
from spmdgt.tensor import _hook

_ENTRY = "_propagate_op_sharding_dispatch_slow_path"


def test_install_and_uninstall_round_trip():
    dispatcher = DTensor._op_dispatcher
    assert _hook.installed() and _ENTRY in vars(dispatcher)  # ours, on the instance
    try:
        _hook.uninstall()
        assert not _hook.installed() and _ENTRY not in vars(dispatcher)  # torch's own again
        _hook.install()
        _hook.install()  # once only
        assert _hook.installed() and _ENTRY in vars(dispatcher)
    finally:
        _hook.install()


def test_a_moved_entry_point_is_named_with_torch_version(monkeypatch):
    import torch

    cls = type(DTensor._op_dispatcher)
    monkeypatch.delattr(cls, _ENTRY)
    version = re.escape(torch.__version__)
    with pytest.raises(ImportError, match=rf"{_ENTRY}\(op_call.*torch {version} has no such"):
        _hook.check_torch()


def test_a_changed_signature_is_named(monkeypatch):
    cls = type(DTensor._op_dispatcher)
    monkeypatch.setattr(cls, _ENTRY, lambda self, op_call, args, kwargs: None)
    with pytest.raises(ImportError, match=r"has \(op_call, args, kwargs\)"):
        _hook.check_torch()
