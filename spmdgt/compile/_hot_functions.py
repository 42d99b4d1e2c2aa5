"""Hot functions of the compile pass: hot functions, found by op count, compiled by dynamo.

``HotFunctionPass.start()`` asks the interceptor for a ``CodeSampler`` (every ``every``-th
top-level op, one sample of which user code object issued it; ``compile/_sampler.py``).
A code with ``hot_at`` samples is *hot*: if it is a plain function (not module-level code, not
a generator) that the user has not compiled, the frame hook (``_frames``) goes in and dynamo
compiles the function at its next call. Each frame compile is an agreement point
(``runtime._agree.any_rank``): if it failed on any rank, every rank runs the function eagerly
from then on.

Classification of code objects (the sampler's and the hook's):
- ``STOP``: code running inside a compiled function (dynamo's transformed code, inductor's
  generated modules, dynamo's ``compile_wrapper``): ops there are not attributed to a caller,
  so a function that only calls the user's own compiled function never turns hot around it;
- ``LIBRARY``: torch, spmdgt, the standard library, site-packages, ``<string>``-like files,
  except the ``forward`` of an ``nn.Module`` subclass outside torch and spmdgt: a model's
  forward is the user's code even where it lives in site-packages (Hugging Face models);
- ``USER``: everything else.

Where the time goes: a hot module ``forward`` stands for the outermost module ``forward`` on
its stack (the model the program calls, e.g. ``LlamaForCausalLM.forward`` for ops sampled in
its ``LlamaMLP``), so dynamo compiles the whole model at its next call, as
``torch.compile(model)`` would, rather than each small layer apart.

On more than one rank a hot function is a proposal, settled at the next agreement point: a
creation, a host read, or the end of a training step on ``_steps``' schedule (an optimizer
step, or ``spmdgt.compile.step()``), which every rank reaches in the same order without a host
read.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import time
from types import CodeType
from typing import Any

from spmdgt._core import debuglog as _debuglog
from spmdgt.compile._backend import CountingBackend
from spmdgt.compile._frames import FrameHook
from spmdgt.compile._guards import static_shapes
from spmdgt.compile._sampler import LIBRARY, STOP, USER, CodeSampler
from spmdgt.compile._stats import CompileStats, first_line
from spmdgt.compile._steps import StepPoints
from spmdgt.tensor import _dynamo_guards

__all__ = ["HotFunctionPass"]

_NOT_FUNCTIONS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class HotFunctionPass:
    """One session of hot functions on this rank (see the module docstring)."""

    def __init__(self, backend: Any = "inductor", every: int = 16, hot_at: int = 8) -> None:
        import torch

        self.backend_name = backend if isinstance(backend, str) else _name_of(backend)
        self.every = every
        self.hot_at = hot_at
        self.stats = CompileStats()
        self._roots = _library_roots(torch)
        self._module_type = torch.nn.Module
        self._kinds: dict[CodeType, int] = {}
        self._forwards: dict[CodeType, bool] = {}  # code -> is an nn.Module's forward
        self._files: dict[str, Any] = {}  # a source file -> its module (see _module_of)
        self._decided: set[CodeType] = set()  # codes on_hot has ruled on (once each)
        self.backend = CountingBackend(backend, self.stats, self._runtime_fallback)
        self.hook = FrameHook(self._compile_frame, self._is_user, self.backend)
        self.hook.admits = self._admits
        self.sampler = CodeSampler(every, hot_at, self.classify, self.on_hot)
        self._by_key: dict[str, CodeType] = {}  # codes this rank proposed (see on_hot)
        self._eager_keys: set[str] = set()  # fallen back on some rank at run time (agreed)
        self._ic: Any = None
        self._listener: Any = None  # our on_agreed registration (runtime._agree.Listener)
        self.steps = StepPoints()  # training steps: agreement points on a schedule
        self.worker = False  # a DataLoader worker process: decides nothing (see on_hot)
        self._stood_for: dict[CodeType, CodeType] = {}  # hot forward -> the unit compiled

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, interceptor: Any) -> None:
        """Sample ``interceptor``'s op stream (it must be enabled)."""
        from spmdgt.runtime import _agree

        self._ic = interceptor
        interceptor.set_sampler(self.sampler)
        if self._listener is None:
            self._listener = _agree.on_agreed(self._on_agreed)
        self.steps.start()
        _dynamo_guards.hold("hot functions")

    def stop(self) -> None:
        """Stop sampling, remove the hook and its marks (compiled code is dropped by dynamo
        with its code objects; the functions run eagerly again)."""
        if self._listener is not None:  # ours to remove: enable/disable N times leaves none
            self._listener.remove()
            self._listener = None
        self.steps.stop()
        if self._ic is not None and self._ic.sampler is self.sampler:
            self._ic.set_sampler(None)
        self.hook.uninstall()
        _dynamo_guards.let_go("hot functions")

    def snapshot(self) -> dict[str, Any]:
        """The stats entry's ``compilation`` fields (``_stats.CompileStats``), with
        ``status`` (one line: what compiled, or why nothing did), ``hot_functions``,
        ``compiled_functions`` and ``pending`` (proposed here, not yet agreed) by name."""
        samples = self.sampler.samples()
        out = self.stats.snapshot(len(samples))
        out["hot_functions"] = sorted(_where(c) for c in self.hook.hot)
        out["compiled_functions"] = sorted(_where(c) for c in self.stats.compiled_codes)
        out["pending"] = sorted(_where(c) for c in self._pending())
        out["training_steps"] = self.steps.count
        out["status"] = self.status(samples)
        return out

    def _pending(self) -> list[CodeType]:
        return [c for c in self._by_key.values() if c not in self._decided]

    def status(self, samples: dict[CodeType, int] | None = None) -> str:
        """One line: what was compiled, or why nothing was (the first reason that holds)."""
        st = self.stats
        if self.worker:
            return "nothing compiled: a DataLoader worker process (the pass decides nothing here)"
        if st.compiled_codes:
            names = ", ".join(sorted(_where(c) for c in st.compiled_codes))
            failed = f"; fallbacks: {dict(st.fallbacks)}" if st.fallbacks else ""
            return f"compiled: {names}{failed}"
        if st.fallbacks:
            reasons = "; ".join(f"{r} (x{n})" for r, n in st.fallbacks.items())
            return f"nothing compiled: {reasons}"
        waiting = [c for c in self.hook.hot if c not in self.hook.fallen]
        if waiting or self.hook.hot_keys:
            names = ", ".join(sorted([_where(c) for c in waiting] + sorted(self.hook.hot_keys)))
            return f"nothing compiled yet: hot, its next call has not come: {names}"
        pending = self._pending()
        if pending:
            names = ", ".join(sorted(_where(c) for c in pending))
            return (
                f"nothing compiled yet: waiting for agreement: {names} hot on this rank; the "
                "ranks settle it at their next agreement point (a spmdgt creation or host "
                f"read, or a training step on the schedule; {self.steps.count} steps so far)"
            )
        if st.skipped:
            reasons = "; ".join(f"{r} (x{n})" for r, n in st.skipped.items())
            return f"nothing compiled: hot but not compilable: {reasons}"
        samples = self.sampler.samples() if samples is None else samples
        if samples:
            code, n = max(samples.items(), key=lambda kv: kv[1])
            return (
                f"nothing compiled: no hot function yet (the most sampled, {_where(code)}, has "
                f"{n} of {self.hot_at} samples; one sample per {self.every} ops)"
            )
        ops = self._ic.recorded() if self._ic is not None else 0
        if ops < self.every:
            return f"nothing compiled: no op sampled yet ({ops} ops since the pass started)"
        return (
            f"nothing compiled: no hot function: each of the ~{ops // self.every} samples "
            f"({ops} ops) ran in library code only "
            "(torch, spmdgt, the standard library, site-packages other than a module's "
            "forward) or inside a function you compiled"
        )

    # -- classification -------------------------------------------------------------------------
    def classify(self, code: CodeType) -> int:
        kind = self._kinds.get(code)
        if kind is None:
            kind = self._kinds[code] = self._classify(code)
        return kind

    def _classify(self, code: CodeType) -> int:
        from torch._dynamo.utils import orig_code_map

        name = code.co_filename
        if not name.startswith("<"):
            # the roots are absolute and normalised: so is the file, or a package imported
            # through ``dir/../pkg`` (a script's own sys.path entry) counts as the user's,
            # and the pass compiles spmdgt's own hook (once per code: ``classify`` caches)
            name = os.path.abspath(name)
        if code in orig_code_map or name.startswith(self._roots[1]):
            return STOP  # dynamo's transformed code / inductor's generated modules
        if name == self._roots[2] and code.co_name in ("compile_wrapper", "_fn"):
            return STOP  # the user's torch.compile wrapper: what runs below is theirs
        if name.startswith("<"):
            return LIBRARY
        if name.startswith(self._roots[0]):
            # a model's forward is the user's code, even in site-packages (not torch's own
            # modules, nor spmdgt's)
            if not name.startswith(self._roots[3]) and self.is_forward(code):
                return USER
            return LIBRARY
        return USER

    def _is_user(self, code: CodeType) -> bool:
        return self.classify(code) == USER

    def is_forward(self, code: CodeType) -> bool:
        """Whether ``code`` is the ``forward`` of an ``nn.Module`` subclass (a method of a
        class its module defines at top level; decided once per code)."""
        found = self._forwards.get(code)
        if found is None:
            found = self._forwards[code] = self._find_forward(code)
        return found

    def _find_forward(self, code: CodeType) -> bool:
        if code.co_name != "forward":
            return False
        parts = getattr(code, "co_qualname", "").split(".")
        if len(parts) < 2 or "<locals>" in parts:
            return False
        owner = self._module_of(code.co_filename)
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
        return isinstance(owner, type) and issubclass(owner, self._module_type)

    def _module_of(self, filename: str) -> Any:
        """The imported module whose source is ``filename`` (None if none is)."""
        mod = self._files.get(filename)
        if mod is None:
            for m in list(sys.modules.values()):
                f = getattr(m, "__file__", None)
                if isinstance(f, str):
                    self._files.setdefault(f, m)
            mod = self._files.get(filename)
        return mod

    def _unit(self, code: CodeType) -> CodeType:
        """What to compile for a hot ``code``: a module forward stands for the outermost
        module forward on the stack above it (the model the program called), so one compile
        covers the whole model; anything else stands for itself. The stack is the op's: the
        sampler calls ``on_hot`` from the op that made ``code`` hot."""
        if not self.is_forward(code):
            return code
        frame = sys._getframe(1)
        seen = False
        unit = code
        while frame is not None:
            c = frame.f_code
            if c is code:
                seen = True
            elif seen and self.is_forward(c) and self._kind_allows(c):
                unit = c
            frame = frame.f_back
        return unit

    def _forwards_on(self) -> None:
        """A model's forward is hot: its layers' forwards are compiled too where a graph break
        leaves them a frame of their own (``FrameHook.model_forward``; their marks, made
        while they ran eagerly, are lifted). Taken at the agreement point that made the
        model hot, on every rank alike."""
        if self.hook.model_forward is None:
            self.hook.model_forward = self._is_model_forward
            self.hook.lift_marks()

    def _is_model_forward(self, code: CodeType) -> bool:
        # a module forward the sampler counts as the user's, and a plain function
        return (
            self.is_forward(code)
            and self.classify(code) == USER
            and not code.co_flags & _NOT_FUNCTIONS
        )

    def _kind_allows(self, code: CodeType) -> bool:
        # a module forward the sampler would count (not torch's or spmdgt's, e.g. DDP's)
        return self.classify(code) == USER

    # -- hot ------------------------------------------------------------------------------------
    def on_hot(self, codes: list[CodeType]) -> None:
        """Codes that reached the threshold on this rank. Op counts differ between ranks (a
        rank outside a sub-mesh, an empty shard, a fallback's gather run ops the others do
        not), so on more than one rank hotness is a proposal: at the next agreement point
        (a creation, a host read) every rank takes the union of the ranks' hot codes
        (``runtime._agree.propose``), and each compiles them at their next call, which comes
        at the same point of the program everywhere."""
        from spmdgt.runtime import _agree

        if self.worker or _in_dataloader_worker():
            # a DataLoader worker forked from the rank inherits the pass, and its stack below
            # the worker loop is the rank's (``main``...): it would turn the rank's functions
            # hot a second time and print so. Its ops are the loader's, not the program's.
            self.worker = True
            return
        units = []
        for code in codes:
            unit = self._unit(code)
            if unit is not code:
                self._stood_for[unit] = code
            if unit not in units:
                units.append(unit)
        if not _agree.active():
            self._make_hot(units)
            return
        for code in units:
            if code not in self._decided and code not in self.hook.fallen:
                key = _key(code)
                if key not in self._by_key and _debuglog.COMPILE:
                    _debuglog.debug(
                        "compile",
                        f"hot on this rank: {_where(code)}{self._for(code)}; every rank "
                        "decides at the next agreement point",
                    )
                self._by_key[key] = code
                _agree.propose(key)

    def _for(self, code: CodeType) -> str:
        inner = self._stood_for.get(code)
        if inner is None:
            return ""
        return f" (for {_where(inner)}: the outermost module forward on its stack)"

    def _on_agreed(self, keys: set[str]) -> None:
        fallen = {k.removeprefix(_EAGER) for k in keys if k.startswith(_EAGER)}
        if fallen:
            self._fall_back_agreed(fallen)
            keys = keys - {_EAGER + k for k in fallen}
        codes, missing = [], []
        for key in sorted(keys):
            code = self._by_key.get(key)
            (codes.append(code) if code is not None else missing.append(key))
        if missing:  # hot on another rank only: this rank finds the code at its next call
            self.hook.hot_keys.update(missing)
            self.hook.lift_marks()
            self.hook.install()
            if any(k.endswith(".forward") for k in missing):  # a model's, as on that rank
                self._forwards_on()
        self._make_hot(codes)

    def _make_hot(self, codes: list[CodeType]) -> None:
        for code in codes:
            if code in self._decided:  # counts restart when the interceptor restarts
                continue
            self._decided.add(code)
            if code in self.hook.fallen or _key(code) in self._eager_keys:
                # eager from now on, on every rank (a fallback agreed, or followed at an
                # agreement point): a rank whose first compile of it came through another
                # rank's proposal had not ruled on it, and making it hot again would unmark
                # it on that rank alone, whose next call then waited in a compile agreement
                # no other rank reached (found by the parity sweep, both halves on)
                continue
            where = _where(code)
            if not self._admits(code):
                continue
            self.stats.hot += 1
            self.hook.hot.add(code)
            self.hook.unmark(code)
            if self.is_forward(code):
                self._forwards_on()
            if _debuglog.COMPILE:
                _debuglog.debug(
                    "compile",
                    f"hot {where}{self._for(code)} after {self.hot_at} samples (1 per "
                    f"{self.every} ops): compiling at its next call with {self.backend_name}",
                )
            self.hook.install()

    def _admits(self, code: CodeType) -> bool:
        """Is hot ``code`` compiled? Not module-level code, a generator or coroutine, or code
        the user compiled: read off the code object and what every rank compiled alike, so
        the answer is the same on every rank, whether the code turned hot here or came from
        another rank's proposal (``FrameHook.admits``). A rank that took another's proposal
        without asking once compiled a generator expression its finder had refused, and
        waited in a compile agreement no other rank reached (the parity sweep's ``partial``
        layout, both halves on: ``partial_parts``' ``<genexpr>``, a hang)."""
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        if code.co_name == "<module>":
            reason = "module-level code (lazy regions will serve it)"
        elif code.co_flags & _NOT_FUNCTIONS:
            reason = "a generator or coroutine"
        elif _debug_get_cache_entry_list(code) and code not in self.stats.compiled_codes:
            reason = "compiled by the user"
        else:
            return True
        self.stats.skipped[reason] += 1
        if _debuglog.COMPILE:
            _debuglog.debug("compile", f"hot {_where(code)}: not compiled ({reason})")
        return False

    # -- compile --------------------------------------------------------------------------------
    def _compile_frame(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        code = frame.f_code
        if self._eager_keys and _key(code) in self._eager_keys:
            self.hook.fallen.add(code)
            return self.hook._skip
        st = self.stats
        recompile = cache_entry is not None
        t0 = time.perf_counter_ns()
        error: BaseException | None = None
        result: Any = None
        self.backend.code = code
        paused = self._ic.paused() if self._ic is not None else _null()
        from spmdgt._core import scope as _scope
        from spmdgt.runtime import _agree

        if _scope.lazy_sync is not None:
            # lazy regions run too: the open region runs before dynamo reads the frame, so it
            # traces filled tensors and no region is open while it traces (a region open on
            # some ranks only, or flushed at another point of the trace, would put a sharded
            # graph's compile agreement at different places on different ranks)
            _scope.lazy_sync("a hot function's compile")
        _settle_views(frame)

        with paused:
            # The ranks check that they all compile this function *before* any spends the
            # compile's time (seconds, a minute for a model with inductor): a rank that is
            # elsewhere (e.g. in a host read the others skip) is an error on every rank now.
            try:
                _agree.agree(f"compile of {code.co_name}", site=_where(code))
            except BaseException:
                self.backend.code = None
                raise
            # Nothing dynamo does while it compiles may exchange: it runs code on real
            # tensors on its own, per rank (a ``repr`` of a sub-mesh gt.Tensor on the rank
            # outside it, found by the parity sweep), and a point reached there would pair
            # with the other ranks' compile result below. Refused points fail this compile.
            refused: list[tuple[str, str]] = []
            try:
                with static_shapes(_agree.active()), _agree.closed(code.co_name) as refused:
                    result = self.hook.inner(frame, cache_entry, frame_state)
            except Exception as e:  # dynamo or the backend failed: eager is always right
                error = e
            finally:
                self.backend.code = None
            reason = f"compile error: {_describe(error)}" if error else ""
            if refused:
                what, site = refused[0]
                reason = f"an agreement point inside dynamo's compile ({what} at {site})"
            if error is None and _runs_cached_only(result):
                # dynamo's recompile limit: from now on it runs a cached graph where one's
                # guards pass and the code eagerly where none does, a choice per rank (a
                # guard reads this rank's shard: an empty one, its strides), and with no
                # agreement a compiled graph on one rank meets eager ops on another. So the
                # code runs eagerly everywhere, as on a failed compile (the limit is hit at
                # the same call on every rank: each recompile was agreed)
                reason = "past dynamo's recompile limit"
            failed = _agree.any_rank(
                bool(reason), f"compile result of {code.co_name}", _where(code)
            )
        st.compile_ns += time.perf_counter_ns() - t0
        where = _where(code)
        if failed:
            reason = reason or "another rank's compile failed"
            st.fallbacks[reason] += 1
            self.hook.fall_back(code)  # cached graphs too: eager, whatever a guard says
            if _debuglog.COMPILE:
                _debuglog.debug("compile", f"fallback {where}: {reason}; eager from now on")
            return self.hook._skip
        st.cache_misses += 1
        if recompile:
            st.recompiles += 1
        if getattr(result, "guarded_code", None) is None:
            why = getattr(result, "skip_reason", None) or "dynamo found nothing to compile"
            st.fallbacks[f"dynamo skipped: {why}"] += 1
            if _debuglog.COMPILE:
                _debuglog.debug("compile", f"fallback {where}: dynamo skipped it ({why})")
            return result
        st.compiled_codes.add(code)
        if _debuglog.COMPILE:
            _debuglog.debug(
                "compile",
                f"{'recompiled' if recompile else 'compiled'} {where} in "
                f"{(time.perf_counter_ns() - t0) * 1e-9:.2f}s ({st.graphs} graphs so far)",
            )
        return result

    def _runtime_fallback(self, code: Any, reason: str) -> None:
        self.stats.fallbacks[reason] += 1
        if code is not None:
            self.hook.fall_back(code)
            from spmdgt.runtime import _agree

            if _agree.active():  # the other ranks follow at the next agreement point
                _agree.propose(_EAGER + _key(code))
        if _debuglog.COMPILE:
            where = _where(code) if code is not None else "?"
            _debuglog.debug("compile", f"fallback {where}: {reason}; eager from now on")

    def _fall_back_agreed(self, keys: set[str]) -> None:
        """Functions whose graph failed at run time on some rank: eager on every rank from
        this agreement point on (a compiled graph and an eager run may order collectives
        differently), also where this rank has not compiled them yet."""
        self._eager_keys.update(keys)
        for code in list(self.stats.compiled_codes):
            if _key(code) in keys and code not in self.hook.fallen:
                self.hook.fall_back(code)
                self.stats.fallbacks["another rank's graph failed at run time"] += 1
                if _debuglog.COMPILE:
                    _debuglog.debug("compile", f"fallback {_where(code)}: another rank's graph "
                                    "failed at run time; eager from now on")  # fmt: skip


_EAGER = "eager:"  # a proposal's prefix: this function's graph failed at run time


def _library_roots(
    torch: Any,
) -> tuple[tuple[str, ...], tuple[str, ...], str, tuple[str, ...]]:
    """(library prefixes, generated-code prefixes, dynamo's eval_frame.py, the folders of
    torch and spmdgt: libraries whose modules' forwards are never the user's)."""
    from torch._dynamo import eval_frame

    paths = sysconfig.get_paths()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spmdgt/, no import up
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    lib = {
        torch_dir,
        package,
        paths["stdlib"],
        paths["platstdlib"],
        paths["purelib"],
        paths["platlib"],
    }
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        generated: tuple[str, ...] = (os.path.abspath(cache_dir()),)
    except Exception:  # no inductor: nothing generated to recognise
        generated = ()
    own = (torch_dir + os.sep, package + os.sep)
    return tuple(sorted(lib)), generated, os.path.abspath(eval_frame.__file__), own


def _settle_views(frame: Any) -> None:
    """Bring each view DTensor had to copy among the frame's arguments up to date, with its
    autograd history, before dynamo reads them.

    Such a view is autograd's view of its base; after a write to the base autograd rebuilds
    the view's history at its next read by replaying the view on the base, which on a
    sharded base is a redistribution, a collective. Dynamo reads it (``is_leaf``) while it
    turns the arguments into fake tensors, at points that differ by rank, where nothing may
    exchange: the ranks hung in different all-gathers (the both-halves sweep of writes
    through views with autograd, 2026-11-30). Here every rank rebuilds it at the same
    point, before the compile's agreement."""
    import torch
    from torch.distributed.tensor import DTensor

    from spmdgt.tensor import _moves

    try:
        values = list(frame.f_locals.values())
    except Exception:  # no locals to read: nothing to settle
        return
    for value in values:
        for t in value if type(value) in (list, tuple) else (value,):
            if isinstance(t, DTensor) and getattr(t, "_gt_view", None) is not None:
                _moves.refresh(t)
                with torch._C.DisableTorchFunctionSubclass():
                    t.grad_fn  # noqa: B018 (the read rebuilds the history, here)


def _name_of(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _key(code: CodeType) -> str:
    """A code's name that is the same on every rank (file base name: paths differ by node)."""
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_qualname}"


def _where(code: CodeType) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _in_dataloader_worker() -> bool:
    """Whether this process is a ``torch.utils.data`` worker (its loop sets the worker info;
    read without importing anything)."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and getattr(worker, "_worker_info", None) is not None


def _describe(e: BaseException) -> str:
    """``Outer: Root: message`` (dynamo wraps the backend's error; its own first line says
    only which backend raised)."""
    root = getattr(e, "inner_exception", None) or e.__cause__
    if root is None or root is e:
        return f"{type(e).__name__}: {first_line(e)}"
    return f"{type(e).__name__}: {type(root).__name__}: {first_line(root)}"


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _runs_cached_only(result: Any) -> bool:
    """Whether dynamo answered a frame with "run the cached graphs only" (its recompile limit)."""
    from torch._dynamo.types import FrameAction

    strategy = getattr(result, "frame_exec_strategy", None)
    return (
        getattr(result, "guarded_code", None) is None
        and strategy is not None
        and strategy.cur_action == FrameAction.RUN_ONLY
    )
