"""PyTorch snapshot reader: safe loading, event mapping, start-state reconstruction, memory_viz export."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import Layout
from ms_memopt.replay.replay import placed_events
from ms_memopt.io.traces.memory_viz import snapshot_dict, write_memory_viz
from ms_memopt.io.traces.torch_snapshot import (SafeUnpickler, looks_like_torch_snapshot, read_torch_snapshot,
                                             safe_load)

MiB = 1 << 20
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "torch"


def _shared(name: str) -> Path:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"shared snapshot {path} not present (see shared/data/SOURCES.md)")
    return path


def _write(tmp_path: Path, data, name: str = "snap.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


def _block(addr, size, state="active_allocated", requested=None):
    return {"address": addr, "size": size, "requested_size": requested or size, "state": state, "frames": []}


def _segment(addr, size, blocks, kind="large", stream=0):
    return {"device": 0, "address": addr, "total_size": size, "stream": stream, "segment_type": kind,
            "allocated_size": 0, "active_size": 0, "requested_size": 0, "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": blocks}


def _entry(action, addr, size, **extra):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], **extra}


# --- safe loading -----------------------------------------------------------------------------
class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_reduce_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = _write(tmp_path, {"segments": [], "device_traces": [[_Hostile(str(marker))]]})
    with pytest.raises(InputError) as err:
        read_torch_snapshot(path)
    assert str(path) in str(err.value) and "refused" in str(err.value)
    assert "system" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    b"cos\nsystem\n(S'echo hi'\ntR.",            # protocol 0 GLOBAL + REDUCE
    b"\x80\x04cbuiltins\neval\n\x8c\x041+1\x85R.",  # protocol 4 GLOBAL + REDUCE
    b"\x80\x02cbuiltins\nset\n)R.",               # even a harmless builtin class is refused
])
def test_any_global_is_refused(tmp_path, payload):
    path = tmp_path / "g.pickle"
    path.write_bytes(payload)
    with pytest.raises(InputError, match="refused to load global"):
        safe_load(path)


def test_persistent_id_is_refused(tmp_path):
    path = tmp_path / "p.pickle"
    path.write_bytes(b"\x80\x04\x8c\x01xQ.")  # BINPERSID
    with pytest.raises(InputError, match="persistent"):
        safe_load(path)


def test_truncated_empty_missing_and_garbage_files(tmp_path):
    whole = pickle.dumps({"segments": [], "device_traces": [[_entry("alloc", 0, 512)]]}, protocol=4)
    truncated = tmp_path / "cut.pickle"
    for cut in (len(whole) // 2, len(whole) - 1, 3):
        truncated.write_bytes(whole[:cut])
        with pytest.raises(InputError, match="truncated pickle") as err:
            read_torch_snapshot(truncated)
        assert str(err.value).startswith(f"{truncated}: ")
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match="empty file"):
        read_torch_snapshot(empty)
    with pytest.raises(InputError, match="cannot read"):
        read_torch_snapshot(tmp_path / "missing.pickle")
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"\x80\x04\xff\xfe not a pickle")
    with pytest.raises(InputError) as err:
        read_torch_snapshot(garbage)
    assert str(garbage) in str(err.value)


@pytest.mark.parametrize("data, message", [
    ([1, 2, 3], "expected a dict with 'segments'"),
    ({"segments": []}, "expected a dict with 'segments'"),
    ({"segments": {}, "device_traces": []}, "must be lists"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}, r"device_traces\[0\]\[0\]: .*'addr'"),
    ({"segments": [], "device_traces": [[_entry("teleport", 0, 512)]]}, "unknown action"),
    ({"segments": [], "device_traces": [["alloc"]]}, "expected a dict"),
    ({"segments": [_segment(0, 2 * MiB, [_block(0, MiB)])], "device_traces": [[]]}, "blocks cover"),
    ({"segments": [_segment(0, MiB, [_block(0, MiB, state="zombie")])], "device_traces": [[]]}, "unknown state"),
    ({"segments": [_segment(0, MiB, [_block(0, MiB)], kind="huge")], "device_traces": [[]]}, "segment_type"),
    ({"segments": [_segment(0, 2 * MiB, [_block(0, 2 * MiB)]), _segment(MiB, 2 * MiB, [_block(MiB, 2 * MiB)])],
      "device_traces": [[]]}, "overlap"),
])
def test_wrong_shape_is_an_input_error_naming_the_file(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(InputError, match=message) as err:
        read_torch_snapshot(path)
    assert str(err.value).startswith(str(path))


def test_device_out_of_range(tmp_path):
    path = _write(tmp_path, {"segments": [], "device_traces": [[]]})
    with pytest.raises(InputError, match="no trace for device 1"):
        read_torch_snapshot(path, device=1)


def test_safe_unpickler_keeps_builtin_containers():
    data = {"a": [1, 2.5, None, True], "b": (1, "x"), "c": b"raw", "d": {3: 4}}
    import io
    assert SafeUnpickler(io.BytesIO(pickle.dumps(data, protocol=4))).load() == data


def test_looks_like_torch_snapshot():
    assert looks_like_torch_snapshot(pickle.dumps({}, protocol=2)[:8])
    assert looks_like_torch_snapshot(pickle.dumps({}, protocol=5)[:8])
    assert not looks_like_torch_snapshot(b'{"format": "ms-memopt-events"}\n')
    assert not looks_like_torch_snapshot(b"")


# --- event mapping and start state ----------------------------------------------------------------
def _synthetic(tmp_path) -> Path:
    """A large segment holding a weight from before recording (with a 512 KiB unsplit tail), a
    block freed in the trace but never allocated in it, and a segment the trace allocates."""
    base, new = 0x1000_0000, 0x2000_0000
    weight = 3 * MiB + 512 * 1024           # block of a 3 MiB request plus its unsplit tail
    segments = [
        _segment(base, 20 * MiB, [_block(base, weight), _block(base + weight, 20 * MiB - weight, "inactive")]),
        _segment(new, 2 * MiB, [_block(new, 512), _block(new + 512, 2 * MiB - 512, "inactive")], kind="small"),
    ]
    trace = [
        _entry("free_requested", base + weight, 4 * MiB, time_us=10),
        _entry("free_completed", base + weight, 4 * MiB, time_us=11),   # pre-existing block
        _entry("segment_alloc", new, 2 * MiB, time_us=12),
        _entry("alloc", new, 500, time_us=13),
        _entry("alloc", new + 512, 700, time_us=14),
        _entry("free_completed", new + 512, 700, time_us=15),
        _entry("oom", 0, 0),
        _entry("snapshot", 0, 0),
    ]
    return _write(tmp_path, {"segments": segments, "device_traces": [trace]})


def test_events_ids_and_free_pairing(tmp_path):
    trace = read_torch_snapshot(_synthetic(tmp_path))
    assert trace.format == "torch-snapshot"
    assert [e.action for e in trace.events] == ["free", "segment_alloc", "alloc", "alloc", "free"]
    pre_free, _, a1, a2, f2 = trace.events
    assert f2.id == a2.id != a1.id
    assert a1.addr == 0x2000_0000 and a1.size == 500
    assert a1.time == pytest.approx(13e-6)
    assert trace.meta["skipped_actions"] == {"free_requested": 1, "oom": 1, "snapshot": 1}
    assert pre_free.id not in (a1.id, a2.id)


def test_initial_state_reconstruction(tmp_path):
    trace = read_torch_snapshot(_synthetic(tmp_path))
    initial = trace.initial
    initial.check()
    assert [s.addr for s in initial.segments] == [0x1000_0000]      # the trace allocated the other
    blocks = [(b.addr - 0x1000_0000, b.size, b.live) for b in initial.segments[0].blocks]
    weight = 3 * MiB + 512 * 1024
    assert blocks == [(0, weight, True), (weight, 4 * MiB, True), (weight + 4 * MiB, 20 * MiB - weight - 4 * MiB, False)]
    ids = {b.addr: b.id for b in initial.live_blocks()}
    assert ids[0x1000_0000 + weight] == trace.events[0].id           # its free in the trace pairs up
    final_ids = {b.addr: b.id for b in trace.final.live_blocks()}
    assert final_ids[0x1000_0000] == ids[0x1000_0000]
    assert final_ids[0x2000_0000] == trace.events[2].id
    assert [s.pool for s in trace.final.segments] == ["large", "small"]


def test_unsplit_tail_rule_only_for_large_pool(tmp_path):
    base = 0x4000_0000
    # a small segment: a 512 B gap after a live block is a real free block (small pool splits >= 512 B)
    segments = [_segment(base, 2 * MiB, [_block(base, 1024), _block(base + 1024, 2 * MiB - 1024, "inactive")],
                         kind="small")]
    trace = [_entry("free_completed", base + 1536, 4096)]
    initial = read_torch_snapshot(_write(tmp_path, {"segments": segments, "device_traces": [trace]})).initial
    assert [(b.addr - base, b.size, b.live) for b in initial.segments[0].blocks] == [
        (0, 1024, True), (1024, 512, False), (1536, 4096, True), (5632, 2 * MiB - 5632, False)]
    # a large segment: a gap of <= 1 MiB after a live block is that block's unsplit tail
    segments = [_segment(base, 20 * MiB, [_block(base, 20 * MiB, "inactive")])]
    trace = [_entry("free_completed", base, 3 * MiB), _entry("free_completed", base + 3 * MiB + MiB, 5 * MiB),
             _entry("free_completed", base + 10 * MiB, 2 * MiB)]
    initial = read_torch_snapshot(_write(tmp_path, {"segments": segments, "device_traces": [trace]})).initial
    assert [(b.addr - base, b.size, b.live) for b in initial.segments[0].blocks] == [
        (0, 4 * MiB, True), (4 * MiB, 6 * MiB, True), (10 * MiB, 2 * MiB, True), (12 * MiB, 8 * MiB, False)]


def test_segment_freed_in_trace_exists_at_start(tmp_path):
    seg = 0x5000_0000
    trace = [_entry("segment_free", seg, 20 * MiB)]
    initial = read_torch_snapshot(_write(tmp_path, {"segments": [], "device_traces": [trace]})).initial
    assert [(s.addr, s.size, s.pool) for s in initial.segments] == [(seg, 20 * MiB, "large")]
    assert [b.live for b in initial.segments[0].blocks] == [False]


def test_older_snapshot_without_block_addresses(tmp_path):
    seg = _segment(0x10_0000, 2 * MiB, [{"size": 512, "state": "active_allocated"},
                                       {"size": 2 * MiB - 512, "state": "inactive"}], kind="small")
    final = read_torch_snapshot(_write(tmp_path, {"segments": [seg], "device_traces": []})).final
    assert [(b.addr, b.size) for b in final.segments[0].blocks] == [(0x10_0000, 512), (0x10_0200, 2 * MiB - 512)]


def test_shared_snapshots_read(tmp_path):
    old = read_torch_snapshot(_shared("tinyllama_qlora.pickle"))
    counts = {}
    for e in old.events:
        counts[e.action] = counts.get(e.action, 0) + 1
    assert counts == {"alloc": 3505, "free": 3325, "segment_alloc": 152}
    assert len(old.final.segments) == 215 and len(old.initial.segments) == 215 - 152
    assert all(e.time is None for e in old.events)
    new = read_torch_snapshot(_shared("cs336_small_warm.pickle"))
    assert len(new.initial.segments) == len(new.final.segments) == 216
    assert all(e.time is not None for e in new.events)
    assert new.meta["allocator_settings"]["expandable_segments"] is False
    for trace in (old, new):
        trace.initial.check()
        trace.final.check()
        freed_ids = {e.id for e in trace.events if e.action == "free"}
        alloc_ids = {e.id for e in trace.events if e.action == "alloc"}
        initial_ids = {b.id for b in trace.initial.live_blocks()}
        assert freed_ids <= alloc_ids | initial_ids      # every free pairs with a known block


# --- memory_viz export ------------------------------------------------------------------------------
_BUILTIN = (dict, list, tuple, str, int, float, bool, type(None))


def _only_builtins(obj) -> bool:
    if type(obj) not in _BUILTIN:
        return False
    if isinstance(obj, dict):
        return all(_only_builtins(k) and _only_builtins(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_only_builtins(x) for x in obj)
    return True


def _check_schema(data: dict) -> None:
    """The fields PyTorch's memory_viz page reads, with their types."""
    assert _only_builtins(data)
    assert isinstance(data["segments"], list) and isinstance(data["device_traces"], list)
    for seg in data["segments"]:
        for key, kind in (("device", int), ("address", int), ("total_size", int), ("stream", int),
                          ("segment_type", str), ("allocated_size", int), ("active_size", int),
                          ("blocks", list), ("frames", list)):
            assert isinstance(seg[key], kind), key
        assert seg["segment_type"] in ("small", "large")
        cursor = seg["address"]
        for block in seg["blocks"]:
            assert block["address"] == cursor and block["size"] > 0
            assert block["state"] in ("active_allocated", "inactive") and isinstance(block["frames"], list)
            cursor += block["size"]
        assert cursor == seg["address"] + seg["total_size"]
    for trace in data["device_traces"]:
        for entry in trace:
            assert entry["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")
            assert isinstance(entry["addr"], int) and isinstance(entry["size"], int)
            assert isinstance(entry["stream"], int) and isinstance(entry["frames"], list)


def _key(e: Event):
    return (e.action, e.id, e.size, e.addr, e.stream, e.time)


def test_memory_viz_round_trip_synthetic(tmp_path):
    trace = read_torch_snapshot(_synthetic(tmp_path))
    out = tmp_path / "viz" / "out.pickle"
    write_memory_viz(out, trace)
    _check_schema(SafeUnpickler(open(out, "rb")).load())
    again = read_torch_snapshot(out)
    assert [_key(e) for e in again.events] == [_key(e) for e in trace.events]
    assert again.final == trace.final and again.initial == trace.initial


def test_memory_viz_needs_addresses():
    with pytest.raises(InputError, match="no address"):
        snapshot_dict([Event("alloc", id=1, size=512)], Layout())


def test_memory_viz_of_model_placements(tmp_path):
    from ms_memopt.allocators import create
    events = [Event("alloc", id=1, size=3 * MiB), Event("alloc", id=2, size=100),
              Event("free", id=1), Event("alloc", id=3, size=MiB + 1)]
    placed, result = placed_events(Trace(events), create("torch"))
    assert [e.action for e in placed] == ["alloc", "alloc", "free", "alloc"]
    assert placed[2].addr == placed[0].addr == placed[3].addr     # best fit reuses the freed block
    out = tmp_path / "placed.pickle"
    write_memory_viz(out, placed, result.final_layout)
    data = SafeUnpickler(open(out, "rb")).load()
    _check_schema(data)
    back = read_torch_snapshot(out)
    shape = lambda layout: [(s.addr, s.size, s.pool, [(b.addr, b.size, b.live) for b in s.blocks])
                            for s in layout.segments]
    assert shape(back.final) == shape(result.final_layout)
    ours = [(e.action, e.addr) for e in back.events if not e.action.startswith("segment_")]
    assert ours == [(e.action, e.addr) for e in placed]
    # no recorded segment events: each segment of the final layout appears just before its first block
    grown = [(i, e.addr) for i, e in enumerate(back.events) if e.action == "segment_alloc"]
    assert sorted(a for _, a in grown) == sorted(s.addr for s in result.final_layout.segments)
    for i, addr in grown:
        assert back.events[i + 1].action == "alloc" and back.events[i + 1].addr >= addr


@pytest.mark.parametrize("name", ["tinyllama_qlora.pickle", "cs336_small_warm.pickle"])
def test_memory_viz_round_trip_shared(tmp_path, name):
    trace = read_torch_snapshot(_shared(name))
    out = tmp_path / "rt.pickle"
    write_memory_viz(out, trace)
    _check_schema(SafeUnpickler(open(out, "rb")).load())
    again = read_torch_snapshot(out)
    assert [_key(e) for e in again.events] == [_key(e) for e in trace.events]
    assert again.final == trace.final and again.initial == trace.initial


# --- fuzzing: whatever the bytes or the shape, only InputError comes out ------------------------------
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**50), st.floats(allow_nan=False),
                    st.text(max_size=8), st.sampled_from(["alloc", "free_completed", "segment_alloc",
                                                          "inactive", "active_allocated", "large", "small"]))
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(
        ["segments", "device_traces", "address", "total_size", "size", "addr", "action", "state",
         "blocks", "stream", "segment_type", "device"]), inner, max_size=6)), max_leaves=25)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_value)
def test_fuzzed_shapes_only_raise_input_error(tmp_path, data):
    path = _write(tmp_path, data, "fuzz.pickle")
    try:
        trace = read_torch_snapshot(path)
    except InputError as exc:
        assert str(exc).startswith(str(path))
    else:
        trace.final.check()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                   max_size=4))
def test_fuzzed_bytes_only_raise_input_error(tmp_path, cut, flips):
    whole = bytearray(_synthetic(tmp_path).read_bytes())
    for pos, byte in flips:
        whole[pos % len(whole)] = byte
    path = tmp_path / "bytes.pickle"
    path.write_bytes(bytes(whole[: cut % (len(whole) + 1)]))
    try:
        read_torch_snapshot(path)
    except InputError as exc:
        assert str(exc).startswith(str(path))


# --- the consistency checks folded into the reader's pass -------------------------------------
def _checked_as_fed(raw: list[dict], events: list[Event]) -> dict:
    """What TraceChecker says when fed the reader's events as the reader fed it before the checks
    were folded into its pass: every allocation, every free of an id allocated in the trace, each
    with its entry's index; the frees the reader drops (an address freed already) are double frees."""
    from ms_memopt.core.consistency import TraceChecker

    checker, live, touched, allocated = TraceChecker(), set(), set(), set()
    kept = []
    for i, entry in enumerate(raw):
        addr = entry["addr"]
        if entry["action"] == "alloc":
            live.add(addr)
        elif addr not in live and addr in touched:
            checker.found.note("double_free", i)
            continue
        else:
            live.discard(addr)
        touched.add(addr)
        kept.append(i)
    assert len(kept) == len(events)
    for i, event in zip(kept, events):
        if event.action == "alloc":
            allocated.add(event.id)
            checker.feed(event, i)
        elif event.id in allocated:
            checker.feed(event, i)
    return checker.found.to_meta()


_drawn_entries = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free_completed"]),
                                    st.integers(0, 40), st.integers(0, 6)), max_size=120)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=_drawn_entries, flat=st.sampled_from([0, 2, 4096]))
def test_folded_checks_match_the_trace_checker(tmp_path, monkeypatch, drawn, flat):
    """Overlaps, double frees and frees of blocks alive before recording, with the live starts in a
    plain list, a SortedKeys, or moved from one to the other mid-trace: the same counts and first lines."""
    from ms_memopt.io.traces import torch_snapshot

    monkeypatch.setattr(torch_snapshot, "_FLAT_STARTS", flat)
    raw = [_entry(action, addr * 512, size * 512) for action, addr, size in drawn]
    path = _write(tmp_path, {"segments": [_segment(0, 64 * 512, [_block(0, 64 * 512, "inactive")])],
                             "device_traces": [raw]}, "drawn.pickle")
    trace = read_torch_snapshot(path)
    assert trace.inconsistencies == _checked_as_fed(raw, trace.events)
