"""The active signal scopes of this rank (a stack: nested scopes restore the outer one)."""

from __future__ import annotations

__all__ = ["current", "innermost", "pop", "push"]

# (signal name, backward signal override or None, whether a ``compile: true`` scope).
# Module-level on purpose: the op path reads ``stack`` with one truthiness test, and a rank
# runs its program on one thread.
stack: list[tuple[str, str | None, bool]] = []

# Listeners, each called with the innermost signal name (or None) after every push/pop: the
# compiled interceptor (it cannot ask Python per op) and, later, the compile pass (``compile:
# true`` scopes). Empty when nothing listens, so a scope costs one loop over an empty list.
listeners: list = []

# The compile pass's lazy regions (``spmdgt.compile.on_scope``) once a ``compile: true`` scope was
# entered or the lazy-region half was turned on: scope changes are its sync points. None until
# then. Only
# ``spmdgt.compile`` writes it (and the session's reset here).
lazy_hook = None

# The lazy regions' sync for a pending sharded result read without an op (``to_local``,
# ``redistribute``,
# ``full_tensor``, host reads: ``gt.Tensor`` calls it with the method's name): the open region
# runs and fills it. None while the lazy-region half is off.
lazy_sync = None


def push(name: str, backward: str | None = None, compiles: bool = False) -> None:
    """Enter scope ``name`` (``backward``: its gradients' signal, overriding the config's;
    ``compiles``: a ``compile: true`` scope, for the compile pass's ``lazy_hook``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a signal name must be a non-empty string, got {name!r}")
    if lazy_hook is not None:
        lazy_hook(name, True, compiles)  # before the push: the open region is the outer scope's
    stack.append((name, backward, compiles))
    for fn in listeners:
        fn(name)


def pop(name: str | None = None) -> str:
    """Leave the innermost scope; ``name``, if given, must be that scope's name."""
    if not stack:
        raise RuntimeError(f"signal.exit({name!r}) without a matching signal.enter")
    top = stack[-1][0]
    if name is not None and name != top:
        raise RuntimeError(
            f"signal.exit({name!r}) does not match the innermost scope {top!r}; "
            "scopes must be left in the reverse order they were entered"
        )
    if lazy_hook is not None:
        lazy_hook(top, False, stack[-1][2])  # the scope's region runs inside the scope
    stack.pop()
    for fn in listeners:
        fn(stack[-1][0] if stack else None)
    return top


def current() -> str | None:
    return stack[-1][0] if stack else None


def _forget() -> None:
    global lazy_hook, lazy_sync
    stack.clear()
    listeners.clear()
    lazy_hook = None
    lazy_sync = None


def innermost() -> tuple[str, str | None, bool] | None:
    """The innermost scope's ``(name, backward override, compiles)``, or None."""
    return stack[-1] if stack else None


from spmdgt._core.session import session  # noqa: E402  (below: the part's functions exist)

session.register("scopes", _forget)
