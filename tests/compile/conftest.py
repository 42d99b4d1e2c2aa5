"""Fixtures shared by the compile pass's tests."""

from __future__ import annotations

import pytest

import spmdgt
import spmdgt.compile as gt_compile


@pytest.fixture
def regions():
    """Yields ``enable(batch=1000, backend="aot_eager")``; turns lazy regions off afterwards."""

    def enable(batch=1000, backend="aot_eager"):
        assert gt_compile.enable_regions(batch=batch, backend=backend)

    try:
        yield enable
    finally:
        spmdgt.session.reset("compile")  # off, and compile: true scopes may turn it on again
