"""Verdicts that never contradict their own figures (doctor on crash logs and on recordings).

Each wording's figures are read as the source that prints them defines them, version by version
(the builders below are those sources' format strings, cited where they differ); figures that
cannot all be true are named and no verdict is computed from them; "outside the allocator" is
said only past the runtime's own share and a margin; a fragmentation verdict's largest piece is
the piece in the pool that serves the request, and smaller than it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ms_memopt.allocators.base import oom_kind
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.doctor.crash_logs import RUNTIME_SHARE, crash_verdict
from ms_memopt.doctor.diagnose import diagnose
from ms_memopt.io.oom_logs import parse_message
from ms_memopt.io.traces import load_trace

from test_doctor_logs import cuda_21plus, cuda_old, fs, npu

MiB, GiB = 2**20, 2**30
PROFILER = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "ascend_profiler" / \
    "cnn_910b_level1_rank0"


def verdict(text: str):
    report = parse_message(text)
    assert report is not None, text
    return report, crash_verdict(report)


# --- each wording's figures as its source defines them ----------------------------------------------
# (wording, message, figure -> printed text it must hold): the meaning of each figure, by version
WORDINGS = [
    # c10/cuda/CUDACachingAllocator.cpp v1.0.0-v1.3.1, THCCachingAllocator::malloc:
    #   format_size(stats.amount_cached - stats.amount_allocated) << " cached)": the unused cache
    ("pytorch<1.4 (cached)", "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
     "6.64 GiB already allocated; 21.00 MiB free; 150.86 MiB cached)",
     {"reserved_unallocated": "150.86 MiB", "reserved": "6.64 GiB + 150.86 MiB", "device_free": "21.00 MiB"}),
    # v1.4.0-v2.0.1, DeviceCachingAllocator::malloc: format_size(stats.reserved_bytes[..].current)
    #   << " reserved in total by PyTorch)": the total, allocated included
    ("pytorch<=2.0", cuda_old(20 * MiB, int(7.93 * GiB), int(6.64 * GiB), 21 * MiB, int(6.79 * GiB)),
     {"reserved": "6.79 GiB", "reserved_unallocated": "6.79 GiB - 6.64 GiB", "capacity": "7.93 GiB"}),
    # v2.1+: "Of the allocated memory " << format_size(allocated_bytes) << " is allocated by PyTorch, and "
    #   << format_size(reserved_bytes - allocated_bytes) << " is reserved by PyTorch but unallocated."
    ("pytorch>=2.1", cuda_21plus(20 * MiB, int(79.15 * GiB), int(1.06 * GiB), int(63.61 * GiB), int(77.57 * GiB),
                                 this=int(78.07 * GiB)),
     {"reserved_unallocated": "13.96 GiB", "allocated": "63.61 GiB", "device_free": "1.06 GiB",
      "process_in_use": "78.07 GiB"}),
    # torch_npu NPUCachingAllocator.cpp malloc: "... already allocated; " << active_bytes << " current active; "
    #   << device_free << " free; " << reserved_bytes << " reserved in total by PyTorch)"
    ("torch_npu", npu(2 * GiB, int(60.97 * GiB), int(56.44 * GiB), int(56.44 * GiB), int(1.35 * GiB),
                      int(58.92 * GiB)),
     {"reserved": "58.92 GiB", "active": "56.44 GiB", "reserved_unallocated": "58.92 GiB - 56.44 GiB"}),
]


@pytest.mark.parametrize("wording,text,meaning", WORDINGS, ids=[w[0] for w in WORDINGS])
def test_each_wordings_figures_as_its_source_defines_them(wording, text, meaning):
    report, v = verdict(text)
    assert report.wording == wording
    for name, printed in meaning.items():
        assert report.figures[name].printed == printed, name
    assert not report.contradictions and v.kind != "undecidable"
    assert v.free_total == report.figures["reserved_unallocated"].value >= 0


def test_the_old_cached_figure_is_the_unused_cache_not_the_total():
    # the message: 150.86 MiB cached under 6.64 GiB allocated is the unused part, not a negative
    report, v = verdict(WORDINGS[0][1])
    assert report.figures["reserved_unallocated"].value == round(150.86 * MiB)
    assert "150.86 MiB - 6.64 GiB" not in v.text and not report.contradictions
    assert v.kind == "fragmentation" and v.sure          # 150.86 + 21 MiB free covered 20 MiB


# --- impossible figures are named, not computed from ------------------------------------------------
@pytest.mark.parametrize("text,named", [
    # 1.4-2.0: the total reserved below what is allocated
    (cuda_old(20 * MiB, 8 * GiB, int(6.64 * GiB), 21 * MiB, int(150.86 * MiB)), "allocated (6.64 GiB) exceeds reserved"),
    # free above the total
    (cuda_old(20 * MiB, 8 * GiB, 2 * GiB, 9 * GiB, 3 * GiB), "device_free (9.00 GiB) exceeds capacity (8.00 GiB)"),
    # pool and free together above the card
    (npu(2 * GiB, 32 * GiB, 20 * GiB, 20 * GiB, 10 * GiB, 25 * GiB), "reserved + device_free"),
    # active above reserved
    (npu(2 * GiB, 64 * GiB, 20 * GiB, 40 * GiB, 1 * GiB, 30 * GiB), "active (40.00 GiB) exceeds reserved"),
])
def test_impossible_figures_make_an_uncertain_verdict(text, named):
    report, v = verdict(text)
    assert any(named in c for c in report.contradictions), report.contradictions
    assert v.kind == "undecidable" and not v.sure and "contradict" in v.caveat
    assert named in v.text and "FRAGMENTATION" not in v.text and "CAPACITY" not in v.text


# --- "outside" only past the runtime's share and its margin ------------------------------------------
def test_a_cuda_context_is_not_outside():
    # a 16 GB V100: 13.52 GiB reserved, 1.05 GiB free, 1.21 GiB unaccounted: what a CUDA context takes
    report, v = verdict(cuda_old(int(1.5 * GiB), int(15.78 * GiB), int(13.20 * GiB), int(1.05 * GiB),
                                 int(13.52 * GiB)))
    assert v.kind == "capacity" and not v.held_elsewhere
    assert abs(v.unaccounted - 1.21 * GiB) < 0.02 * GiB
    assert "1.2 GiB of the card held neither by the pool nor free" in v.text and "nvidia-smi" in v.text


def test_past_the_margin_is_outside_but_says_how_sure():
    # a T4 with 3.4 GiB unaccounted: likely another process, which only nvidia-smi can tell
    report, v = verdict(cuda_old(2 * GiB, int(14.75 * GiB), 10 * GiB, int(1.05 * GiB), int(10.3 * GiB)))
    assert v.kind == "outside" and not v.sure
    assert "likely, not certain" in v.caveat and "nvidia-smi" in v.caveat
    # the same with the other process printed (PyTorch 2.1+ lists them through NVML): sure
    report, v = verdict(cuda_21plus(2 * GiB, int(14.75 * GiB), int(1.05 * GiB), 10 * GiB, int(10.3 * GiB),
                                    procs=[(4242, int(2.4 * GiB))], this=int(11.3 * GiB)))
    assert v.kind == "outside" and v.sure and v.held_by_others == round(2.4 * GiB)


def test_an_ascend_runtime_share_is_not_outside():
    # torch_npu: 1.5 GiB unaccounted on a 64 GiB card is within the CANN runtime's share and margin
    report, v = verdict(npu(2 * GiB, 64 * GiB, int(61.2 * GiB), int(61.2 * GiB), int(1.0 * GiB), int(61.5 * GiB)))
    assert v.kind == "capacity" and "npu-smi" in v.text


# --- properties over generated figures ------------------------------------------------------------------
SIZES = st.integers(1, 80 * GiB)


@settings(max_examples=200, deadline=None)
@given(req=SIZES, total=st.integers(4 * GiB, 96 * GiB), data=st.data(), old=st.sampled_from(["cached", "total", "npu"]))
def test_the_kind_agrees_with_the_arithmetic(req, total, data, old):
    """Whatever the wording, a sure verdict is the rule on the figures as the source defines them,
    and impossible figures never give one."""
    free = data.draw(st.integers(0, total))
    reserved = data.draw(st.integers(0, total - free))
    allocated = data.draw(st.integers(0, reserved))
    if old == "npu":
        text = npu(req, total, allocated, allocated, free, reserved)
    else:
        text = cuda_old(req, total, allocated, free, reserved, cached=old == "cached")
    report, v = verdict(text)
    assert not report.contradictions              # these figures are possible (at most rounded)
    framework = "torch_npu" if old == "npu" else "pytorch"
    runtime = RUNTIME_SHARE[framework]
    beyond = total - free - reserved - runtime.share
    exact = oom_kind(req, reserved - allocated, free, beyond if beyond > runtime.margin else 0)
    if v.sure:
        assert v.kind == exact
    else:
        assert v.caveat
    assert v.free_total is not None and v.free_total >= 0


@settings(max_examples=100, deadline=None)
@given(req=SIZES, total=st.integers(4 * GiB, 96 * GiB), over=st.integers(1, 2 * GiB), data=st.data())
def test_impossible_figures_never_give_a_verdict(req, total, over, data):
    allocated = data.draw(st.integers(over, total))
    text = cuda_old(req, total, allocated, data.draw(st.integers(0, GiB)), allocated - over)
    report, v = verdict(text)
    if fs(allocated) != fs(allocated - over) and report.figures["allocated"].low > report.figures["reserved"].high:
        assert v.kind == "undecidable" and report.contradictions


@st.composite
def layouts(draw):
    segments, addr = [], 0
    for _ in range(draw(st.integers(1, 6))):
        blocks, at = [], addr
        for _ in range(draw(st.integers(1, 5))):
            size = draw(st.integers(1, 4096)) * 512 * 1024
            blocks.append(Block(at, size, draw(st.booleans())))
            at += size
        segments.append(Segment(addr, at - addr, blocks))
        addr = at + 2 * MiB
    return Layout(segments)


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), req=st.integers(1, 4 * GiB), device_free=st.integers(0, 4 * GiB))
def test_a_fragmentation_verdict_names_a_piece_smaller_than_the_request(layout, req, device_free):
    """With the pool's map beside the log (MindSpore's debug dump), a hole the request fits in is
    never called fragmentation."""
    idle = layout.reserved - layout.allocated
    text = (f"CUDA out of memory. Tried to allocate {fs(req)} (GPU 0; {fs(layout.reserved + device_free)} total "
            f"capacity; {fs(layout.allocated)} already allocated; {fs(device_free)} free; "
            f"{fs(layout.reserved)} reserved in total by PyTorch)")
    report = parse_message(text)
    v = crash_verdict(report, layout=layout)
    if v.kind == "fragmentation":
        assert v.largest_free < report.request.low
    if v.largest_free is not None and v.largest_free >= report.request.high and idle + device_free >= req:
        assert v.kind != "fragmentation"


# --- recordings: the pool that serves the request, and a card the recording already exceeds --------------
needs_profiler = pytest.mark.skipif(not PROFILER.is_dir(), reason=f"{PROFILER} is absent (shared/data)")


@needs_profiler
def test_a_small_request_is_not_served_by_the_large_pools_hole():
    # the real torch_npu capture starts at 1.42 GiB reserved; on a 1.40 GiB card a 36 KiB request
    # fails in the small pool while the large pool holds a 364 MiB hole it can never use
    d = diagnose(load_trace(PROFILER), capacity=int(1.40 * GiB))
    v = d.verdict
    assert v.failed and v.pool == "small" and v.largest_free < v.request
    assert v.text.startswith("the recording starts with 1.42 GiB reserved")
    assert "small pool" in v.text and "in a pool this request cannot use" in v.text
    assert "the largest piece was 364" not in v.text


@needs_profiler
def test_a_card_below_the_runs_live_bytes_is_capacity():
    d = diagnose(load_trace(PROFILER), capacity=900 * MiB)
    assert d.verdict.kind == "capacity"
    assert d.verdict.text.startswith("the recording starts with 1.42 GiB reserved")
    assert "its live tensors reach 1.16 GiB" in d.verdict.text


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 6 * MiB), min_size=4, max_size=40), frees=st.data(),
       capacity=st.integers(4 * MiB, 48 * MiB), model=st.sampled_from(["torch-npu", "torch", "mindspore"]))
def test_a_recordings_fragmentation_verdict_never_contradicts_its_figures(sizes, frees, capacity, model):
    events, live = [], []
    for i, size in enumerate(sizes):
        events.append(Event("alloc", id=i, size=size))
        live.append(i)
        if len(live) > 1 and frees.draw(st.booleans()):
            events.append(Event("free", id=live.pop(frees.draw(st.integers(0, len(live) - 1)))))
    d = diagnose(Trace(events, format="jsonl"), capacity=capacity, allocator=model)
    v = d.verdict
    if v.failed and v.kind == "fragmentation":
        assert v.largest_free < v.request
        assert "fragmentation" in v.text and "capacity" not in v.text.split(": ")[-1]
    if v.failed and v.kind == "capacity":
        assert "capacity: the card is too small for this step" in v.text


def test_a_run_cached_above_the_card_is_capacity_not_a_fit():
    """A snapshot taken mid-run starts with its pool cached above the card: every request fits
    in that cache, so no replay fails; the live tensors alone exceed the card, so the verdict is
    capacity and the advice never says the run fits (it did: "the run as recorded fits in 400 MiB"
    for a 13 GiB recording)."""
    base = 1 << 40
    start = Layout([Segment(base, 128 * MiB, [Block(base, 16 * MiB, True, id=1),
                                              Block(base + 16 * MiB, 112 * MiB, False)], pool="large")])
    events = [Event("alloc", id=2, size=60 * MiB, addr=base + 16 * MiB), Event("free", id=2),
              Event("free", id=1)]
    d = diagnose(Trace(events, source="warm.pickle", initial=start), capacity=64 * MiB, allocator="torch")
    assert (d.verdict.kind, d.verdict.failed, d.verdict.event) == ("capacity", False, 0)
    assert "live tensors reach 76.00 MiB at event 0, more than the card" in d.verdict.text
    assert "starts with 128.00 MiB reserved" in d.verdict.text
    assert d.summary.startswith("no setting saves this run at 64.00 MiB") and "fits" not in d.summary
    assert "a card of at least 76.00 MiB" in d.summary and d.remedies == []
    # under the card's size of live tensors, a cached start says so and the run is fine
    d = diagnose(Trace(events, source="warm.pickle", initial=start), capacity=100 * MiB, allocator="torch")
    assert d.verdict.kind == "none" and d.verdict.text.startswith("the recording starts with 128.00 MiB reserved")
