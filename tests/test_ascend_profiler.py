"""The Ascend profiler's memory output: the reader against the real shared samples, files written in
each writer's format with every quirk (TAB, CRLF/LF, unsorted rows, empty and N/A fields, cann:: rows,
KB), a db written with the writer's schema, and bad input."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.io.traces import detect_format, load_trace
from ms_memopt.io.traces.ascend_profiler import read_ascend_profiler
from ms_memopt.io.traces.ascend_profiler.writer import us_text, write_profiler_output

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "ascend_profiler"
KiB, MiB = 1024, 2**20
T0 = 1736408883694624810        # ns, as the profiler's clock gives them


def _shared(name: str) -> Path:
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"shared data not present: {path}")
    return path


def _live_at_end(trace, pad: int = 0) -> dict[int, int]:
    """Tensor id -> recorded block size of what is live at the end (the initial state included);
    ``pad``: what the events ask for less than the block (torch_npu's 32 B)."""
    live = {b.id: b.size for b in trace.initial.live_blocks()} if trace.initial is not None else {}
    for e in trace.events:
        if e.action == "alloc":
            live[e.id] = e.size + pad
        elif e.action == "free":
            live.pop(e.id)           # a free of an unknown id would be a reader bug
    return live


# --------------------------------------------------------------------------- the real samples

@pytest.mark.parametrize("name", ["cnn_910b_level1_rank0", "cnn_910b_level1_rank0_db"])
def test_shared_sample_matches_the_recorded_curve_to_the_byte(name):
    trace = load_trace(_shared(name))
    assert trace.format == "ascend-profiler"
    meta = trace.meta
    assert meta["writer"] == "torch_npu" and meta["component"] == "PTA"
    assert meta["allocator_candidates"][0] == "torch-npu" and meta["framework"] == "torch_npu"
    for component in ("PTA", "GE"):
        figures = meta["components"][component]
        assert figures["allocated_max_diff"] == 0, component
        assert figures["checked"] == figures["events"] > 100
        assert figures["peak_allocated"] == figures["events_peak_allocated"]
    pta = meta["components"]["PTA"]
    assert pta["rows"] == 127 and pta["release_totals"] == "after"
    assert meta["components"]["GE"]["release_totals"] == "before"     # CANN's totals at a release
    # five tensors of the step before were released with no row: the totals fell between rows
    assert pta["unseen_releases"] == 5
    assert pta["allocated_first"] == (pta["held_initial_bytes"] + pta["unseen_release_bytes"])
    assert meta["recorded"]["peak_reserved"] == 1452 * MiB
    # the initial state: the pre-capture tensors in segments of the recorded reserved total
    assert trace.initial.reserved == pta["reserved_first"] == 1452 * MiB
    assert trace.initial.allocated == pta["allocated_first"]
    trace.initial.check()
    _live_at_end(trace)


def test_shared_sample_each_file_and_the_db_alone():
    rank = _shared("cnn_910b_level1_rank0") / "ASCEND_PROFILER_OUTPUT"
    for name in ("operator_memory.csv", "memory_record.csv", "npu_module_mem.csv"):
        assert detect_format(rank / name) == "ascend-profiler"
    alone = load_trace(rank / "memory_record.csv")
    assert alone.meta["components"]["PTA"]["allocated_max_diff"] == 0
    modules = load_trace(rank / "npu_module_mem.csv")
    assert modules.events == [] and modules.meta["modules_peak_reserved"]["HCCL"] > 0
    db = _shared("cnn_910b_level1_rank0_db") / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db"
    assert detect_format(db) == "ascend-profiler"
    ge = read_ascend_profiler(db, component="GE")
    allocs = [e for e in ge.events if e.action == "alloc" and e.addr is not None]
    assert len(allocs) == 57 and ge.meta["components"]["GE"]["allocated_max_diff"] == 0
    assert ge.meta["modules_peak_reserved"] == modules.meta["modules_peak_reserved"]     # NPU_MODULE_MEM


# --------------------------------------------------------------------------- each writer's format

def _events(spec: list[tuple[str, int, int, int]]) -> list[Event]:
    """(action, id, size, time offset in ns) -> events."""
    return [Event(a, id=i, size=s if a == "alloc" else 0, time=T0 + t) for a, i, s, t in spec]


QUIRKY = _events([("alloc", 1, 1536, 0), ("alloc", 2, 4 * MiB, 10), ("free", 1, 0, 20),
                  ("free", 900, 0, 25),                         # allocated before the capture: no row
                  ("alloc", 3, 512, 30), ("free", 2, 0, 30),    # equal times: the totals say which went first
                  ("alloc", 4, 2048, 40), ("free", 4, 0, 40),   # released the ns it was allocated
                  ("alloc", 5, 1 * MiB, 50)])                   # never released: live at the end


@pytest.mark.parametrize("writer,line_end,shuffle", [("torch_npu", "\r\n", None), ("torch_npu", "\n", 3),
                                                     ("mindspore", "\r\n", None), ("mindspore", "\n", 7)])
def test_writer_formats_read_back_exactly(tmp_path, writer, line_end, shuffle):
    folder = write_profiler_output(tmp_path, QUIRKY, writer=writer, initial={900: 3 * MiB, 901: 5 * MiB},
                                   line_end=line_end, shuffle=shuffle)
    raw = (folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv").read_bytes()
    assert (b"\r\n" in raw) == (line_end == "\r\n")
    assert (b"\t" in raw) == (writer == "torch_npu") and (b"N/A" in raw) == (writer == "mindspore")
    trace = load_trace(folder)
    component = "PTA" if writer == "torch_npu" else "MindSpore"
    figures = trace.meta["components"][component]
    assert trace.meta["writer"] == writer
    assert figures["allocated_max_diff"] == 0
    assert figures["unseen_releases"] == 1 and figures["unseen_release_bytes"] == 3 * MiB
    assert figures["held_initial_bytes"] == 5 * MiB
    # the initial state laid out in the recorded reserved total (PyTorch's pools, MindSpore's common pool)
    assert trace.initial.reserved == figures["reserved_first"] and trace.initial.allocated == 8 * MiB
    assert {seg.pool for seg in trace.initial.segments} == ({"large"} if writer == "torch_npu" else {"common"})
    if writer == "torch_npu":      # MindSpore's float times make all these rows one instant
        assert figures["unsorted"] == (shuffle is not None)
    pad = 32 if writer == "torch_npu" else 0     # torch_npu rounds request + 32 up to the block
    sizes = {e.id: e.size + pad for e in trace.events if e.action == "alloc" and e.id < 1 << 40}
    assert sorted(sizes.values()) == sorted([1536, 4 * MiB, 512, 2048, 1 * MiB])    # Size(KB) x 1024
    live = _live_at_end(trace, pad)
    assert sorted(live.values()) == sorted([512, 1 * MiB, 5 * MiB])
    # at T0 + 30 the 512 B tensor came first, then the 4 MiB one went: the totals say so (MindSpore's
    # float microseconds keep ~0.25 us at this clock, so there all of these times are one)
    order = [(e.action, sizes[e.id]) for e in trace.events if e.id < 1 << 40]
    assert order.index(("alloc", 512)) + 1 == order.index(("free", 4 * MiB))


def test_ties_follow_the_recorded_totals(tmp_path):
    # the allocation came first in the recording, though releases go first by default
    spec = _events([("alloc", 1, 8 * MiB, 0), ("alloc", 2, 2 * MiB, 10), ("free", 1, 0, 10)])
    trace = load_trace(write_profiler_output(tmp_path, spec))
    order = [e.action for e in trace.events if e.time == T0 + 10]
    assert order == ["alloc", "free"]
    figures = trace.meta["components"]["PTA"]
    assert figures["allocated_max_diff"] == 0 and figures["ties_ordered_by_totals"] == 1


def test_cann_rows_are_the_graph_engines_own_component(tmp_path):
    ge = _events([("alloc", 11, 64 * KiB, 5), ("alloc", 12, 256 * KiB, 6), ("free", 11, 0, 7), ("free", 12, 0, 9)])
    folder = write_profiler_output(tmp_path, QUIRKY[:3], ge=ge)
    text = (folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv").read_text()
    assert text.count("cann::") == 2
    trace = load_trace(folder)
    assert all(e.tag is None or not e.tag.startswith("cann") for e in trace.events)
    figures = trace.meta["components"]["GE"]
    assert figures["release_totals"] == "before" and figures["allocated_max_diff"] == 0
    assert figures["peak_allocated"] == 320 * KiB
    ge_trace = read_ascend_profiler(folder, component="GE")
    assert [e.size for e in ge_trace.events if e.action == "alloc"] == [64 * KiB, 256 * KiB]


def test_empty_allocation_time_is_the_initial_state(tmp_path):
    out = tmp_path / "ASCEND_PROFILER_OUTPUT"
    out.mkdir()
    header = ("Name,Size(KB),Allocation Time(us),Release Time(us),Active Release Time(us),Duration(us),"
              "Active Duration(us),Allocation Total Allocated(MB),Allocation Total Reserved(MB),"
              "Allocation Total Active(MB),Release Total Allocated(MB),Release Total Reserved(MB),"
              "Release Total Active(MB),Stream Ptr,Device Type")
    rows = [f"w,1024.0,,{us_text(T0 + 50)},,,,,,,1.0,4.0,1.0,7,NPU:0",       # allocated before, released at 50
            f"a,1024.0,{us_text(T0)},,,,,2.0,4.0,2.0,,,,7,NPU:0"]
    (out / "operator_memory.csv").write_text("\r\n".join([header] + rows) + "\r\n")
    trace = load_trace(tmp_path)
    figures = trace.meta["components"]["PTA"]
    assert figures["initial_rows"] == 1 and figures["allocated_max_diff"] == 0
    assert [b.id for b in trace.initial.live_blocks()] == [2] and trace.initial.reserved == 4 * MiB
    assert [(e.action, e.id) for e in trace.events] == [("alloc", 3), ("free", 2)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 3), st.booleans()), min_size=1, max_size=40),
       st.lists(st.integers(1, 8), max_size=4), st.sampled_from(["torch_npu", "mindspore"]), st.booleans())
def test_any_recording_reads_back_to_the_byte(tmp_path_factory, steps, initial, writer, shuffle):
    """Random tensors (sizes in 512 B units, times in us with many ties, some live at the end) and
    pre-capture tensors released unseen: the events' curve is the recorded one at every row."""
    events, live, time, ident = [], [], 0, 0
    pre = {1000 + i: units * 512 for i, units in enumerate(initial)}
    pending_pre = list(pre)
    for number, (units, gap, release) in enumerate(steps):
        time += gap if number else 0
        if release and live:
            events.append(Event("free", id=live.pop(0), time=T0 + 1000 * time))
        elif pending_pre and gap == 0 and time > 0:   # (one at the first row's time may be invisible)
            events.append(Event("free", id=pending_pre.pop(), time=T0 + 1000 * time))
        ident += 1
        events.append(Event("alloc", id=ident, size=units * 512, time=T0 + 1000 * time))
        live.append(ident)
    folder = write_profiler_output(tmp_path_factory.mktemp("p"), events, writer=writer, initial=pre,
                                   shuffle=1 if shuffle else None)
    trace = load_trace(folder)
    figures = trace.meta["components"]["PTA" if writer == "torch_npu" else "MindSpore"]
    assert figures["allocated_max_diff"] == 0
    assert figures["allocated_first"] == sum(pre.values())
    assert figures["rows"] == ident
    _live_at_end(trace)


# --------------------------------------------------------------------------- the db

def _db(path: Path, *, op_rows: list[tuple], ge_records: list[tuple] = ()) -> Path:
    """A db with torch_npu's MemoryDbParser schema (TableColumnsManager) and msprof's NPU_OP_MEM."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE STRING_IDS (id INTEGER PRIMARY KEY, value TEXT)")
    db.executemany("INSERT INTO STRING_IDS VALUES (?, ?)",
                   [(536870913, "PTA"), (536870914, "aten::mm"), (1, "Conv2D1"), (2, "allocate"), (3, "release")])
    db.execute("CREATE TABLE OP_MEMORY (name INTEGER, size INTEGER, allocationTime INTEGER, releaseTime INTEGER, "
               "activeReleaseTime INTEGER, duration INTEGER, activeDuration INTEGER, allocationTotalAllocated INTEGER, "
               "allocationTotalReserved INTEGER, allocationTotalActive INTEGER, releaseTotalAllocated INTEGER, "
               "releaseTotalReserved INTEGER, releaseTotalActive INTEGER, streamPtr INTEGER, deviceId INTEGER)")
    db.executemany("INSERT INTO OP_MEMORY VALUES (" + ",".join("?" * 15) + ")", op_rows)
    db.execute("CREATE TABLE MEMORY_RECORD (component INTEGER, timestamp INTEGER, totalAllocated INTEGER, "
               "totalReserved INTEGER, totalActive INTEGER, streamPtr INTEGER, deviceId INTEGER)")
    db.execute("INSERT INTO MEMORY_RECORD VALUES (536870913, ?, 1048576, 20971520, 1048576, 5, 0)", (T0,))
    if ge_records:
        db.execute("CREATE TABLE NPU_OP_MEM (operatorName INTEGER, addr INTEGER, type INTEGER, size INTEGER, "
                   "timestampNs INTEGER, globalTid INTEGER, totalAllocate NUMERIC, totalReserve NUMERIC, "
                   "component INTEGER, deviceId INTEGER)")
        db.executemany("INSERT INTO NPU_OP_MEM VALUES (?,?,?,?,?,0,?,?,0,0)", ge_records)
    db.commit()
    db.close()
    return path


def _op(size, at, rt, a_total, r_total, reserved=20 * MiB):
    return (536870914, size, at, rt, rt, None if rt is None else rt - at, None, a_total, reserved, a_total,
            r_total, None if rt is None else reserved, r_total, 5, 0)


def test_db_following_the_writers_schema(tmp_path):
    out = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    # rows out of time order; 1 MiB held before the capture
    rows = [_op(4096, T0 + 20, None, MiB + 8192, None), _op(4096, T0, T0 + 30, MiB + 4096, MiB + 4096),
            _op(2 * MiB, T0 + 5, None, 2 * MiB, None, reserved=0)]      # the workspace allocator's
    ge = [(1, 0x12C040000000, 2, 65536, T0 + 1, 65536, 2 * MiB), (1, 0x12C040000000, 3, -65536, T0 + 2, 65536, 2 * MiB)]
    _db(out / "ascend_pytorch_profiler_0.db", op_rows=rows, ge_records=ge)
    trace = load_trace(tmp_path / "rank0_ascend_pt")
    assert trace.meta["writer"] == "torch_npu" and trace.meta["files"] == ["ascend_pytorch_profiler_0.db"]
    pta = trace.meta["components"]["PTA"]
    assert pta["allocated_max_diff"] == 0 and pta["held_initial_bytes"] == MiB and pta["unsorted"]
    assert trace.meta["components"]["WORKSPACE"]["rows"] == 1
    assert trace.meta["components"]["PTA"]["memory_record_rows"] == 1
    assert [e.tag for e in trace.events if e.action == "alloc"] == ["aten::mm", "aten::mm"]
    assert trace.initial.allocated == MiB and trace.initial.reserved == 20 * MiB
    ge_trace = read_ascend_profiler(out / "ascend_pytorch_profiler_0.db", component="GE")
    assert [(e.action, e.addr) for e in ge_trace.events] == [("alloc", 0x12C040000000), ("free", 0x12C040000000)]
    assert ge_trace.meta["components"]["GE"]["allocated_max_diff"] == 0


def test_db_bad_cell_names_file_table_and_row(tmp_path):
    path = _db(tmp_path / "ascend_pytorch_profiler_0.db", op_rows=[_op("lots", T0, None, MiB, None)])
    with pytest.raises(InputError, match="OP_MEMORY row 1: size: expected an integer") as info:
        load_trace(path)
    assert info.value.source == str(path)


def test_db_without_memory_tables_names_them(tmp_path):
    path = tmp_path / "ascend_pytorch_profiler_0.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE TASK (startNs INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(InputError, match="no OP_MEMORY or NPU_OP_MEM table.*TASK"):
        load_trace(path)


# --------------------------------------------------------------------------- bad input

def _operator_csv(tmp_path: Path, *rows: str) -> Path:
    path = tmp_path / "operator_memory.csv"
    header = ("Name,Size(KB),Allocation Time(us),Release Time(us),Active Release Time(us),Duration(us),"
              "Active Duration(us),Allocation Total Allocated(MB),Allocation Total Reserved(MB),"
              "Allocation Total Active(MB),Release Total Allocated(MB),Release Total Reserved(MB),"
              "Release Total Active(MB),Stream Ptr,Device Type")
    path.write_text("\n".join((header,) + rows) + "\n")
    return path


GOOD_ROW = f"a,1.0,{us_text(T0)},,,,,1.0,2.0,1.0,,,,7,NPU:0"


@pytest.mark.parametrize("row,match", [
    (f"a,lots,{us_text(T0)},,,,,1.0,2.0,1.0,,,,7,NPU:0", "Size\\(KB\\): expected a number"),
    (f"a,-1.0,{us_text(T0)},,,,,1.0,2.0,1.0,,,,7,NPU:0", "non-negative"),
    ("a,1.0,yesterday,,,,,1.0,2.0,1.0,,,,7,NPU:0", "Allocation Time\\(us\\): expected a time"),
    (f"a,1.0,{us_text(T0)},,,,,inf,2.0,1.0,,,,7,NPU:0", "finite"),
    (f"a,1.0,{us_text(T0)}", "3 fields; expected 15"),
    (f"a,1.0,{us_text(T0 + 10)},{us_text(T0)},,,,1.0,2.0,1.0,0.0,2.0,0.0,7,NPU:0", "release time before allocation"),
])
def test_bad_rows_name_file_and_line(tmp_path, row, match):
    path = _operator_csv(tmp_path, GOOD_ROW, row)
    with pytest.raises(InputError, match=match) as info:
        load_trace(path)
    assert info.value.source == str(path) and info.value.line == 3


def test_bad_layouts(tmp_path):
    path = tmp_path / "operator_memory.csv"
    path.write_text("Name,Size(KB),Allocation Time(us),Release Time(us),Allocation Total Allocated(MB),"
                    "Allocation Total Reserved(MB),Release Total Allocated(MB),Release Total Reserved(MB)\n"
                    "a,1.0\n")
    with pytest.raises(InputError, match="2 fields") as info:
        load_trace(path)
    assert info.value.line == 2
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(InputError, match="is a directory"):
        load_trace(empty_dir)
    for rank in ("r0_ascend_pt", "r1_ascend_pt"):
        (tmp_path / "job" / rank / "ASCEND_PROFILER_OUTPUT").mkdir(parents=True)
        (tmp_path / "job" / rank / "ASCEND_PROFILER_OUTPUT" / "memory_record.csv").write_text(
            "Component,Timestamp(us),Total Allocated(MB),Total Reserved(MB),Total Active(MB),Stream Ptr,Device Type\n")
    job = read_ascend_profiler(tmp_path / "job")         # the lowest rank of a job's folder
    assert "r0_ascend_pt read" in job.meta["notes"][0] and detect_format(tmp_path / "job") == "ascend-profiler"
    lonely = tmp_path / "lonely" / "ASCEND_PROFILER_OUTPUT"
    lonely.mkdir(parents=True)
    (lonely / "kernel_details.csv").write_text("x\n")
    with pytest.raises(InputError, match="no memory files"):
        read_ascend_profiler(lonely)


def test_workspace_rows_are_their_own_component(tmp_path):
    # torch_npu's NPUWorkspaceAllocator reports through the same records, its own allocated total
    # and reserved 0 ("reserved_bytes not used"): such rows are not the caching allocator's
    rows = [f"a,1024.0,{us_text(T0)},{us_text(T0 + 30)},,,,2.0,4.0,2.0,1.0,4.0,1.0,7,NPU:0",
            f"ws,2048.0,{us_text(T0 + 10)},,,,,2.0,0.0,2.0,,,,7,NPU:0",
            f"b,512.0,{us_text(T0 + 20)},,,,,2.5,4.0,2.5,,,,7,NPU:0"]
    trace = load_trace(_operator_csv(tmp_path, *rows))
    assert trace.meta["components"]["PTA"]["allocated_max_diff"] == 0
    assert trace.meta["components"]["WORKSPACE"]["rows"] == 1


# --------------------------------------------------------------------------- the commands

def test_replay_and_doctor_on_a_profiler_folder(tmp_path, capsys):
    from ms_memopt.cli import main

    spec = [Event("alloc", id=i, size=(i % 5 + 1) * 3 * MiB, time=T0 + 1000 * i) for i in range(1, 40)]
    spec += [Event("free", id=i, time=T0 + 1000 * (40 + i)) for i in range(1, 40, 2)]
    folder = write_profiler_output(tmp_path, spec, initial={900: 64 * MiB})
    assert main(["replay", str(folder), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    recorded = out["recorded"]
    assert out["format"] == "ascend-profiler" and out["allocator"] in ("torch-npu", "torch")
    assert recorded["allocated_max_diff"] == 0 and recorded["component"] == "PTA"
    assert recorded["peak_reserved"] > 0 and out["peak_reserved"] > 0
    assert main(["replay", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "recorded         PTA: peak allocated" in text and "differs from the recorded one by 0 B" in text
    assert main(["doctor", str(folder), "--json"]) == 0
    diagnosis = json.loads(capsys.readouterr().out)
    assert diagnosis["verdict"]["kind"] and diagnosis["format"] == "ascend-profiler"
    assert main(["replay", str(tmp_path / "nothing_here")]) == 2


def test_shared_sample_replayed_beside_the_recording(capsys):
    from ms_memopt.cli import main

    assert main(["replay", str(_shared("cnn_910b_level1_rank0")), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    recorded = out["recorded"]
    assert recorded["allocated_max_diff"] == 0
    # the model (torch_npu's rules, from the recorded reserved size) against the recording
    assert abs(out["peak_allocated"] - recorded["peak_allocated"]) <= MiB
    assert abs(out["peak_reserved"] - recorded["peak_reserved"]) <= 8 * MiB
    db = _shared("cnn_910b_level1_rank0_db")
    assert main(["replay", str(db), "--component", "GE", "--json"]) == 0
    ge = json.loads(capsys.readouterr().out)
    assert ge["recorded"]["component"] == "GE" and ge["address_match"] is not None
    assert main(["replay", str(db), "--component", "HCCL"]) == 2


@pytest.mark.parametrize("writer,shuffle", [("torch_npu", None), ("mindspore", None), ("torch_npu", 5)])
def test_stream_gives_the_same_events_and_replay(tmp_path, writer, shuffle):
    from ms_memopt.allocators import create
    from ms_memopt.io.traces.ascend_profiler import stream_ascend_profiler
    from ms_memopt.replay.replay import recorded_allocator, replay

    folder = write_profiler_output(tmp_path, QUIRKY, writer=writer, initial={900: 3 * MiB, 901: 5 * MiB},
                                   shuffle=shuffle)
    whole = read_ascend_profiler(folder)
    streamed = load_trace(folder, stream=True)
    assert bool(streamed.meta.get("streamed")) == (shuffle is None)     # out-of-order rows: read whole
    assert list(streamed.events) == whole.events == list(stream_ascend_profiler(folder).events)
    assert streamed.meta["recorded"] == whole.meta["recorded"]
    name = recorded_allocator(whole).name
    a, b = replay(whole, create(name)), replay(streamed, create(name))
    assert (a.peak_allocated, a.peak_reserved, a.final_allocated) == (b.peak_allocated, b.peak_reserved,
                                                                      b.final_allocated)


def test_stream_of_the_shared_sample():
    folder = _shared("cnn_910b_level1_rank0")
    assert list(load_trace(folder, stream=True).events) == load_trace(folder).events


def test_the_profiler_format_is_one_folder(tmp_path):
    """issue 44 item 6: its modules live in ``io/traces/ascend_profiler/``, none beside the other formats,
    and the package names the reader's public functions as the flat module did."""
    import ms_memopt.io.traces as traces
    import ms_memopt.io.traces.ascend_profiler as package
    from ms_memopt.io.traces.ascend_profiler import reader

    flat = sorted(p.name for p in Path(traces.__file__).parent.glob("ascend_profiler_*.py"))
    assert not flat, flat
    assert Path(package.__file__).name == "__init__.py"
    assert {name: getattr(package, name) for name in reader.__all__} == {n: getattr(reader, n) for n in reader.__all__}
    folder = write_profiler_output(tmp_path, [Event("alloc", id=1, size=512, time=T0)])
    assert detect_format(folder) == "ascend-profiler" and load_trace(folder).meta["framework"]
