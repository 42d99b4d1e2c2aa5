"""A plan's result: the ranked table, why each candidate loses, and the winner as the
trainer's YAML."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

from spmdgt.train._config import TrainConfig
from spmdgt.train._plan._cost import Estimate
from spmdgt.train._plan._device import DeviceSpec

__all__ = ["Plan", "config_yaml"]

GiB = 2**30


def _why(e: Estimate, best: Estimate) -> str:
    """The largest term by which ``e``'s step exceeds the winner's, named."""
    c, b = e.candidate, best.candidate
    gaps = {
        "compute": e.compute - best.compute,
        "per-op cost": e.overhead - best.overhead,
        "optimizer": e.optimizer - best.optimizer,
        "communication": e.exposed - best.exposed,
    }
    term, gap = max(gaps.items(), key=lambda kv: kv[1])
    if gap <= 0:
        return "ties the winner"
    ms = f"+{gap * 1e3:.3g} ms"
    if term == "compute":
        if c.amp != b.amp:
            why = "fp32 peak" if not c.amp else "bf16 slower here"
        elif c.ac and not b.ac:
            why = "recomputes the forward (AC)"
        elif c.tp < b.tp:
            why = f"tp {c.tp} splits less of each matmul"
        else:
            why = "more FLOPs per rank"
        return f"compute {ms}: {why}"
    if term == "per-op cost":
        return f"per-op cost {ms}: {c.accumulation} micro-steps of {c.micro_batch}"
    if term == "optimizer":
        return f"optimizer {ms}: more state per rank"
    top = max(e.comm_parts.items(), key=lambda kv: kv[1], default=("", 0.0))[0]
    return f"communication {ms} ({top or 'exposed'})"


@dataclass
class Plan:
    """The searched space, priced: ``ranked`` (fits, fastest first) and ``dropped``."""

    world: int
    global_batch: int
    device: DeviceSpec
    budget: float
    ranked: list[Estimate]
    dropped: list[Estimate]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    base: TrainConfig | None = None
    memory_model: object = None
    """The calibrated ``MemoryModel`` (pass it to ``plan(memory_model=)`` to plan again
    without the dry runs)."""

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def config(self) -> TrainConfig:
        """The winner as the trainer's config."""
        if self.best is None:
            raise ValueError(self._nothing_fits())
        return self.best.candidate.config(self.base)

    def _nothing_fits(self) -> str:
        least = min(self.dropped, key=lambda e: e.memory, default=None)
        extra = f" (the smallest needs {least.memory / GiB:.2f} GiB)" if least else ""
        return (
            f"no candidate fits {self.budget / GiB:.2f} GiB per device{extra}: a larger world, "
            "a smaller global batch or a larger --memory"
        )

    def table(self, limit: int | None = 20, dropped: int | None = 10) -> str:
        head = (
            f"{'#':>3}  {'strategy':<10} {'mesh r x s x t':<9} {'micro-batch':<10} AC AMP  SP"
            f"  {'GiB':>7} {'ms/step':>9} {'tokens/s':>11} {'MFU':>6}  why it loses"
        )
        lines = [head]
        best = self.best
        for i, e in enumerate(self.ranked[:limit]):
            tps = f"{e.tokens_per_s:,.0f}" if e.tokens_per_s else "-"
            why = "winner" if e is best else _why(e, best)
            lines.append(
                f"{i + 1:>3}  {e.candidate.label()}  {e.memory / GiB:>7.3f} {e.step * 1e3:>9.2f}"
                f" {tps:>11} {e.mfu * 100:>5.1f}%  {why}"
            )
        if limit is not None and len(self.ranked) > limit:
            lines.append(f"     ... {len(self.ranked) - limit} more that fit")
        for e in sorted(self.dropped, key=lambda e: e.memory)[:dropped]:
            lines.append(f"  -  {e.candidate.label()}  {e.memory / GiB:>7.3f}  {e.why}")
        if dropped is not None and len(self.dropped) > dropped:
            lines.append(f"     ... {len(self.dropped) - dropped} more dropped (do not fit)")
        return "\n".join(lines)

    def summary(self) -> str:
        d = self.device
        lines = [
            f"plan: world {self.world}, global batch {self.global_batch}, {d.label}, budget "
            f"{self.budget / GiB:.2f} GiB per device; {len(self.ranked)} fit, "
            f"{len(self.dropped)} do not ({self.seconds:.1f}s)",
            f"links: inside a node ({d.per_node if d.per_node < 1 << 20 else 'all'}) "
            f"{d.intra.label}; across {d.inter.label}",
            f"compute: {d.peak_half / 1e12:.3g} TFLOP/s bf16, {d.peak_full / 1e12:.3g} fp32 "
            f"x efficiency {d.efficiency:g} ({d.source}); per op {d.op_seconds * 1e6:.1f} us",
        ]
        lines += [f"note: {n}" for n in self.notes]
        if self.best is None:
            lines.append(self._nothing_fits())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()

    def write(self, path: str | os.PathLike) -> None:
        """The winner as a YAML file the trainer takes (``--config``)."""
        text = config_yaml(self.config(), header=self._header())
        with open(path, "w") as f:
            f.write(text)

    def _header(self) -> str:
        e = self.best
        assert e is not None
        return (
            f"# spmdgt plan: world {self.world}, global batch {self.global_batch}, "
            f"{self.device.label}\n# predicted: {e.memory / GiB:.3f} GiB per rank, "
            f"{e.step * 1e3:.2f} ms/step, MFU {e.mfu * 100:.1f}%\n"
        )


def config_yaml(cfg: TrainConfig, header: str = "") -> str:
    """``cfg`` as YAML that ``load_train_config`` reads back to an equal config."""
    return header + yaml.safe_dump(_plain(cfg), sort_keys=False)


def _plain(obj: object) -> object:
    slots = getattr(type(obj), "__slots__", None)
    if slots and hasattr(obj, "__dataclass_fields__"):
        return {f: _plain(getattr(obj, f)) for f in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj
