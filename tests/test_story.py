"""The figures and exports a user looks at first tell the story: the largest hole against the
watched request, the trend behind the noise, the memory map at the OOM (or the worst moment),
blocks named by purpose in PyTorch's own memory viewer, and a trace's buffers as a placement
instance."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_memopt.cli import main
from ms_memopt.core.events import Event, Trace
from ms_memopt.report.plots import Marker, _marker_value, _same_until, _window_trend

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


# --- timeline helpers ------------------------------------------------------------------------------

@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 10**6)), min_size=1, max_size=200),
       st.integers(1, 50))
def test_window_trend_is_the_minimum_of_each_window(raw, window):
    samples = sorted((step, 0, value, None) for step, value in raw)
    xs, ys = _window_trend(samples, 2, window, min)
    expected: dict[int, int] = {}
    for step, _, value, _ in samples:
        key = (step - 1) // window
        expected[key] = min(expected.get(key, value), value)
    assert ys == [expected[k] for k in sorted(expected)]
    assert xs == sorted(xs) and len(xs) == len(expected)


def test_same_until_names_how_long_one_series_hides_another():
    base = [(s, 10, 5, 1.0) for s in range(1, 11)]
    forked = base[:6] + [(s, 10, 9, 0.1) for s in range(7, 11)]
    assert _same_until(base, forked) == "until step 6"
    assert _same_until(base, list(base)) == "throughout"
    assert _same_until(base, [(1, 0, 0, None)]) is None


def test_a_marker_sits_on_what_the_scan_saw_never_on_a_made_up_zero():
    samples = [(10, 8 * MiB, 4 * MiB, 1.0), (20, 8 * MiB, 2 * MiB, 3.0)]
    assert _marker_value(Marker("r", 25, "compaction", 3 * MiB, 7 * MiB), samples) == 3 * MiB
    assert _marker_value(Marker("r", 25, "compaction"), samples) == 2 * MiB    # the last sample before
    assert _marker_value(Marker("r", 5, "compaction"), samples) is None        # nothing seen yet: no symbol


# --- simulate --out: the report with its memory map ---------------------------------------------------

def test_simulate_out_writes_a_report_with_the_memory_map_at_the_oom_or_the_worst_moment(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(ROOT / "recipes" / "demo_cpu.yaml"), "--steps", "12",
                 "--policy", "baseline,pool", "--out", str(out)]) == 0
    capsys.readouterr()
    report = (out / "report.md").read_text()
    assert "![memory map](memory_map.png)" in report and "![fragmentation timeline](fragmentation.png)" in report
    assert (out / "memory_map.png").stat().st_size > 0
    labels = [json.loads(line)["label"] for line in (out / "layouts.jsonl").read_text().splitlines()]
    assert len(labels) == 2                                            # one per policy
    for policy, label in zip(("baseline", "pool"), labels):
        assert label.startswith(policy) and ("OOM" in label or "worst moment" in label)
    rows = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    watched = [r for r in rows if r["kind"] == "watch"]
    assert watched and all(r["size"] > 0 for r in watched)           # the request line's height


# --- the PyTorch memory viewer names blocks and shows segments growing --------------------------------

def _viewer():
    return pytest.importorskip("torch.cuda._memory_viz", reason="PyTorch (the test extra) is not installed")


def test_pytorch_memory_viz_names_each_block_by_tag_and_sees_segments_grow(tmp_path):
    viz = _viewer()
    path = tmp_path / "sim.pickle"
    assert main(["simulate", str(ROOT / "recipes" / "demo_cpu.yaml"), "--steps", "6", "--policy", "compact",
                 "--export-memory-viz", str(path), "--json"]) == 0
    data = pickle.loads(path.read_bytes())
    # PyTorch's own readers: the flame graph lines carry each block's frame, the trace its segments
    lines = viz.segments(data, format_flamegraph=lambda lines: lines)
    assert "ms-memopt:0:parameter" in lines and "ms-memopt:0:optimizer" in lines
    assert "untagged" not in lines                     # every live block at the end names its purpose
    names = {e["frames"][0]["name"] for e in data["device_traces"][0]}
    assert {"activation", "allreduce", "gradient"} <= names
    text = viz.trace(data)
    assert text.count("cudaMalloc(") == len(data["segments"]) >= 1     # every segment appears, growing
    first_alloc = next(i for i, e in enumerate(data["device_traces"][0]) if e["action"] == "alloc")
    assert data["device_traces"][0][first_alloc - 1]["action"] == "segment_alloc"
    assert "Summary of segments" in viz.segsum(data)


def test_compaction_moves_are_named_in_the_export(tmp_path):
    from ms_memopt.io.traces.memory_viz import snapshot_dict
    from ms_memopt.core.layout import Block, Layout, Segment

    events = [Event("alloc", id=1, size=512, addr=0x1000, tag="activation"),
              Event("alloc", id=2, size=512, addr=0x1200, tag="parameter"),
              Event("free", id=1, addr=0x1000),
              Event("free", id=2, addr=0x1200, tag="compaction"),
              Event("alloc", id=2, size=512, addr=0x1000, tag="compaction")]
    layout = Layout([Segment(0x1000, 4096, [Block(0x1000, 512, True, tag="parameter"),
                                            Block(0x1200, 4096 - 512, False)])])
    trace = snapshot_dict(events, layout)["device_traces"][0]
    names = [(e["action"], e["frames"][0]["name"]) for e in trace]
    assert names[0] == ("segment_alloc", "common pool segment")
    assert ("alloc", "parameter (moved by compaction)") in names
    assert ("free_completed", "parameter (moved by compaction)") in names
    assert ("free_completed", "activation") in names


# --- replay --export-instances: a trace's buffers for the static planner ------------------------------

def test_replay_exports_instances_that_pack_places_below_what_the_allocator_reserved(tmp_path, capsys):
    from ms_memopt.core.events import write_jsonl
    from ms_memopt.io.traces.instances import read_instance
    from ms_memopt.io.traces.instances_events import trace_to_instances

    events = []
    for step in range(4):
        events += [Event("alloc", id=10 * step + i, size=(i + 1) * 4096) for i in range(5)]
        events += [Event("free", id=10 * step + i) for i in (0, 2, 4)]
    trace_path = tmp_path / "t.jsonl"
    write_jsonl(trace_path, events)
    csv_path = tmp_path / "buffers.csv"
    assert main(["replay", str(trace_path), "--export-instances", str(csv_path), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    buffers = read_instance(csv_path)
    assert buffers == trace_to_instances(Trace(events))
    assert len(buffers) == 20 and all(b.lower < b.upper for b in buffers)
    assert main(["pack", str(csv_path), "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert packed["arena"] <= replayed["peak_reserved"]
