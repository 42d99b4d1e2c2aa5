"""The compile pass: unchanged eager code runs compiled where it pays.

Hot functions (``GT_AUTO_COMPILE=1`` or ``spmdgt.compile.enable()``): the interceptor
samples which user function issues the ops (by op count, so every rank decides at the same
op; a module's ``forward`` is user code even in site-packages, and a hot one stands for the
outermost module forward on its stack: the model); a function with enough samples is handed to
``torch.compile``'s own frame machinery, which compiles it at its next call with guards, graph
breaks, recompiles and a compiled backward. A compile error, a failed agreement or a run-time
error sends that function back to eager (on every rank when any rank failed). Functions the
user compiled are left alone. Guide: ``docs/compilation.md``; machinery: ``_hot_functions``
(decisions), ``_frames`` (dynamo's frame hook), ``_backend`` (the counted backend), ``_steps``
(training steps as agreement points: optimizer steps, ``step()``), ``_stats`` (the counters);
the ranks agree through ``spmdgt.runtime._agree`` (``propose``, ``agree``, ``any_rank``).
``status()`` says what was compiled, or why nothing was.

Lazy regions (YAML ``compile: true`` scopes, ``GT_WORKER_BATCH_SIZE=N`` or
``enable_regions()``): ops on large tensors, plain or sharded, are recorded, their results are
placeholders, and at a sync point the region runs as one compiled graph (``_lazy_regions``: the
hook and sync points; ``_region``: recording and placeholders; ``_calls``: what recording reads
off a call, and the nodes' formats; ``_plan``: a region's plan at a sync point, and filling its
placeholders; ``_sharded``: layouts, agreement and autograd of graphs over DTensors;
``_graphs``: keys, caps, compile, fallback; ``_lazy_ops``: what may be recorded). Both halves
may run at once: a hot function's graph and compile run the open region first (``_backend``,
``_hot_functions``), and placeholders show the ``requires_grad`` dynamo's guards check.

Environment (read by ``maybe_enable_from_env``, which ``import spmdgt`` reaches through the
interceptor's start-up; with none of these set nothing here is imported):

    GT_AUTO_COMPILE=1            hot functions on
    GT_COMPILE=0                 every compilation off, whatever else is set
    GT_COMPILE_BACKEND=name      the torch.compile backend (default inductor)
    GT_COMPILE_SAMPLE_EVERY=n    top-level ops between stack samples (default 16)
    GT_COMPILE_HOT_SAMPLES=n     samples that make a function hot (default 8)
    GT_DEBUG_COMPILE=1           print each decision, rank-prefixed
    GT_WORKER_BATCH_SIZE=n       lazy regions everywhere, a region runs at n recorded ops at most
    GT_LAZY_MIN_NUMEL=n          elements a tensor needs for its ops to be recorded (65536)
    GT_LAZY_CACHE=n              lazy-region graphs kept (LRU, default 64)
    GT_LAZY_REGION_GRAPHS=n      graphs per region (scope name) before it runs eagerly (8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdgt._core import env as _env
from spmdgt._core.session import session

__all__ = [
    "disable",
    "compile_scope_entered",
    "disable_regions",
    "enable",
    "enable_regions",
    "is_enabled",
    "maybe_enable_from_env",
    "plain_torch",
    "regions_enabled",
    "stats",
    "status",
    "step",
]

_hot: Any = None
_regions: Any = (
    None  # the lazy regions' LazyPass, made by enable_regions() or the first compile scope
)
# disable_regions() was called: ``compile: true`` scopes stay eager until enable_regions()
_regions_refused = False
_atexit = False


def enable(
    backend: str | Callable[..., Any] | None = None,
    every: int | None = None,
    hot_at: int | None = None,
) -> None:
    """Turn hot functions on for this rank (every rank must: the decisions are collective).

    Turns the interceptor on if it is off (level ``native`` when it builds: the sampling then
    costs what the C++ log costs; else ``torch``). ``backend``, ``every``, ``hot_at``: as the
    ``GT_COMPILE_*`` variables (``backend`` may also be a dynamo backend callable). A no-op
    with ``GT_COMPILE=0``.
    """
    global _hot
    if compile_disabled():
        _note("GT_COMPILE=0: compilation off")
        return
    if _hot is not None:
        return
    from spmdgt.compile._hot_functions import HotFunctionPass
    from spmdgt.interceptor import _control
    from spmdgt.interceptor._mode import get_interceptor

    ic = get_interceptor()
    if not ic.active:
        from spmdgt.interceptor import _native

        level = _env.text("GT_INTERCEPT") or ("native" if _native.available() else "torch")
        _control.enable(stats=False, hotpath=False, level=level, sampling_only=True)
    p = HotFunctionPass(
        backend=backend or _env.text("GT_COMPILE_BACKEND"),
        every=every or _env.integer("GT_COMPILE_SAMPLE_EVERY"),
        hot_at=hot_at or _env.integer("GT_COMPILE_HOT_SAMPLES"),
    )
    p.start(ic)
    _hot = p
    global _atexit
    if not _atexit:  # the frame hook must be out before the interpreter tears modules down
        import atexit

        atexit.register(disable)
        _atexit = True
    _provide()
    _note(
        f"compile pass on (hot functions, backend {p.backend_name}, a sample every {p.every} ops, "
        f"hot at {p.hot_at} samples, interceptor level {ic.level})"
    )


def disable() -> None:
    """Turn hot functions off: sampling stops, the frame hook and its marks go, functions run
    eagerly. Under ``GT_DEBUG_COMPILE=1`` the last line says what was compiled, or why
    nothing was (``status()``)."""
    global _hot
    p, _hot = _hot, None
    if p is not None:
        from spmdgt._core import debuglog as _debuglog

        if _debuglog.COMPILE:
            _debuglog.debug("compile", f"compile pass off: {p.status()}")
        p.stop()
        _provide()


def plain_torch(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as plain torch on this rank, whatever ``GT_*`` turned on: the open lazy
    region is run first and records nothing inside, the hot functions' frame hook is out
    (code the pass compiled runs eagerly; a function the program ``torch.compile``s itself
    still compiles, as in one process; a code that turns hot meanwhile is compiled at a call
    outside). For code that must be one process's torch: the parity sweeps' reference and
    judge run in the process their ranks are forked from, which has the ranks' tools on.
    Free where no half is on."""
    hot, regions = _hot, _regions
    if hot is None and regions is None:
        return fn(*args)
    from spmdgt.compile._before_op import without_hooks

    if regions is not None:
        regions.sync("plain torch")  # pending results are filled before plain torch reads
    if hot is None:
        return without_hooks(fn, *args)
    prior = hot.hook.pause()
    try:
        return without_hooks(fn, *args)
    finally:
        hot.hook.resume(prior)


def step() -> None:
    """Mark the end of a training step, on every rank (a collective decision point).

    Not needed where the step is a ``torch.optim`` optimizer's ``step()``: the pass counts
    those itself. For a loop without one (a hand-written update, an optimizer of another
    library), call it once per step on every rank. On more than one rank some steps are the
    pass's agreement points (steps 1-8, then 16, 32, ..., 256, then every 256th; see
    ``spmdgt/compile/_steps.py``), where functions found hot on any rank are settled, so a
    loop that never reads a value on the host still compiles. Every rank must call it the same
    number of times. A no-op while hot functions are off.
    """
    if _hot is not None:
        _hot.steps.step_eagerly()


def status() -> str:
    """One line: what the hot-function half compiled on this rank, or why nothing was
    compiled (no hot function, only library frames sampled, waiting for agreement, a hot
    function not called again, a compile failure...); also ``stats()["status"]``."""
    if _hot is None:
        return "hot functions off" + (" (GT_COMPILE=0)" if compile_disabled() else "")
    return _hot.status()


def is_enabled() -> bool:
    """Whether the hot-function half runs on this rank."""
    return _hot is not None


def enable_regions(
    batch: int | None = None, backend: str | Callable[..., Any] | None = None
) -> bool:
    """Turn lazy regions on for this rank: lazy regions inside ``compile: true`` scopes, and, with
    ``batch`` (``GT_WORKER_BATCH_SIZE``), everywhere, a region running at ``batch`` recorded
    ops at most. Returns whether it is on (not with ``GT_COMPILE=0``)."""
    global _regions, _regions_refused
    _regions_refused = False
    if compile_disabled():
        _note("lazy regions off: GT_COMPILE=0")
        return False
    if _regions is not None:
        return True
    import spmdgt.compile._lazy_regions as lazy

    _regions = lazy.LazyPass(
        backend=backend or _env.text("GT_COMPILE_BACKEND"),
        batch=batch,
        min_numel=_env.integer("GT_LAZY_MIN_NUMEL"),
        cache=_env.integer("GT_LAZY_CACHE"),
        per_region=_env.integer("GT_LAZY_REGION_GRAPHS"),
    )
    _regions.start()
    from spmdgt._core import scope as _scope

    _scope.lazy_hook = on_scope  # scope changes are sync points
    _scope.lazy_sync = _regions.sync  # reads of a pending gt.Tensor that are no op
    _provide()
    global _atexit
    if not _atexit:
        import atexit

        atexit.register(disable)
        atexit.register(_stop_regions)
        _atexit = True
    where = f"everywhere, {batch} ops at most" if batch else "in compile: true scopes"
    _note(
        f"lazy regions on ({where}; tensors of {_regions.min_numel}+ elements; {_regions.backend})"
    )
    return True


def disable_regions() -> None:
    """Turn lazy regions off: the open region runs, the hook goes, the graphs are dropped; and it
    stays off, ``compile: true`` scopes included, until ``enable_regions()``."""
    global _regions_refused
    _regions_refused = True
    _stop_regions()


def _stop_regions() -> None:
    """Lazy regions off, the scope hooks out (a later ``compile: true`` scope may turn it on)."""
    global _regions
    from spmdgt._core import scope as _scope

    _scope.lazy_hook = None
    _scope.lazy_sync = None
    lz, _regions = _regions, None
    if lz is not None:
        lz.stop()
        _provide()


def compile_scope_entered() -> None:
    """A ``compile: true`` scope is being entered (``spmdgt.signal``): from now on scope
    changes reach ``on_scope``, which turns lazy regions on at this scope, unless the program
    turned it off with ``disable_regions()``. The one writer of ``_scope.lazy_hook``."""
    from spmdgt._core import scope as _scope

    if _scope.lazy_hook is None and not _regions_refused:
        _scope.lazy_hook = on_scope


def regions_enabled() -> bool:
    """Whether the lazy-region half runs on this rank."""
    return _regions is not None


def on_scope(name: str, entering: bool, compiles: bool) -> None:
    """``_scope``'s call at each push and pop while the lazy-region half runs, or for a ``compile:
    true``
    scope (which turns lazy regions on at its first entry)."""
    if _regions is None and not (compiles and entering and enable_regions()):
        return
    _regions.on_scope(name, entering, compiles)


def stats() -> dict[str, Any]:
    """This rank's compile counters (``_stats.CompileStats``, the lazy regions' under ``regions``);
    empty when no half is on."""
    out: dict[str, Any] = _hot.snapshot() if _hot is not None else {}
    if _regions is not None:
        out = dict(out)
        reg = _regions.snapshot()
        out["regions"] = reg
        out["compiled_ops"] = out.get("compiled_ops", 0) + reg["compiled_ops"]
    return out


def _provide() -> None:
    """Point ``get_worker_stats`` at these counters while a half runs, and keep AOTAutograd
    from donating buffers meanwhile (``_donation``)."""
    from spmdgt import debug

    on = _hot is not None or _regions is not None
    debug.set_compilation_stats_provider(stats if on else None)
    _donation(on)


_donated_before: Any = None  # torch's setting while a half runs (None: no half runs)


def _donation(on: bool) -> None:
    """AOTAutograd's donated buffers off while a half runs, torch's setting back after.

    Donating saved tensors to a compiled backward frees them in it, and such a backward
    refuses ``retain_graph=True`` and ``create_graph=True`` with a ``RuntimeError``: a program
    that runs eagerly with a second backward through one graph (several losses, a GAN's two
    steps) failed only because the pass compiled its forward (the autograd scenario sweep
    with both halves on). Torch decides it when a backward compiles (at the forward's compile
    under ``force_non_lazy_backward_lowering``, else at the first backward) and checks it
    again at every backward, so a setting patched around the pass's compiles is not enough:
    it is off for the process while the pass runs. It only saves memory; values are alike."""
    global _donated_before
    import torch._functorch.config as functorch_config

    if on and _donated_before is None:
        _donated_before = functorch_config.donated_buffer
        functorch_config.donated_buffer = False
    elif not on and _donated_before is not None:
        functorch_config.donated_buffer = _donated_before
        _donated_before = None


def compile_disabled() -> bool:
    """``GT_COMPILE=0`` (off by the one flag rule of ``spmdgt._core.env``): no compilation of
    any kind. ``spmdgt.train`` asks the same question through this function."""
    return not _env.flag("GT_COMPILE")


def maybe_enable_from_env() -> bool:
    """``GT_AUTO_COMPILE=1``: ``enable()``; ``GT_WORKER_BATCH_SIZE=n``: ``enable_regions(n)``;
    both may be set (neither runs with ``GT_COMPILE=0``). Returns whether the hot-function half
    is on."""
    if _env.flag("GT_AUTO_COMPILE"):
        enable()
    batch = _env.integer("GT_WORKER_BATCH_SIZE")  # None when unset
    if batch is not None:
        enable_regions(batch=batch)
    return is_enabled()


def _note(msg: str) -> None:
    from spmdgt._core import debuglog as _debuglog

    _debuglog.verbose(msg)
    if _debuglog.COMPILE:
        _debuglog.debug("compile", msg)


def _forget() -> None:
    # the session's reset: both halves off (the lazy regions' open region runs first), as at import
    global _regions_refused
    _stop_regions()
    disable()
    _regions_refused = False


session.register("compile", _forget)
