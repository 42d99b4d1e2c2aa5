"""bench_trainer's compile section: one training step of the example transformer, eager vs
hand ``torch.compile`` vs ``TrainConfig(compile=True)`` vs ``GT_AUTO_COMPILE=1``, alternating,
each side's cold compile timed in a fresh process (``python benchmarks/bench_trainer.py
--compile-only``; ``bench_compile.py``'s transformer case runs that)."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from _example import ROOT
from _example import load_example as _example
from _results import Progress


def _peak_flops(dtype_bf16: bool) -> float | None:
    """Dense peak FLOP/s of the current CUDA device (H100/H200 SXM figures), None if unknown."""
    import torch

    name = torch.cuda.get_device_name()
    if "H100" in name or "H200" in name:
        if dtype_bf16:
            return 989.4e12
        return 494.7e12 if torch.backends.cuda.matmul.allow_tf32 else 66.9e12
    if "A100" in name:
        return 312e12 if dtype_bf16 else 19.5e12
    return None


def _flops_per_step(model, args) -> float:
    """6 N T + 12 L d s T (N: parameters outside the embedding; T tokens per step)."""
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed"))
    tokens = args.batch_size * args.seq_len
    return 6 * n * tokens + 12 * args.layers * args.dim * args.seq_len * tokens


def _compile_model(args, ex):
    import torch

    torch.manual_seed(0)
    margs = ex.ModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=2 * args.dim,
        max_seq_len=args.seq_len,
    )
    model = ex.Transformer(margs)
    # room for the pass side's longer warm-up: every side reads the same data in one order
    steps = args.steps + 2 + max(args.warmup, _PASS_WARMUP_MAX)
    n_tok = steps * args.batch_size * args.seq_len + 1
    ds = ex.TokenDataset(ex.load_tokens(None, n_tok, 256, 0), args.seq_len)
    return model, ds


def _hand_side(args, ex, compiled: bool) -> dict:
    """The hand-written loop (same sampler order as the trainer's), blocks compiled by hand."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from spmdgt.train._compile import compile_seconds

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, ds = _compile_model(args, ex)
    model = model.to(device)
    if compiled:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=args.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times, losses = [], []
    warmup = args.warmup
    settle = getattr(args, "settle", 0)
    quiet = 0  # steps in a row without a compile (the pass side warms up until ``settle``)
    c_start = compile_seconds()[0]
    timed_compile = 0.0
    t0 = time.perf_counter()
    for x, y in loader:
        c0 = compile_seconds()[0]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with amp:
            loss = ex.lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a sync on CUDA
        t1 = time.perf_counter()
        times.append(t1 - t0)
        compiled_now = compile_seconds()[0] - c0
        if len(times) > warmup:
            timed_compile += compiled_now
        elif settle:  # the warm-up goes on until the pass has compiled nothing for a while
            quiet = 0 if compiled_now else quiet + 1
            if quiet < settle and len(times) < _PASS_WARMUP_MAX:
                warmup += 1
        t0 = t1
        if len(times) == warmup + args.steps:
            break
    return {
        "step": statistics.fmean(times[warmup:]),
        "losses": losses,
        "compile_sec": compile_seconds()[0] - c_start,
        "compile_in_timed": timed_compile,
    }


_PASS_SETTLE = 40  # the pass's warm-up ends after this many steps in a row with no compile
_PASS_WARMUP_MAX = 120  # ... or at this many steps (a function that turns hot later than this
# compiles inside the timed steps, and the report's "compile seconds inside timed steps" says so)


def _pass_side(args, ex, compiled: bool, both: bool = False) -> dict:
    """The eager hand loop with the compile pass on (``GT_AUTO_COMPILE=1``): the model's hot
    functions are found by op count and compiled by dynamo, no change to the loop; ``both``:
    lazy regions everywhere too (``GT_WORKER_BATCH_SIZE=256``). A small function (the loss, ~4
    ops a step) turns hot only after ~32 steps (one op sampled in 16, hot at 8 samples), so the
    warm-up lasts until the pass has compiled nothing for ``_PASS_SETTLE`` steps: the timed
    steps are the steady state a long run has, with no compile inside them. Run in a fresh process
    each round (``compile_section``), as a user's run has it: a second pass in one process
    would take the first one's compiled functions for the user's."""
    import argparse

    import spmdgt.compile as gt_compile

    more = argparse.Namespace(**vars(args))
    more.settle = _PASS_SETTLE  # the data stay the other sides' (see _compile_model)
    gt_compile.enable(backend=args.compile_backend)
    if both:
        gt_compile.enable_regions(batch=256, backend=args.compile_backend)
    try:
        out = _hand_side(more, ex, False)
        out["pass"] = gt_compile.stats()
        out["warmup_steps"] = len(out["losses"]) - args.steps
    finally:
        gt_compile.disable()
        if both:
            gt_compile.disable_regions()
    return out


def _both_side(args, ex, compiled: bool) -> dict:
    """``_pass_side`` with both halves on (hot functions and lazy regions everywhere)."""
    return _pass_side(args, ex, compiled, both=True)


def _trainer_side(args, ex, compiled: bool) -> dict:
    import contextlib
    import io

    import torch

    from spmdgt.train import DistributedTrainer, OptimizedDataLoader, TrainConfig, TrainingConfig

    model, ds = _compile_model(args, ex)
    cfg = TrainConfig(
        compile=compiled,
        compile_backend=args.compile_backend,
        training=TrainingConfig(warmup_steps=args.warmup),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = DistributedTrainer(
        model,
        opt,
        loss_fn=ex.lm_loss,
        max_grad_norm=1.0,
        config=cfg,
        use_amp=torch.cuda.is_available(),
        log_every=args.warmup + args.steps,
    )
    loader = OptimizedDataLoader.create(ds, args.batch_size, seed=0, num_workers=0)
    with contextlib.redirect_stdout(io.StringIO()):
        s = t.train(loader, max_steps=args.warmup + args.steps)
    st = t.last_stats
    return {
        "step": s["avg_step_time"],
        "losses": st.global_losses,
        "compile_sec": s.get("compile_time_sec", 0.0),
        "compile_in_timed": sum(st.compile_sec[args.warmup :]),
        "fallback": s.get("compile_fallback", "none"),
    }


_SIDES = {
    "eager (hand loop)": (_hand_side, False),
    "hand torch.compile": (_hand_side, True),
    "trainer eager": (_trainer_side, False),
    "trainer compile=True": (_trainer_side, True),
    "GT_AUTO_COMPILE=1": (_pass_side, False),
    "both halves": (_both_side, False),
}
_FRESH = (_pass_side, _both_side)  # run in a fresh process each round (see _pass_side)


def _cold_compile_child(args, name: str, cache_dir: str, conn) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch is imported here
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    fn, compiled = _SIDES[name]
    out = fn(args, _example(), compiled)
    conn.send(out)
    conn.close()


def _cold_compile(args, name: str) -> dict:
    """One run of ``name`` in a fresh process with an empty inductor cache directory, so
    each side's compile time is a cold one (no kernel or graph compiled by the other side)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as cache:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_cold_compile_child, args=(args, name, cache, child))
        proc.start()
        child.close()
        try:
            out = parent.recv()
        except EOFError:
            proc.join(timeout=30)
            raise RuntimeError(
                f"the fresh process timing {name!r} died without a result (exit code "
                f"{proc.exitcode}; a negative code is the signal that ended it)"
            ) from None
        proc.join()
    return out


def compile_section(args) -> dict:
    """Eager vs hand compile vs ``TrainConfig(compile=True)``, alternating; see the docstring."""
    import torch

    torch.set_num_threads(args.threads)
    ex = _example()
    say = Progress("bench_trainer compile")
    out = {"cold": {}, "runs": {n: [] for n in _SIDES}}
    for name in ("hand torch.compile", "trainer compile=True"):
        say(f"cold compile of {name!r} in a fresh process")
        out["cold"][name] = _cold_compile(args, name)
    names = list(_SIDES)
    for i in range(args.compile_rounds):
        say(f"round {i + 1}/{args.compile_rounds} of the {len(names)} sides")
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            fn, compiled = _SIDES[name]
            if fn in _FRESH:  # the pass once per process, as a user's run has it
                out["runs"][name].append(_cold_compile(args, name))
            else:
                out["runs"][name].append(fn(args, ex, compiled))
    model, _ = _compile_model(args, ex)
    out["flops"] = _flops_per_step(model, args)
    out["cuda"] = torch.cuda.is_available()
    out["device"] = torch.cuda.get_device_name() if out["cuda"] else "CPU"
    out["peak"] = _peak_flops(True) if out["cuda"] else None
    return out


def report_compile(out: dict, args) -> None:
    dev = out["device"]
    prec = "bf16 autocast" if out["cuda"] else f"fp32, {args.threads} thread(s)"
    print(
        f"\ncompile: one training step (forward, loss, backward, clip, AdamW) of the example "
        f"transformer dim={args.dim} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"seq={args.seq_len} batch={args.batch_size}, world of one on {dev} ({prec}), backend "
        f"{args.compile_backend}; {args.steps} timed steps after {args.warmup} warm-up "
        f"(the pass's sides: until it compiles no more), median of {args.compile_rounds} "
        "alternating rounds"
    )
    eager = statistics.median(r["step"] for r in out["runs"]["eager (hand loop)"])
    hand = statistics.median(r["step"] for r in out["runs"]["hand torch.compile"])
    ref = out["runs"]["eager (hand loop)"][0]["losses"]
    hdr = (
        f"  {'side':<22}{'ms/step':>9}{'range ms':>17}{'vs eager':>10}{'vs hand':>9}"
        f"{'compile s':>11}{'max |dloss|':>13}" + (f"{'MFU':>7}" if out["peak"] else "")
    )
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for name, runs in out["runs"].items():
        steps = [r["step"] for r in runs]
        med = statistics.median(steps)
        cold = out["cold"].get(name)
        comp = f"{cold['compile_sec']:>11.2f}" if cold else f"{'-':>11}"
        dloss = max(abs(a - b) for r in runs for a, b in zip(r["losses"], ref))
        line = (
            f"  {name:<22}{med * 1e3:>9.2f}{f'{min(steps) * 1e3:.2f}..{max(steps) * 1e3:.2f}':>17}"
            f"{eager / med:>9.2f}x{hand / med:>8.2f}x{comp}{dloss:>13.2e}"
        )
        if out["peak"]:
            line += f"{out['flops'] / med / out['peak'] * 100:>6.1f}%"
        print(line)
    tr = statistics.median(r["step"] for r in out["runs"]["trainer compile=True"])
    leaked = max(r["compile_in_timed"] for rs in out["runs"].values() for r in rs)
    for name in ("GT_AUTO_COMPILE=1", "both halves"):
        ps = out["runs"][name][-1].get("pass", {})
        pa = statistics.median(r["step"] for r in out["runs"][name])
        warm = sorted(r.get("warmup_steps", 0) for r in out["runs"][name])
        print(
            f"  {name}: {eager / pa:.2f}x eager, {hand / pa:.2f}x hand compile; warm-up until "
            f"no compile for {_PASS_SETTLE} steps: {warm[0]}-{warm[-1]} steps; functions "
            f"compiled {ps.get('compiled')}, fallbacks {dict(ps.get('fallbacks') or {})}"
        )
    fallbacks = {r.get("fallback", "none") for r in out["runs"]["trainer compile=True"]}
    print(
        f"  targets: trainer compile=True no slower than eager: {tr / eager - 1:+.1%} "
        f"({'met' if tr <= eager else 'NOT met'}); within 15% of hand compile: "
        f"{tr / hand - 1:+.1%} ({'met' if tr <= 1.15 * hand else 'NOT met'})"
    )
    print(
        "  (ms/step: median over rounds of each run's mean timed step; range: min..max over "
        "rounds; vs eager/hand: speed-up\n   against the eager hand loop / the hand-compiled "
        "loop; compile s: a cold compile (a fresh process, empty inductor\n   cache dir), "
        "dynamo's compile callbacks, forward and backward; max |dloss|: largest per-step loss "
        "difference\n   from the eager hand loop over every run (same data order); compile "
        f"seconds inside timed steps: {leaked:.3f};\n   trainer fallbacks: "
        f"{', '.join(sorted(fallbacks))})"
    )
