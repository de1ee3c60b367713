"""MindSpore's pool log (VLOG_v=12906) reader and the DynamicMemPoolBestFit model."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ms_memopt.allocators import create
from ms_memopt.allocators.mindspore import MindSporeBestFitPool, MindSporePool
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import read_jsonl, write_jsonl
from ms_memopt.replay.replay import replay
from ms_memopt.io.traces import detect_format, load_trace
from ms_memopt.io.traces.ms_pool_log import PoolLogParser, read_pool_log, recorded_final_layout

DATA = Path(__file__).parent / "data" / "pool_log"
RECORDINGS = sorted(DATA.glob("*.log.gz"))
KiB = 1 << 10


def _alloc_line(addr: int, size: int, in_use: int, total: int = 1 << 30, pid: int = 7) -> str:
    return (f"[V12906] PRE_ACT({pid},7f00,python):2026-12-01-06:47:05.892.425 [mindspore/ccsrc/runtime/memory/"
            f"mem_pool/mem_dynamic_allocator.cc:260] AllocTensorMem] Alloc memory details, name:Unknown, "
            f"persistent_mem:0, stream id: 0, address:{addr:#x}, size:{size}B, total allocated mem:{total}B, "
            f"peak used mem:{in_use}B, in used mem:{in_use}B, used by event mem:0B, actual peak used "
            f"mem:{in_use}B, total idle mem:{total - in_use}B.")


def _free_line(addr: int, in_use: int, total: int = 1 << 30, pid: int = 7) -> str:
    return (f"[V12906] PRE_ACT({pid},7f00,python):2026-12-01-06:47:06.080.020 [mindspore/ccsrc/runtime/memory/"
            f"mem_pool/mem_dynamic_allocator.cc:811] FreeTensorMemInner] Free memory details, name:Unknown, "
            f"address:{addr:#x}, total allocated mem:{total}B, peak used mem:{in_use}B, in used mem:{in_use}B, "
            f"used by event mem:0B, actual peak used mem:{in_use}B, total idle mem:{total - in_use}B.")


# --- MindSpore 2.10's format strings -------------------------------------------------------
# Exactly as they are in the 2.10 wheel's binaries (found with `strings -n 8`; the order of the
# pieces, what is streamed between them, the functions and the line numbers read from the
# machine code with `objdump -d`). Never seen on a device.
# Ascend's DefaultEnhancedAscendMemoryPool (ascend_memory_pool.cc), from
# mindspore/lib/plugin/ascend/libmindspore_ascend_res_manager.so:
ASCEND_REQUEST = ("Allocate tensor mem, size : ", ", align_size : ", ", need_recycle : ")   # AllocTensorMem:255
ASCEND_RETURN = ("Allocate tensor mem, return : ", ", stat info : ")                        # AllocTensorMem:301
ASCEND_FAILED = "Allocate tensor mem, return nullptr."                 # AllocTensorMem:260, MS_LOG(INFO)
ASCEND_FREE_REQUEST = "Free tensor mem, device addr : "                # FreeTensorMem:341
ASCEND_FREE = ("Do free tensor mem : ", ", return : ")                 # DoFreeTensorMem:379
ASCEND_CONTINUOUS = "Alloc continuous tensor mem, stream id : "         # AllocContinuousTensorMem:308
ASCEND_PART = "Free part tensor mems."                                  # FreePartTensorMems:387
ASCEND_FUNCTIONS = ("AllocTensorMem", "FreeTensorMem", "DoFreeTensorMem", "AllocContinuousTensorMem",
                    "FreePartTensorMems")
ASCEND_FILE = "mindspore/ccsrc/plugin/ascend/res_manager/mem_manager/ascend_memory_pool.cc"
# MemBuf::ToJson() and MemStat::ToJson() (JsonBuilder: {"key":value,...}, values unquoted), same .so
MEMBUF_KEYS = ("addr_", "size_", "stream_id_", "status_", "owner_name_", "alloc_type_")
MEMSTAT_KEYS = ("used_size_", "peak_size_", "alloc_size_", "idle_size_", "used_by_event_size_", "eager_free_size_")
# DynamicMemPoolBestFit (mem_dynamic_allocator.cc: CPU, and Ascend with older_pool:True), from
# mindspore/lib/libmindspore_memory_pool.so (_alloc_line/_free_line above: the recorded lines' format)
CPU_ALLOC = ("Alloc memory details, name:", ", persistent_mem:", ", stream id: ", ", address:", ", size:",
             "B, total allocated mem:", "B, peak used mem:", "B, in used mem:", "B, used by event mem:",
             "B, actual peak used mem:", "B, total idle mem:")                  # AllocTensorMem:260
CPU_FREE = ("Free memory details, name:", ", address:", ", total allocated mem:")   # FreeTensorMemInner:811
CPU_FUNCTIONS = ("AllocTensorMem", "FreeTensorMemInner")
GiB = 1 << 30
BASE = 0x12C0_4000_0000


def _ascend(tid: str, line: int, function: str, message: str, level: str = "V12906", pid: int = 9) -> str:
    # the prefix as MindSpore's LogWriter writes it (submodule 6 = DEVICE, the number the binary passes)
    return (f"[{level}] DEVICE({pid},{tid},python):2026-12-01-06:47:05.892.425 [{ASCEND_FILE}:{line}] "
            f"{function}] {message}")


def _request(tid: str, size: int, align: int, recycle: int = 0) -> str:
    a, b, c = ASCEND_REQUEST
    return _ascend(tid, 255, "AllocTensorMem", f"{a}{size}{b}{align}{c}{recycle}.")


def _json(keys: tuple[str, ...], values: tuple) -> str:
    return "{" + ",".join(f'"{k}":{v}' for k, v in zip(keys, values)) + "}"


def _return(tid: str, addr: int, size: int, stat: tuple[int, int, int, int] | None, owner: str = "",
            stream: int = 0) -> str:
    """``stat``: (used, peak, alloc, idle) of the pool after the allocation, or None: no stat part."""
    a, b = ASCEND_RETURN
    membuf = _json(MEMBUF_KEYS, (f"{addr:#x}", size, stream, "used", owner, "Kernel"))
    tail = "" if stat is None else b + _json(MEMSTAT_KEYS, (*stat, 0, 0))
    return _ascend(tid, 301, "AllocTensorMem", f"{a}{membuf}{tail}.")


def _stat(used: int, peak: int, alloc: int = GiB) -> tuple[int, int, int, int]:
    return used, peak, alloc, alloc - used


def _free_request(tid: str, addr: int) -> str:
    return _ascend(tid, 341, "FreeTensorMem", f"{ASCEND_FREE_REQUEST}{addr:#x}.")


def _do_free(tid: str, addr: int, ok: int = 1) -> str:
    a, b = ASCEND_FREE
    return _ascend(tid, 379, "DoFreeTensorMem", f"{a}{addr:#x}{b}{ok}.")


def _continuous(tid: str, stream: int = 0) -> str:
    return _ascend(tid, 308, "AllocContinuousTensorMem", f"{ASCEND_CONTINUOUS}{stream}.")


# --- the model: multimap tie rule -------------------------------------------------------------
def test_bestfit_takes_the_equal_size_buffer_idle_longest():
    for cls, expected_first in ((MindSporeBestFitPool, "high"), (MindSporePool, "low")):
        pool = cls()
        low, _, high, _ = (pool.malloc(4 * KiB) for _ in range(4))
        pool.free(high)            # idle first
        pool.free(low)
        got = pool.malloc(4 * KiB)
        assert got == (high if expected_first == "high" else low), cls.name


def test_bestfit_merged_buffer_goes_behind_older_equal_sizes():
    pool = MindSporeBestFitPool()
    a, b, c, d, e, f, g = (pool.malloc(2 * KiB) for _ in range(7))
    pool.free(f)                   # 2 KiB hole, idle first
    pool.free(b)
    pool.free(c)                   # b+c merge: a 4 KiB hole, re-entered now
    pool.free(d)                   # b+c+d: 6 KiB
    assert pool.malloc(2 * KiB) == f          # the only 2 KiB hole
    pool.free(a)                   # a merges into a+b+c+d = 8 KiB
    assert pool.malloc(8 * KiB) == a
    assert pool.layout().allocated == pool.allocated


def test_tie_rule_is_a_parameter_of_the_one_model():
    assert MindSporePool(tie="idle_order").tie == "idle_order"
    assert create("mindspore-bestfit").tie == "idle_order" and create("mindspore").tie == "address"
    with pytest.raises(ValueError):
        MindSporePool(tie="newest")


# --- the reader ----------------------------------------------------------------------------
def test_parser_pairs_frees_by_address_and_finds_block_bases():
    parser = PoolLogParser()
    lines = ["unrelated output", _alloc_line(0x1010, 100, 512), _alloc_line(0x1210, 700, 512 + 1024),
             "[WARNING] ME(7:1,MainProcess): something", _free_line(0x1010, 1024),
             _alloc_line(0x1010, 512, 1536)]
    events = list(parser.feed_all(lines))
    assert [(e.action, e.id, e.addr) for e in events] == [
        ("segment_alloc", None, 0x1010), ("alloc", 1, 0x1010), ("alloc", 2, 0x1210), ("free", 1, None),
        ("alloc", 3, 0x1010)]
    assert events[0].size == 1 << 30 and events[1].size == 100
    meta = parser.meta()
    assert meta["counter_mismatches"] == 0 and meta["skipped_lines"] == 0
    assert meta["counters"]["in_use"] == 1536


def test_torn_and_garbled_lines_are_skipped_and_counted_never_guessed(tmp_path):
    full = _alloc_line(0x1010, 100, 512)
    lines = [full, _alloc_line(0x1210, 512, 1024)[:200],            # torn mid-line
             _alloc_line(0x1410, 512, 1024).replace("size:512B", "size:5x2B"),   # garbled
             _free_line(0x1210, 1024 - 512),                          # its alloc was torn
             _free_line(0x1010, 0),
             "progress 50%" + _alloc_line(0x1010, 64, 512),          # glued to another writer's text
             _free_line(0x1010, 0)[:-40]]                              # a killed run's last line
    path = tmp_path / "stderr.txt"
    path.write_text("\n".join(lines))
    trace = load_trace(path)
    assert trace.format == "mindspore-pool-log"
    assert [(e.action, e.id) for e in trace.events] == [("segment_alloc", None), ("alloc", 1), ("free", 1),
                                                          ("alloc", 2)]
    log = trace.meta["pool_log"]
    assert log["skipped_lines"] == 3 and log["skipped_at_lines"] == [2, 3, 7]
    assert log["unmatched_frees"] == 1


def test_step_and_mark_lines_become_events():
    parser = PoolLogParser()
    events = list(parser.feed_all(["ms-memopt step 12", "ms-memopt mark compaction_begin", "ms-memopt step x",
                                   "ms-memopt mark two words", "[WARNING] no newline herems-memopt step 13"]))
    assert [(e.action, e.step, e.tag) for e in events] == [("step", 12, None), ("mark", None, "compaction_begin"),
                                                           ("step", 13, None)]


def test_a_marker_glued_to_the_front_of_a_pool_line_gives_both_events():
    # seen in a live recording: the marker's newline came after a pool line another thread wrote
    parser = PoolLogParser()
    events = list(parser.feed_all(["ms-memopt step 3" + _alloc_line(0x1000, 512, 512),
                                   "ms-memopt mark compaction_begin" + _free_line(0x1000, 0),
                                   "ms-memopt step 4"]))
    assert [(e.action, e.step, e.tag) for e in events if e.action != "segment_alloc"] == [
        ("step", 3, None), ("alloc", None, None), ("mark", None, "compaction_begin"), ("free", None, None),
        ("step", 4, None)]
    assert parser.counts.skipped_lines == 0 and parser.counts.pool_lines == 2


def test_record_markers_are_one_write_each(monkeypatch):
    import ms_memopt.analysis.scan as scan
    writes = []
    monkeypatch.setattr(scan, "_RECORDING", True)
    monkeypatch.setattr(scan.os, "write", lambda fd, data: writes.append(data) or len(data))
    scan.record_mark("compaction_begin")
    assert writes == [b"ms-memopt mark compaction_begin\n"]


def test_a_lost_free_is_inferred_before_the_address_is_reused():
    parser = PoolLogParser()
    events = list(parser.feed_all([_alloc_line(0x1010, 512, 512), _alloc_line(0x1010, 512, 512)]))
    assert [(e.action, e.id) for e in events][-2:] == [("free", 1), ("alloc", 2)]
    assert parser.meta()["inferred_frees"] == 1


def test_other_processes_lines_are_left_out(tmp_path):
    path = tmp_path / "two.txt"
    path.write_text("\n".join([_alloc_line(0x1010, 512, 512, pid=5), _alloc_line(0x9010, 512, 512, pid=6),
                               _alloc_line(0x9210, 512, 1024, pid=6)]) + "\n")
    trace = read_pool_log(path)
    assert trace.meta["pool_log"]["pid"] == 6
    assert [e.addr for e in trace.events if e.action == "alloc"] == [0x9010, 0x9210]


def test_no_pool_line_is_a_clear_error(tmp_path):
    path = tmp_path / "stderr.txt"
    path.write_text("hello\nAlloc memory details, but torn\n")
    with pytest.raises(InputError, match="stderr.txt.*unknown trace format"):
        load_trace(path)
    with pytest.raises(InputError, match="no complete MindSpore pool line"):
        read_pool_log(path)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"just text\n"))
    with pytest.raises(InputError, match="gzip data of no known format"):
        detect_format(bad)


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_recorded_cpu_pool_replays_exactly(path):
    """Real recordings (MindSpore 2.10 CPU, tests/data/pool_log/README.md): every address and
    the final layout match with the multimap rule; the address rule does not."""
    trace = load_trace(path)
    assert trace.format == "mindspore-pool-log" and trace.meta["pool_log"]["skipped_lines"] == 0
    assert trace.meta["pool_log"]["counter_mismatches"] == 0
    result = replay(trace, create("mindspore-bestfit"))
    assert result.allocs >= 300
    assert result.address_match == 1.0 and result.final_layout_match is True
    assert replay(trace, create("mindspore")).address_match < 0.9


def test_jsonl_round_trip_replays_the_same(tmp_path):
    trace = load_trace(RECORDINGS[0])
    out = tmp_path / "rec.jsonl"
    write_jsonl(out, trace.events, meta=trace.meta)
    again = read_jsonl(out)
    assert recorded_final_layout(again.events).segments == trace.final.segments
    proc = subprocess.run([sys.executable, "-m", "ms_memopt", "replay", str(out), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["allocator"] == "mindspore-bestfit"
    assert got["address_match"] == 1.0 and got["final_layout_match"] is True


def test_ascend_enhanced_pool_lines_replay(tmp_path):
    a = "7f01"
    lines = ["[INFO] other", _request(a, 1000, 1024), _return(a, BASE, 1024, _stat(1024, 1024), "Default/MatMul-op1"),
             _request(a, 4096, 4096), _return(a, BASE + 1024, 4096, _stat(5120, 5120)),
             _free_request(a, BASE), _do_free(a, BASE, ok=0),      # still used by an event: not a free yet
             _do_free(a, BASE)]                                     # WaitEvent frees it: no Free line
    path = tmp_path / "ascend.log"
    path.write_text("\n".join(lines) + "\n")
    trace = load_trace(path)        # found by content
    assert trace.meta["pool"] == "AbstractDynamicMemPool"
    assert [(e.action, e.id, e.size, e.tag) for e in trace.events] == [
        ("segment_alloc", None, GiB, None), ("alloc", 1, 1000, "Default/MatMul-op1"), ("alloc", 2, 4096, None),
        ("free", 1, 0, None)]
    log = trace.meta["pool_log"]
    assert log["counter_mismatches"] == 0 and log["skipped_lines"] == 0 and log["frees_returned_0"] == 1
    assert log["pool_lines"] == 7 and log["unpaired_allocations"] == 0
    from ms_memopt.cli.replay_cmd import default_allocator
    assert default_allocator(trace) == "mindspore"
    result = replay(trace, create("mindspore"))
    assert result.address_match == 1.0 and result.final_layout_match is True


def test_ascend_two_threads_interleaved_continuous_and_torn_lines():
    a, b = "7f00aa", "7f00bb"
    lines = [
        _request(a, 1000, 1024),                                    # 1  before the lock: threads interleave
        _request(b, 4096, 4096),                                    # 2
        _return(b, BASE, 4096, _stat(4096, 4096)),                  # 3  b's return first: pairs with line 2
        _return(a, BASE + 4096, 1024, _stat(5120, 5120)),           # 4  a's: pairs with line 1
        _request(a, 300, 512)[:-25],                                # 5  torn: skipped and counted
        _return(a, BASE + 5120, 512, _stat(5632, 5632)),            # 6  no request line: size = aligned
        _free_request(b, BASE), _do_free(b, BASE, ok=0),            # 7, 8  kept for an event
        _continuous(a),                                             # 9  no sizes, no addresses
        _free_request(a, BASE + 4096), _do_free(a, BASE + 4096),    # 10, 11
        _do_free(b, BASE),                                          # 12 the event's free
        _request(a, 2048, 2048),                                    # 13
        # 3 KiB continuous memory now in used_size_; the pool grew for the continuous allocation
        _return(a, BASE + 8192, 2048, _stat(512 + 2048 + 3072, 5632 + 2048, 2 * GiB)),   # 14
        _request(b, 100, 512), _return(b, BASE, 512, _stat(512 + 2048 + 512 + 3072, 6144, 2 * GiB)),  # 15, 16
        _request(a, 1 << 40, 1 << 40),                                             # 17
        _ascend(a, 260, "AllocTensorMem", ASCEND_FAILED, level="INFO"),            # 18 out of memory
        _do_free(b, BASE + 0x8000_0000),                            # 19 a continuous piece: address never seen
        _request(b, 512, 512), _return(b, BASE + 10240, 512, None),                 # 20, 21 no stat part
        _ascend(b, 387, "FreePartTensorMems", ASCEND_PART),         # 22
    ]
    parser = PoolLogParser()
    events = list(parser.feed_all(lines))
    assert [(e.action, e.id, e.addr, e.size) for e in events] == [
        ("segment_alloc", None, BASE, GiB),
        ("alloc", 1, BASE, 4096), ("alloc", 2, BASE + 4096, 1000), ("alloc", 3, BASE + 5120, 512),
        ("free", 2, None, 0), ("free", 1, None, 0),
        ("alloc", 4, BASE + 8192, 2048),                            # no segment_alloc for the 1 GiB growth
        ("alloc", 5, BASE, 100), ("alloc", 6, BASE + 10240, 512)]
    assert {live.id: live.size for live in parser.live.values()} == {3: 512, 4: 2048, 5: 512, 6: 512}   # aligned
    meta = parser.meta()
    assert meta["skipped_lines"] == 1 and meta["skipped_at_lines"] == [5]
    assert meta["unpaired_allocations"] == 1 and meta["frees_returned_0"] == 1
    assert meta["continuous_allocations"] == 1 and meta["unattributed_growths"] == 1
    assert meta["untracked_in_use"] == 3072 and meta["counter_mismatches"] == 0
    assert meta["failed_allocations"] == 1 and meta["unmatched_frees"] == 1 and meta["partial_frees"] == 1
    assert meta["pool_lines"] == len(lines) - 1 and meta["pid"] == 9
    assert meta["counters"]["in_use"] == 6144 and meta["counters"]["reserved"] == 2 * GiB
    assert parser.pool == "AbstractDynamicMemPool" and parser.segments == {BASE: (GiB, "common")}


def test_ascend_lines_of_the_old_guessed_format_are_skipped_not_read():
    # the format this reader once expected (from_persistent_mem, stream_id): 2.10 writes neither
    old = _ascend("7f01", 255, "AllocTensorMem", "Allocate tensor mem, size : 1000, align_size : 1024, "
                  "from_persistent_mem : 0, need_recycle : 0, stream_id : 0.")
    parser = PoolLogParser()
    assert parser.feed(old) == [] and parser.counts.skipped_lines == 1


def _wheel_library(*parts: str) -> bytes:
    import importlib.util
    spec = importlib.util.find_spec("mindspore")          # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mindspore is not installed")
    path = Path(next(iter(spec.submodule_search_locations)), "lib", *parts)
    if not path.is_file():
        pytest.skip(f"{path} is absent (this MindSpore wheel has no such library)")
    return path.read_bytes()


@pytest.mark.parametrize("library, pieces", [
    (("plugin", "ascend", "libmindspore_ascend_res_manager.so"),
     (*ASCEND_REQUEST, *ASCEND_RETURN, ASCEND_FAILED, ASCEND_FREE_REQUEST, *ASCEND_FREE, ASCEND_CONTINUOUS,
      ASCEND_PART, *ASCEND_FUNCTIONS, ASCEND_FILE, *MEMBUF_KEYS, *MEMSTAT_KEYS)),
    (("libmindspore_memory_pool.so",), (*CPU_ALLOC, *CPU_FREE, *CPU_FUNCTIONS, *MEMBUF_KEYS)),
], ids=["ascend_res_manager", "memory_pool"])
def test_the_format_strings_the_reader_relies_on_are_in_the_installed_binaries(library, pieces):
    """A MindSpore that changes a log line fails here, before a recording is misread."""
    data = _wheel_library(*library)
    # each piece is a C string of its own or the tail of a longer one (the linker shares tails)
    missing = [piece for piece in pieces if piece.encode() + b"\0" not in data]
    assert not missing, f"{'/'.join(library)} no longer holds {missing}: check the pool log's format"


def test_a_digit_run_longer_than_any_64_bit_number_is_a_skipped_line():
    # int() of thousands of digits raises ValueError (CPython's int_max_str_digits): never reached
    parser = PoolLogParser()
    assert parser.feed(_alloc_line(0x1000, 512, 512).replace("size:512B", "size:" + "9" * 5000 + "B")) == []
    assert parser.counts.skipped_lines == 1
