"""PyTorch caching allocator models: rules, options, OOM path, properties, fidelity on real snapshots."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_memopt.allocators import create
from ms_memopt.allocators.torch import TorchCachingAllocator, allocation_size, round_size
from ms_memopt.allocators.torch_expandable import TorchExpandableAllocator
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import measure
from ms_memopt.replay.replay import replay

MiB = 1 << 20
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "torch"
MODELS = ("torch", "torch-expandable")


def _shared(name: str) -> Path:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"shared snapshot {path} not present (see shared/data/SOURCES.md)")
    return path


def _shape(layout: Layout):
    return [(s.addr, s.size, s.pool, [(b.addr, b.size, b.live) for b in s.blocks]) for s in layout.segments]


# --- rules of the caching allocator ---------------------------------------------------------------
def test_rounding_and_segment_sizes():
    assert [round_size(s) for s in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert allocation_size(MiB) == 2 * MiB                  # small pool
    assert allocation_size(MiB + 512) == 20 * MiB           # 1 MiB < request < 10 MiB
    assert allocation_size(10 * MiB) == 10 * MiB            # rounded up to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_roundup_power2_divisions():
    assert round_size(5 * MiB + 1, 4) == 6 * MiB            # steps of 1 MiB between 4 and 8 MiB
    assert round_size(4 * MiB, 4) == 4 * MiB                # powers of two stay
    assert round_size(1200, 4) == 1536                      # <= 512 * divisions: plain 512 rounding
    assert round_size(1300 * 1024, 8) == 1408 * 1024        # steps of 128 KiB between 1 and 2 MiB
    m = TorchCachingAllocator(roundup_power2_divisions=4)
    a = m.malloc(5 * MiB + 1)
    m.malloc(512)
    assert m.layout().segments[0].blocks[0].size == 6 * MiB and a is not None


@pytest.mark.parametrize("option, value", [("max_split_size_mb", 20), ("max_split_size_mb", "64"),
                                           ("roundup_power2_divisions", 3), ("roundup_power2_divisions", 0)])
def test_bad_options(option, value):
    with pytest.raises(InputError, match=option):
        create("torch", **{option: value})
    if option == "roundup_power2_divisions":
        with pytest.raises(InputError, match=option):
            create("torch-expandable", **{option: value})


def test_small_pool_split_and_best_fit_lowest_address():
    m = TorchCachingAllocator()
    a, b, c, d = (m.malloc(4096) for _ in range(4))
    assert [b - a, c - b, d - c] == [4096] * 3 and m.reserved == 2 * MiB
    m.free(a)
    m.free(c)                       # two equal 4 KiB holes: the lower one wins
    assert m.malloc(4000) == a
    assert m.malloc(4000) == c


def test_large_pool_split_threshold_is_strictly_more_than_1mib():
    m = TorchCachingAllocator()
    a = m.malloc(19 * MiB)          # 20 MiB segment, 1 MiB remainder: not split
    assert [b.size for b in m.layout().segments[0].blocks] == [20 * MiB]
    m.free(a)
    b = m.malloc(19 * MiB - 512)    # remainder 1 MiB + 512 B: split
    assert [x.size for x in m.layout().segments[0].blocks] == [19 * MiB - 512, MiB + 512]
    assert b == a


def test_streams_do_not_share_blocks():
    m = TorchCachingAllocator()
    a = m.malloc(4096, stream=0)
    m.free(a)
    b = m.malloc(4096, stream=1)
    assert b != a and m.reserved == 4 * MiB


def test_no_merge_across_adjacent_segments():
    m = TorchCachingAllocator()
    m.note_segment_alloc(0x1000_0000, 20 * MiB)
    a = m.malloc(5 * MiB)
    m.note_segment_alloc(0x1000_0000 + 20 * MiB, 20 * MiB)
    b = m.malloc(19 * MiB)          # does not fit the first segment's 15 MiB: new one, back to back
    assert (a, b) == (0x1000_0000, 0x1000_0000 + 20 * MiB)
    m.free(a)
    m.free(b)
    layout = m.layout()
    assert [len(s.blocks) for s in layout.segments] == [1, 1]
    assert measure(layout).largest_free == 20 * MiB


def test_recorded_segment_address_ignored_when_it_overlaps():
    m = TorchCachingAllocator()
    first = m.malloc(3 * MiB)
    m.note_segment_alloc(first + MiB, 20 * MiB)     # overlaps the model's own segment
    second = m.malloc(30 * MiB)
    assert second is not None and second >= first + 20 * MiB
    m.layout().check()


def test_max_split_size():
    m = TorchCachingAllocator(max_split_size_mb=40)
    big = m.malloc(50 * MiB)
    m.free(big)
    small = m.malloc(5 * MiB)       # < 40 MiB never takes a cached block >= 40 MiB
    assert small != big and m.reserved == 70 * MiB
    m.free(small)
    other = m.malloc(45 * MiB)      # oversize: takes the 50 MiB block (< 45 + 20 MiB), unsplit
    assert other == big
    assert [b.size for s in m.layout().segments if s.addr == big for b in s.blocks] == [50 * MiB]
    m.free(other)
    far = m.malloc(25 * MiB)        # < 40 MiB: not from the 50 MiB block
    assert far != big


def test_empty_cache_releases_only_idle_segments():
    m = TorchCachingAllocator()
    a = m.malloc(4096)
    b = m.malloc(12 * MiB)
    c = m.malloc(3 * MiB)
    m.free(b)
    m.empty_cache()
    assert m.reserved == 2 * MiB + 20 * MiB
    m.free(a)
    m.free(c)
    m.release_segment(a, 2 * MiB)
    assert m.reserved == 20 * MiB
    m.empty_cache()
    assert m.reserved == 0 and m.layout().segments == []


def test_release_segment_stands_in_for_a_diverged_one():
    m = TorchCachingAllocator()
    a = m.malloc(3 * MiB)
    b = m.malloc(30 * MiB)
    m.free(a)
    m.release_segment(0xdead_0000, 20 * MiB)     # not the model's: its idle 20 MiB segment goes
    assert m.reserved == 30 * MiB
    m.release_segment(b, 30 * MiB)               # in use: stays
    assert m.reserved == 30 * MiB


def test_oom_record_and_release_then_retry():
    m = TorchCachingAllocator(capacity=64 * MiB)
    a = m.malloc(30 * MiB)
    m.malloc(4096)
    m.free(a)                        # 30 MiB cached, 2 MiB small segment in use
    b = m.malloc(40 * MiB)           # only fits after the cached 30 MiB segment is released
    assert b is not None and m.reserved == 42 * MiB and not m.ooms
    assert m.malloc(30 * MiB) is None
    (oom,) = m.ooms
    assert oom.size == 30 * MiB and oom.reserved == 42 * MiB and oom.capacity == 64 * MiB
    assert oom.free_total == 2 * MiB - 4096 and oom.largest_free == 2 * MiB - 4096
    assert oom.kind == "capacity" and oom.device_free == 22 * MiB


def test_max_split_release_oversize_first():
    m = TorchCachingAllocator(capacity=100 * MiB, max_split_size_mb=30)
    x = m.malloc(40 * MiB)
    y = m.malloc(40 * MiB)
    m.malloc(4096)
    m.free(x)
    m.free(y)
    z = m.malloc(60 * MiB)           # no room: two oversize cached blocks go back, then it fits
    assert z is not None and not m.ooms
    assert m.reserved == 62 * MiB


def test_restore_round_trip():
    m = TorchCachingAllocator()
    addrs = [m.malloc(s) for s in (100, 3 * MiB, 700, 25 * MiB, 2 * MiB)]
    m.free(addrs[1])
    m.free(addrs[2])
    layout = m.layout()
    fresh = TorchCachingAllocator()
    fresh.restore(layout)
    assert _shape(fresh.layout()) == _shape(layout)
    assert (fresh.reserved, fresh.allocated) == (m.reserved, m.allocated)
    assert fresh.malloc(3 * MiB) == m.malloc(3 * MiB)


# --- expandable segments ---------------------------------------------------------------------------
def test_expandable_pages_and_remerge():
    m = TorchExpandableAllocator()
    a = m.malloc(12 * MiB)
    b = m.malloc(12 * MiB)
    assert b == a + 12 * MiB and m.reserved == 40 * MiB   # two 20 MiB pages
    s = m.malloc(4096)
    assert m.reserved == 42 * MiB                          # a 2 MiB small page in another range
    m.free(a)
    m.free(b)
    layout = m.layout()
    large = [seg for seg in layout.segments if seg.pool == "large"]
    assert [(len(seg.blocks), seg.size) for seg in large] == [(1, 40 * MiB)]   # pieces re-merged
    c = m.malloc(30 * MiB)
    assert c == a and m.reserved == 42 * MiB
    m.free(c)
    m.free(s)
    m.empty_cache()
    assert m.reserved == 0 and measure(m.layout()).reserved == 0


def test_expandable_live_block_pins_its_pages():
    m = TorchExpandableAllocator()
    a = m.malloc(15 * MiB)
    b = m.malloc(10 * MiB)           # spans the page boundary at 20 MiB
    m.malloc(30 * MiB)
    m.free(a)
    m.empty_cache()                  # [0, 15) is free but its page holds b's first 5 MiB
    assert m.reserved == 60 * MiB
    assert b == a + 15 * MiB


def test_expandable_prefers_block_that_cannot_grow():
    m = TorchExpandableAllocator()
    a = m.malloc(12 * MiB)
    m.malloc(30 * MiB)               # maps 3 pages: 60 MiB
    tail_owner = m.malloc(14 * MiB)
    assert tail_owner == a + 42 * MiB and m.reserved == 60 * MiB   # a 4 MiB free tail at the end
    m.free(a)                        # a 12 MiB hole at the start
    # best fit by size is the 4 MiB tail, but it borders unmapped space: the hole is preferred
    assert m.malloc(3 * MiB) == a


def test_expandable_oom():
    m = TorchExpandableAllocator(capacity=50 * MiB)
    assert m.malloc(45 * MiB) is None            # needs three 20 MiB pages
    assert m.ooms[0].size == 45 * MiB and m.reserved <= 50 * MiB
    assert m.malloc(30 * MiB) is not None


# --- properties ------------------------------------------------------------------------------------
_op = st.one_of(
    st.tuples(st.just("malloc"), st.sampled_from([1, 512, 4000, MiB, 3 * MiB, 12 * MiB, 30 * MiB])
              | st.integers(1, 40 * MiB), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
)
_options = st.sampled_from([{}, {"max_split_size_mb": 24}, {"roundup_power2_divisions": 4}])


def _check(model, held: set[int]) -> None:
    layout = model.layout()
    layout.check()                    # tiled segments, no overlap, no two adjacent free blocks
    m = measure(layout)
    assert m.allocated + m.free_total == m.reserved
    assert (m.reserved, m.allocated) == (model.reserved, model.allocated)
    assert model.largest_free() == m.largest_free
    assert model.peak_reserved >= model.reserved and model.peak_allocated >= model.allocated
    if model.capacity is not None:
        assert model.reserved <= model.capacity
    live = sorted((b.addr, b.end) for b in layout.live_blocks())
    assert all(x[1] <= y[0] for x, y in zip(live, live[1:]))
    assert {a for a, _ in live} == held
    if m.free_total:
        assert m.frag_ratio == pytest.approx(m.free_total / m.largest_free - 1)
        assert m.utilization == pytest.approx(m.allocated / m.reserved)


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=60), options=_options, capacity=st.sampled_from([None, 96 * MiB]))
def test_model_properties(name, ops, options, capacity):
    if name == "torch-expandable":
        options = {k: v for k, v in options.items() if k != "max_split_size_mb"}
    model = create(name, capacity=capacity, **options)
    held: list[int] = []
    for action, value, stream in ops:
        if action == "malloc":
            before = len(model.ooms)
            addr = model.malloc(value, stream=stream)
            if addr is None:
                assert len(model.ooms) == before + 1
                oom = model.ooms[-1]
                assert oom.size == value and oom.free_total + oom.allocated == oom.reserved
                assert oom.largest_free <= oom.free_total
            else:
                assert addr not in held
                held.append(addr)
        elif action == "free" and held:
            model.free(held.pop(value % len(held)))
        elif action == "empty_cache":
            model.empty_cache()
        _check(model, set(held))
    for addr in held:
        model.free(addr)
    model.empty_cache()
    assert model.reserved == 0 and model.allocated == 0


@pytest.mark.parametrize("name", MODELS)
def test_restore_then_free_everything(name):
    layout = Layout([
        Segment(0x100_0000, 2 * MiB, [Block(0x100_0000, 512, True), Block(0x100_0200, 2 * MiB - 512, False)],
                pool="small"),
        Segment(0x120_0000, 20 * MiB, [Block(0x120_0000, 4 * MiB, False), Block(0x160_0000, 16 * MiB, True)],
                pool="large"),
    ])
    model = create(name)
    model.restore(layout)
    _check(model, {0x100_0000, 0x160_0000})
    assert model.malloc(3 * MiB) == 0x120_0000
    model.free(0x120_0000)
    model.free(0x160_0000)
    model.free(0x100_0000)
    model.empty_cache()
    assert model.reserved == 0


# --- fidelity on recorded snapshots ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["tinyllama_qlora.pickle", "cs336_small_warm.pickle"])
def test_fidelity_on_recorded_snapshots(name):
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    trace = read_torch_snapshot(_shared(name))
    result = replay(trace, create("torch"), sample_every=0)
    assert result.address_match is not None and result.address_match >= 0.99
    assert result.address_match == 1.0            # what the rules achieve on these snapshots
    assert _shape(result.final_layout) == _shape(trace.final)
    got, want = measure(result.final_layout), measure(trace.final)
    assert (got.reserved, got.allocated, got.free_total, got.largest_free) == \
        (want.reserved, want.allocated, want.free_total, want.largest_free)
    assert not result.ooms


def test_fidelity_speed():
    """Throughput floor, lenient for a shared machine (docs/torch.md has the measured figure)."""
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    trace = read_torch_snapshot(_shared("tinyllama_qlora.pickle"))
    best = max(replay(trace, create("torch"), sample_every=0).events_per_s for _ in range(3))
    assert best >= 150_000


@pytest.mark.parametrize("name", MODELS)
def test_replay_under_a_small_capacity_reports_ooms(name):
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot
    trace = read_torch_snapshot(_shared("tinyllama_qlora.pickle"))
    trace.initial = None
    result = replay(trace, create(name, capacity=2 << 30), sample_every=500)
    assert result.ooms and result.peak_reserved <= 2 << 30
    assert all(o.event_index is not None and o.size > 0 for o in result.ooms)
    result.final_layout.check()
