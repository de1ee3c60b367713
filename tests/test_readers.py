"""Trace readers: MindSpore memory_block.csv, msMemScope, instances, JSONL, pool debug dump,
format detection, and fuzzing (a damaged file gives a Trace or an InputError, nothing else)."""
from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace, write_jsonl
from ms_memopt.core.metrics import measure
from ms_memopt.io.traces import FORMATS, detect_format, load_trace
from ms_memopt.io.traces.fields import parse_address
from ms_memopt.io.traces.instances_events import instances_to_trace
from ms_memopt.io.traces.memory_block import NEVER_FREED, read_memory_block
from ms_memopt.io.traces.ms_debug_dump import layout_at, read_pool_debug_dump
from ms_memopt.io.traces.msmemscope import read_msmemscope
from ms_memopt.io.traces.synthetic import synthetic_trace

DATA = Path(__file__).resolve().parent / "data"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MIB = 2**20


def _shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not present: {path}")
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _paired(trace: Trace) -> None:
    """Every free follows its alloc; ids are unique; times never go backwards."""
    live, seen, last = set(), set(), None
    for event in trace.events:
        if event.time is not None:
            assert last is None or event.time >= last
            last = event.time
        if event.action == "alloc":
            assert event.id not in seen
            seen.add(event.id)
            live.add(event.id)
        elif event.action == "free":
            assert event.id in live
            live.remove(event.id)


# --- memory_block.csv ---------------------------------------------------------------------
def test_memory_block_2_10_sample():
    trace = load_trace(DATA / "memory_block_2.10.csv")
    assert trace.format == "mindspore-memory-block"
    assert trace.meta["layout"] == "2.10" and trace.meta["rows"] == 10
    assert trace.meta["somas_inner_rows"] == 2 and trace.meta["somas_inner_bytes"] == 8 * MIB
    assert trace.meta["never_freed"] == 3
    allocs = [e for e in trace.events if e.action == "alloc"]
    frees = [e for e in trace.events if e.action == "free"]
    assert len(allocs) == 8 and len(frees) == 5
    weights = [e for e in allocs if e.tag == "Weight"]
    assert [e.pool for e in weights] == ["persistent", "persistent"]
    assert weights[0].addr == 0x124080000000 and weights[0].size == 4 * MIB
    assert {e.tag for e in allocs} == {"Weight", "Kernel", "WorkSpace", "Somas", "GraphOutput"}
    assert [e.stream for e in allocs if e.time == 21] == [1]
    assert [e.time for e in trace.events] == sorted(e.time for e in trace.events)
    _paired(trace)


def test_header_only_file_as_written_on_cpu(tmp_path):
    """MindSpore 2.10 on CPU writes only this header (CPU blocks are not tracked): zero events."""
    header = ("start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,actual_used_memory,"
              "actual_peak_memory,file_name,line_num,type,producer_task,task_name,node_name,graph_name,"
              "user_tasks,last_user_task,python_stack,is_persistent,is_small,\n")
    trace = load_trace(_write(tmp_path, "memory_block.csv", header))
    assert trace.format == "mindspore-memory-block" and trace.events == [] and trace.meta["layout"] == "2.10"


def test_older_layout_reads_the_same_events():
    new = read_memory_block(DATA / "memory_block_2.10.csv")
    old = read_memory_block(DATA / "memory_block_older.csv")
    assert old.meta["layout"] == "older"
    strip = lambda t: [(e.action, e.id, e.size, e.addr, e.stream, e.time, e.tag) for e in t.events]
    assert strip(old) == strip(new)
    assert all(e.pool is None for e in old.events)  # the older layout has no is_persistent


def test_python_stack_with_commas_and_newlines(tmp_path):
    header = ("start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,type,python_stack,"
              "is_persistent,is_small,\n")
    rows = ('3,9,0x2000,0,Ascend,1024,Kernel,File "a.py", line 3, in f\n  File "b.py", line 9, in g,0,0,\n'
            "5,7,4096,2,Ascend,512,WorkSpace,,1,0,\n")
    trace = read_memory_block(_write(tmp_path, "m.csv", header + rows))
    assert [(e.action, e.id, e.time) for e in trace.events] == [
        ("alloc", 1, 3), ("alloc", 2, 5), ("free", 2, 7), ("free", 1, 9)]
    assert trace.events[1].addr == 4096 and trace.events[1].stream == 2 and trace.events[1].pool == "persistent"


def test_never_freed_has_no_free(tmp_path):
    text = f"start_time_stamp,end_time_stamp,device_addr,size,\n1,{NEVER_FREED},0x10,512,\n"
    trace = read_memory_block(_write(tmp_path, "m.csv", text))
    assert [e.action for e in trace.events] == ["alloc"]


@pytest.mark.parametrize("row, message", [
    ("1,2,0x10,", "expected 4 comma-separated fields"),
    ("5,3,0x10,512,", "before start_time_stamp"),
    ("1,2,0x10,-5,", "non-negative"),
    ("1,2,zz,512,", "device_addr"),
    ("1,2,0x10,1.5,", "size: expected an integer"),
])
def test_memory_block_bad_rows_name_the_line(tmp_path, row, message):
    path = _write(tmp_path, "m.csv", "start_time_stamp,end_time_stamp,device_addr,size,\n1,2,0x20,512,\n" + row + "\n")
    with pytest.raises(InputError) as info:
        read_memory_block(path)
    assert message in str(info.value) and f"{path}:3" in str(info.value)


def test_memory_block_missing_columns(tmp_path):
    with pytest.raises(InputError, match="missing device_addr"):
        read_memory_block(_write(tmp_path, "m.csv", "start_time_stamp,end_time_stamp,size,\n1,2,512,\n"))


@pytest.mark.parametrize("text, value", [("0x12c041400000", 0x12c041400000), ("4096", 4096), ("0", None),
                                         ("(nil)", None), ("0X1F", 31)])
def test_parse_address(text, value):
    assert parse_address(text) == value


# --- msMemScope -------------------------------------------------------------------------------
def test_msmemscope_shared_baseline():
    trace = load_trace(_shared("traces", "msmemscope", "baseline.csv"))
    assert trace.format == "msmemscope"
    actions = [e.action for e in trace.events]
    # as the CSV: 18 PTA MALLOC, 14 FREE; plus one placeholder for memory held before recording
    assert actions.count("alloc") == 19 and actions.count("free") == 14
    held = trace.events[1]
    assert (held.action, held.id, held.tag, held.addr, held.size) == ("alloc", 0, "pre-trace", 0x12c041200000, 4096)
    assert actions.count("segment_alloc") == 3 and actions.count("segment_free") == 2
    assert trace.meta["other_device_allocs"] == 3  # HAL allocations holding no PTA tensor
    inferred = trace.events[0]
    assert inferred.action == "segment_alloc" and inferred.tag == "inferred"
    assert (inferred.addr, inferred.size) == (0x12c041200000, 2 * MIB)
    big = [e for e in trace.events if e.action == "alloc" and e.size == 16778240]
    assert [e.addr for e in big] == [0x12c041400000, 0x12c041400000]
    _paired(trace)


def test_msmemscope_bad_attr(tmp_path):
    header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n"
    row = '5,MALLOC,PTA,N/A,100,1,1,0,0x10,"{allocation_id:1,addr:0x10,size:big}"\n'
    with pytest.raises(InputError, match="Attr size"):
        read_msmemscope(_write(tmp_path, "s.csv", header + row))
    with pytest.raises(InputError, match="truncated row"):
        read_msmemscope(_write(tmp_path, "t.csv", header + "5,MALLOC,PTA,N/A,100\n"))


def test_msmemscope_pairs_by_address_without_ids(tmp_path):
    header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n"
    rows = ('2,FREE,MINDSPORE,N/A,300,1,1,0,0x10,"{addr:0x10,size:512}"\n'
            '1,MALLOC,MINDSPORE,N/A,100,1,1,0,0x10,"{addr:0x10,size:512}"\n'
            '3,MALLOC,HOST,N/A,150,1,1,host,0x99,"{addr:0x99,size:64}"\n')
    trace = read_msmemscope(_write(tmp_path, "s.csv", header + rows))
    assert [(e.action, e.id, e.time) for e in trace.events] == [("alloc", 1, 100), ("free", 1, 300)]


def test_msmemscope_device_ids_order_numerically_however_long(tmp_path):
    """A fuzz case: a 5,000-digit Device Id made int() raise ValueError (its digit limit)."""
    header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n"
    rows = ('1,MALLOC,MINDSPORE,N/A,100,1,1,10,0x10,"{addr:0x10,size:512}"\n'
            '2,MALLOC,MINDSPORE,N/A,110,1,1,' + "9" * 5000 + ',0x20,"{addr:0x20,size:512}"\n'
            '3,MALLOC,MINDSPORE,N/A,120,1,1,02,0x30,"{addr:0x30,size:512}"\n')
    trace = read_msmemscope(_write(tmp_path, "s.csv", header + rows))
    assert [e.addr for e in trace.events if e.action == "alloc"] == [0x30]     # device 2, the lowest


# --- instances --------------------------------------------------------------------------------
def test_instances_frees_before_allocs_at_equal_times():
    buffers = [SimpleNamespace(id="x", lower=0, upper=2, size=8), SimpleNamespace(id="y", lower=2, upper=4, size=8),
               SimpleNamespace(id="z", lower=1, upper=2, size=4)]
    trace = instances_to_trace(buffers)
    assert [(e.action, e.id, e.time) for e in trace.events] == [
        ("alloc", 1, 0), ("alloc", 3, 1), ("free", 1, 2), ("free", 3, 2), ("alloc", 2, 2), ("free", 2, 4)]
    assert trace.meta["buffer_ids"] == ["x", "y", "z"]


def test_instances_files():
    trace = load_trace(DATA / "instances_small.csv")
    assert trace.format == "instances" and len(trace.events) == 8
    _paired(trace)
    shared = load_trace(_shared("dsa", "minimalloc", "input.12.csv"))
    assert shared.format == "instances" and shared.events
    _paired(shared)


# --- JSONL ------------------------------------------------------------------------------------
def test_jsonl_sample_and_round_trip(tmp_path):
    trace = load_trace(DATA / "events.jsonl")
    assert trace.format == "jsonl"
    assert [e.action for e in trace.events] == ["segment_alloc", "step", "alloc", "alloc", "alloc", "free",
                                                 "mark", "free", "empty_cache"]
    synthetic = synthetic_trace(5000, seed=3)
    write_jsonl(tmp_path / "s.jsonl", synthetic.events, meta={"seed": 3})
    back = load_trace(tmp_path / "s.jsonl")
    assert back.events == synthetic.events and back.meta == {"seed": 3}


# --- detection ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, fmt", [("memory_block_2.10.csv", "mindspore-memory-block"),
                                       ("memory_block_older.csv", "mindspore-memory-block"),
                                       ("events.jsonl", "jsonl"), ("instances_small.csv", "instances")])
def test_detect_samples(name, fmt):
    assert detect_format(DATA / name) == fmt


def test_detect_shared_files():
    assert detect_format(_shared("traces", "msmemscope", "baseline.csv")) == "msmemscope"
    assert detect_format(_shared("traces", "torch", "cs336_small_warm.pickle")) == "torch-snapshot"


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"), (b"   \n\n", "empty file"), (b"\x00\x01\x02garbage" * 50, "binary"),
    (b'{"format": "chrome-trace"}\n', "not the ms-memopt header"), (b"hello world\n", "unknown trace format"),
])
def test_detect_rejects(tmp_path, content, message):
    path = tmp_path / "f.txt"
    path.write_bytes(content)
    with pytest.raises(InputError) as info:
        load_trace(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_detect_rejects_directory_and_missing(tmp_path):
    with pytest.raises(InputError, match="directory"):
        load_trace(tmp_path)
    with pytest.raises(InputError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_pool_dump_is_pointed_to_its_reader():
    with pytest.raises(InputError, match="read_pool_debug_dump"):
        load_trace(DATA / "MemoryDebugInfo0.txt")


def test_explicit_format(tmp_path):
    with pytest.raises(InputError, match="unknown trace format 'csv'"):
        load_trace(DATA / "events.jsonl", format="csv")
    with pytest.raises(InputError, match="memory_block.csv header"):
        load_trace(DATA / "events.jsonl", format="mindspore-memory-block")
    assert set(FORMATS) == {"torch-snapshot", "jsonl", "mindspore-memory-block", "msmemscope", "instances",
                            "mindspore-pool-log", "ascend-profiler"}


# --- pool debug dump and layouts ------------------------------------------------------------------
def test_pool_debug_dump_sample():
    layout = read_pool_debug_dump(DATA / "MemoryDebugInfo0.txt")
    layout.check()
    assert [(s.pool, s.stream, s.size) for s in layout.segments] == [
        ("persistent", 0, 2**30), ("common", 0, 2**30), ("common", 0, 2 * 2**30), ("common", 1, 2**30)]
    m = measure(layout)
    assert m.reserved == 5 * 2**30
    assert m.allocated == 8 * MIB + MIB + 512 * 2**10 + 100 * MIB + 2 * MIB + 4 * MIB
    assert m.largest_free == 2 * 2**30 - 0xca00000
    pinned = [b for b in layout.blocks() if b.pinned]
    assert [(b.addr, b.size) for b in pinned] == [(0x12c080200000, 512 * 2**10)]
    assert {b.tag for b in layout.live_blocks()} == {"Weight", "Kernel", "WorkSpace"}


def test_pool_debug_dump_older_allocator_text_and_eager_free(tmp_path):
    text = (DATA / "MemoryDebugInfo0.txt").read_text()
    text = text.replace(", is small : 0, is customized : 0.", ".").replace("status_\":idle", "status_\":eager_free", 1)
    layout = read_pool_debug_dump(_write(tmp_path, "MemoryDebugInfo1.txt", text))
    layout.check()
    assert layout.reserved == 5 * 2**30


@pytest.mark.parametrize("edit, message", [
    (("mem_bufs size : 2", "mem_bufs size : 3"), "expected a mem buf line"),
    (("Mem block info - total count : 1", "Mem block info - total count : 9"), "expected a mem block line"),
    (('"addr_":0x12c140000000,"size_":4194304', '"addr_":0x13c140000000,"size_":4194304'), "lies in no mem block"),
    (("stream id : 1, is persistent : 0\n", "what is this\n"), "unexpected line"),
    (("status_\":used,", "status_\":lost,"), "status_"),
    # a digit run longer than any 64-bit number: int() of it would raise ValueError (found by the fuzz test)
    (("is persistent : 0, stream id : 1,", "is persistent : 0, stream id : " + "9" * 5000 + ","), "stream id"),
    (('"size_":4194304,"stream_id_":1', '"size_":' + "4" * 5000 + ',"stream_id_":1'), "expected a mem buf line"),
])
def test_pool_debug_dump_errors(tmp_path, edit, message):
    text = (DATA / "MemoryDebugInfo0.txt").read_text().replace(*edit, 1)
    with pytest.raises(InputError, match=message):
        read_pool_debug_dump(_write(tmp_path, "MemoryDebugInfo2.txt", text))


def test_layout_at_reconstructs_live_buffers():
    trace = load_trace(DATA / "memory_block_2.10.csv")
    layout = layout_at(trace, 13, {0x12c080000000: {"block_memory_size": 2**30, "block_stream_id": 0},
                                   0x12c140000000: {"block_memory_size": 2**30, "block_stream_id": 1}},
                       persistent_bases=[(0x124080000000, 2**30)])
    layout.check()
    common = layout.segments[1]
    assert [(b.addr, b.size, b.live) for b in common.blocks[:4]] == [
        (0x12c080000000, MIB, True), (0x12c080100000, 2048, False), (0x12c080100800, 512 * 1024, True),
        (0x12c080180800, 8 * MIB, True)]
    assert layout.segments[0].pool == "persistent" and layout.segments[0].allocated == 8 * MIB
    later = layout_at(trace, 22, {0x12c080000000: 2**30, 0x12c140000000: 2**30}, strict=False)
    assert later.segments[1].allocated == 4 * MIB  # the stream-1 AllReduce buffer


def test_layout_at_accepts_capsules_and_rejects_strays():
    make = ctypes.pythonapi.PyCapsule_New
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = make(0x10000, None, None)
    trace = Trace([Event("alloc", id=1, size=512, addr=0x10200, time=1)])
    layout = layout_at(trace, 5, {capsule: {"block_memory_size": 4096, "block_stream_id": 0}})
    assert layout.segments[0].addr == 0x10000 and layout.allocated == 512
    with pytest.raises(InputError, match="lies in no given pool block"):
        layout_at(trace, 5, {0x20000: 4096})


# --- synthetic traces -----------------------------------------------------------------------------
def test_synthetic_is_seeded_and_exact():
    a, b = synthetic_trace(20000, seed=5), synthetic_trace(20000, seed=5)
    assert len(a.events) == 20000 and a.events == b.events
    assert a.events != synthetic_trace(20000, seed=6).events
    actions = {e.action for e in a.events}
    assert {"alloc", "free", "step", "mark"} <= actions
    _paired(a)
    assert any(e.pool == "persistent" for e in a.events)


# --- fuzzing: damaged files give a Trace or an InputError, never another exception -----------------
_SAMPLES = {name: (DATA / name).read_bytes() for name in
            ("memory_block_2.10.csv", "memory_block_older.csv", "events.jsonl")}
_MSMEMSCOPE = SHARED / "traces" / "msmemscope" / "baseline.csv"
if _MSMEMSCOPE.exists():
    _SAMPLES["baseline.csv"] = _MSMEMSCOPE.read_bytes()


def _damage(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data[: max(0, min(cut, len(data)))])
    for position, value in flips:
        if out:
            out[position % len(out)] = value
    return bytes(out)


def _load_or_input_error(reader, data: bytes, suffix: str) -> None:
    handle, name = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        try:
            result = reader(name)
        except InputError as exc:
            assert str(exc)
        else:
            assert result is not None
    finally:
        os.unlink(name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample=st.sampled_from(sorted(_SAMPLES)), cut=st.integers(0, 20000),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6))
def test_fuzz_trace_readers(sample, cut, flips):
    _load_or_input_error(load_trace, _damage(_SAMPLES[sample], cut, flips), ".trace")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, 6000), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6))
def test_fuzz_pool_debug_dump(cut, flips):
    data = _damage((DATA / "MemoryDebugInfo0.txt").read_bytes(), cut, flips)
    _load_or_input_error(read_pool_debug_dump, data, ".txt")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("0123456789,-x\n abcdef:{}\"")), max_size=300))
def test_fuzz_memory_block_rows(text):
    header = "start_time_stamp,end_time_stamp,device_addr,stream_id,size,type,python_stack,is_persistent,\n"
    _load_or_input_error(load_trace, (header + text).encode(), ".csv")


def test_jsonl_segment_events_need_an_address(tmp_path):
    path = _write(tmp_path, "e.jsonl", '{"format": "ms-memopt-events", "version": 1}\n'
                                       '{"action":"segment_alloc","size":4096}\n')
    with pytest.raises(InputError, match=":2: missing 'addr'"):
        load_trace(path)
