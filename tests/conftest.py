"""Suite-wide: every test outside ``tests/gpu`` is a CPU test (CI has no GPU). On a machine
with a GPU they stay on the CPU (``GT_DEVICE=cpu``), so they check there what they check in
CI; ``tests/gpu`` runs on the GPU and is skipped where there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

_GPU_TESTS = Path(__file__).parent / "gpu"


@pytest.fixture(autouse=True)
def _cpu_unless_a_gpu_test(request, monkeypatch):
    if _GPU_TESTS in Path(str(request.node.fspath)).parents:
        yield
        return
    import spmdgt.runtime._state as state

    monkeypatch.setenv("GT_DEVICE", "cpu")
    if state._runtime is not None and state._runtime.device.type != "cpu":
        state.shutdown()  # a GPU test ran first in this process
    yield


def pytest_collection_modifyitems(config, items):
    # GPU tests last: once this process has run backward on CUDA, the autograd engine's device
    # threads exist and forked ranks (tests/_dist.py) can no longer run backward.
    items.sort(key=lambda item: _GPU_TESTS in Path(str(item.fspath)).parents)
