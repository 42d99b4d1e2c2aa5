"""A pytest plugin for the runs of ``test_modes.py``: ``--world-only N`` keeps, of the tests
collected from whole files, only the cases parametrized on ``world`` N (and those with no
``world``); a test named by its node id on the command line is kept whatever its world.
So one mode's run takes every check of a file at one world size, the other size in another
(``slow``) run, without listing the cases by hand."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--world-only", type=int, default=None, help="keep world=N cases only")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    world = config.getoption("--world-only")
    if world is None:
        return
    named = {str(arg) for arg in config.args}
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        off = "world" in params and params["world"] != world and item.nodeid not in named
        (drop if off else keep).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
