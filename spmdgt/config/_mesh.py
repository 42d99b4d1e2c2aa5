"""The config's one named device mesh: ``mesh: {dp: 2, tp: 2}`` at the top of a signal YAML.

``mesh`` is a reserved top-level key (no signal can be called ``mesh``). Its body maps mesh dim
names to sizes, row-major (the last dim's ranks are adjacent: ``tp`` inside a node); one size
may be ``-1``, meaning the rest of the world. Signals place tensors on it with ``over``::

    mesh: {dp: 2, tp: 2}
    rows: {shard: {axis: 0, over: dp}}                 # (Shard(0), Replicate())
    grid: {shard: {axis: [0, 1], over: [dp, tp]}}      # (Shard(0), Shard(1))
    flat: {shard: {axis: 0, over: [dp, tp]}}           # (Shard(0), Shard(0))

What can be checked from the text alone is checked at load (sizes, names, the dims a signal
names); that the sizes multiply to the world size is checked once the world is known: at load
when the process already runs distributed, else at the first placement on the mesh -- the
same file and the same world on every rank, so the same error on every rank. A world of one
ignores the mesh, as it ignores every placement: ``python prog.py`` runs the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from spmdgt.config._errors import ConfigError

__all__ = ["MESH_KEY", "MeshConfig", "parse_mesh"]

MESH_KEY = "mesh"
"""The reserved top-level key of a signal YAML that declares the device mesh."""

_SIGNAL_KEYS = {"shard", "backward", "compile"}


@dataclass(slots=True)
class MeshConfig:
    """The config's device mesh: dim name -> size, in row-major order."""

    dims: dict[str, int]
    """Mesh dim names and sizes, outermost first; one size may be -1 (the rest of the world)."""
    file: str | None = field(default=None, compare=False)
    """The YAML file it came from (None when registered from Python), for errors."""
    line: int | None = field(default=None, compare=False)
    """The line of the ``mesh:`` key, for errors found once the world is known."""

    def __post_init__(self) -> None:
        where = {"file": self.file, "line": self.line}
        if not isinstance(self.dims, Mapping) or not self.dims:
            raise ConfigError(
                f"mesh must map dim names to sizes, e.g. mesh: {{dp: 2, tp: 2}}; got {self.dims!r}",
                key=MESH_KEY,
                value=self.dims,
                **where,
            )
        for name, size in self.dims.items():
            key = f"{MESH_KEY}.{name}"
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(
                    f"mesh dim names must be identifiers (dp, tp), got {name!r}",
                    key=key,
                    value=name,
                    **where,
                )
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise ConfigError(
                    f"mesh dim {name!r} must have a positive int size (or -1 for the rest of "
                    f"the world), got {size!r}",
                    key=key,
                    value=size,
                    **where,
                )
        rest = [n for n, s in self.dims.items() if s == -1]
        if len(rest) > 1:
            raise ConfigError(
                f"only one mesh dim may be -1 (the rest of the world), got {rest}",
                key=f"{MESH_KEY}.{rest[1]}",
                value=-1,
                **where,
            )
        self.dims = dict(self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        """The dim names, outermost first."""
        return tuple(self.dims)

    def describe(self) -> str:
        """``dp=2, tp=2``: the mesh as written (the same text on every rank that loaded it)."""
        return ", ".join(f"{n}={s}" for n, s in self.dims.items())

    def sizes(self, world: int) -> tuple[tuple[str, int], ...]:
        """The (name, size) pairs for a world of ``world`` ranks, -1 resolved; a
        ``ConfigError`` naming file, line and key when they do not multiply to ``world``."""
        known = math.prod(s for s in self.dims.values() if s != -1)
        rest = [n for n, s in self.dims.items() if s == -1]
        if rest and world % known == 0:
            return tuple((n, world // known if s == -1 else s) for n, s in self.dims.items())
        if not rest and known == world:
            return tuple(self.dims.items())
        product = " x ".join(f"{n}={s}" for n, s in self.dims.items() if s != -1)
        what = (
            f"the sizes {product} (= {known}) leave no whole size for {rest[0]!r}"
            if rest
            else f"the sizes {product} multiply to {known}"
        )
        raise ConfigError(
            f"mesh {{{self.describe()}}}: {what}, but the world has {world} rank(s); make the "
            f"sizes multiply to {world} (or give one dim -1, the rest)",
            file=self.file,
            line=self.line,
            key=MESH_KEY,
            value=dict(self.dims),
        )

    def index(self, name: str) -> int:
        """The position of dim ``name`` in the mesh."""
        return self.names.index(name)


def parse_mesh(data: Mapping, file: str | None = None) -> MeshConfig | None:
    """The ``mesh:`` entry of a loaded signal YAML as a ``MeshConfig`` (None when absent)."""
    from spmdgt.config._yaml import line_of

    if MESH_KEY not in data:
        return None
    body = data[MESH_KEY]
    line = line_of(data, MESH_KEY)
    if isinstance(body, Mapping) and body and set(body) <= _SIGNAL_KEYS:
        raise ConfigError(
            f"{MESH_KEY!r} is reserved for the config's device mesh (dim name -> size, e.g. "
            f"mesh: {{dp: 2, tp: 2}}); a signal cannot be named {MESH_KEY!r}: rename it",
            file=file,
            line=line,
            key=MESH_KEY,
            value=body,
        )
    if isinstance(body, Mapping):
        for name in body:  # the line of the offending dim, where the YAML gave one
            try:
                MeshConfig({name: body[name]})
            except ConfigError:
                line = line_of(body, str(name)) or line
                break
    return MeshConfig(body, file=file, line=line)
