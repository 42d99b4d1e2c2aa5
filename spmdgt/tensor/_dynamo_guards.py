"""Dynamo's guard on a DTensor input, made exact: it compares the global shape (torch 2.13).

Dynamo guards a DTensor input by its local tensor (shape, stride, dtype...) and by its spec
*without its shape* (``guards.check_dtensor_spec``: ``skip_shapes=True``), trusting the local
guard for sizes. The global shape is not determined by one rank's local shape: rows 5 and 6
over 2 ranks are 3+2 and 3+3, so rank 0's graph for 5 rows passes its guards for 6 rows and
returns a result of global shape 5, while rank 1 recompiles. Plain ``torch.compile`` of
``x.amax(1)`` on a ``Shard(0)`` DTensor shows it; on ``gt.Tensor``s the next host read then
raises a ``RankDivergenceError`` in a correct program (``tests/compile/test_hot_shapes_dist.py``
for the compile pass, ``tests/compile/test_user_compile_shapes_dist.py`` for your own
``torch.compile``).

So the guard compares the global shape too, whoever holds it on (``hold``): the compile pass
while its hot functions are on, and spmdgt's meshes from the first one over more than one rank
(a ``torch.compile`` of yours over ``gt.Tensor``s gets it). The guard is replaced in
``torch._dynamo.guards``, where guards read it by name when they run; and because importing
dynamo costs seconds, a holder that comes before dynamo is loaded waits for its import
(``_AfterImport``) instead of importing it. Put back when the last holder lets go.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["hold", "let_go"]

_MODULE = "torch._dynamo.guards"
_holders: set[str] = set()
_saved: Any = None  # torch's own guard function while ours is in
_watching = False  # an import hook waits for dynamo's guards module


def _check_dtensor_spec(value: Any, metadata: Any) -> bool:
    return value._check_equals(metadata)  # mesh, placements, order, and the global shape


def hold(holder: str) -> None:
    """``holder`` needs the exact guard: in from now on (or from dynamo's import)."""
    if holder not in _holders:
        _holders.add(holder)
        _apply()


def let_go(holder: str) -> None:
    """``holder`` no longer needs it: torch's guard is put back when no holder is left."""
    if holder in _holders:
        _holders.discard(holder)
        _apply()


def _apply() -> None:
    global _saved
    guards = sys.modules.get(_MODULE)
    if guards is None or not hasattr(guards, "check_dtensor_spec"):
        if _holders:
            _watch()
        return
    if _holders and _saved is None:
        _saved = guards.check_dtensor_spec
        guards.check_dtensor_spec = _check_dtensor_spec
    elif not _holders and _saved is not None:
        guards.check_dtensor_spec = _saved
        _saved = None


def _watch() -> None:
    global _watching
    if not _watching:
        _watching = True
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds dynamo's guards module with the other finders, and applies the guard once that
    module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._real.create_module(spec)

    def exec_module(self, module: Any) -> None:
        global _watching
        self._real.exec_module(module)
        _watching = False
        _apply()
