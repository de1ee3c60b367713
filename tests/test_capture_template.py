"""Step templates learned from an Ascend profiler capture (issue 42, item 1): ``learn FOLDER`` cuts
the capture at the profiler's own step markers (trace_view.json's ProfilerStep#N, the db's
STEP_TIME), the tensors held before the capture are the prologue (persistent), and
``simulate T --steps 5`` reproduces the recorded peak allocated within 1%."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ms_memopt.cli import main
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.io.traces.ascend_profiler import read_step_marks
from ms_memopt.io.traces.ascend_profiler.steps import trace_view_steps
from ms_memopt.io.traces.ascend_profiler.writer import write_profiler_output
from ms_memopt.templates.capture import capture_recording
from ms_memopt.templates.template import learn_files, load_template

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "ascend_profiler"
TEXT = SHARED / "cnn_910b_level1_rank0"
DB = SHARED / "cnn_910b_level1_rank0_db"
MiB = 1 << 20
T0 = 1_736_408_883_694_624_810          # a profiler clock reading (ns)


def _steady_run(steps: int = 4, weights: int = 3) -> tuple[list[Event], dict[int, int], list[tuple[int, int, int]]]:
    """A run caught mid-way: weights held before the capture, one gradient of the step before it
    (freed in the first captured step), and steps that allocate activations, free them and keep a
    gradient to the next step. Sizes are whole 512 B blocks (the profiler records blocks)."""
    initial = {100 + w: 4 * MiB for w in range(weights)}
    initial[99] = 2 * MiB                    # the gradient the step before the capture kept
    events, marks, kept, nid, t = [], [], 99, 1, T0
    for number in range(10, 10 + steps):
        start = t
        acts = []
        for k in range(3):
            t += 1000
            events.append(Event("alloc", id=nid, size=(k + 1) * MiB, time=t))
            acts.append(nid)
            nid += 1
        t += 1000
        events.append(Event("alloc", id=nid, size=2 * MiB, time=t))        # this step's gradient
        grad, nid = nid, nid + 1
        for ident in [kept] + acts:
            t += 1000
            events.append(Event("free", id=ident, time=t))
        kept = grad
        t += 5000
        marks.append((number, start, t))
        t += 10
    return events, initial, marks


def _peak(initial: dict[int, int], events: list[Event]) -> int:
    live, now, peak = dict(initial), sum(initial.values()), sum(initial.values())
    for e in events:
        if e.action == "alloc":
            live[e.id] = e.size
            now += e.size
            peak = max(peak, now)
        elif e.action == "free":
            now -= live.pop(e.id)
    return peak


def _simulated_peak(template: Path, capsys, steps: int = 5) -> dict:
    capsys.readouterr()
    assert main(["simulate", str(template), "--steps", str(steps), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    return {name: p["first_rank"]["peak_allocated"] for name, p in out["policies"].items()}


@pytest.mark.parametrize("writer", ["torch_npu", "mindspore"])
def test_a_capture_in_the_writers_format_is_learned_at_its_step_markers(tmp_path, capsys, writer):
    events, initial, marks = _steady_run()
    folder = write_profiler_output(tmp_path, events, writer=writer, initial=initial, steps=marks)
    assert (folder / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").is_file()
    found = read_step_marks(folder)
    assert found.source == "trace_view.json" and [m.number for m in found.steps] == [10, 11, 12, 13]
    out = tmp_path / "run.template.json"
    assert main(["learn", str(folder), "--out", str(out)]) == 0
    template = load_template(out)
    assert template.allocator == ("torch-npu" if writer == "torch_npu" else template.allocator)
    assert set(template.classes) == {"first", "repeat"} and template.dims == []
    capture = template.recordings[0]["capture"]
    assert capture["marks"] == "trace_view.json" and capture["steps"] == 4
    # held before the capture: the weights (one total to the profiler) and the gradient freed in step 1
    assert capture["held_before"]["tensors"] == 2 and capture["held_before"]["held_through"] == 12 * MiB - (32 if writer == "torch_npu" else 0)
    # the weights are the persistent state: the prologue's allocation never freed, tagged as parameters
    prologue = [op for op in template.prologue["ops"] if op[0] == "a"]
    assert [op[4] for op in prologue][0] == "parameter" and prologue[1][4] != "parameter"
    recorded = _peak(initial, events)
    assert capture["recorded"]["peak_allocated"] == recorded
    for policy, peak in _simulated_peak(out, capsys).items():
        assert abs(peak - recorded) <= 0.01 * recorded, (policy, peak, recorded)


def test_one_captured_step_gives_repeat_steps_that_free_what_the_step_before_kept(tmp_path):
    events, initial, marks = _steady_run(steps=1)
    folder = write_profiler_output(tmp_path, events, initial=initial, steps=marks)
    rec = capture_recording(folder)
    assert rec.steps == 1 and any("one step captured" in n for n in rec.notes)
    template = learn_files([folder])
    from ms_memopt.templates.template import generate

    generated = generate(template, [{}] * 6)
    live, now, ends = {}, 0, []
    for e in generated:
        if e.action == "alloc":
            live[e.id] = -(-(e.size + 32) // 512) * 512
            now += live[e.id]
        elif e.action == "free":
            now -= live.pop(e.id)
        elif e.action == "step":
            ends.append(now)
    assert len(set(ends)) == 1, ends          # a steady run: every step ends where the first did


def test_dims_per_step_from_a_csv(tmp_path, capsys):
    events, initial, marks = _steady_run(steps=3)
    folder = write_profiler_output(tmp_path, events, writer="mindspore", initial=initial, steps=marks)
    good = tmp_path / "dims.csv"
    good.write_text("step,seq\n10,16\n11,16\n12,16\n")
    template = learn_files([folder], dims_csv=[good])
    assert template.dims == ["seq"]
    bad = tmp_path / "short.csv"
    bad.write_text("seq\n16\n16\n")
    capsys.readouterr()
    assert main(["learn", str(folder), "--dims-csv", str(bad), "--out", str(tmp_path / "x.template.json")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "2 row(s) of dims" in err and "3 step(s)" in err


def test_a_broken_step_marker_names_the_file_and_line(tmp_path):
    path = tmp_path / "trace_view.json"
    path.write_text('[\n{"ph": "X", "name": "ProfilerStep#3", "ts": "12.5"}\n]')
    with pytest.raises(InputError, match=r"trace_view.json:2: the .*ProfilerStep#3.* ts and dur"):
        trace_view_steps(path)
    path.write_text('[{"ph": "X", "name": "ProfilerStep#3", "ts": "1e999", "dur": 1}]')
    with pytest.raises(InputError, match="int64"):
        trace_view_steps(path)


@pytest.mark.skipif(not TEXT.is_dir() or not DB.is_dir(), reason="the shared torch_npu captures are absent "
                    "(../shared/data/traces/ascend_profiler)")
@pytest.mark.parametrize("capture,marks", [(TEXT, None), (DB, "STEP_TIME")])
def test_the_real_torch_npu_captures(tmp_path, capsys, capture, marks):
    """The shared captures hold one step of a CNN: the text export has no step marker (the whole
    capture is the step), the db marks it in STEP_TIME (ProfilerStep#50)."""
    out = tmp_path / "cnn.template.json"
    assert main(["learn", str(capture), "--out", str(out)]) == 0
    template = load_template(out)
    info = template.recordings[0]["capture"]
    assert info["marks"] == marks and info["steps"] == 1
    # the tensors held all through the capture (735,492,608 B of blocks) are the persistent state
    assert info["held_before"]["held_through"] == 735_492_576
    assert template.purposes["purposes"]["parameters"]["bytes"] == 735_492_576
    recorded = info["recorded"]["peak_allocated"]
    assert recorded == 1_245_688_832
    for policy, peak in _simulated_peak(out, capsys).items():
        assert abs(peak - recorded) <= 0.01 * recorded, (policy, peak, recorded)
