"""``--export-memory-viz`` as the format's writers write it (issue 44): trace entries carry the
requested size, blocks their size and requested size, every segment the model frees is freed in
the trace, the allocator is named, and MindStudio Insight's converter accepts the export of each
Ascend model (its rules: tests/insight_rules.py). Bounded: written as a stream, the newest
``--export-max-entries`` entries, only the shown rank recorded."""
from __future__ import annotations

import os
import pickle
from collections import Counter

import pytest

from insight_rules import npu_block, violations
from ms_memopt.cli import main

RECIPE = "recipes/dense_100b_1024x910c.yaml"
ASCEND = ("mindspore", "mindspore-vmm", "torch-npu", "torch-npu-expandable")
STEPS = 6           # torch-npu frees its first segments in step 5


def _export(path, allocator, *extra) -> dict:
    code = main(["simulate", RECIPE, "--steps", str(STEPS), "--ranks", "1", "--policy", "baseline", "--json",
                 "--allocator", allocator, "--export-memory-viz", str(path), *extra])
    assert code == 0
    with open(path, "rb") as handle:
        return pickle.load(handle)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = tmp_path_factory.mktemp("viz")
    return {name: _export(out / f"{name}.pickle", name) for name in ASCEND}


@pytest.mark.parametrize("allocator", ASCEND)
def test_the_converter_rebuilds_every_block_of_each_ascend_model(exports, allocator, capsys):
    """Before: the MindSpore models' entries carried the block size, rebuilt 512 B larger (over
    their neighbours); torch-npu's allocations sat in segments freed but never freed in the trace."""
    assert violations(exports[allocator]) == []


def test_segments_the_model_freed_are_freed_in_the_trace(exports):
    snapshot = exports["torch-npu"]
    actions = Counter(e["action"] for e in snapshot["device_traces"][0])
    assert actions["segment_free"] > 0
    assert actions["segment_alloc"] - actions["segment_free"] == len(snapshot["segments"])


@pytest.mark.parametrize("allocator", ["mindspore-vmm", "torch-npu-expandable"])
def test_expandable_models_map_and_unmap(exports, allocator):
    snapshot = exports[allocator]
    actions = Counter(e["action"] for e in snapshot["device_traces"][0])
    assert actions["segment_map"] > 0 and actions["segment_alloc"] == 0
    assert all(seg["is_expandable"] for seg in snapshot["segments"])


def test_entries_carry_the_requested_size_and_blocks_the_allocators(exports):
    snapshot = exports["torch-npu"]
    requested = {}
    for entry in snapshot["device_traces"][0]:
        if entry["action"] == "alloc":
            requested[entry["addr"]] = entry["size"]
    live = [b for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert live
    for block in live:
        assert block["requested_size"] == requested[block["address"]]
        assert block["size"] >= npu_block(block["requested_size"])
    assert all(b["size"] > b["requested_size"] for b in live)     # padded, and whole when unsplit


def test_mindspore_entries_are_the_tensor_sizes_its_runtime_pads_to_the_block(exports):
    """MindSpore's runtime pads a tensor as torch_npu does ((n + 32) up to 512 B) before the pool
    sees it: the entry is the largest tensor padded to the pool's block."""
    for name in ("mindspore", "mindspore-vmm"):
        live = [b for seg in exports[name]["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
        assert live and all(b["size"] == npu_block(b["requested_size"]) == b["requested_size"] + 32 for b in live)


@pytest.mark.parametrize("allocator", ASCEND)
def test_the_allocator_is_named(exports, allocator):
    settings = exports[allocator]["allocator_settings"]
    assert settings["ms_memopt"]["allocator"] == allocator
    assert settings["ms_memopt"]["entries"] == len(exports[allocator]["device_traces"][0])


def test_max_entries_keeps_the_newest_entries_and_the_final_state(exports, tmp_path):
    full = exports["torch-npu"]
    bounded = _export(tmp_path / "bounded.pickle", "torch-npu", "--export-max-entries", "5000")
    assert bounded["device_traces"][0] == full["device_traces"][0][-5000:]
    assert bounded["segments"] == full["segments"]
    assert violations(bounded) == []


@pytest.mark.parametrize("argv, message", [
    (["--export-max-entries", "0", "--export-memory-viz", "x.pickle"], "positive number of trace entries"),
    (["--export-max-entries", "10"], "give that too"),
])
def test_max_entries_refuses_bad_input(argv, message, capsys, tmp_path):
    argv = [str(tmp_path / a) if a.endswith(".pickle") else a for a in argv]
    assert main(["simulate", RECIPE, "--steps", "2", "--ranks", "1", "--policy", "baseline", *argv]) == 2
    err = capsys.readouterr().err
    assert "--export-max-entries" in err and message in err


def test_the_job_records_only_the_rank_it_shows(tmp_path, monkeypatch):
    """The job's runs keep no placed events; the shown rank is simulated once more into the file."""
    import ms_memopt.simulation.job as job_module

    calls = []
    real = job_module.record_placed
    monkeypatch.setattr(job_module, "record_placed", lambda job, stream, sinks: calls.append(stream.rank)
                        or real(job, stream, sinks))
    path = tmp_path / "job.pickle"
    assert main(["simulate", RECIPE, "--steps", "2", "--ranks", "3", "--policy", "baseline", "--workers", "1",
                 "--export-memory-viz", str(path)]) == 0
    with open(path, "rb") as handle:
        recorded = pickle.load(handle)["allocator_settings"]["ms_memopt"]
    assert calls == [recorded["rank"]]


def test_the_snapshot_is_written_as_a_stream(tmp_path):
    from ms_memopt.core.events import Event
    from ms_memopt.core.layout import Layout
    from ms_memopt.io.traces.memory_viz import SnapshotWriter

    path = tmp_path / "stream.pickle"
    writer = SnapshotWriter(path)
    for i in range(20_000):
        writer.add(Event("alloc", id=i, size=512, addr=0x200000 + 512 * i))
    assert os.path.getsize(path) > 20_000 * 20      # on disk before the end
    writer.close(Layout())
    with open(path, "rb") as handle:
        assert len(pickle.load(handle)["device_traces"][0]) == 20_000


# --- replay ANY --export-memory-viz: the model places the events, then they are exported -------------

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "traces")
DATA = os.path.join(os.path.dirname(__file__), "data")
RECORDINGS = {
    "ascend profiler folder": os.path.join(SHARED, "ascend_profiler", "cnn_910b_level1_rank0"),
    "ascend profiler db": os.path.join(SHARED, "ascend_profiler", "cnn_910b_level1_rank0_db"),
    "torch_npu snapshot": os.path.join(SHARED, "torch_npu", "resnet_adam_default.pickle"),
    "memory_block.csv": os.path.join(DATA, "memory_block_2.10.csv"),
    "pool log": os.path.join(DATA, "pool_log", "gpt_varying_seq_4steps.log.gz"),
    "events.jsonl (two streams, empty_cache)": os.path.join(DATA, "events.jsonl"),
    "msmemscope": os.path.join(SHARED, "msmemscope", "baseline.csv"),
}


@pytest.mark.parametrize("name", RECORDINGS)
def test_replay_exports_every_format_it_reads(name, tmp_path, capsys):
    """Before: a profiler capture was refused ("alloc of id 2 has no address; use
    ms_memopt.replay.replay.placed_events()"); the others exported the recording's addresses
    beside the model's final layout."""
    source = RECORDINGS[name]
    if not os.path.exists(source):
        pytest.skip(f"{source} is not here")
    path = tmp_path / "out.pickle"
    assert main(["replay", source, "--export-memory-viz", str(path)]) == 0
    err = capsys.readouterr().err
    assert "ms_memopt." not in err
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    allocator = snapshot["allocator_settings"]["ms_memopt"]["allocator"]
    entries = snapshot["device_traces"][0]
    assert any(e["action"] == "alloc" for e in entries) and all(e["addr"] is not None for e in entries)
    if allocator not in ("torch", "torch-expandable"):      # the converter replays as torch_npu's allocator does
        assert violations(snapshot) == []


def test_replay_export_bounded_and_refused_bad_counts(tmp_path, capsys):
    source = RECORDINGS["pool log"]
    path = tmp_path / "out.pickle"
    assert main(["replay", source, "--export-memory-viz", str(path), "--export-max-entries", "100"]) == 0
    with open(path, "rb") as handle:
        assert len(pickle.load(handle)["device_traces"][0]) == 100
    assert main(["replay", source, "--export-memory-viz", str(path), "--export-max-entries", "-1"]) == 2
    assert "--export-max-entries" in capsys.readouterr().err


def test_an_alloc_without_address_names_no_python_api():
    from ms_memopt.core.errors import InputError
    from ms_memopt.core.events import Event
    from ms_memopt.core.layout import Layout
    from ms_memopt.io.traces.memory_viz import snapshot_dict

    with pytest.raises(InputError) as info:
        snapshot_dict([Event("alloc", id=1, size=512)], Layout())
    assert "no address" in str(info.value) and "ms_memopt." not in str(info.value)


def test_an_expandable_export_replays_through_its_model(exports, tmp_path, capsys):
    path = tmp_path / "vmm.pickle"
    with open(path, "wb") as handle:
        pickle.dump(exports["mindspore-vmm"], handle)
    assert main(["replay", str(path), "--json"]) == 0


def test_compaction_and_pool_mode_exports_follow_the_rules(tmp_path, capsys):
    """A compaction's moves carry the moved block's request (they carried its size: rebuilt 512 B too
    large); pool mode's blocks are MindSpore's padded sizes, whatever the job's allocator."""
    path = tmp_path / "cp.pickle"
    assert main(["simulate", RECIPE, "--steps", str(STEPS), "--ranks", "1", "--policy", "compact,pool", "--json",
                 "--allocator", "torch-npu", "--compact-every", "2", "--export-memory-viz", str(path)]) == 0
    assert "could not be followed" not in capsys.readouterr().err
    moved = {}
    for policy in ("compact", "pool"):
        with open(tmp_path / f"cp.{policy}.pickle", "rb") as handle:
            snapshot = pickle.load(handle)
        assert violations(snapshot) == []
        moved[policy] = sum(e["frames"][0]["name"].endswith("(moved by compaction)")
                            for e in snapshot["device_traces"][0])
    assert moved["compact"] > 0 and moved["pool"] == 0
