"""torch_npu's NPUCachingAllocator models (ms_memopt/allocators/torch_npu.py): each rule of
NPUCachingAllocator.cpp on its own, the compiled twins against the references (hypothesis),
who-recorded-it detection of snapshots, and the real Ascend snapshot in ../shared/data."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.allocators import create, fast
from ms_memopt.allocators.options import parse_allocator_options
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
from ms_memopt.replay.replay import recorded_allocator, replay

MiB = 2**20
KiB = 2**10
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "torch_npu"
NPU_SNAPSHOT = SHARED / "resnet_adam_default.pickle"
NPU_NAMES = ["torch-npu", "torch-npu-expandable"]
needs_fast = pytest.mark.skipif(not fast.FAST_MODELS, reason="the compiled fast path is not built (or stale)")


def _both(name: str, **options):
    """The reference and, when built, the compiled model (the rules hold for both)."""
    models = [create(name, fast=False, **options)]
    if fast.FAST_MODELS:
        models.append(create(name, fast=True, **options))
    return models


# --- round_size: size + kPadSize (32), then 512-byte multiples ---------------------------------------

@pytest.mark.parametrize("name", NPU_NAMES)
@pytest.mark.parametrize("request_size,block", [(1, 512), (256, 512), (480, 512), (481, 1024), (512, 1024),
                                                (4096, 4608), (37632, 37888)])
def test_requests_are_padded_by_32_bytes_before_rounding(name, request_size, block):
    for model in _both(name):
        a = model.malloc(request_size)
        b = model.malloc(512)
        assert b - a == block, type(model).__name__
        assert model.allocated == block + 1024


def test_pytorch_rounds_without_the_pad():
    model = create("torch", fast=False)
    a = model.malloc(512)
    assert model.malloc(512) - a == 512


@pytest.mark.parametrize("name", NPU_NAMES)
def test_the_small_pool_takes_padded_sizes_up_to_1_mib(name):
    for model in _both(name):
        model.malloc(MiB - 32)                 # 1 MiB padded: small pool, a 2 MiB segment or page
        assert model.reserved == 2 * MiB
        model.malloc(MiB - 31)                 # one byte over: the large pool
        assert model.reserved == 2 * MiB + 20 * MiB


@pytest.mark.parametrize("request_size,segment", [(512, 2 * MiB), (3 * MiB, 20 * MiB), (10 * MiB - 544, 20 * MiB),
                                                  (10 * MiB - 33, 10 * MiB),   # padded: 10 MiB, kMinLargeAlloc
                                                  (17 * MiB, 18 * MiB), (10 * MiB, 12 * MiB)])
def test_segment_sizes_are_get_allocation_size(request_size, segment):
    """kSmallBuffer 2 MiB, kLargeBuffer 20 MiB below kMinLargeAlloc (10 MiB), else kRoundLarge (2 MiB)
    multiples of the padded, rounded size."""
    for model in _both("torch-npu"):
        model.malloc(request_size)
        assert model.reserved == segment


def test_page_size_1g_makes_large_segments_whole_gib():
    for model in _both("torch-npu", page_size_1g=True):
        model.malloc(3 * MiB)
        assert model.reserved == 1 << 30
        model.malloc(4096)                     # the small pool keeps its 2 MiB segments
        assert model.reserved == (1 << 30) + 2 * MiB


def test_large_blocks_split_only_above_1_mib_remainders():
    """should_split: the large pool keeps a remainder of 1 MiB or less in the block."""
    for model in _both("torch-npu"):
        a = model.malloc(19 * MiB - 32)        # 19 MiB of a 20 MiB segment: 1 MiB left, not split
        model.free(a)
        assert model.malloc(19 * MiB - 32) == a
        model.malloc(512 * KiB)                # no piece of the first segment: a new small segment
        assert [s.size for s in model.layout().segments] == [20 * MiB, 2 * MiB]


# --- expandable segments: pages, the 16 KiB alignment, ranges given back ---------------------------

def test_expandable_large_requests_start_16_kib_aligned():
    """malloc's base_addr_aligned_size: a 2 MiB+ request moves to the next 16 KiB boundary of its
    block; the bytes before it stay a free block."""
    for model in _both("torch-npu-expandable"):
        a = model.malloc(1536 * KiB)           # 1.5 MiB + 32 rounds to 1.5 MiB + 512
        b = model.malloc(4 * MiB)
        assert b % (16 * KiB) == 0 and b - a == 1536 * KiB + 16 * KiB
        holes = [blk for seg in model.layout().segments for blk in seg.blocks if not blk.live]
        assert (a + 1536 * KiB + 512, 16 * KiB - 512) in [(h.addr, h.size) for h in holes]
        model.free(b)                          # merges with the gap again
        assert model.malloc(4 * MiB) == b


def test_expandable_alignment_off_and_small_requests_unaligned():
    for model in _both("torch-npu-expandable", base_addr_aligned_kb=0):
        a = model.malloc(1536 * KiB)
        assert model.malloc(4 * MiB) - a == 1536 * KiB + 512
    for model in _both("torch-npu-expandable"):
        a = model.malloc(1536 * KiB)
        assert model.malloc(1536 * KiB) - a == 1536 * KiB + 512   # below kRoundLarge: no alignment


@pytest.mark.parametrize("options,page", [({}, 20 * MiB), ({"segment_size_mb": 64}, 64 * MiB),
                                          ({"page_size_1g": True}, 1 << 30)])
def test_expandable_large_page(options, page):
    for model in _both("torch-npu-expandable", **options):
        model.malloc(3 * MiB)
        assert model.reserved == page
        model.malloc(1000)
        assert model.reserved == page + 2 * MiB


def test_empty_cache_unmaps_free_pages_and_gives_an_empty_range_back():
    for model in _both("torch-npu-expandable"):
        keep = model.malloc(30 * MiB)          # 30 MiB + 512 B: two 20 MiB pages
        gone = model.malloc(30 * MiB)          # from 30 MiB + 16 KiB (aligned) to past 60 MiB: four pages
        assert model.reserved == 80 * MiB
        model.free(gone)
        model.empty_cache()
        assert model.reserved == 40 * MiB      # pages the live block touches stay mapped
        model.free(keep)
        model.empty_cache()
        assert model.reserved == 0 and model.layout().segments == []


def test_a_recorded_mapping_places_a_new_range():
    for model in _both("torch-npu-expandable"):
        model.note_segment_map(0x12C0_0000_0000, 20 * MiB, 0)
        assert model.malloc(5 * MiB) == 0x12C0_0000_0000
        model.note_segment_map(0x1300_0000_0000, 2 * MiB, 0)    # announced for a request served from a page
        model.malloc(6 * MiB)
        assert model.malloc(1000) != 0x1300_0000_0000            # stale: no later request uses it


def test_a_recorded_unmap_shrinks_only_where_it_was():
    for model in _both("torch-npu-expandable"):
        a = model.malloc(50 * MiB)             # three 20 MiB pages
        model.free(a)
        model.unmap_range(a + 20 * MiB, 20 * MiB, 0)
        assert model.reserved == 40 * MiB
        assert [(s.addr - a, s.size) for s in model.layout().segments] == [(0, 20 * MiB), (40 * MiB, 20 * MiB)]


# --- options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,options,key", [
    ("torch-npu-expandable", {"base_addr_aligned_kb": 17}, "base_addr_aligned_kb"),
    ("torch-npu-expandable", {"segment_size_mb": 10}, "segment_size_mb"),
    ("torch-npu-expandable", {"segment_size_mb": 513}, "segment_size_mb"),
    ("torch-npu", {"max_split_size_mb": 20}, "max_split_size_mb"),
    ("torch-npu", {"page_size_1g": "yes"}, "page_size_1g"),
])
def test_options_outside_parseargs_limits_are_refused(name, options, key):
    with pytest.raises(InputError, match=key):
        create(name, fast=False, **options)


def test_options_parse_as_pytorch_npu_alloc_conf_sets_them():
    assert parse_allocator_options("torch-npu-expandable", ["segment_size_mb=64", "page_size_1g=true",
                                                            "base_addr_aligned_kb=0"]) == \
        {"segment_size_mb": 64, "page_size_1g": True, "base_addr_aligned_kb": 0}
    with pytest.raises(InputError, match="max_split_size_mb"):   # refused with expandable segments
        parse_allocator_options("torch-npu-expandable", ["max_split_size_mb=64"])


# --- the compiled twins ----------------------------------------------------------------------------

_sizes = st.one_of(st.integers(0, 4096), st.integers(0, 3 * MiB), st.sampled_from([480, 481, MiB - 32, 2 * MiB]),
                   st.integers(0, 60 * MiB))
_ops = st.lists(st.one_of(
    st.tuples(st.just("malloc"), _sizes, st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("note_segment_map"), st.integers(0, 8).map(lambda k: (1 << 44) + k * (40 << 30)),
              st.just(20 * MiB), st.integers(0, 1)),
    st.tuples(st.just("unmap_range"), st.integers(0, 60).map(lambda k: (1 << 44) + k * 2 * MiB),
              st.sampled_from([2 * MiB, 20 * MiB, 40 * MiB]), st.integers(0, 1)),
    st.tuples(st.just("note_segment_alloc"), st.integers(0, 40).map(lambda k: (1 << 40) + k * 2 * MiB),
              st.sampled_from([2 * MiB, 20 * MiB]), st.integers(0, 1)),
), max_size=150)
_CONFIGS = [("torch-npu", {"capacity": 200 * MiB}), ("torch-npu", {"roundup_power2_divisions": 4}),
            ("torch-npu", {"page_size_1g": True}),
            ("torch-npu-expandable", {"capacity": 160 * MiB}), ("torch-npu-expandable", {}),
            ("torch-npu-expandable", {"segment_size_mb": 32, "base_addr_aligned_kb": 4}),
            ("torch-expandable", {"capacity": 160 * MiB})]


def _state(model):
    return (model.reserved, model.allocated, model.peak_reserved, model.peak_allocated, model.segment_allocs,
            model.largest_free(), [o.to_dict() for o in model.ooms], model.layout())


@needs_fast
@pytest.mark.parametrize("name,options", _CONFIGS)
@settings(max_examples=25, deadline=None)
@given(ops=_ops)
def test_the_compiled_models_place_every_request_as_the_references(name, options, ops):
    ref, quick = create(name, fast=False, **options), create(name, fast=True, **options)
    assert type(quick) is fast.FAST_MODELS[name]
    live: list[int] = []
    for op in ops:
        if op[0] == "malloc":
            got = quick.malloc(op[1], stream=op[2])
            assert got == ref.malloc(op[1], stream=op[2])
            if got is not None:
                live.append(got)
        elif op[0] == "free":
            if live:
                addr = live.pop(op[1] % len(live))
                ref.free(addr)
                quick.free(addr)
        else:
            getattr(ref, op[0])(*op[1:])
            getattr(quick, op[0])(*op[1:])
        assert (quick.reserved, quick.allocated) == (ref.reserved, ref.allocated)
    assert _state(quick) == _state(ref)


# --- snapshots: who recorded them, and their maps read as events ------------------------------------

_NPU_FRAME = [{"filename": "/env/lib/python3.11/site-packages/torch_npu/utils/_module.py", "name": "f", "line": 9}]


def _snapshot(tmp_path, trace, segments=(), **extra) -> Path:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": list(segments), "device_traces": [trace], **extra}, protocol=4))
    return path


def _segment(addr, size, blocks, kind="small", expandable=False):
    out, cursor = [], addr
    for bsize, requested in blocks:
        out.append({"address": cursor, "size": bsize, "requested_size": requested,
                    "state": "active_allocated" if requested else "inactive"})
        cursor += bsize
    return {"device": 0, "address": addr, "total_size": size, "stream": 0, "segment_type": kind,
            "is_expandable": expandable, "blocks": out}


def test_a_frame_naming_torch_npu_picks_its_model(tmp_path):
    trace = [{"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0, "frames": _NPU_FRAME},
             {"action": "free_completed", "addr": 1 << 30, "size": 512, "stream": 0}]
    t = read_torch_snapshot(_snapshot(tmp_path, trace))
    assert t.meta["framework"] == "torch_npu"
    choice = recorded_allocator(t)
    assert choice.name == "torch-npu" and "torch_npu/utils/_module.py" in choice.why


def test_block_sizes_tell_torch_npu_without_frames(tmp_path):
    seg = _segment(1 << 30, 2 * MiB, [(1024, 512), (1536, 1024), (512, 100), (2 * MiB - 3072, 0)])
    t = read_torch_snapshot(_snapshot(tmp_path, [], [seg]))
    assert t.meta["framework"] == "torch_npu" and "round_up(requested + 32, 512)" in t.meta["framework_evidence"]
    cuda = _segment(1 << 30, 2 * MiB, [(512, 512), (1024, 1024), (512, 100), (2 * MiB - 2048, 0)])
    t = read_torch_snapshot(_snapshot(tmp_path, [], [cuda]))
    assert t.meta["framework"] == "torch" and recorded_allocator(t).name == "torch"


def test_expandable_segments_are_detected_and_their_maps_read(tmp_path):
    base = 0x12C0_0000_0000
    trace = [{"action": "segment_map", "addr": base, "size": 20 * MiB, "stream": 0, "frames": _NPU_FRAME},
             {"action": "alloc", "addr": base, "size": 5 * MiB, "stream": 0},
             {"action": "free_completed", "addr": base, "size": 5 * MiB, "stream": 0},
             {"action": "segment_unmap", "addr": base, "size": 20 * MiB, "stream": 0}]
    t = read_torch_snapshot(_snapshot(tmp_path, trace))
    assert [e.action for e in t.events] == ["segment_map", "alloc", "free", "segment_unmap"]
    assert t.meta["expandable_segments"] is True and t.initial.segments == []
    choice = recorded_allocator(t)
    assert choice.name == "torch-npu-expandable" and "segment_map" in choice.why
    result = replay(t, create(choice.name))
    assert result.address_match == 1.0 and result.final_reserved == 0


def test_is_expandable_segments_pick_the_expandable_pytorch_model(tmp_path):
    seg = _segment(1 << 40, 20 * MiB, [(20 * MiB, 0)], kind="large", expandable=True)
    t = read_torch_snapshot(_snapshot(tmp_path, [], [seg]))
    assert recorded_allocator(t).name == "torch-expandable"


def test_the_initial_state_of_an_expandable_recording_leaves_out_what_it_mapped(tmp_path):
    """Runs mapped before the trace stay; pages the trace mapped are not there at its start,
    pages it unmapped are."""
    base = 0x12C0_0000_0000
    final = [_segment(base, 40 * MiB, [(1024, 100), (40 * MiB - 1024, 0)], kind="large", expandable=True)]
    trace = [{"action": "segment_unmap", "addr": base + 60 * MiB, "size": 20 * MiB, "stream": 0},
             {"action": "segment_map", "addr": base + 20 * MiB, "size": 20 * MiB, "stream": 0}]
    t = read_torch_snapshot(_snapshot(tmp_path, trace, final))
    assert [(s.addr - base, s.size, s.pool) for s in t.initial.segments] == [(0, 20 * MiB, "large"),
                                                                              (60 * MiB, 20 * MiB, "large")]
    # no large-pool "tail" is merged into a block with expandable segments (they split at 512 B)
    assert [(b.size, b.live) for b in t.initial.segments[0].blocks] == [(1024, True), (20 * MiB - 1024, False)]


def test_the_jsonl_events_keep_segment_maps(tmp_path):
    from ms_memopt.core.events import read_jsonl, write_jsonl
    path = tmp_path / "e.jsonl"
    events = [Event("segment_map", size=20 * MiB, addr=1 << 40), Event("segment_unmap", size=20 * MiB, addr=1 << 40)]
    write_jsonl(path, events)
    assert read_jsonl(path).events == events
    path.write_text('{"format": "ms-memopt-events", "version": 1}\n{"action": "segment_map", "size": 4}\n')
    with pytest.raises(InputError, match="addr"):
        read_jsonl(path)


# --- the real Ascend snapshot -----------------------------------------------------------------------

@pytest.mark.skipif(not NPU_SNAPSHOT.exists(), reason="../shared/data/traces/torch_npu is not here")
def test_the_ascend_snapshot_replays_exactly_through_the_model_it_picks():
    trace = read_torch_snapshot(NPU_SNAPSHOT)
    choice = recorded_allocator(trace)
    assert choice.name == "torch-npu"
    result = replay(trace, create(choice.name), sample_every=0)
    assert result.address_match == 1.0 and result.final_layout_match
    # PyTorch's own rounding is 1% exact on it (issue 34)
    assert replay(trace, create("torch"), sample_every=0).address_match < 0.05


def test_replay_json_says_what_chose_the_model(tmp_path, capsys):
    from ms_memopt.cli import main
    trace = [{"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0, "frames": _NPU_FRAME}]
    path = _snapshot(tmp_path, trace)
    assert main(["replay", str(path), "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["allocator"] == "torch-npu" and out["allocator_reason"].startswith("a torch_npu snapshot")
    assert main(["replay", str(path), "--json", "--allocator", "torch"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["allocator"] == "torch" and out["allocator_reason"] == "--allocator"


# --- a recording of the expandable model, replayed: maps, unmaps, ranges given back and re-reserved --

def _runs(model) -> set[tuple[int, int]]:
    return {(seg.addr, seg.end) for seg in model.layout().segments}


def _pages(runs: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """Mapped runs as 2 MiB pieces (every page size is a multiple), for set differences."""
    return sorted({(a, a + 2 * MiB) for start, end in runs for a in range(start, end, 2 * MiB)})


def _intervals(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in pieces:
        if out and out[-1][1] == start:
            out[-1][1] = end
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _record_expandable(ops, capacity: int) -> dict:
    """A snapshot as torch_npu writes one, made by running the model at ``capacity`` (its ranges
    are 1 1/8 x capacity apart) with ``segment_map``/``segment_unmap`` entries where it mapped and
    unmapped pages."""
    model = create("torch-npu-expandable", capacity=capacity, fast=False)
    trace, live = [], []
    for op in ops:
        before = _pages(_runs(model))
        if op[0] == "malloc":
            addr = model.malloc(op[1])
            after = _pages(_runs(model))
            for start, end in _intervals(sorted(set(after) - set(before))):
                trace.append({"action": "segment_map", "addr": start, "size": end - start, "stream": 7})
            trace.append({"action": "alloc", "addr": addr, "size": op[1], "stream": 7, "frames": _NPU_FRAME})
            live.append((addr, op[1]))
        elif op[0] == "free" and live:
            addr, size = live.pop(op[1] % len(live))
            model.free(addr)
            trace += [{"action": a, "addr": addr, "size": size, "stream": 7} for a in ("free_requested", "free_completed")]
        elif op[0] == "empty_cache":
            model.empty_cache()
            after = _pages(_runs(model))
            for start, end in _intervals(sorted(set(before) - set(after))):
                trace.append({"action": "segment_unmap", "addr": start, "size": end - start, "stream": 7})
    sizes = dict(live)
    segments = [{"device": 0, "address": seg.addr, "total_size": seg.size, "stream": 7, "segment_type": seg.pool,
                 "is_expandable": True,
                 "blocks": [{"address": b.addr, "size": b.size, "requested_size": sizes.get(b.addr, 0) if b.live else 0,
                             "state": "active_allocated" if b.live else "inactive"} for b in seg.blocks]}
                for seg in model.layout().segments]
    return {"segments": segments, "device_traces": [trace]}


_workload = st.lists(st.one_of(
    st.tuples(st.just("malloc"), st.one_of(st.integers(1, 4096), st.integers(1, 3 * MiB), st.integers(1, 50 * MiB))),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("empty_cache"))), min_size=1, max_size=80)


@settings(max_examples=30, deadline=None)
@given(ops=_workload)
def test_a_recorded_expandable_run_replays_exactly(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("rec") / "snap.pickle"
    ops = [("malloc", 1000), ("malloc", 3 * MiB)] + ops      # a frame and both pools' ranges at least
    path.write_bytes(pickle.dumps(_record_expandable(ops, capacity=4 << 30), protocol=4))
    trace = read_torch_snapshot(path)
    choice = recorded_allocator(trace)
    assert choice.name == "torch-npu-expandable"
    for fast_path in ([False, True] if fast.FAST_MODELS else [False]):
        # unbounded here: ranges of 1 TiB, so the recorded ranges (4.5 GiB apart) must come from the trace
        result = replay(trace, create(choice.name, fast=fast_path), sample_every=0)
        assert result.address_match in (None, 1.0)
        assert result.final_layout_match


def test_the_trace_tells_torch_npu_when_nothing_else_does(tmp_path):
    """No frames, no live blocks: a small request followed by one placed right after it shows
    the block it took."""
    trace = [{"action": "alloc", "addr": (1 << 30) + k * 1024, "size": 512, "stream": 0} for k in range(3)]
    t = read_torch_snapshot(_snapshot(tmp_path, trace))
    assert t.meta["framework"] == "torch_npu" and "2 of 2 small requests" in t.meta["framework_evidence"]
    trace = [{"action": "alloc", "addr": (1 << 30) + k * 512, "size": 512, "stream": 0} for k in range(3)]
    assert read_torch_snapshot(_snapshot(tmp_path, trace)).meta["framework"] == "torch"


@pytest.mark.skipif(not NPU_SNAPSHOT.exists(), reason="../shared/data/traces/torch_npu is not here")
@pytest.mark.parametrize("name,framework", [("torch_npu/resnet_adam_default.pickle", "torch_npu"),
                                            ("torch/tinyllama_qlora.pickle", "torch"),
                                            ("torch/cs336_small_warm.pickle", "torch")])
def test_the_real_snapshots_tell_their_framework_without_frames(name, framework):
    from ms_memopt.io.traces.torch_origin import snapshot_origin
    from ms_memopt.io.traces.torch_snapshot import safe_load
    data = safe_load(SHARED.parent / name)
    trace = [{k: v for k, v in e.items() if k != "frames"} for e in data["device_traces"][0]]
    assert snapshot_origin({"segments": []}, trace).framework == framework


_growing = st.lists(st.one_of(
    st.tuples(st.just("malloc"), st.one_of(st.integers(1, 4096), st.integers(1, 3 * MiB), st.integers(1, 50 * MiB))),
    st.tuples(st.just("free"), st.integers(0, 10**6))), min_size=1, max_size=60)


@settings(max_examples=30, deadline=None)
@given(ops=_growing, start=st.integers(0, 100))
def test_a_recording_started_late_restores_its_expandable_ranges(tmp_path_factory, ops, start):
    """Recording started after the pool had grown: the mapped runs at the start are the
    recording's expandable ranges again (not fixed segments), its live blocks torch_npu-sized, so
    the rest replays exactly."""
    ops = [("malloc", 1000), ("malloc", 3 * MiB)] + ops
    data = _record_expandable(ops, capacity=4 << 30)
    entries = data["device_traces"][0]
    cut = min(start, len(entries))
    while cut < len(entries) and entries[cut]["action"] == "free_completed":
        cut += 1                                   # a free's two entries stay together
    data["device_traces"][0] = entries[cut:]
    path = tmp_path_factory.mktemp("late") / "snap.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    trace = read_torch_snapshot(path)
    assert trace.initial.expandable
    for fast_path in ([False, True] if fast.FAST_MODELS else [False]):
        result = replay(trace, create("torch-npu-expandable", fast=fast_path), sample_every=0)
        assert result.address_match in (None, 1.0)
        assert result.final_layout_match


def test_origin_reads_all_dict_traces_at_c_speed_and_anything_else_one_by_one():
    """The frame lists and the segment_map count are gathered in bulk when every entry is a dict;
    an entry that is not one, or an action that cannot be hashed, takes the entry-by-entry pass,
    with the same answer; the first frame naming torch_npu is the one reported either way."""
    from ms_memopt.io.traces.torch_origin import snapshot_origin

    plain = [{"filename": "train.py", "line": 1, "name": "f"}]
    npu = [{"filename": "/env/torch_npu/npu/memory.py", "line": 2, "name": "g"}]
    later = [{"filename": "/x/torch_npu/utils/_module.py", "line": 3, "name": "h"}]
    trace = [{"action": "alloc", "addr": 0, "size": 512, "frames": plain},
             {"action": "segment_map", "addr": 0, "size": 2 * MiB, "frames": npu},
             {"action": "alloc", "addr": 512, "size": 512, "frames": plain},
             {"action": "free_completed", "addr": 0, "size": 512, "frames": later}]
    segments = [{"address": 0, "total_size": 2 * MiB, "frames": [], "blocks": [{"frames": plain}]}]
    for entries in (trace, trace + ["not a dict"], trace + [{"action": ["unhashable"], "frames": None}]):
        origin = snapshot_origin({"segments": segments}, entries)
        assert (origin.framework, origin.framework_evidence) == (
            "torch_npu", "a frame names torch_npu (torch_npu/npu/memory.py)")
        assert origin.expandable and "1 segment_map/segment_unmap" in origin.expandable_evidence


def test_the_package_loads_arena_when_asked():
    import ms_memopt
    from ms_memopt.analysis.arena import Arena, Handle

    assert (ms_memopt.Arena, ms_memopt.Handle) == (Arena, Handle)
    with pytest.raises(AttributeError):
        ms_memopt.nothing_here
