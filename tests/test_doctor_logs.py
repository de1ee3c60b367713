"""``ms-memopt doctor LOG`` / ``LOGDIR``: OOM reports read from failed jobs' logs.

Every message here is built the way the framework builds it: PyTorch's and torch_npu's
``format_size`` and the operator<< chains of their caching allocators (each wording by version),
MindSpore's strings from the 2.10 wheel (``libmindspore_ascend_res_manager.so``,
``libmindspore_memory_pool.so``, ``libmindspore_ms_backend.so``) in the order its sources stream
them. One log is real: a MindSpore 2.10 CPU run that died of fragmentation here
(``tests/data/crash_logs/``, made by ``python -m ms_memopt.mindspore.crash_demo``).
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ms_memopt.allocators.base import oom_kind
from ms_memopt.cli import main
from ms_memopt.doctor.crash_logs import RUNTIME_SHARE, crash_verdict, diagnose_log, diagnose_logdir, find_rank_logs
from ms_memopt.io.oom_logs import parse_message, rank_of_path, read_oom_log, scan_bytes

DATA = Path(__file__).parent / "data"
CRASH = DATA / "crash_logs"
MiB, GiB = 2**20, 2**30


# --- the frameworks' own formatting ---------------------------------------------------------------------
def fs(n: int) -> str:
    """c10's and torch_npu's ``format_size``."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


def cuda_21plus(req, total, free, allocated, reserved, *, procs=None, this=None, allowed=None, private=None,
                misspelt=False, old_tail=False, device=0):
    """CUDACachingAllocator.cpp from 2.1 (2.1.0: "capacty" and the max_split_size_mb tail)."""
    proc_info = "".join(f"Process {pid} has {fs(n)} memory in use. " for pid, n in (procs or []))
    if this is not None:
        proc_info += f"Including non-PyTorch memory, this process has {fs(this)} memory in use. "
    allowed_info = f"{fs(allowed)} allowed; " if allowed is not None else ""
    pools = f"with {fs(private)} allocated in private pools (e.g., CUDA Graphs), " if private else ""
    tail = (" If reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  "
            "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF" if old_tail else
            " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    return (f"CUDA out of memory. Tried to allocate {fs(req)}. GPU {device} has a total "
            f"{'capacty' if misspelt else 'capacity'} of {fs(total)} of which {fs(free)} is free. {proc_info}"
            f"{allowed_info}Of the allocated memory {fs(allocated)} is allocated by PyTorch, {pools}and "
            f"{fs(reserved - allocated - (private or 0))} is reserved by PyTorch but unallocated.{tail}")


def cuda_old(req, total, allocated, free, reserved, *, allowed=None, cached=False, tail=True):
    """Up to 2.0 (the max_split_size_mb advice from 1.10). Before 1.4 the last figure is the unused
    cache, ``format_size(stats.amount_cached - stats.amount_allocated) << " cached)"``; from 1.4 the
    total, ``format_size(reserved_bytes) << " reserved in total by PyTorch)"``."""
    allowed_info = f"{fs(allowed)} allowed; " if allowed is not None else ""
    last = f"{fs(reserved - allocated)} cached)" if cached else f"{fs(reserved)} reserved in total by PyTorch)"
    text = (f"CUDA out of memory. Tried to allocate {fs(req)} (GPU 0; {fs(total)} total capacity; {fs(allocated)} "
            f"already allocated; {fs(free)} free; {allowed_info}{last}")
    if tail:
        text += (" If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  "
                 "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
    return text


def npu(req, total, allocated, active, free, reserved, *, allowed=None, glued=False):
    """NPUCachingAllocator.cpp: AT_ERROR(...) and the newer retmsg (no space before "If")."""
    allowed_info = f"{fs(allowed)} allowed; " if allowed is not None else ""
    head = (f"NPU out of memory. Tried to allocate {fs(req)} (NPU 0; {fs(total)} total capacity; {fs(allocated)} "
            f"already allocated; {fs(active)} current active; {fs(free)} free; {allowed_info}{fs(reserved)} "
            "reserved in total by PyTorch)")
    advice = "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
    return head + ("." + advice if glued else " " + advice)


def ms_header(level="ERROR", module="DEVICE", when="2026-03-01-10:23:45.123.456", where="x.cc:1 Fn"):
    return f"[{level}] {module}(4242,ffff9c2b,python):{when} [mindspore/ccsrc/{where}] "


def ms_two_pointer(req, device_mb, used_mb, static_mb, dyn_mb, graph_mb, *, hbm=False, kbk=False, peaks=(0, 0)):
    """AscendTwoPointerMemAdapter: the exception text and DevMemStatistics (``M`` = bytes // 2**20)."""
    stats = [f"Device {'HBM' if hbm else 'MOC'} memory size: {device_mb}M", f"MindSpore Used memory size: {used_mb}M",
             "MindSpore memory base address: 0x124140000000"]
    if not kbk:
        stats += [f"Total Static Memory size: {static_mb}M", f"Total Dynamic memory size: {dyn_mb}M"]
        stats += [f"Dynamic memory size of this graph: {graph_mb}M"]
    else:
        stats += [f"Used peak memory usage (without fragments): {peaks[0]}M",
                  f"Actual peak memory usage (with fragments): {peaks[1]}M"]
    return ("RuntimeError: \n----------------------------------------------------\n- Framework Error Message:\n"
            "----------------------------------------------------\n"
            f"Out of Memory!!! Request memory size: {req}B, Memory Statistic:\n" + "\n".join(stats) + "\n\n"
            "Please try to reduce 'batch_size' or check whether exists extra large shape. For more details, please "
            "refer to 'Out of Memory' at https://www.mindspore.cn .\n")


def ms_pool_failure(req, device_free, *, state=None, kernel="Default/network-GPT/FlashAttentionScore-op0",
                    when="2026-03-01-10:23:45.123.456"):
    """AbstractDynamicMemPool's grow failure, its state dump at GLOG_v=1, then the runtime's line."""
    lines = [ms_header("WARNING", "PRE_ACT", when, "runtime/memory/mem_pool/abstract_dynamic_mem_pool.cc:712 "
                       "CalMemBlockAllocSize")
             + f"Memory not enough: current free memory size[{device_free}] is smaller than required size[{req}]."]
    if state is not None:
        in_use, peak, alloc = state
        idle = alloc - in_use
        f2 = lambda n: f"{int(n / MiB * 100) / 100:.2f}MB"    # noqa: E731  MemStat::Format: two decimals, cut
        info = ms_header("INFO", "PRE_ACT", when, "runtime/memory/mem_pool/abstract_dynamic_mem_pool.cc:1065 "
                         "DumpDynamicMemPoolStateInfo")
        lines += [info + "\tIn used mem buf info for Mem buf allocator, enable vmm : 0, is persistent : 0, stream id : 0, "
                  "is small : 0, is customized : 0, mem_bufs size : 412",
                  info + "stream id : 0, is persistent : 0", info + "Dump state info for Mem buf allocator, enable vmm : 0",
                  info + "\tMem block info - total count : 3",
                  info + f"\tMem block total size : {alloc}",
                  info + f"\tFree mem buf total size : {idle}, total count : 9",
                  info + "\tEager free mem buf total size : 0, total count : 0",
                  info + f"The dynamic memory pool[Ascend] stat info : {{\"in used mem\":{f2(in_use)},\"peak used mem\":"
                  f"{f2(peak)},\"alloc mem\":{f2(alloc)},\"idle mem\":{f2(idle)},\"used by event mem\":0.00MB,"
                  f"\"eager free mem\":0.00MB}}, actual peak used mem:{peak // MiB}M. Weight used size:1200M, constant "
                  f"value used size:0M, kernel output used size:{in_use // MiB - 1200}M, other used size:0M."]
    lines.append(ms_header("ERROR", "ME", when, "runtime/graph_scheduler/actor/memory_manager_actor.cc:390 "
                           "SetOpMemoryAllocFailedInfo")
                 + f"Device(id:0) memory isn't enough and alloc failed, kernel name: {kernel}, alloc size: {req}B.")
    return "\n".join(lines) + "\n"


def ms_vmm(used, event, req, total):
    return ms_header("ERROR", "PRE_ACT", where="runtime/memory/mem_pool/mem_dynamic_allocator.cc:500 "
                     "AddMemBlockAndMemBufByEagerFree") + (
        f"TotalUsedMemStatistics : {used} plus TotalUsedByEventMemStatistics : {event} and plus alloc size : {req} "
        f"is more than total mem size : {total}.\n")


def verdict_of(text: str):
    report = parse_message(text)
    assert report is not None, text
    return report, crash_verdict(report)


# --- wordings -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,kind", [
    (dict(req=4509715660, total=85 * GiB, free=1 * GiB, allocated=63 * GiB, reserved=77 * GiB, this=78 * GiB),
     "fragmentation"),
    (dict(req=20 * GiB, total=80 * GiB, free=1 * GiB, allocated=75 * GiB, reserved=78 * GiB, procs=[(991, 79 * GiB)]),
     "capacity"),
    (dict(req=10 * GiB, total=80 * GiB, free=2 * GiB, allocated=20 * GiB, reserved=21 * GiB,
          procs=[(11, 22 * GiB), (12, 55 * GiB)]), "outside"),
    (dict(req=6 * GiB, total=80 * GiB, free=40 * GiB, allocated=10 * GiB, reserved=10 * GiB, this=11 * GiB,
          allowed=12 * GiB), "outside"),     # a memory fraction refused it
    (dict(req=256 * MiB, total=24 * GiB, free=100 * MiB, allocated=20 * GiB, reserved=23 * GiB, private=2 * GiB,
          this=24 * GiB), "fragmentation"),
])
@pytest.mark.parametrize("misspelt", [False, True])
def test_pytorch_21_plus(kwargs, kind, misspelt):
    report, v = verdict_of("torch.OutOfMemoryError: " + cuda_21plus(**kwargs, misspelt=misspelt, old_tail=misspelt))
    assert (report.framework, report.allocator, report.wording) == ("pytorch", "cuda-caching", "pytorch>=2.1")
    assert v.kind == kind and v.request == pytest.approx(kwargs["req"], rel=0.003)
    assert not report.cut
    if misspelt:
        assert any("capacty" in n for n in report.notes)


@pytest.mark.parametrize("cached", [False, True])
def test_pytorch_old_wordings(cached):
    text = "RuntimeError: " + cuda_old(20 * MiB, 16 * GiB, 14 * GiB, 13 * MiB, 15 * GiB, cached=cached, tail=not cached)
    report, v = verdict_of(text)
    assert report.wording == ("pytorch<1.4 (cached)" if cached else "pytorch<=2.0")
    assert report.figures["reserved_unallocated"].value == pytest.approx(GiB, rel=0.01)
    assert v.kind == "fragmentation" and v.sure


def test_pytorch_old_allowed_fraction():
    report, v = verdict_of(cuda_old(3 * GiB, 16 * GiB, 3 * GiB, 11 * GiB, int(3.5 * GiB), allowed=4 * GiB))
    assert report.figures["allowed"].value == 4 * GiB
    assert v.kind == "outside" and "held elsewhere" in v.text


@pytest.mark.parametrize("glued", [False, True])
def test_torch_npu(glued):
    report, v = verdict_of(npu(2 * GiB, int(60.97 * GiB), int(56.44 * GiB), int(56.44 * GiB), int(1.35 * GiB),
                               int(58.92 * GiB), glued=glued))
    assert (report.framework, report.allocator) == ("torch_npu", "npu-caching")
    assert report.figures["active"].printed == "56.44 GiB"
    assert v.kind == "fragmentation"
    assert any("If reserved" in n for n in report.notes) == glued


def test_remedy_lines_are_the_replay_doctors_own():
    from ms_memopt.doctor.remedies import SETTINGS
    from ms_memopt.doctor.remedy_table import remedy_lines

    lines = {s.line for s in SETTINGS["torch_npu"]}
    assert remedy_lines("torch_npu", "fragmentation")[0][1] in lines


def test_torch_npu_capacity_and_remedies_in_its_terms():
    d = _diagnosis_of_text(npu(8 * GiB, 61 * GiB, 58 * GiB, 58 * GiB, 1 * GiB, 59 * GiB))
    assert d.verdict.kind == "capacity"
    assert any("ms-memopt plan" in r.line for r in d.remedies)
    assert "torch_npu.npu.memory._record_memory_history" in d.record


def test_rounding_caveat():
    # 1.00 GiB requested; 0.50 + 0.50 GiB free as printed: the exact bytes could be either side
    report, v = verdict_of(cuda_21plus(GiB, 80 * GiB, GiB // 2, 70 * GiB, 70 * GiB + GiB // 2, this=79 * GiB))
    assert v.kind == "fragmentation" and not v.sure and "rounding" in v.caveat


def test_windows_allocated_beyond_capacity():
    # the figures cannot all hold: no verdict is computed from them (Windows counts shared memory)
    report, v = verdict_of(cuda_old(2 * GiB, 4 * GiB, 6 * GiB, 0, int(6.5 * GiB)))
    assert any("Windows" in n for n in report.notes)
    assert v.kind == "undecidable" and not v.sure and "contradict" in v.caveat
    assert "allocated (6.00 GiB) exceeds capacity (4.00 GiB)" in v.text


@pytest.mark.parametrize("hbm", [False, True])
def test_mindspore_two_pointer(hbm):
    # MindSpore's share is 1024M of a 32768M card: a 1.0 GiB request beyond the share is outside the allocator
    report, v = verdict_of(ms_two_pointer(1088627200, 32768, 1024, 56, 0, 0, hbm=hbm))
    assert report.allocator == "ascend-two-pointer" and report.request.value == 1088627200
    assert report.figures["ms_used"].printed == "1024M" and report.figures["ms_used"].high == 1025 * MiB - 1
    assert v.kind == "outside" and v.held_elsewhere == (32768 - 1024) * MiB - 2 * GiB   # beyond the runtime's 2 GiB
    report, v = verdict_of(ms_two_pointer(40 * GiB, 32768, 30684, 496, 0, 0, hbm=hbm))
    assert v.kind == "capacity"
    # beyond MindSpore's share by less than the 2 GiB it leaves the runtime by default: the card is too small
    report, v = verdict_of(ms_two_pointer(33100113920, 32768, 30684, 496, 0, 0, hbm=hbm))
    assert v.kind == "capacity"


def test_the_runtimes_own_memory_is_not_outside():
    # 128 MiB asked, 35 MiB free, 300 MiB held by the CUDA context: the card is full of PyTorch's own
    report, v = verdict_of(cuda_old(128 * MiB, int(11.17 * GiB), int(10.85 * GiB), 25 * MiB, int(10.86 * GiB)))
    assert v.kind == "capacity" and not v.held_elsewhere


def test_mindspore_two_pointer_kernel_by_kernel_is_undecidable_inside_the_share():
    report, v = verdict_of(ms_two_pointer(2 * GiB, 65536, 62000, 0, 0, 0, kbk=True, peaks=(60000, 61500)))
    assert v.kind == "undecidable" and "GLOG_v=1" in v.setting


def test_mindspore_kernel_by_kernel_free_lower_bound():
    # nothing was in use beyond the used peak: at least 62000M - 60000M was free, and 1 GiB fits in it
    report, v = verdict_of(ms_two_pointer(GiB, 65536, 62000, 0, 0, 0, kbk=True, peaks=(60000, 62000)))
    assert v.kind == "fragmentation" and abs(v.free_total - 2000 * MiB) < MiB and v.sure


def mps(req, allocated, other, allowed=None):
    """MPSAllocator.mm: with the high watermark (``max allowed``) and without it."""
    limit = f", max allowed: {fs(allowed)}" if allowed is not None else ""
    tail = (" pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause "
            "system failure).") if allowed is not None else " pool."
    return (f"RuntimeError: MPS backend out of memory (MPS allocated: {fs(allocated)}, other allocations: {fs(other)}"
            f"{limit}). Tried to allocate {fs(req)} on private{tail}")


def test_pytorch_mps():
    report, v = verdict_of(mps(4 * GiB, 8 * GiB, 7 * GiB, allowed=18 * GiB))
    assert report.allocator == "mps" and v.kind == "capacity" and v.device_free == 3 * GiB
    report, v = verdict_of(mps(GiB, 8 * GiB, 7 * GiB))
    assert v.kind == "undecidable"


def test_mindspore_runtime_line_without_size_joins_the_pool_report():
    text = ms_pool_failure(GiB, 0) + ("RuntimeError: Malloc for kernel output failed, Memory isn't enough, node:"
                                      "Default/network/MatMul-op12\n")
    scan = scan_bytes([text.encode()])
    assert len(scan.reports) == 1 and scan.reports[0].request.value == GiB


def test_mindspore_pool_with_and_without_its_state():
    text = ms_pool_failure(4509715660, 300 * MiB)
    report, v = verdict_of(text)
    assert (report.allocator, report.kernel) == ("dynamic-pool", "Default/network-GPT/FlashAttentionScore-op0")
    assert v.kind == "undecidable" and "GLOG_v=1" in v.setting and "idle" in v.missing
    report, v = verdict_of(ms_pool_failure(4509715660, 300 * MiB, state=(70 * GiB, 80 * GiB, 84 * GiB)))
    assert report.figures["pool_idle"].printed == "14336.00MB"
    assert v.kind == "fragmentation" and v.sure and v.largest_free_bound == 14 * GiB   # its allocator's free total
    report, v = verdict_of(ms_pool_failure(20 * GiB, 300 * MiB, state=(70 * GiB, 80 * GiB, 84 * GiB)))
    assert v.kind == "capacity"


def test_mindspore_vmm_path():
    report, v = verdict_of(ms_vmm(60 * GiB, GiB, 4 * GiB, 62 * GiB))
    assert report.allocator == "dynamic-pool-vmm" and v.kind == "capacity"
    assert not any(r.setting == "enable_vmm:True" for r in _diagnosis_of_text(ms_vmm(60 * GiB, GiB, 4 * GiB, 62 * GiB)).remedies)


def test_one_rule_with_oom_kind():
    # the verdict is oom_kind on the printed figures, whatever the wording
    for text in (cuda_21plus(3 * GiB, 80 * GiB, GiB, 70 * GiB, 72 * GiB, this=79 * GiB),
                 npu(5 * GiB, 61 * GiB, 50 * GiB, 50 * GiB, GiB, 53 * GiB)):
        report, v = verdict_of(text)
        assert v.kind == oom_kind(v.request, v.free_total, v.device_free, v.held_elsewhere)


# --- damaged text --------------------------------------------------------------------------------------------------
def test_cut_message_says_what_is_missing():
    full = cuda_21plus(4 * GiB, 80 * GiB, GiB, 63 * GiB, 77 * GiB, this=78 * GiB)
    report, v = verdict_of(full[:full.index("Of the allocated")])
    assert report.cut and v.kind == "undecidable" and v.missing == "reserved but unallocated memory"
    report, v = verdict_of("CUDA out of memory. Tried to allocate 4.00 GiB")
    assert v.kind == "undecidable"


def test_an_oom_without_figures_says_what_is_missing():
    scan = scan_bytes([b"step 3\nRuntimeError: CUDA error: out of memory\nCUDA kernel errors might be reported\n"])
    (r,) = scan.reports
    v = crash_verdict(r)
    assert r.wording == "no figures" and v.kind == "undecidable" and "size" in v.missing


def test_reformatted_and_traceback_wrapped(tmp_path):
    msg = cuda_21plus(4 * GiB, 80 * GiB, GiB, 63 * GiB, 77 * GiB, this=78 * GiB)
    words = msg.split(" ")
    wrapped = "\n".join("# " + " ".join(words[i:i + 9]) for i in range(0, len(words), 9))   # a user's comment block
    tb = ("Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n    loss.backward()\n"
          f"torch.OutOfMemoryError: {msg}\n")
    for text in (wrapped, tb, "\n".join(f"[rank3]: {line}" for line in tb.splitlines())):
        log = tmp_path / "x.log"
        log.write_text("some line\n" + text + "\nafter\n")
        scan = read_oom_log(log)
        assert len(scan.reports) == 1, text
        assert crash_verdict(scan.reports[0]).kind == "fragmentation"
    assert scan.reports[0].rank == 3


def test_repeats_are_one_report_and_distinct_failures_are_two():
    msg = "torch.OutOfMemoryError: " + cuda_21plus(4 * GiB, 80 * GiB, GiB, 63 * GiB, 77 * GiB, this=78 * GiB)
    once = scan_bytes([f"{msg}\nre-raised:\n{msg}\n".encode()])
    assert len(once.reports) == 1
    other = cuda_21plus(8 * GiB, 80 * GiB, GiB, 63 * GiB, 77 * GiB, this=78 * GiB)
    twice = scan_bytes([f"{msg}\n{other}\n".encode()])
    assert [r.request.printed for r in twice.reports] == ["4.00 GiB", "8.00 GiB"]


def test_ranks_of_one_launcher_log_stay_apart():
    # torchrun prefixes every rank's line: the same OOM on two ranks is two reports
    msg = "torch.OutOfMemoryError: " + cuda_21plus(4 * GiB, 80 * GiB, GiB, 63 * GiB, 77 * GiB, this=78 * GiB)
    scan = scan_bytes([f"[rank0]: {msg}\n[rank1]: {msg}\n".encode()])
    assert [r.rank for r in scan.reports] == [0, 1]


def test_chunk_boundaries_do_not_matter():
    text = ("epoch: 1 step: 9, loss is 2.0\n" * 50 + ms_pool_failure(4509715660, 300 * MiB,
                                                                     state=(70 * GiB, 80 * GiB, 84 * GiB))).encode()
    whole = scan_bytes([text]).reports
    for size in (7, 64, 1000):
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        got = scan_bytes(parts).reports
        assert [(r.line, r.step, r.request.value, sorted(r.figures)) for r in got] == \
               [(r.line, r.step, r.request.value, sorted(r.figures)) for r in whole]
    assert whole[0].step == 10 and whole[0].time == "2026-03-01 10:23:45.123"


@pytest.mark.parametrize("step_line,step", [
    ("epoch: 1 step: 436, loss is 1.98", 437),
    ("2026-03-01 10:23:40,100 - mindformers[INFO] - { Epoch:[  1/  2], step:[  436/ 1000], loss: 2.1, lr: 1e-5 }", 437),
    (" [2026-03-01 10:23:40] iteration      436/   10000 | consumed samples:  3488 | elapsed time per iteration (ms): "
     "4700.1 |", 437),
])
def test_steps(step_line, step):
    scan = scan_bytes([(step_line + "\n" + ms_pool_failure(GiB, 0)).encode()])
    assert scan.reports[0].step == step and scan.reports[0].last_step_line == step_line.strip()


def test_step_before_lines_that_only_look_like_triggers():
    # "memory" in ordinary lines (GLOG_v=1 logs are full of it) must not hide the step line before them
    noise = "[INFO] PRE_ACT(1,2,python):2026-03-01-10:23:44.000.000 [x.cc:1 F] Alloc memory details, name:x\n" * 30
    scan = scan_bytes([("epoch: 1 step: 436, loss is 1.98\n" + noise + ms_pool_failure(GiB, 0)).encode()])
    assert scan.reports[0].step == 437


def test_a_long_state_dump_is_read_to_its_end_and_a_window_is_bounded():
    # twenty allocators' state lines between the pool's warning and the runtime's line
    text = ms_pool_failure(4509715660, 300 * MiB, state=(70 * GiB, 80 * GiB, 84 * GiB))
    first, rest = text.split("\n", 1)
    extra = "".join(ms_header("INFO") + f"\t\t{{\"addr_\":0x{i:x},\"size_\":1073741824}}\n" for i in range(40))
    (r,) = scan_bytes([(first + "\n" + extra + rest).encode()]).reports
    assert "pool_idle" in r.figures and r.kernel
    endless = "Memory not enough: current free memory size[0] is smaller than required size[5].\n" + \
        ms_header("INFO") + "stat info : {}\n" * 5000
    assert len(scan_bytes([endless.encode()]).reports) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([b"out of memory", b"Tried to allocate 1.00 GiB", b"\n", b"emory", b"\xff\x00",
                                 b"Out of Memory!!! Request memory size: ", b"(GPU 0; ", b"12", b"M\n",
                                 b"stat info : {", b"HCCL timeout ERROR", b"step: 3", b" free; "]), max_size=60))
def test_garbage_never_raises(pieces):
    scan = scan_bytes([b"".join(pieces)])
    for report in scan.reports:
        crash_verdict(report)


def test_no_oom_and_binary_noise_and_long_lines():
    scan = scan_bytes([b"\x00\xff" * 1000 + b"\n" + b"x" * (3 << 20) + b"\nHCCL timeout EI0002\n"])
    assert scan.reports == [] and "EI0002" in scan.first_error


def test_gzip_and_rank_from_path(tmp_path):
    log = tmp_path / "rank_7" / "worker_7.log.gz"
    log.parent.mkdir()
    with gzip.open(log, "wt") as f:
        f.write(ms_two_pointer(40 * GiB, 32768, 30684, 496, 0, 0))
    scan = read_oom_log(log)
    assert scan.rank == 7 and scan.reports[0].allocator == "ascend-two-pointer"
    assert rank_of_path("output/log/rank_104/info.log") == 104


# --- the real MindSpore CPU OOM -----------------------------------------------------------------------------------------
def test_real_mindspore_cpu_fragmentation_oom():
    d = diagnose_log(CRASH / "ms2.10_cpu_fragmentation_glog1.log")
    (r,) = d.reports
    assert r.allocator == "cpu-pool" and not any(m.setting == "enable_vmm:True" for m in d.remedies)
    assert r.request.value == 400 * MiB and r.figures["pool_idle"].printed == "1087M"
    assert r.blocks_idle == [544 * MiB, 543 * MiB]
    assert d.verdict.kind == "fragmentation" and d.verdict.sure
    assert d.verdict.largest_free_bound == 544 * MiB
    d2 = diagnose_log(CRASH / "ms2.10_cpu_fragmentation_glog2.log")
    assert d2.verdict.kind == "undecidable" and "GLOG_v=1" in d2.verdict.setting


def test_layout_beside_the_log_names_blockers(tmp_path):
    shutil.copy(DATA / "MemoryDebugInfo0.txt", tmp_path / "MemoryDebugInfo0.txt")
    log = tmp_path / "worker_0.log"
    log.write_text(ms_pool_failure(2_000_000_000, 0, state=(121110528, 121110528, 5 * GiB)))
    d = diagnose_log(log)
    assert d.layout_file and d.verdict.largest_free == 1935671296
    assert d.verdict.kind == "fragmentation"
    assert [b["size"] for b in d.blockers] == [2 * MiB]     # slid into the 100 MiB hole before it


# --- a job's folder ------------------------------------------------------------------------------------------------------
def _write_job(root: Path, ranks: int, bad: int, step: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        lines = [f"2026-03-01 10:{s % 40:02d}:00,000 - mindformers[INFO] - {{ Epoch:[  1/  1], step:[{s:5d}/ 9999], "
                 f"loss: 2.0 }}" for s in range(max(1, step - 40), step)]
        if rank == bad:
            body = ms_pool_failure(4509715660, 0, state=(70 * GiB, 80 * GiB, 84 * GiB), when="2026-03-01-10:41:05.000.000")
        else:
            body = (ms_header("ERROR", "DISTRIBUTED", "2026-03-01-10:51:07.000.000", "hccl_adapter.cc:1 Wait")
                    + f"HCCL timeout: EI0002 The wait execution of the Notify register times out. rank {rank}\n"
                    "RuntimeError: Call runtime rtStreamSynchronizeWithTimeout error.\n")
        (root / f"worker_{rank}.log").write_text("\n".join(lines) + "\n" + body)
    (root / "scheduler.log").write_text("scheduler up\n")


def test_logdir_names_the_rank_among_1024(tmp_path):
    _write_job(tmp_path / "msrun_log", 1024, bad=104, step=437)
    job = diagnose_logdir(tmp_path / "msrun_log", workers=2)
    assert job.first == [104]
    r = job.first_diagnosis.reports[0]
    assert r.step == 437 and job.first_diagnosis.verdict.kind == "fragmentation"
    assert job.text.startswith("rank 104 died at step 437: needed 4.2 GiB in one piece; 14.0 GiB were free")
    assert len(job.followers) == 1023 and job.counts == {"fragmentation": 1}
    out = job.to_dict()
    assert out["job"]["rank"] == 104 and out["job"]["step"] == 437 and out["job"]["verdict"]["kind"] == "fragmentation"


def test_logdir_on_dask_gives_the_same_answer(tmp_path):
    pytest.importorskip("distributed", reason="Dask's distributed is not installed")
    _write_job(tmp_path / "job", 16, bad=9, step=30)
    local = diagnose_logdir(tmp_path / "job", workers=1)
    dask = diagnose_logdir(tmp_path / "job", executor="dask", workers=2, processes=False)
    assert dask.first == local.first == [9] and dask.text == local.text and dask.counts == local.counts


def test_cli_exit_codes_json_and_report(tmp_path, capsys):
    _write_job(tmp_path / "job", 8, bad=5, step=12)
    assert main(["doctor", str(tmp_path / "job"), "--json", "--workers", "1", "--out", str(tmp_path / "rep")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["job"]["rank"] == 5 and out["job"]["step"] == 12 and out["counts"] == {"fragmentation": 1}
    assert "rank 5 died at step 12" in (tmp_path / "rep" / "report.md").read_text()
    log = tmp_path / "job" / "worker_5.log"
    assert main(["doctor", str(log), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["verdict"]["kind"] == "fragmentation" and len(one["reports"]) == 1
    assert main(["doctor", str(log), "--fail-on-oom"]) == 1
    capsys.readouterr()
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "dense_100b_1024x910c.yaml"
    assert main(["doctor", str(log), "--json", "--recipe", str(recipe)]) == 0
    planned = json.loads(capsys.readouterr().out)["plan"]
    assert planned["needs"] > 0 and planned["capacity"] > 0 and "ms-memopt plan" in planned["text"]
    plain = tmp_path / "notes.txt"
    plain.write_text("nothing to see\n")
    assert main(["doctor", str(plain)]) == 2
    assert "nor a log holding an out-of-memory message" in capsys.readouterr().err
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 2
    with pytest.raises(Exception):
        find_rank_logs(empty)


def _diagnosis_of_text(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.txt"
        path.write_text(text)
        return diagnose_log(path)


def test_mindformers_folder_info_and_error_logs_and_a_dump_per_rank(tmp_path, capsys):
    root = tmp_path / "output" / "log"
    for rank in range(4):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        if rank == 2:
            body = ms_pool_failure(2_000_000_000, 0, state=(121110528, 121110528, 5 * GiB))
            shutil.copy(DATA / "MemoryDebugInfo0.txt", folder / "MemoryDebugInfo0.txt")
        else:
            body = "RuntimeError: The pointer[comm] is null. HCCL timeout\n"
        (folder / "info.log").write_text("step:[  11/ 99]\n" + body)
        (folder / "error.log").write_text(body)        # MindFormers writes the errors to both
    job = diagnose_logdir(tmp_path / "output", workers=1)
    assert job.first == [2] and len(job.first_diagnosis.reports) == 1
    assert [b["size"] for b in job.first_diagnosis.blockers] == [2 * MiB]
    assert sorted(job.followers) == [0, 1, 3]
    assert main(["doctor", str(root / "rank_2" / "info.log"), "--out", str(tmp_path / "rep")]) == 0
    text = capsys.readouterr().out
    assert "blockers    1 live blocks" in text and "largest hole 1.80 GiB" in text
    assert (tmp_path / "rep" / "memory_map.png").stat().st_size > 0


@settings(max_examples=150, deadline=None)
@given(req=st.integers(1, 90 * GiB), total=st.integers(8 * GiB, 96 * GiB), data=st.data())
def test_a_sure_verdict_is_the_rule_on_the_exact_bytes(req, total, data):
    """Whatever the rounding of the printed figures, a verdict marked sure is oom_kind on the bytes the
    allocator had (the rule is monotone in each figure, so both ends of every range agreeing settles it)."""
    free = data.draw(st.integers(0, total))
    reserved = data.draw(st.integers(0, total - free))
    allocated = data.draw(st.integers(0, reserved))
    this = min(total - free, reserved + data.draw(st.integers(0, 2 * GiB)))
    report, v = verdict_of(cuda_21plus(req, total, free, allocated, reserved, this=this))
    runtime = RUNTIME_SHARE["pytorch"]
    beyond = total - free - reserved - runtime.share
    held = beyond if beyond > runtime.margin else 0       # "outside" only past the runtime's share and margin
    exact = oom_kind(req, reserved - allocated, free, held)
    if v.sure:
        assert v.kind == exact
    else:
        assert v.caveat and ("rounding" in v.caveat or (v.kind == "outside" and "nvidia-smi" in v.caveat))
    if v.kind == "outside":
        assert v.unaccounted > runtime.share + runtime.margin - 2 * (10 * MiB)     # the printed rounding aside


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 400), min_size=1, max_size=30))
def test_any_split_of_the_stream_gives_the_same_reports(cuts):
    text = ("epoch: 1 step: 7, loss is 2.0\n" * 20 + ms_pool_failure(4509715660, 300 * MiB, state=(70 * GiB, 80 * GiB, 84 * GiB))
            + "torch noise\n" + npu(2 * GiB, 61 * GiB, 56 * GiB, 56 * GiB, GiB, 59 * GiB) + "\n").encode()
    parts, pos = [], 0
    for cut in cuts:
        parts.append(text[pos:pos + cut])
        pos += cut
    parts.append(text[pos:])
    whole = [(r.line, r.step, r.request.value, sorted(r.figures)) for r in scan_bytes([text]).reports]
    assert [(r.line, r.step, r.request.value, sorted(r.figures)) for r in scan_bytes(parts).reports] == whole
    assert len(whole) == 2
