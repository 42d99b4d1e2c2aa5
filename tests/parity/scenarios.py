"""The scenario sweeps: whole user patterns that the op-by-op sweep cannot reach.

The OpInfo and training-pattern sweeps run one op and compare its outputs and its inputs'
gradients. Some contracts live between ops: an optimizer's ``step()`` over three steps and
its state dict, ``torch.autograd.grad`` with respect to a parameter upstream, a composite
random op and the generator's state after it. A *scenario* is such a pattern written as a
function of a :class:`Case`; it runs in one process on plain tensors (the reference) and on
every rank of a fresh gloo group with its tensors laid out per a layout, and everything it
returns is compared.

Families and their modules (each exposes ``SCENARIOS``, and ``PLANTED``: scenarios wrong on
purpose, which must come out ``differs``)::

    optim     tests/parity/optimizers.py     every torch.optim implementation, 3 steps
    autograd  tests/parity/autograd_apis.py  every autograd entry point
    random    tests/parity/random_ops.py     every op that draws, and the generator after
    state     tests/parity/state_patterns.py generator states restored, modules' own writes,
                                             custom Functions, hooks, accumulated gradients

A row is ``(scenario name, "scenario", layout, world)`` in ``tests/parity/ledger.csv``, beside
the OpInfo and training rows, with the same outcomes (``verdict.py``): ``equal``, ``raises``
(every rank raised the same error), ``differs``, ``disagree``, ``hang``, ``crash``.

    python -m tests.parity.scenarios --family optim            # every optim row
    python -m tests.parity.scenarios --family all --sample 60  # a seeded slice
    python -m tests.parity.scenarios --names optim.Adam.fused --update-ledger

How a group runs: the rows of one (world, layout) run as one forked group, scenario after
scenario. Before each, every rank (and the reference) seeds torch with the scenario's stable
seed, so scenarios that draw start alike. After each, the ranks check that the group is still
in step (an all-reduce of the scenario's index); a group that fell out of step (one rank
raised inside a collective another entered) stops, and a fresh group picks up at the next
scenario. Each rank writes each result to a file as it goes, so a hang or a crash is pinned
on the scenario that had no result from some rank. ``GT_TIMEOUT`` is short in the ranks, so
a collective that waits for a rank that left turns into an error instead of a hang.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.parity import ledger
from tests.parity.layouts import PLACEMENTS_2D, WORLD_2D, min_dim, rank_layout
from tests.parity.prepare import RowKey, plain_torch, stable_seed
from tests.parity.sweep import SweepResult, line, report, summary
from tests.parity.verdict import CRASH, DIFFERS, DISAGREE, EQUAL, HANG, RAISES

__all__ = [
    "FAMILIES",
    "Case",
    "Scenario",
    "check_family",
    "family_rows",
    "run_planted",
    "run_rows",
    "scenarios",
]

FAMILIES: dict[str, str] = {
    "optim": "tests.parity.optimizers",
    "autograd": "tests.parity.autograd_apis",
    "random": "tests.parity.random_ops",
    "state": "tests.parity.state_patterns",
}
VARIANT = "scenario"
LAYOUTS: tuple[str, ...] = ("shard0", "shard1", "subrep", "shard0_empty", "mesh_s0s1")
_RANK_TIMEOUT = "30"  # GT_TIMEOUT in the ranks: a wait for a rank that left ends as an error
_GROUP_SECONDS = 90.0  # forking, joining, meshes on 2 shared cores; then per scenario:
_SCENARIO_SECONDS = 40.0


@dataclass(frozen=True)
class Scenario:
    """A user pattern: ``run(case)`` returns named results (tensors, numbers, strings, and
    lists/tuples/dicts of those). ``mesh_*`` layouts run at world 4 only."""

    name: str
    run: Callable[[Case], dict[str, Any]]
    layouts: tuple[str, ...] = LAYOUTS
    worlds: tuple[int, ...] = (2, 3)
    atol: float = 1e-5  # fp32 sums in another order move the last digit or two
    rtol: float = 1e-5


class Case:
    """What a scenario sees: where it runs, how to lay out a tensor, how to read one back.

    ``layout`` is None in the one-process reference, and ``world`` is 1 there.
    """

    def __init__(self, layout: str | None, world: int, target: tuple[str, int]) -> None:
        self.layout, self.world = layout, world
        self._target = target  # the row's (layout, world), known to the reference too
        self._put = rank_layout(layout, world).put if layout is not None else None

    def rows(self, n: int) -> int:
        """Rows of a batch dim: ``n``, or ``world - 1`` under ``shard0_empty`` (the last
        rank's shard is then empty), in the reference and on the ranks alike."""
        layout, world = self._target
        return world - 1 if layout == "shard0_empty" else n

    def put(self, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        """A copy of plain ``t`` laid out per the layout (a leaf needing grad if asked).
        A tensor with fewer dims than the layout splits stays plain."""
        t = t.detach().clone()
        if self._put is not None and t.dim() >= min_dim(self.layout):
            t = self._put(t)
        return t.requires_grad_(requires_grad) if requires_grad else t

    def value(self, x: Any) -> Any:
        """The global value of ``x`` as plain, detached CPU tensors, through dicts, lists and
        tuples (a state dict). A collective for sharded tensors: every rank calls it."""
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            from spmdgt.tensor._moves import global_value

            return global_value(x).detach().cpu().clone()
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().clone()
        if isinstance(x, dict):
            return {k: self.value(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self.value(v) for v in x)
        return x


# -- the scenarios -------------------------------------------------------------------------


def scenarios(family: str = "all") -> dict[str, Scenario]:
    """Every scenario of ``family`` (or of all families), by name."""
    out: dict[str, Scenario] = {}
    for name, module in FAMILIES.items():
        if family in ("all", name):
            for sc in _module(module).SCENARIOS:
                out[sc.name] = sc
    return out


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return type("Empty", (), {"SCENARIOS": (), "PLANTED": ()})


def family_rows(
    family: str = "all",
    worlds: Iterable[int] = (2, 3, WORLD_2D),
    sample: int | None = None,
    seed: int = 0,
    names: Iterable[str] | None = None,
    table: dict[str, Scenario] | None = None,
) -> list[RowKey]:
    """The rows of ``family`` at ``worlds`` (2-D layouts at world 4 only), or a seeded sample."""
    table = table if table is not None else scenarios(family)
    wanted = set(names) if names else None
    rows = []
    for sc in table.values():
        if wanted is not None and sc.name not in wanted:
            continue
        for layout in sc.layouts:
            for w in worlds:
                fits = w == WORLD_2D if layout in PLACEMENTS_2D else w in sc.worlds
                if fits:
                    rows.append(RowKey(sc.name, VARIANT, layout, w))
    rows.sort()
    if sample is not None and sample < len(rows):
        rows = sorted(random.Random(seed).sample(rows, sample))
    return rows


# -- one rank of a group -------------------------------------------------------------------


def _error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def _rank_body(rank: int, world: int, table, names, layout, out_dir) -> None:
    import faulthandler

    import torch.distributed as dist

    for i, name in enumerate(names):
        sc = table[name]
        torch.manual_seed(stable_seed(name))
        case = Case(layout, world, (layout, world))
        # a rank silent for _SCENARIO_SECONDS dumps its stack into hang-RANK and exits: the
        # parent reads a non-empty file as a hang (the test group's own timeout is 30 min)
        with open(Path(out_dir) / f"hang-{rank}", "w") as watch:
            faulthandler.dump_traceback_later(_SCENARIO_SECONDS, exit=True, file=watch)
            try:
                result = ("ok", case.value(sc.run(case)))
            except Exception as e:
                result = ("raised", _error_text(e))
            finally:
                faulthandler.cancel_dump_traceback_later()
        with open(Path(out_dir) / f"{rank}-{i}.pkl", "wb") as f:
            pickle.dump(result, f)
        try:  # still in step? (an index that differs, or a broken group, stops the group)
            step = torch.tensor([i])
            dist.all_reduce(step)
            in_step = int(step) == i * world
        except Exception:
            in_step = False
        if not in_step:
            (Path(out_dir) / f"broken-{rank}").touch()
            return


def _run_group(table, names, layout, world) -> tuple[dict, str]:
    """Run ``names`` on one group; (``{(rank, i): result}``, "" or how the group ended)."""
    from tests._dist import run_ranks

    with tempfile.TemporaryDirectory(prefix="gt-scenarios-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        ended = ""
        try:
            run_ranks(
                _rank_body,
                world,
                Path(tmp),
                table,
                names,
                layout,
                str(out),
                env={"GT_TIMEOUT": _RANK_TIMEOUT},
                timeout=_GROUP_SECONDS + _SCENARIO_SECONDS * len(names),
            )
        except AssertionError as e:
            hung = any(f.stat().st_size for f in out.glob("hang-*"))
            ended = HANG if hung or "timed out" in str(e) else CRASH
        results = {}
        for f in out.glob("[0-9]*-*.pkl"):
            rank, i = (int(p) for p in f.stem.split("-"))
            results[rank, i] = pickle.loads(f.read_bytes())
        if any(out.glob("broken-*")) and not ended:
            ended = "broken"
        return results, ended


# -- judging -------------------------------------------------------------------------------


def _mismatch(got: Any, want: Any, sc: Scenario, where: str = "") -> str:
    """ "" when ``got`` equals ``want`` under the scenario's tolerance, else what differs."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{where}: {type(got).__name__} where {type(want).__name__} expected"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
        exact = not (want.is_floating_point() or want.is_complex())
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": sc.rtol, "atol": sc.atol}
        try:
            torch.testing.assert_close(got, want, equal_nan=True, **tol)
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            picked = [ln for ln in lines if "Greatest" in ln or "Mism" in ln] or lines[1:3]
            return f"{where}: {'; '.join(picked)[:200]}"
        return ""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"[:200]
        for k in want:
            m = _mismatch(got[k], want[k], sc, f"{where}.{k}" if where else str(k))
            if m:
                return m
        return ""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{where}: {got!r:.60} vs {want!r:.60}"
        for i, (g, w) in enumerate(zip(got, want)):
            m = _mismatch(g, w, sc, f"{where}[{i}]")
            if m:
                return m
        return ""
    if isinstance(want, float) and isinstance(got, (int, float)):
        close = abs(got - want) <= sc.atol + sc.rtol * abs(want) or (got != got and want != want)
        return "" if close else f"{where}: {got!r} vs {want!r}"
    return "" if got == want else f"{where}: {got!r:.60} vs {want!r:.60}"


def _judge(sc: Scenario, reference: tuple, ranks: list, ended: str) -> tuple[str, str]:
    if any(r is None for r in ranks):
        missing = [i for i, r in enumerate(ranks) if r is None]
        return (ended if ended in (HANG, CRASH) else HANG), f"no result from ranks {missing}"
    kinds = {status for status, _ in ranks}
    if kinds == {"raised"}:
        errors = {text for _, text in ranks}
        if len(errors) == 1:
            return RAISES, ranks[0][1]
        return DISAGREE, " | ".join(f"rank {i}: {t}" for i, (_, t) in enumerate(ranks))[:300]
    if len(kinds) > 1:
        said = [f"rank {i}: {t if s == 'raised' else 'returned'}" for i, (s, t) in enumerate(ranks)]
        return DISAGREE, " | ".join(said)[:300]
    if reference[0] == "raised":
        return DIFFERS, f"returned where torch raises {reference[1]}"
    wrong = [_mismatch(value, reference[1], sc) for _, value in ranks]
    if not any(wrong):
        return EQUAL, ""
    if all(wrong) and not any(_mismatch(v, ranks[0][1], sc) for _, v in ranks):
        return DIFFERS, wrong[0]
    return DISAGREE, next(w for w in wrong if w)


def _reference(sc: Scenario, layout: str, world: int) -> tuple:
    torch.manual_seed(stable_seed(sc.name))
    case = Case(None, 1, (layout, world))
    try:
        return ("ok", case.value(sc.run(case)))
    except Exception as e:
        return ("raised", _error_text(e))


def run_rows(
    rows: list[RowKey], table: dict[str, Scenario] | None = None, progress: bool = False
) -> SweepResult:
    """Run ``rows`` (scenario rows) and judge each against one process."""
    table = table if table is not None else scenarios()
    start = time.monotonic()
    result = SweepResult()
    groups: dict[tuple[int, str], list[str]] = {}
    for key in rows:
        groups.setdefault((key.world, key.placement), []).append(key.op)
    for (world, layout), names in sorted(groups.items()):
        pending = list(names)
        while pending:
            got, ended = _run_group(table, pending, layout, world)
            finished = 0
            while finished < len(pending) and all((r, finished) in got for r in range(world)):
                finished += 1
            for i in range(min(finished + 1, len(pending))):
                if i == finished and ended == "broken":
                    break  # the group stopped after the last finished one: not run
                sc = table[pending[i]]
                ranks = [got.get((r, i)) for r in range(world)]
                want = plain_torch(_reference, sc, layout, world)
                verdict = plain_torch(_judge, sc, want, ranks, ended)
                result.rows[RowKey(sc.name, VARIANT, layout, world)] = verdict
                if progress and verdict[0] != EQUAL:
                    print(f"  {verdict[0]:8} {sc.name} {layout} w{world}: {verdict[1]}")
            pending = pending[finished + (0 if ended == "broken" else 1) :]
            if ended == "broken" and finished == 0:
                pending = pending[1:]  # never loop on a group that cannot start
    result.seconds = time.monotonic() - start
    return result


# -- what tests call -----------------------------------------------------------------------


def check_family(family: str, sample: int | None = None, seed: int = 0) -> list[str]:
    """Run ``family``'s rows (or a seeded sample); the failing and regressed rows as lines."""
    result = run_rows(family_rows(family, sample=sample, seed=seed))
    cmp = ledger.compare(result.rows, ledger.read())
    lines = [line(k, *result.rows[k]) for k in cmp.failures]
    lines += [line(k, *result.rows[k]) + " (ledger: equal)" for k in cmp.regressions]
    return [*lines, summary(result)] if lines else []


def run_planted(
    planted: Iterable[Scenario], worlds: Iterable[int] = (2, 3)
) -> dict[RowKey, tuple[str, str]]:
    """Run scenarios wrong on purpose (a family's ``PLANTED``); each row's outcome."""
    table = {sc.name: sc for sc in planted}
    return run_rows(family_rows(worlds=worlds, table=table), table=table).rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.parity.scenarios", description=__doc__)
    p.add_argument("--family", choices=("all", *FAMILIES), default="all")
    p.add_argument("--names", type=lambda s: [n for n in s.split(",") if n])
    p.add_argument("--sample", type=int, metavar="N", help="N rows drawn with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worlds", type=lambda s: [int(w) for w in s.split(",")], default=[2, 3, 4])
    p.add_argument("--update-ledger", action="store_true", help="write the rows run")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    rows = family_rows(args.family, args.worlds, args.sample, args.seed, args.names)
    result = run_rows(rows, progress=not args.quiet)
    return 0 if report(result, update_ledger=args.update_ledger) else 1


if __name__ == "__main__":
    sys.exit(main())
