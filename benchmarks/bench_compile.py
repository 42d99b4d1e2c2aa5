"""The compile pass against eager and hand-written ``torch.compile``, side by side.

    python benchmarks/bench_compile.py [--rounds 5] [--backend inductor] [--both] [--json PATH]

One process, 1 CPU thread. Every case times its variants in alternation (``--rounds`` rounds,
best round kept), after a warm-up that is not timed; compile times are reported apart. Targets:

- ``chain``: 25 pointwise ops on 1M elements: eager, hand ``torch.compile``, ``GT_AUTO_COMPILE``
  (the pass); the pass's speed-up >= 0.8 of hand compile's.
- ``small``: a function of small ops (10 x ``c = c * b + a``, 64x64): the pass >= 1.2x eager;
  hand ``torch.compile`` beside it, the ceiling (a compiled call's own cost, dynamo's guards and
  AOTAutograd's wrappers, is ~50 us on a 2-core CPU: more than the function's 20 ops).
- ``module``: a module-level small-op loop, pass on and nothing hot: <= 1.3x eager.
- ``user``: the user's own ``torch.compile`` of the chain with the interceptor and the pass on:
  <= 1.1x its time without them.
- ``scope2``: the chain in a ``compile: true`` scope (lazy regions): sharded on 2 forked ranks
  against eager on 2 ranks, and on 1 process (plain tensors) against eager and hand compile.
- ``transformer`` (a training step): a hook for the trainer's ``compile=True``.

``--both``: both halves at once, as ``GT_AUTO_COMPILE=1 GT_WORKER_BATCH_SIZE=256`` gives them:
lazy regions everywhere beside hot functions in every "pass" variant, and hot functions on for
``scope2``'s scope calls (its eager and hand variants run with them off: the pass would compile
"eager" too, as it did before 2026-11-29, when its ratios there measured nothing).

How the pass is toggled between variants without recompiling: the pass stays alive; "off" is
its frame hook out and the interceptor off (pure eager), "on" is the interceptor back on (the
sampler re-attached) and, once something is hot, the hook back in (dynamo's cache entries for
the pass's backend are still on the code objects, so nothing recompiles).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(
    0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
)  # the scope2 case's ranks
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import Progress, write

Case = tuple[list[str], dict]
"""What a case returns: its printed lines and its figures (seconds, ratios) for ``--json``."""

N_CHAIN = 1_000_000


def chain(x: torch.Tensor) -> torch.Tensor:
    """25 pointwise ops."""
    for i in range(25):
        x = torch.sin(x) if i % 2 else x * 1.0001 + 0.0001
    return x


def small(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """10 x ``c = c * b + a`` on 64x64."""
    c = torch.zeros_like(a)
    for _ in range(10):
        c = c * b + a
    return c


_MODULE_LOOP = """
c = torch.zeros_like(a)
for _ in range(n):
    c = c * b + a
"""


def _copy(fn: Callable, name: str) -> Callable:
    """The same function under another code object (the pass and the hand compile must not
    share one: a code the user compiled is never compiled by the pass)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class _Pass:
    """The pass, switched on and off between timed variants (see the module docstring)."""

    def __init__(self, backend: str, both: bool = False) -> None:
        import spmdgt.compile as gt_compile

        os.environ.pop("GT_COMPILE", None)
        gt_compile.enable(backend=backend)
        self.p = gt_compile._hot
        self.level = self.p._ic.level
        self.both = both
        self.regions: Any = None
        if both:  # lazy regions everywhere too; their hook goes with "off"
            assert gt_compile.enable_regions(batch=256, backend=backend)
            self.regions = gt_compile._regions

    def on(self) -> None:
        from spmdgt.interceptor import _control

        if self.regions is not None:
            self.regions._hook(True)
        if not self.p._ic.active:
            _control.enable(stats=False, hotpath=False, level=self.level, sampling_only=True)
        if self.p.hook.hot:
            self.p.hook.install()

    def off(self) -> None:
        from spmdgt.interceptor import _control

        self.p.hook.uninstall()
        if self.regions is not None:
            self.regions.flush("bench off")
            self.regions._hook(False)
        _control.disable()

    def stats(self) -> dict:
        return self.p.snapshot()

    def done(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` whose result is computed when it returns: with ``--both`` a call may leave
        its ops recorded in an open region (a result never read is never computed)."""
        if self.regions is None:
            return fn
        regions = self.regions

        def call() -> object:
            out = fn()
            regions.flush("bench")
            return out

        return call

    def compiled(self) -> int:
        """Functions compiled by hot functions, and with ``--both`` region graphs too."""
        n = self.stats()["compiled"]
        if self.regions is not None:
            n += self.regions.snapshot()["compiled"]
        return n


def _best(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _rounds(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, run in variants.items():
            best[name] = min(best[name], run())
    return best


def _warm_until_compiled(pss: _Pass, fn: Callable[[], object], limit: int = 2000) -> float:
    """Call ``fn`` with the pass on until the pass has compiled it; returns the seconds."""
    before = pss.compiled()
    fn = pss.done(fn)
    t0 = time.perf_counter()
    for _ in range(limit):
        fn()
        if pss.compiled() > before:
            fn()  # one compiled run: the first run of a graph is part of its compile
            return time.perf_counter() - t0
    raise RuntimeError("the pass did not compile the function: is it hot? (GT_DEBUG_COMPILE=1)")


def case_chain_and_user(pss: _Pass, rounds: int) -> Case:
    x = torch.randn(N_CHAIN)
    hand_fn = _copy(chain, "chain_hand")
    user_fn = _copy(chain, "chain_user")
    pass_fn = _copy(chain, "chain_pass")
    hand = torch.compile(hand_fn)
    user = torch.compile(user_fn)
    pss.off()
    t0 = time.perf_counter()
    hand(x)
    hand_compile = time.perf_counter() - t0
    user(x)
    pss.on()
    t_pass = _warm_until_compiled(pss, lambda: pass_fn(x))
    pass_compile = pss.stats()["compile_time_s"] + (
        pss.regions.snapshot()["compile_time_s"] if pss.regions is not None else 0.0
    )
    user(x)  # under the interceptor and the pass: must not recompile

    def off(fn):
        def run():
            pss.off()
            return _best(fn, 10)

        return run

    def on(fn):
        def run():
            pss.on()
            return _best(fn, 10)

        return run

    best = _rounds(
        {
            "eager": off(lambda: chain(x)),
            "hand": off(lambda: hand(x)),
            "pass": on(pss.done(lambda: pass_fn(x))),
            "user_off": off(lambda: user(x)),
            "user_on": on(pss.done(lambda: user(x))),
        },
        rounds,
    )
    pss.off()
    e, h, p = best["eager"], best["hand"], best["pass"]
    frac = (e / p) / (e / h)
    ratio = best["user_on"] / best["user_off"]
    figs = {
        "chain": {
            "eager_s": e,
            "hand_s": h,
            "pass_s": p,
            "speedup_hand": e / h,
            "speedup_pass": e / p,
            "pass_over_hand_gain": frac,
            "target_min_pass_over_hand_gain": 0.8,
            "compile_s": {"hand": hand_compile, "pass": pass_compile, "warmup_pass": t_pass},
        },
        "user": {
            "pass_off_s": best["user_off"],
            "pass_on_s": best["user_on"],
            "ratio": ratio,
            "target_max_ratio": 1.1,
        },
    }
    return [
        f"chain   eager {e * 1e3:8.2f} ms  hand {h * 1e3:8.2f} ms ({e / h:.2f}x)  "
        f"pass {p * 1e3:8.2f} ms ({e / p:.2f}x)  pass/hand speed-up {frac:.2f} "
        f"(target >= 0.80: {'ok' if frac >= 0.8 else 'MISSED'})  "
        f"compile: hand {hand_compile:.1f}s, pass {pass_compile:.1f}s "
        f"(warm-up until compiled {t_pass:.1f}s)",
        f"user    own torch.compile: pass off {best['user_off'] * 1e3:8.2f} ms  "
        f"pass on {best['user_on'] * 1e3:8.2f} ms  ratio {ratio:.2f} "
        f"(target <= 1.10: {'ok' if ratio <= 1.1 else 'MISSED'})",
    ], figs


def case_small(pss: _Pass, rounds: int) -> Case:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    fn = _copy(small, "small_pass")
    pss.on()
    before = pss.stats()["compile_time_s"]
    _warm_until_compiled(pss, lambda: fn(a, b))
    compile_s = pss.stats()["compile_time_s"] - before

    pss.off()
    hand = torch.compile(_copy(small, "small_hand"))
    hand(a, b)  # its compile, apart

    def eager():
        pss.off()
        return _best(lambda: small(a, b), 300)

    def handed():  # the ceiling: torch.compile's own call costs ~50 us on this 2-core CPU
        pss.off()
        return _best(lambda: hand(a, b), 300)

    def on():
        pss.on()
        return _best(pss.done(lambda: fn(a, b)), 300)

    best = _rounds({"eager": eager, "hand": handed, "pass": on}, rounds)
    pss.off()
    s = best["eager"] / best["pass"]
    h = best["eager"] / best["hand"]
    figs = {
        "small": {
            "eager_s": best["eager"],
            "hand_s": best["hand"],
            "pass_s": best["pass"],
            "speedup": s,
            "hand_speedup": h,
            "target_min_speedup": 1.2,
            "compile_s": compile_s,
        }
    }
    return [
        f"small   eager {best['eager'] * 1e6:8.1f} us  hand {best['hand'] * 1e6:8.1f} us "
        f"({h:.2f}x)  pass {best['pass'] * 1e6:8.1f} us ({s:.2f}x; "
        f"target >= 1.20: {'ok' if s >= 1.2 else 'MISSED'}; pass/hand time "
        f"{best['pass'] / best['hand']:.2f})  compile {compile_s:.1f}s"
    ], figs


def case_module(pss: _Pass, rounds: int) -> Case:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    code = compile(_MODULE_LOOP, "bench_module_loop.py", "exec")  # its code is <module>
    n = 2000

    def run_loop():
        exec(code, {"torch": torch, "a": a, "b": b, "n": n})

    def eager():
        pss.off()
        return _best(run_loop, 3) / (2 * n)

    def on():
        pss.on()
        pss.p.hook.uninstall()  # "nothing hot": the hook is not in
        return _best(pss.done(run_loop), 3) / (2 * n)

    best = _rounds({"eager": eager, "pass": on}, rounds)
    pss.off()
    r = best["pass"] / best["eager"]
    figs = {
        "module": {
            "eager_s_per_op": best["eager"],
            "pass_s_per_op": best["pass"],
            "ratio": r,
            "target_max_ratio": 1.3,
            "interceptor_level": pss.level,
        }
    }
    return [
        f"module  eager {best['eager'] * 1e6:8.2f} us/op  pass on, nothing hot "
        f"{best['pass'] * 1e6:8.2f} us/op  ratio {r:.2f} (target <= 1.30: "
        f"{'ok' if r <= 1.3 else 'MISSED'}; interceptor level {pss.level})"
    ], figs


def _scope_rank(
    rank: int, world: int, rounds: int, backend: str, both: bool = False
) -> dict[str, float]:
    """One rank of ``scope2`` (a forked child: hot functions, inherited from the parent, goes
    off; ``both``: a fresh one on, beside the lazy regions). World 2: the chain on a sharded
    gt.Tensor (1M rows over the ranks) in a ``compile: true`` scope and in a plain one. World 1:
    plain tensors, eager, hand ``torch.compile`` and the scope. Alternating rounds; a host read
    ends a call."""
    import spmdgt as gt
    import spmdgt.compile as gt_compile

    gt_compile.disable_regions()
    gt_compile.disable()
    pss = _Pass(backend) if both else None  # hot functions, on for the scope's calls only
    torch.set_num_threads(1)
    assert gt_compile.enable_regions(backend=backend)
    gt.register_config("rows", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
    gt.register_config("hot", gt.SignalConfig(compile=True))
    gt.register_config("cold", gt.SignalConfig())
    if world > 1:
        with gt.signal.context("rows"):
            x = gt.tensor(torch.randn(N_CHAIN).numpy())
    else:
        x = torch.randn(N_CHAIN)

    def scoped(scope: str) -> Callable[[], object]:
        def call() -> object:
            with gt.signal.context(scope):
                y = chain(x)
            return y.sum().item()

        return call

    variants = {"eager": scoped("cold"), "scope": scoped("hot")}
    hand = torch.compile(_copy(chain, "chain_scope_hand"))

    def handed() -> object:
        with gt.signal.context("cold"):
            return hand(x).sum().item()

    variants["hand"] = handed

    def switch(name: str) -> None:
        """Hot functions on for the scope only: eager is eager, and hand is torch's own."""
        if pss is not None:
            pss.on() if name == "scope" else pss.off()

    def timed(name: str) -> float:
        switch(name)
        if pss is not None:
            variants[name]()  # (switching the pass costs ms: not the variant's time)
        return _best(variants[name], 3)

    t0 = time.perf_counter()
    for name, fn in variants.items():
        switch(name)
        fn()  # warm-up; the scope's first call compiles its graphs
    if pss is not None:  # and the hot-function pass compiles the chain, once it is hot
        pss.on()
        _warm_until_compiled(pss, variants["scope"], limit=400)
    first = time.perf_counter() - t0
    best = _rounds({k: (lambda k=k: timed(k)) for k in variants}, rounds)
    st = gt_compile.stats()["regions"]
    best.update(first=first, captured=st["ops_captured"], compiled=st["compiled"])
    best["fallbacks"] = st["fallbacks"]
    return best


def case_scope2(pss: _Pass, rounds: int) -> Case:
    # The chain in a YAML `compile: true` scope: sharded over 2 forked gloo ranks (as
    # tests/_dist.py starts them) against eager on 2 ranks; and on one process, plain tensors,
    # against eager and hand torch.compile.
    import tempfile
    from pathlib import Path

    from tests._dist import run_ranks

    backend = pss.p.backend_name
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        two = run_ranks(_scope_rank, 2, Path(tmp), rounds, backend, pss.both, env=env, timeout=600)
    for r, b in enumerate(two):
        lines.append(
            f"scope2  rank {r}/2 sharded: eager {b['eager'] * 1e3:8.2f} ms  hand compile "
            f"{b['hand'] * 1e3:8.2f} ms ({b['eager'] / b['hand']:.2f}x)  compile: true scope "
            f"{b['scope'] * 1e3:8.2f} ms ({b['eager'] / b['scope']:.2f}x; "
            f"{(b['eager'] / b['scope'] - 1) / (b['eager'] / b['hand'] - 1):.2f} of hand's gain) "
            f"(ops captured {b['captured']}, graphs {b['compiled']}, fallbacks {b['fallbacks']})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        [b] = run_ranks(_scope_rank, 1, Path(tmp), rounds, backend, pss.both, env=env, timeout=600)
    lines.append(
        f"scope1  1 rank plain: eager {b['eager'] * 1e3:8.2f} ms  hand compile "
        f"{b['hand'] * 1e3:8.2f} ms ({b['eager'] / b['hand']:.2f}x)  compile: true scope "
        f"{b['scope'] * 1e3:8.2f} ms ({b['eager'] / b['scope']:.2f}x; warm-up incl. compiles "
        f"{b['first']:.1f}s; graphs {b['compiled']}, fallbacks {b['fallbacks']})"
    )
    keys = ("eager", "hand", "scope", "first", "captured", "compiled", "fallbacks")
    figs = {
        "scope2": [{k: r.get(k) for k in keys} for r in two],
        "scope1": {k: b.get(k) for k in keys},
    }
    return lines, figs


def case_transformer(pss: _Pass, rounds: int) -> Case:
    """One training step of examples/train_transformer.py: eager, hand ``torch.compile``,
    ``TrainConfig(compile=True)`` and ``GT_AUTO_COMPILE=1`` (MFU on a GPU). It lives in
    ``bench_trainer.py``'s compile section, which this runs (each side's cold compile in a
    fresh process; its own table)."""
    import json
    import subprocess
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trainer.json")
        cmd = [sys.executable, os.path.join(here, "bench_trainer.py"), "--compile-only"]
        cmd += ["--compile-rounds", str(rounds), "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            err = proc.stderr[-2000:]
            return [f"transformer: bench_trainer.py --compile-only failed:\n{err}"], {}
        with open(out) as f:
            figs = {"transformer": json.load(f)["results"].get("compile")}
    text = proc.stdout[proc.stdout.index("compile: one training step") :]
    text = text[: text.index("results written to")] if "results written to" in text else text
    return ["transformer " + text.rstrip()], figs


CASES: dict[str, Callable[[_Pass, int], Case]] = {
    "chain": case_chain_and_user,
    "small": case_small,
    "module": case_module,
    "scope2": case_scope2,
    "transformer": case_transformer,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    ap.add_argument("--both", action="store_true", help="lazy regions everywhere too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pss = _Pass(args.backend, args.both)
    print(
        f"bench_compile: torch {torch.__version__}, 1 thread, backend {args.backend}, "
        f"interceptor level {pss.level}, best of {args.rounds} alternating rounds"
    )
    progress = Progress("bench_compile")
    figures: dict = {}
    for name in args.cases.split(","):
        progress(f"case {name}")
        lines, figs = CASES[name](pss, args.rounds)
        figures.update(figs)
        for line in lines:
            print(line, flush=True)
    stats = pss.stats()
    print("pass stats:", stats)
    if args.json:
        write(
            args.json,
            "compile",
            {"cases": figures, "rounds": args.rounds, "backend": args.backend, "pass": stats},
            device="cpu",
            world_size=1,
            threads={"per_rank": 1},
        )


if __name__ == "__main__":
    main()
