"""MindSpore allocator models: rules from MindSpore's source, and properties every model keeps.

``check_invariants`` and ``apply_ops`` / ``ops_strategy`` are written for any
:class:`~ms_memopt.allocators.base.AllocatorModel`; other model tests may import them
(``from tests.test_mindspore_allocators import check_invariants`` or copy the idea).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.mindspore import MindSporePool, align_size
from ms_memopt.allocators.mindspore_vmm import CHUNK, MindSporeVMMPool
from ms_memopt.core.events import Event, Trace
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import measure
from ms_memopt.replay.replay import replay

MiB = 1 << 20
GiB = 1 << 30


# --- reusable property helpers ---------------------------------------------------------------
def check_invariants(model: AllocatorModel, live: dict[int, int]) -> None:
    """Assert what every allocator model must keep true.

    ``live`` maps each address the model returned (and that was not freed) to the size
    requested. Checks: the layout tiles its segments with no two adjacent free blocks and no
    overlapping segments; live blocks are exactly the live requests, at least as large, and
    never overlap; ``allocated + free_total == reserved``; the model's counters agree with its
    layout; the metric identities hold.
    """
    layout = model.layout()
    layout.check()
    live_blocks = sorted((b.addr, b.size) for b in layout.live_blocks())
    assert [a for a, _ in live_blocks] == sorted(live), "live blocks differ from live requests"
    for addr, size in live_blocks:
        assert size >= live[addr]
    for (a1, s1), (a2, _) in zip(live_blocks, live_blocks[1:]):
        assert a1 + s1 <= a2, f"live blocks overlap at {a2:#x}"
    m = measure(layout)
    assert m.allocated + m.free_total == m.reserved
    assert m.reserved == model.reserved and m.allocated == model.allocated
    assert model.peak_reserved >= model.reserved and model.peak_allocated >= model.allocated
    assert 0 <= m.largest_free <= m.free_total
    assert m.holes == sum(m.hole_histogram.values())
    if m.free_total == 0:
        assert m.frag_ratio is None
    else:
        assert m.frag_ratio == pytest.approx(m.free_total / m.largest_free - 1)
        assert m.frag_ratio >= 0
    if m.reserved:
        assert m.utilization == pytest.approx(m.allocated / m.reserved)
    if model.capacity is not None:
        assert model.reserved <= model.capacity
        assert m.device_free == model.capacity - model.reserved
    if not model.virtual:
        assert model.largest_free() == m.largest_free
    else:
        assert model.largest_free() >= 0
    for oom in model.ooms:
        assert oom.size > 0 and oom.largest_free >= 0 and oom.free_total >= 0


def ops_strategy(max_size: int = 64 * MiB, streams: int = 2):
    """Lists of operations: ("alloc", size, pool, stream), ("free", k), ("empty",)."""
    alloc = st.tuples(st.just("alloc"),
                      st.one_of(st.integers(0, 4096), st.integers(4096, MiB), st.integers(MiB, max_size)),
                      st.sampled_from([None, "persistent"]), st.integers(0, streams - 1))
    free = st.tuples(st.just("free"), st.integers(0, 10**6))
    empty = st.tuples(st.just("empty"))
    return st.lists(st.one_of(alloc, alloc, free, free, empty), max_size=60)


def apply_ops(model: AllocatorModel, ops, *, check_every: int = 1) -> dict[int, int]:
    """Run ``ops`` on ``model``, checking :func:`check_invariants` every ``check_every`` ops."""
    live: dict[int, int] = {}
    for n, op in enumerate(ops):
        if op[0] == "alloc":
            _, size, pool, stream = op
            ooms = len(model.ooms)
            addr = model.malloc(size, pool=pool, stream=stream)
            if addr is None:
                assert len(model.ooms) == ooms + 1, "a failed malloc must record an OOM"
                assert model.ooms[-1].size == align_size(size)
            else:
                assert addr not in live
                live[addr] = size
        elif op[0] == "free" and live:
            addr = sorted(live)[op[1] % len(live)]
            model.free(addr)
            del live[addr]
        elif op[0] == "empty":
            model.empty_cache()
        if n % check_every == 0:
            check_invariants(model, live)
    check_invariants(model, live)
    return live


_FACTORIES = {
    "mindspore": lambda: MindSporePool(capacity=256 * MiB, increase_size=16 * MiB),
    "mindspore-pregrow": lambda: MindSporePool(capacity=256 * MiB, increase_size=16 * MiB, pregrow=True),
    "mindspore-unbounded": lambda: MindSporePool(increase_size=8 * MiB),
    "mindspore-vmm": lambda: MindSporeVMMPool(capacity=256 * MiB),
    "mindspore-vmm-unbounded": lambda: MindSporeVMMPool(),
}


def _vmm_buffers_are_merged(model: MindSporeVMMPool) -> None:
    """Inside the VMM model no two neighbouring buffers share a free state (idle or eager-free),
    buffers tile each virtual range, and every used buffer lies in mapped chunks."""
    from ms_memopt.allocators import mindspore_vmm as vmm
    for allocator in model._allocators.values():
        for rng in allocator.ranges:
            buf, cursor, prev_state = rng.head, rng.addr, None
            while buf is not None:
                assert buf[vmm._ADDR] == cursor and buf[vmm._SIZE] > 0
                state = buf[vmm._STATE]
                assert not (state != vmm._USED and state == prev_state), "unmerged free neighbours"
                if state == vmm._USED:
                    first, last = buf[vmm._ADDR] // CHUNK, (buf[vmm._ADDR] + buf[vmm._SIZE] - 1) // CHUNK
                    assert all(c in model._mapped for c in range(first, last + 1))
                prev_state, cursor, buf = state, cursor + buf[vmm._SIZE], buf[vmm._NEXT]
            assert cursor == rng.addr + rng.size


@pytest.mark.parametrize("factory", sorted(_FACTORIES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy())
def test_model_properties(factory, ops):
    model = _FACTORIES[factory]()
    apply_ops(model, ops)
    if isinstance(model, MindSporeVMMPool):
        _vmm_buffers_are_merged(model)


@settings(max_examples=30, deadline=None)
@given(ops=ops_strategy())
def test_vmm_defrag_keeps_invariants_and_unmaps_idle_chunks(ops):
    model = MindSporeVMMPool(capacity=256 * MiB)
    live = apply_ops(model, ops)
    model.defrag()
    check_invariants(model, live)
    _vmm_buffers_are_merged(model)
    live_chunks = {c for a, s in ((b.addr, b.size) for b in model.layout().live_blocks())
                   for c in range(a // CHUNK, (a + s - 1) // CHUNK + 1)}
    assert model.reserved == len(live_chunks) * CHUNK


# --- MindSporePool: the rules -------------------------------------------------------------------
def test_alignment_is_512_bytes():
    pool = MindSporePool(capacity=GiB)
    a, b, c = pool.malloc(1), pool.malloc(0), pool.malloc(513)
    assert (b - a, c - b) == (512, 512)
    assert pool.allocated == 512 + 512 + 1024


def test_best_fit_takes_smallest_then_lowest_address():
    pool = MindSporePool(capacity=GiB, increase_size=64 * MiB)
    sizes = [8 * MiB, 1 * MiB, 4 * MiB, 1 * MiB, 4 * MiB, 1 * MiB]
    addrs = [pool.malloc(s) for s in sizes]
    pool.free(addrs[0]); pool.free(addrs[2]); pool.free(addrs[4])   # holes 8, 4, 4 MiB
    assert pool.malloc(3 * MiB) == addrs[2]      # smallest hole >= 3 MiB, lowest address of the two
    assert pool.malloc(4 * MiB) == addrs[4]
    assert pool.malloc(5 * MiB) == addrs[0]


def test_split_and_merge_with_idle_neighbours():
    pool = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    a, b, c = pool.malloc(MiB), pool.malloc(MiB), pool.malloc(MiB)
    assert [blk.size for blk in pool.layout().blocks()] == [MiB, MiB, MiB, 13 * MiB]
    pool.free(a); pool.free(c)
    assert [(blk.size, blk.live) for blk in pool.layout().blocks()] == [(MiB, False), (MiB, True), (14 * MiB, False)]
    pool.free(b)
    assert [(blk.size, blk.live) for blk in pool.layout().blocks()] == [(16 * MiB, False)]


def test_growth_doubles_the_unit_until_the_request_fits_capped_at_device_free():
    pool = MindSporePool(capacity=100 * MiB, increase_size=8 * MiB)
    pool.malloc(MiB)
    pool.malloc(20 * MiB)                       # 8 -> 16 -> 32 MiB block
    assert [s.size for s in pool.layout().segments] == [8 * MiB, 32 * MiB]
    pool.malloc(50 * MiB)                       # 64 MiB wanted, 60 MiB left on the device
    assert [s.size for s in pool.layout().segments] == [8 * MiB, 32 * MiB, 60 * MiB]
    assert pool.reserved == 100 * MiB
    add = MindSporePool(capacity=GiB, increase_size=8 * MiB, grow="add")
    add.malloc(20 * MiB)
    assert add.reserved == 24 * MiB


def test_oom_records_fragmentation_and_capacity():
    pool = MindSporePool(capacity=64 * MiB, increase_size=64 * MiB)
    addrs = [pool.malloc(8 * MiB) for _ in range(8)]
    for a in addrs[::2]:
        pool.free(a)
    assert pool.malloc(16 * MiB) is None        # 32 MiB free, but in 8 MiB pieces
    oom = pool.ooms[-1]
    assert (oom.size, oom.free_total, oom.largest_free, oom.kind) == (16 * MiB, 32 * MiB, 8 * MiB, "fragmentation")
    assert pool.malloc(40 * MiB) is None
    assert pool.ooms[-1].kind == "capacity"
    assert pool.malloc(8 * MiB) is not None     # the pool still works after OOMs


def test_persistent_and_common_are_separate_allocators():
    pool = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    w = pool.malloc(MiB, pool="persistent")
    x = pool.malloc(MiB)
    pools = {s.pool for s in pool.layout().segments}
    assert pools == {"persistent", "common"}
    seg_of = {b.addr: s.pool for s in pool.layout().segments for b in s.blocks}
    assert (seg_of[w], seg_of[x]) == ("persistent", "common")


def test_persistent_overflow_goes_to_common_and_common_borrows_persistent():
    pool2 = MindSporePool(capacity=64 * MiB, increase_size=32 * MiB)
    pool2.malloc(MiB, pool="persistent")
    p = pool2.malloc(31 * MiB + 512 * 1024, pool="persistent")   # does not fit in persistent remainder
    seg_of = {b.addr: s.pool for s in pool2.layout().segments for b in s.blocks}
    assert seg_of[p] == "common"                 # served by the common allocator's new block
    pool3 = MindSporePool(capacity=64 * MiB, increase_size=32 * MiB)
    pool3.malloc(MiB, pool="persistent")         # persistent: 32 MiB, 31 MiB idle
    pool3.malloc(32 * MiB)                       # common: the other 32 MiB
    q = pool3.malloc(16 * MiB)                   # common cannot grow: borrows persistent
    seg_of = {b.addr: s.pool for s in pool3.layout().segments for b in s.blocks}
    assert seg_of[q] == "persistent"


def test_streams_have_their_own_blocks():
    pool = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    pool.malloc(MiB, stream=0); pool.malloc(MiB, stream=1)
    assert sorted(s.stream for s in pool.layout().segments) == [0, 1]


def test_init_size_splits_between_persistent_and_common():
    pool = MindSporePool(capacity=GiB, init_size=512 * MiB)
    assert sorted((s.pool, s.size) for s in pool.layout().segments) == [("common", 256 * MiB), ("persistent", 256 * MiB)]
    pre = MindSporePool(capacity=GiB, pregrow=True)
    assert pre.reserved == GiB and len(pre.layout().segments) == 2
    assert pre.malloc(600 * MiB) is None         # no single block holds it: a pre-grown pool is two halves


def test_idle_blocks_stay_until_empty_cache():
    pool = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    a = pool.malloc(MiB); b = pool.malloc(20 * MiB)
    pool.free(b)
    assert pool.reserved == 16 * MiB + 32 * MiB
    pool.empty_cache()
    assert pool.reserved == 16 * MiB              # the block still holding `a` stays
    pool.free(a); pool.empty_cache()
    assert pool.reserved == 0


def test_restore_round_trip_and_continue():
    pool = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    addrs = [pool.malloc(s) for s in (MiB, 3 * MiB, 2 * MiB, 20 * MiB)]
    pool.free(addrs[1])
    before = pool.layout()
    again = MindSporePool(capacity=GiB, increase_size=16 * MiB)
    again.restore(before)
    assert again.layout() == before
    assert again.malloc(3 * MiB) == addrs[1]      # the same best fit as the original would make
    check_invariants(again, {addrs[0]: MiB, addrs[1]: 3 * MiB, addrs[2]: 2 * MiB, addrs[3]: 20 * MiB})


def test_restore_merges_free_ranges_and_gaps():
    layout = Layout([Segment(0, 4096, [Block(0, 512, True), Block(512, 512, False), Block(1024, 1024, False)])])
    pool = MindSporePool()
    pool.restore(layout)
    assert [(b.size, b.live) for b in pool.layout().blocks()] == [(512, True), (3584, False)]


def test_registry_and_replay():
    trace = Trace([Event("alloc", id=1, size=4096), Event("alloc", id=2, size=MiB, pool="persistent"),
                   Event("free", id=1), Event("alloc", id=3, size=100)])
    for name in ("mindspore", "mindspore-vmm"):
        result = replay(trace, create(name, capacity=GiB), sample_every=0)
        assert result.allocs == 3 and not result.ooms
        assert result.final_allocated == MiB + 512


# --- MindSporeVMMPool ------------------------------------------------------------------------------
def test_vmm_maps_2mib_chunks_on_demand():
    pool = MindSporeVMMPool(capacity=GiB)
    a = pool.malloc(3 * MiB)
    assert pool.reserved == 2 * CHUNK
    b = pool.malloc(MiB)                          # inside the second, already mapped chunk
    assert pool.reserved == 2 * CHUNK and b == a + 3 * MiB
    pool.free(a)
    assert pool.reserved == 2 * CHUNK             # idle memory stays mapped until eager free
    pool.defrag()
    assert pool.reserved == CHUNK                 # the chunk wholly idle is unmapped
    check_invariants(pool, {b: MiB})


def test_vmm_serves_what_fragments_the_plain_pool():
    def pattern(model):
        addrs = [model.malloc(8 * MiB) for _ in range(8)]
        for a in addrs[::2]:
            model.free(a)
        return model.malloc(16 * MiB)
    plain = MindSporePool(capacity=64 * MiB, increase_size=64 * MiB)
    vmm = MindSporeVMMPool(capacity=64 * MiB)
    assert pattern(plain) is None
    assert pattern(vmm) is not None               # idle chunks unmapped, a fresh virtual range backed
    assert vmm.reserved <= 64 * MiB and not vmm.ooms


def test_vmm_largest_free_counts_backable_virtual_range():
    pool = MindSporeVMMPool(capacity=64 * MiB)
    a = pool.malloc(8 * MiB)
    assert measure(pool.layout()).largest_free == 0       # nothing mapped is free
    assert pool.largest_free() == 56 * MiB                # but 56 MiB could be backed
    assert pool.malloc(56 * MiB) is not None and pool.malloc(512) is None
    assert pool.ooms[-1].largest_free == 0
    pool.free(a)


def test_vmm_oom_when_physical_memory_is_exhausted():
    pool = MindSporeVMMPool(capacity=16 * MiB)
    assert pool.malloc(10 * MiB) is not None
    assert pool.malloc(8 * MiB) is None
    oom = pool.ooms[-1]
    assert oom.kind == "capacity" and oom.size == 8 * MiB


@settings(max_examples=30, deadline=None)
@given(ops=ops_strategy())
def test_vmm_restore_round_trip(ops):
    model = MindSporeVMMPool(capacity=256 * MiB)
    live = apply_ops(model, ops)
    before = model.layout()
    again = MindSporeVMMPool(capacity=256 * MiB)
    again.restore(before)
    assert again.layout() == before
    check_invariants(again, live)
    _vmm_buffers_are_merged(again)
    addr = again.malloc(MiB)
    if addr is not None:
        live[addr] = MiB
    check_invariants(again, live)


def test_vmm_restore_rejects_unaligned_segments():
    with pytest.raises(ValueError, match="2 MiB"):
        MindSporeVMMPool().restore(Layout([Segment(4096, CHUNK, [Block(4096, CHUNK, False)])]))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 8)), max_size=30),
       probe=st.tuples(st.integers(0, 50), st.integers(0, 10)))
def test_vmm_chunk_set_behaves_like_a_set(ops, probe):
    """The VMM model's mapped chunks are runs, not one entry per chunk; they must act as a set."""
    from ms_memopt.allocators.mindspore_vmm import ChunkSet

    chunks, ref = ChunkSet(), set()
    for add, first, length in ops:
        if add:
            chunks.add(first, first + length)
            ref.update(range(first, first + length))
        else:
            chunks.remove(first, first + length)
            ref.difference_update(range(first, first + length))
        assert len(chunks) == len(ref)
        assert all(e < s for e, s in zip(chunks.ends, chunks.starts[1:]))      # disjoint, not touching
    assert [c for c in range(-2, 52) if c in chunks] == sorted(ref)
    first, length = probe
    assert chunks.covered(first, first + length) == len(ref & set(range(first, first + length)))


def test_vmm_huge_request_is_one_run():
    """A 1 PiB request on an unbounded VMM pool maps one run: fast, and small in memory."""
    model = MindSporeVMMPool()
    addr = model.malloc(1 << 50)
    assert addr is not None and model.reserved >= 1 << 50 and len(model._mapped.starts) == 1
    model.free(addr)
    model.empty_cache()
    assert model.reserved == 0
