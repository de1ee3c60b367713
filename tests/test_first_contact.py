"""A new user's first quarter hour: what simulate exports names its allocator, doctor answers a
MindSpore job in MindSpore's settings and says plainly when none saves the run, one report per
simulation whichever command writes it, and the small things (``--version``, why addresses differ,
``simulate --capacity`` on a recipe, what ``--export-instances`` wrote).

Everything runs on the CPU demo recipe (a few MiB, 20 steps): seconds, not minutes.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from ms_memopt.cli import main
from ms_memopt.core.events import Event, Trace
from ms_memopt.doctor.diagnose import diagnose
from ms_memopt.doctor.remedies import SETTINGS, family_of_model
from ms_memopt.io.traces import load_trace
from ms_memopt.replay.replay import recorded_allocator

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "recipes" / "demo_cpu.yaml"
GPT_LOG = ROOT / "tests" / "data" / "pool_log" / "gpt_varying_seq_4steps.log.gz"


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory) -> Path:
    """The demo recipe's baseline simulated for 20 steps, exported for PyTorch's viewer (its
    peak: 6.98 MiB allocated, 7 MiB reserved in 1 MiB blocks)."""
    path = tmp_path_factory.mktemp("export") / "snapshot.pickle"
    assert main(["simulate", str(DEMO), "--steps", "20", "--policy", "baseline", "--export-memory-viz", str(path),
                 "--json"]) == 0
    return path


def test_the_export_names_the_model_that_placed_it_and_pytorch_still_reads_it(demo_export, capsys):
    data = pickle.loads(demo_export.read_bytes())
    recorded = data["allocator_settings"]["ms_memopt"]
    assert recorded["allocator"] == "mindspore" and recorded["source"] == "ms-memopt simulate"
    assert recorded["recipe"].endswith("demo_cpu.yaml") and recorded["capacity"] == 128 * MiB
    trace = load_trace(demo_export)
    assert trace.meta["allocator"] == "mindspore" and trace.meta["allocator_options"] == {"increase_size": MiB}
    who = recorded_allocator(trace)
    assert (who.name, who.capacity) == ("mindspore", 128 * MiB) and "ms-memopt simulate" in who.why
    # what PyTorch's format has no field for travels in keys its tools ignore: the pool and the steps
    assert any(e.action == "step" for e in trace.events)
    # replayed through the model that made it, at its card: every address as simulated
    capsys.readouterr()
    assert main(["replay", str(demo_export), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["allocator"] == "mindspore" and got["capacity"] == 128 * MiB
    assert got["address_match"] == 1.0 and got["final_layout_match"] is True
    viz = pytest.importorskip("torch.cuda._memory_viz")
    assert "Active Memory Timeline" in viz.trace_plot(data) and viz.segsum(data) and viz.trace(data)


def test_another_model_says_why_its_addresses_differ(demo_export, capsys):
    assert main(["replay", str(demo_export), "--allocator", "torch"]) == 0
    out = capsys.readouterr().out
    assert "placed by mindspore" in out and "not expected to match" in out


def test_doctor_ranks_mindspores_settings_and_says_when_none_saves_the_run(demo_export):
    trace = load_trace(demo_export)
    d = diagnose(trace, capacity=7 * MiB)
    assert d.allocator == "mindspore" and d.family == "mindspore" and d.verdict.failed
    assert "the recording names it" in d.allocator_why
    lines = [r.line for r in d.remedies]
    assert not any("PYTORCH" in line for line in lines)
    names = {r.setting for r in d.remedies}
    assert {"enable_vmm:True", "compaction at the step ends", "pool mode", "increase_size=2.00 GiB"} <= names
    assert not any(r.survives for r in d.remedies)
    assert d.summary.startswith("no setting saves this run at 7.00 MiB") and "What would: a card of at least" in d.summary
    # a little more room: some settings do, and the summary names the best
    roomier = diagnose(trace, capacity=8 * MiB)
    best = roomier.remedies[0]
    assert best.survives and best.setting != "baseline"
    assert f"save this run at 8.00 MiB, best first: {best.setting}" in roomier.summary


def test_doctor_cli_prints_the_advice_and_parts_survivors_from_the_rest(demo_export, capsys):
    assert main(["doctor", str(demo_export), "--capacity", "7MiB"]) == 0
    out = capsys.readouterr().out
    assert "advice      no setting saves this run at 7.00 MiB" in out
    assert "-- none of these survive 7.00 MiB --" in out
    assert "the recording names it (ms-memopt simulate)" in out


def _fragmenting_torch_trace() -> Trace:
    events = [Event("alloc", id=50, size=180 * MiB), Event("free", id=50)]
    events += [Event("alloc", id=i, size=30 * MiB) for i in range(1, 7)]
    events += [Event("free", id=k) for k in (1, 3, 5)] + [Event("alloc", id=100, size=70 * MiB)]
    return Trace(events, source="synthetic", format="torch-snapshot")


def test_allocator_mindspore_gets_mindspores_remedies_and_torch_npu_its_own_variable():
    d = diagnose(_fragmenting_torch_trace(), capacity=200 * MiB, allocator="mindspore")
    assert d.family == "mindspore" and d.allocator == "mindspore"
    assert not any("PYTORCH" in r.line for r in d.remedies)
    assert any(r.line == 'export MS_ALLOC_CONF="enable_vmm:True"' for r in d.remedies)
    npu = _fragmenting_torch_trace()
    npu.meta["framework"] = "torch_npu"
    d = diagnose(npu, capacity=200 * MiB)
    assert d.family == "torch_npu" and all("PYTORCH_CUDA" not in r.line for r in d.remedies)
    assert any(r.line == "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" for r in d.remedies)


def test_the_family_table_covers_every_model():
    from ms_memopt.allocators import MODELS

    for model in MODELS:
        if model != "pool":
            assert family_of_model(model) in SETTINGS, model


def test_verdict_none_ranks_nothing(capsys, tmp_path):
    calm = Trace([Event("alloc", id=1, size=MiB), Event("free", id=1), Event("alloc", id=2, size=MiB)],
                 source="calm", format="torch-snapshot")
    d = diagnose(calm, capacity=64 * MiB)
    assert d.verdict.kind == "none" and d.remedies == [] and d.summary.startswith("nothing needs saving")


def test_a_cpu_pool_log_is_not_offered_vmm():
    d = diagnose(load_trace(GPT_LOG), capacity=int(2.44 * MiB))
    assert d.allocator == "mindspore-bestfit" and d.family == "mindspore"
    assert "enable_vmm:True" not in {r.setting for r in d.remedies}
    why = {s.setting: s.why for s in d.skipped}
    assert "CPU pool" in why["enable_vmm:True"] and "Ascend" in why["enable_vmm:True"]


def test_simulate_and_report_write_one_report(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(DEMO), "--steps", "20", "--policy", "baseline,compact", "--capacity", "7MiB",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "--capacity 7.00 MiB overrides memopt.device.hbm (128.00 MiB in the recipe)" in printed.err
    assert "median: the median OOM step" in printed.out and "lf_min" in printed.out
    first = (out / "report.md").read_text()
    assert first.startswith("# Simulation of demo_cpu.yaml: 20 steps, 1 rank streams")
    info = json.loads((out / "simulation.json").read_text())
    baseline = info["policies"]["baseline"]
    # the printed table's figures are the report's: the same row, the same numbers
    row = next(line for line in printed.out.splitlines() if line.startswith("baseline "))
    assert str(baseline["job_oom_step"]) in row.split()
    from ms_memopt.core.units import format_size
    assert format_size(baseline["largest_free_min"]) in row
    assert f"| {format_size(baseline['largest_free_min'])} |" in first
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == first


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("ms-memopt ")


def test_export_instances_says_what_it_wrote(demo_export, tmp_path, capsys):
    target = tmp_path / "buffers.csv"
    assert main(["replay", str(demo_export), "--export-instances", str(target), "--json"]) == 0
    err = capsys.readouterr().err
    assert f"written to {target}" in err and "buffers" in err and target.read_text().startswith("id,lower,upper,size")


def test_an_expandable_snapshot_is_not_offered_what_its_model_lacks():
    trace = _fragmenting_torch_trace()
    trace.meta["expandable_segments"] = True
    d = diagnose(trace, capacity=200 * MiB)
    assert d.allocator == "torch-expandable"
    why = {s.setting: s.why for s in d.skipped}
    assert why["expandable_segments:True"] == "the recording already runs with it"
    assert "has no max_split_size_mb" in why["max_split_size_mb:64"]
    assert all(r.measured for r in d.remedies)
    assert d.summary.startswith("the run as recorded fits in 200.00 MiB")


def test_a_multi_policy_export_is_named_when_its_plain_name_is_given(tmp_path, capsys):
    for policy in ("baseline", "compact"):
        (tmp_path / f"snapshot.{policy}.pickle").write_bytes(b"")
    for command in ("replay", "doctor"):
        assert main([command, str(tmp_path / "snapshot.pickle")]) == 2
        err = capsys.readouterr().err
        assert "one file per policy" in err and "snapshot.baseline.pickle" in err and "Traceback" not in err
