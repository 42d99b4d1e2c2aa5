"""The session: one object that owns this process's spmdgt state and resets all of it.

The state itself stays where the hot path reads it (the scope stack, the runtime, the meshes,
the signal registry, the agreement group, the interceptor and its tools, the compile pass);
each of those modules registers how to forget its part when it is imported. So
``spmdgt.session.reset()`` returns the process to what a fresh ``import spmdgt`` gives, and a
test or a forked child calls that one method instead of poking private globals.

``reset()`` runs no collective, so it is safe on one rank alone: a process group spmdgt made
is destroyed without the end-of-program agreement ``gt.shutdown()`` has, and a forked child
(which owns none of its parent's) only forgets.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Session", "session"]


class Session:
    """This process's spmdgt state, as named parts that each know how to forget themselves."""

    def __init__(self) -> None:
        self._parts: dict[str, Callable[[], None]] = {}

    def register(self, name: str, forget: Callable[[], None]) -> None:
        """Own part ``name``: ``forget()`` drops it (called by ``reset``, newest part first)."""
        self._parts[name] = forget

    def parts(self) -> list[str]:
        """The registered parts, in the order they are forgotten."""
        return list(reversed(self._parts))

    def reset(self, *parts: str) -> None:
        """Forget every part (or only ``parts``), upper layers first (the compile pass before
        the interceptor it reads, the interceptor before the runtime)."""
        unknown = set(parts) - set(self._parts)
        if unknown:
            raise ValueError(f"unknown session parts {sorted(unknown)}; known: {self.parts()}")
        for name in self.parts():
            if not parts or name in parts:
                self._parts[name]()

    def __repr__(self) -> str:
        return f"Session(parts={self.parts()})"


session = Session()
