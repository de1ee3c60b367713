"""The compaction planner: valid layouts, memmove-safe order, pinned blocks fixed, bounds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.analysis.compaction import apply_plan, cheapest_window, coalesce_runs, plan_compaction, slide_targets
from ms_memopt.core.layout import Block, Layout, Segment


@st.composite
def layouts(draw, max_segments=3, max_blocks=12):
    """Random layouts: segments of 1..max_blocks blocks, some live, some of those pinned."""
    segments = []
    addr = 0
    next_id = 0
    for _ in range(draw(st.integers(1, max_segments))):
        addr += draw(st.integers(0, 64))
        seg_addr = addr
        blocks = []
        previous_free = False
        for _ in range(draw(st.integers(1, max_blocks))):
            size = draw(st.integers(1, 64))
            live = draw(st.booleans()) or previous_free
            if live:
                blocks.append(Block(addr, size, True, id=next_id, pinned=draw(st.booleans()) and
                                    draw(st.booleans())))
                next_id += 1
            else:
                blocks.append(Block(addr, size, False))
            previous_free = not live
            addr += size
        segments.append(Segment(seg_addr, addr - seg_addr, blocks, pool=draw(st.sampled_from(["a", "b"]))))
    layout = Layout(segments, capacity=addr + 1000)
    layout.check()
    return layout


def _execute(layout: Layout, plan) -> np.ndarray:
    """Fill every live block with its own bytes, run the moves in order on one buffer."""
    end = max(s.end for s in layout.segments)
    memory = np.zeros(end, dtype=np.uint8)
    for b in layout.live_blocks():
        memory[b.addr:b.end] = np.arange(b.size, dtype=np.uint8) * 7 + (b.id % 251) + 1
    for m in plan.moves:
        np.copyto(memory[m.dst:m.dst + m.size], memory[m.src:m.src + m.size])
    return memory


def _live(layout: Layout) -> dict:
    return {b.id: (b.size, b.pinned) for b in layout.live_blocks()}


@settings(max_examples=300, deadline=None)
@given(layouts(), st.booleans())
def test_full_plan_is_valid_and_safe(layout, evacuate):
    plan = plan_compaction(layout, evacuate=evacuate, release_empty=False)
    plan.layout.check()
    assert _live(plan.layout) == _live(layout)
    assert plan.after.allocated == plan.before.allocated
    assert plan.after.free_total == plan.before.free_total
    assert plan.bytes_moved == sum(m.size for m in plan.moves)
    old = {b.id: b for b in layout.live_blocks()}
    new = {b.id: b for b in plan.layout.live_blocks()}
    for block_id, b in old.items():
        if b.pinned:
            assert new[block_id].addr == b.addr
    # executing the moves in order leaves every block's bytes at its new address
    memory = _execute(layout, plan)
    for block_id, b in new.items():
        expect = np.arange(b.size, dtype=np.uint8) * 7 + (block_id % 251) + 1
        assert np.array_equal(memory[b.addr:b.end], expect), f"block {block_id} corrupted"
    assert plan.after.largest_free >= (0 if evacuate else plan.before.largest_free)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_full_slide_leaves_one_hole_per_window(layout):
    plan = plan_compaction(layout)
    for seg in plan.layout.segments:
        # every hole is followed by a pinned block or ends the segment
        for b, nxt in zip(seg.blocks, seg.blocks[1:] + [None]):
            if not b.live:
                assert nxt is None or nxt.pinned


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 300))
def test_max_bytes_bounds_the_work(layout, budget):
    plan = plan_compaction(layout, max_bytes=budget, evacuate=True)
    plan.layout.check()
    assert plan.bytes_moved <= budget
    full = plan_compaction(layout, evacuate=True)
    if full.bytes_moved <= budget:
        assert plan.moves == full.moves and plan.stopped_by is None


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(1, 400))
def test_target_largest_free_stops_early(layout, target):
    plan = plan_compaction(layout, target_largest_free=target)
    full = plan_compaction(layout)
    plan.layout.check()
    assert plan.bytes_moved <= full.bytes_moved
    if full.after.largest_free >= target:
        assert plan.after.largest_free >= target
    if plan.before.largest_free >= target:
        assert plan.moves == []


def test_pinned_block_splits_windows():
    seg = Segment(0, 60, [Block(0, 10, False), Block(10, 10, True, id=1), Block(20, 10, True, id=2, pinned=True),
                          Block(30, 10, False), Block(40, 10, True, id=3), Block(50, 10, False)])
    plan = plan_compaction(Layout([seg]))
    assert [(m.block_id, m.src, m.dst) for m in plan.moves] == [(1, 10, 0), (3, 40, 30)]
    assert [(b.addr, b.size, b.live) for b in plan.layout.segments[0].blocks] == [
        (0, 10, True), (10, 10, False), (20, 10, True), (30, 10, True), (40, 20, False)]


def test_evacuation_releases_a_segment_and_skips_other_pools():
    a = Segment(0, 100, [Block(0, 40, True, id=1), Block(40, 60, False)], pool="common")
    b = Segment(1000, 100, [Block(1000, 50, False), Block(1050, 30, True, id=2), Block(1080, 20, False)],
                pool="common")
    c = Segment(2000, 100, [Block(2000, 10, True, id=3), Block(2010, 90, False)], pool="persistent")
    plan = plan_compaction(Layout([a, b, c], capacity=4000), evacuate=True)
    assert plan.released == [(1000, 100)]
    assert [s.addr for s in plan.layout.segments] == [0, 2000]
    assert plan.after.device_free == plan.before.device_free + 100
    assert {b.id: b.addr for b in plan.layout.live_blocks()} == {1: 0, 2: 40, 3: 2000}


def test_evacuation_skips_segments_with_pinned_blocks():
    a = Segment(0, 100, [Block(0, 40, True, id=1), Block(40, 60, False)])
    b = Segment(1000, 60, [Block(1000, 30, True, id=2, pinned=True), Block(1030, 30, False)])
    plan = plan_compaction(Layout([a, b]), evacuate=True)  # b would fit into a, but is pinned
    assert plan.released == [] and plan.moves == []


def test_field_report_shape():
    """14 'GB' free in holes of at most 3 between live blocks: compaction merges them."""
    blocks, addr, bid = [], 0, 0
    for hole in [3, 2, 3, 1, 3, 2]:
        blocks.append(Block(addr, 10, True, id=bid)); addr += 10; bid += 1
        blocks.append(Block(addr, hole, False)); addr += hole
    blocks.append(Block(addr, 10, True, id=bid)); addr += 10
    layout = Layout([Segment(0, addr, blocks)])
    plan = plan_compaction(layout)
    assert plan.before.largest_free == 3 and plan.before.free_total == 14
    assert plan.after.largest_free == 14 and plan.after.frag_ratio == 0.0
    smaller = plan_compaction(layout, target_largest_free=8)
    assert 8 <= smaller.after.largest_free < 14 and smaller.bytes_moved < plan.bytes_moved
    assert smaller.stopped_by == "target_largest_free"


def test_slide_targets_and_runs_agree_with_memmove():
    addrs = np.array([8, 16, 24, 40, 48])
    sizes = np.array([8, 8, 8, 8, 4])
    pinned = np.zeros(5, dtype=bool)
    targets, why = slide_targets(addrs, sizes, pinned, 0, 64)
    assert targets.tolist() == [0, 8, 16, 24, 32] and why is None
    runs = coalesce_runs(addrs, targets, sizes)
    assert [(r.src, r.dst, r.size, r.first, r.count) for r in runs] == [(8, 0, 24, 0, 3), (40, 24, 12, 3, 2)]


def test_apply_plan_rejects_overlapping_moves():
    seg = Segment(0, 30, [Block(0, 10, True, id=1), Block(10, 10, True, id=2), Block(20, 10, False)])
    plan = plan_compaction(Layout([seg]))
    from ms_memopt.analysis.compaction import Move
    plan.moves = [Move(2, 10, 5, 10)]
    with pytest.raises(ValueError):
        apply_plan(Layout([seg]), plan)


@st.composite
def segment_arrays(draw):
    """Sorted live blocks of one segment: (addrs, sizes, pinned, end)."""
    addrs, sizes, pinned = [], [], []
    cursor = 0
    for _ in range(draw(st.integers(0, 10))):
        cursor += draw(st.integers(0, 20))
        size = draw(st.integers(1, 20))
        addrs.append(cursor)
        sizes.append(size)
        pinned.append(draw(st.integers(0, 4)) == 0)
        cursor += size
    end = cursor + draw(st.integers(0, 20))
    return np.array(addrs, dtype=np.int64), np.array(sizes, dtype=np.int64), np.array(pinned, dtype=bool), end


def _brute_force_cost(addrs, sizes, pinned, end, target):
    """Try every range of holes i..j inside a window; the cheapest cost, or None."""
    n = len(addrs)
    gap_start = [0] + [int(a + s) for a, s in zip(addrs, sizes)]
    gaps = [int(e) - g for e, g in zip(list(addrs) + [end], gap_start)]
    best = None
    for i in range(n + 1):
        for j in range(i, n + 1):
            if any(pinned[i:j]):
                break
            if sum(gaps[i:j + 1]) >= target:
                cost = int(sum(sizes[i:j]))
                best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=400, deadline=None)
@given(segment_arrays(), st.integers(1, 80))
def test_cheapest_window_is_optimal_and_opens_the_hole(arrays, target):
    addrs, sizes, pinned, end = arrays
    found = cheapest_window(addrs, sizes, pinned, 0, end, target)
    expect = _brute_force_cost(addrs, sizes, pinned, end, target)
    if expect is None:
        assert found is None
        return
    targets, cost = found
    assert cost == expect
    assert cost == int(sizes[targets != addrs].sum())
    assert np.all(targets[pinned] == addrs[pinned]) and np.all(targets <= addrs)
    order_ok = np.all(targets[1:] >= targets[:-1] + sizes[:-1]) if len(addrs) > 1 else True
    assert order_ok
    holes = np.diff(np.concatenate(([0], np.stack([targets, targets + sizes], 1).ravel(), [end])))[::2]
    assert holes.max() >= target
