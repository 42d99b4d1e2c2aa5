"""The planner's ``cpu`` profile on disk (``_plan/_cpuprofile``): measured once by forked
ranks, saved, and reused by later plans (``plan(device_profile=)``, ``--cpu-profile``)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from spmdgt.train._plan import _cpuprofile, plan
from spmdgt.train._plan._cpuprofile import load_profile, measure_profile, save_profile
from tests.train.test_plan import ROOT, TINY, _example, _memory


def _plan_kw() -> tuple:
    ex = _example()
    model = ex.build_model(ex.parse_args(TINY))
    x = torch.zeros(4, 16, dtype=torch.long)
    kw = dict(world=4, global_batch=16, loss_fn=ex.lm_loss, memory_model=_memory())
    kw.update(micro_batches=[4], amp=(False,))
    return model, (x, x), kw


def test_a_profile_measured_by_2_ranks_saves_loads_and_prices_the_plan(tmp_path):
    prof = measure_profile(2, repeats=1)  # 2 forked gloo ranks probe at once
    assert prof["ranks"] == 2 and prof["threads"] == 1
    assert [n for n, _, _ in prof["links"]] == [2]
    assert all(prof[k] > 0 for k in ("op_seconds", "peak_fp32"))
    path = tmp_path / "cpu.json"
    save_profile(prof, path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "spmdgt cpu profile" and doc["saved_at"]
    assert load_profile(path) == prof
    model, batch, kw = _plan_kw()
    from_file = plan(model, batch, device="cpu", device_profile=path, **kw)
    from_dict = plan(model, batch, device="cpu", device_profile=prof, **kw)
    dev = from_file.device
    assert dev.op_seconds == prof["op_seconds"] and dev.peak_full == prof["peak_fp32"]
    assert dev.unit_seconds == prof["unit_seconds"]
    assert dev.intra.by_size == tuple(tuple(x) for x in prof["links"])
    assert "measured by 2 ranks" in from_file.summary()
    steps = [(e.candidate, e.step) for e in from_file.ranked]
    assert steps == [(e.candidate, e.step) for e in from_dict.ranked]
    # the plain cpu device (this process's peak, one assumed link) prices differently
    plain = plan(model, batch, device="cpu", **kw)
    assert [e.step for e in plain.ranked] != [s for _, s in steps]


def test_a_profile_refuses_what_it_cannot_price(tmp_path):
    model, batch, kw = _plan_kw()
    prof = {"ranks": 2, "threads": 1, "links": [[2, 1e-3, 1e9]], "op_seconds": 1e-4}
    prof.update(peak_fp32=1e10, unit_seconds=0.0, tp_module_seconds=0.0, ac_block_seconds=0.0)
    with pytest.raises(ValueError, match=r"device_profile is a measured cpu profile.*h100"):
        plan(model, batch, device="h100", device_profile=prof, **kw)
    with pytest.raises(ValueError, match="latency"):
        plan(model, batch, device="cpu", device_profile=prof, latency="1ms", **kw)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=re.escape(f"cpu profile {bad}: not a file")):
        plan(model, batch, device="cpu", device_profile=bad, **kw)
    save_profile(prof, bad)
    doc = json.loads(bad.read_text())
    del doc["profile"]["op_seconds"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'op_seconds' is None, expected float"):
        load_profile(bad)


def test_the_command_line_measures_once_and_reads_the_file_after(tmp_path, monkeypatch, capsys):
    """``--cpu-profile PATH``: the first plan measures (``measure_profile``, by ``--world``
    ranks) and saves; the second reads the file and measures nothing; both price alike."""
    from spmdgt.scripts.plan import main
    from spmdgt.train import _plan as plan_mod

    prof = {"ranks": 4, "threads": 1, "links": [[2, 1e-3, 5e8], [4, 6e-3, 1e8]]}
    prof.update(op_seconds=2e-4, peak_fp32=1e10, unit_seconds=3e-3)
    prof.update(tp_module_seconds=4e-3, ac_block_seconds=2e-3)
    calls = []

    def fake_measure(world: int, **_) -> dict:
        calls.append(world)
        return dict(prof)

    real_plan = plan_mod.plan

    def calibrated_plan(*args, **kw):  # the pricing is under test, not the dry runs
        return real_plan(*args, **{**kw, "memory_model": _memory(2)})

    monkeypatch.setattr(_cpuprofile, "measure_profile", fake_measure)
    monkeypatch.setattr(plan_mod, "plan", calibrated_plan)
    path = tmp_path / "cpu.json"
    script = str(ROOT / "examples" / "train_transformer.py")
    flags = ["--world", "4", "--global-batch", "8", "--micro-batches", "2", "--amp", "off"]
    argv = [*flags, "--cpu-profile", str(path), script, *TINY, "--batch-size", "2"]
    tables, said = [], []
    for _ in range(2):
        assert main(argv) == 0
        out = capsys.readouterr()
        tables.append(re.sub(r"\(\d+\.\d+s\)", "", out.out))  # the plan's own seconds
        said.append(out.err)
    assert calls == [4]  # measured once, by --world ranks
    assert load_profile(path) == prof
    assert f"cpu profile saved to {path}" in said[0]
    assert f"cpu profile read from {path}" in said[1] and "measuring" not in said[1]
    assert tables[0] == tables[1] and "measured by 4 ranks" in tables[0]
    assert main(["--device", "h100", *argv]) == 2
    assert "--cpu-profile prices --device cpu, not --device h100" in capsys.readouterr().err
