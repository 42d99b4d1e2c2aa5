"""The frame hook: dynamo compiles the hot functions' frames and nothing else.

Installed (``install``) only once a function is hot: while a PEP 523 hook is in, every Python
call passes through it. It is dynamo's own eval-frame hook (``set_eval_frame``) with a callback
that hands a frame to dynamo's ``convert_frame`` (guards, graph breaks, recompiles, compiled
backward: all dynamo's) when its code is hot, or is a resume function dynamo made for one,
and otherwise answers SKIP *for the code*: dynamo's C layer then runs that code eagerly without
calling Python again (measured here: ~1.25x on a bare Python call; a Python callback per call
would be ~18 us).

Dynamo keeps that per-code SKIP in one table for every ``torch.compile``, so a SKIP left on a
function the user later compiles would silently run it eagerly. Hence:

- a code that already has compiled entries (the user compiled it) is skipped for this call
  only, never marked;
- the marks on user code (not torch's or the standard library's) are lifted whenever a
  ``torch.compile`` region of the user's is entered (dynamo switches callbacks through
  ``eval_frame._maybe_set_eval_frame``, wrapped while the hook is in), and made again at the
  next eager call;
- ``uninstall`` lifts every mark and removes the hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import CodeType
from typing import Any

from spmdgt._core import debuglog as _debuglog

__all__ = ["FrameHook"]

_RESUME = "torch_dynamo_resume_in_"


class _Callback:
    """What dynamo's C layer calls per frame; ``_torchdynamo_orig_backend`` lets it match
    cache entries to the backend that made them."""

    def __init__(self, hook: FrameHook, inner: Any) -> None:
        self._hook = hook
        self._torchdynamo_orig_backend = inner

    def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        return self._hook.on_frame(frame, cache_entry, frame_state)


class FrameHook:
    """Dynamo's eval-frame hook, limited to ``hot`` codes (see the module docstring).

    ``compile_frame(frame, cache_entry, frame_state) -> ConvertFrameReturn`` is the pass's
    compile step (dynamo plus agreement and fallback); ``is_user(code)`` says whose code it
    is (user marks are lifted when a user region starts).
    """

    def __init__(
        self,
        compile_frame: Callable[[Any, Any, Any], Any],
        is_user: Callable[[CodeType], bool],
        backend: Any,
    ) -> None:
        from torch._dynamo import eval_frame
        from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy

        self.hot: set[CodeType] = set()
        self.hot_keys: set[str] = set()  # agreed hot on another rank; found by name here
        # whether a hot code is compiled (the pass's rule, the same on every rank), asked of
        # a code found by ``hot_keys`` as of one that turned hot on this rank
        self.admits: Callable[[CodeType], bool] = lambda code: True
        # Set once a model's forward is hot: every model forward (``model_forward(code)``)
        # reaching the hook is compiled too, as ``torch.compile(model)`` compiles the frames
        # its graph breaks leave (e.g. the layers below FSDP's hooks, which dynamo skips).
        self.model_forward: Callable[[CodeType], bool] | None = None
        self.tried: set[CodeType] = set()  # hot codes handed to the compile step at least once
        self.fallen: set[CodeType] = set()
        self._compile_frame = compile_frame
        self._is_user = is_user
        self._marked: set[CodeType] = set()
        self._marked_user: set[CodeType] = set()
        self._skip = ConvertFrameReturn()  # SKIP this code from now on (dynamo's default)
        self._skip_once = ConvertFrameReturn(
            frame_exec_strategy=FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT),
            apply_to_code=False,
        )
        ctx = eval_frame._optimize(rebuild_ctx=lambda: ctx, backend=backend)  # type: ignore[arg-type]
        self.inner = ctx.callback  # dynamo's convert_frame behind its error handling
        self.callback = _Callback(self, self.inner)
        self.installed = False
        self._prior: Any = None
        self._orig_set: Any = None
        self.installed_at_ns = 0
        self.paused = 0  # > 0 inside ``spmdgt.compile.plain_torch``: see ``pause``
        self._install_after = False

    # -- per frame ------------------------------------------------------------------------------
    def on_frame(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        code = frame.f_code
        if self.hot_keys and self._hot_by_key(code) and self.admits(code):
            self.hot.add(code)
        if code in self.hot or (code.co_name.startswith(_RESUME) and self.hot):
            if code in self.fallen:
                return self._skip
            self.tried.add(code)
            return self._compile_frame(frame, cache_entry, frame_state)
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        if _debug_get_cache_entry_list(code):  # compiled by the user: leave it theirs
            return self._skip_once
        if self.model_forward is not None and self.model_forward(code):
            below = self._below_compiled()
            if below:
                self.hot.add(code)
                self.tried.add(code)
                return self._compile_frame(frame, cache_entry, frame_state)
            if below is None:  # the model above still runs eagerly (its next call compiles)
                return self._skip_once
        self._marked.add(code)
        if self._is_user(code):
            self._marked_user.add(code)
        return self._skip

    def _below_compiled(self) -> bool | None:
        """Whether the frame about to run was called, at any depth, from a frame dynamo
        compiled (a graph break in a hot model's forward left this layer's forward a frame of
        its own): True; else from a hot frame running eagerly before its first compile (the
        call in which it turned hot): None (decided again at the next call); else False (a
        model that compiled whole never calls it; one that fell back runs it eagerly)."""
        import sys

        from torch._dynamo.utils import orig_code_map

        # the frame dynamo hands the hook has no f_back: the stack above it is the hook's own
        # (this function, on_frame, the callback), then the frames that made the call
        f = sys._getframe(1)
        depth = 0
        below_hot = False
        while f is not None and depth < 64:
            c = f.f_code
            if c in orig_code_map or c.co_name.startswith(_RESUME):
                return True
            below_hot = below_hot or (c in self.hot and c not in self.tried)
            f = f.f_back
            depth += 1
        return None if below_hot else False

    def _hot_by_key(self, code: CodeType) -> bool:
        import os

        key = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_qualname}"
        if key in self.hot_keys:
            self.hot_keys.discard(key)
            return True
        return False

    def lift_marks(self) -> None:
        """Forget every SKIP mark but the fallen's, so a code turned hot elsewhere reaches the
        callback again at its next call."""
        codes = list(self._marked - self.fallen)
        self._set_default(codes)
        self._marked.difference_update(codes)
        self._marked_user.difference_update(codes)

    def fall_back(self, code: CodeType) -> None:
        """Run ``code`` eagerly from now on (outside a frame callback too)."""
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        self.fallen.add(code)
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))
        self._marked.add(code)

    def unmark(self, code: CodeType) -> None:
        """Forget a SKIP mark (a code that turned hot after it was marked)."""
        if code in self._marked:
            self._set_default([code])
            self._marked.discard(code)
            self._marked_user.discard(code)

    # -- install ------------------------------------------------------------------------------
    def pause(self) -> Any:
        """Out until ``resume``: dynamo's frame callback is None, so no frame is compiled and
        compiled code runs eagerly (a ``torch.compile`` of the program's own sets its own
        callback, as in one process). An ``install`` asked for meanwhile (a code turned hot)
        waits for the last ``resume``. Returns what ``resume`` restores."""
        from torch._C._dynamo.eval_frame import set_eval_frame

        self.paused += 1
        return set_eval_frame(None)

    def resume(self, prior: Any) -> None:
        from torch._C._dynamo.eval_frame import set_eval_frame

        set_eval_frame(prior)
        self.paused -= 1
        if not self.paused and self._install_after:
            self._install_after = False
            self.install()

    def install(self) -> None:
        """Put the hook in (this thread: the rank's), and watch for the user's regions."""
        if self.installed:
            return
        if self.paused:
            self._install_after = True
            return
        from torch._C._dynamo.eval_frame import set_eval_frame
        from torch._dynamo import eval_frame

        self._orig_set = eval_frame._maybe_set_eval_frame
        orig, ours = self._orig_set, self.callback
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        def switch(callback: Any) -> Any:
            # a torch.compile region of the user's starts: lift our marks on user code
            if (
                callback not in (None, False)
                and callback is not ours
                and self._marked_user
                and get_eval_frame_callback() is ours
            ):
                self._lift_user_marks()
            return orig(callback)

        eval_frame._maybe_set_eval_frame = switch
        self._prior = set_eval_frame(self.callback)
        self.installed = True
        self.installed_at_ns = time.perf_counter_ns()
        if _debuglog.COMPILE:
            _debuglog.debug("compile", "frame hook installed")

    def uninstall(self) -> None:
        """Remove the hook and every mark it left (no trace in dynamo's tables)."""
        if not self.installed:
            return
        from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame
        from torch._dynamo import eval_frame

        if get_eval_frame_callback() is self.callback:
            set_eval_frame(self._prior)
        if eval_frame._maybe_set_eval_frame is not self._orig_set:
            eval_frame._maybe_set_eval_frame = self._orig_set
        self._set_default(list(self._marked))  # the fallen too: the pass is over
        self._marked.clear()
        self._marked_user.clear()
        self.installed = False

    def _lift_user_marks(self) -> None:
        codes = list(self._marked_user - self.fallen)
        self._set_default(codes)
        self._marked.difference_update(codes)
        self._marked_user.clear()

    @staticmethod
    def _set_default(codes: list[CodeType]) -> None:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
        for code in codes:
            set_code_exec_strategy(code, default)
