"""What the MindSpore models count for the time model (ms_memopt.simulation.timing): requests on the
slow path (``slow_path_events``) and idle blocks given back to the device (``segment_frees``),
on small hand-made request sequences, pure-Python and compiled alike (MindSpore 2.10's
``AbstractDynamicMemPool::AllocMemBuf`` and ``MemBufAllocator::ReleaseFreeBlocks``; the rules
are in the models' module docstrings)."""
from __future__ import annotations

import pytest

from ms_memopt.allocators import create
from ms_memopt.allocators import fast

MiB = 2**20

# (fast?) pairs: the compiled models only where they are built
FAST = [False] + ([True] if fast.FAST_MODELS else [])
BEST_FIT = ["mindspore", "mindspore-bestfit"]


def _pool(name: str, use_fast: bool, **options):
    model = create(name, fast=use_fast, **options)
    assert (type(model) is fast.FAST_MODELS.get(name)) == use_fast
    return model


@pytest.mark.parametrize("use_fast", FAST)
@pytest.mark.parametrize("name", BEST_FIT)
def test_empty_cache_counts_each_idle_block_given_back(name, use_fast):
    """ReleaseFreeBlocks: every block that is one idle buffer goes back (one count each); a
    block still holding a live buffer stays and counts nothing."""
    pool = _pool(name, use_fast, capacity=256 * MiB, increase_size=16 * MiB)
    a = pool.malloc(10 * MiB)                 # block 1 (16 MiB)
    b = pool.malloc(10 * MiB)                 # block 2
    c = pool.malloc(10 * MiB)                 # block 3
    assert pool.segment_allocs == 3 and pool.segment_frees == 0
    pool.free(a)
    pool.free(c)
    pool.empty_cache()
    assert pool.segment_frees == 2
    assert pool.reserved == 16 * MiB
    pool.empty_cache()                        # nothing idle left: nothing more
    assert pool.segment_frees == 2
    pool.free(b)
    pool.empty_cache()
    assert (pool.segment_frees, pool.reserved) == (3, 0)


@pytest.mark.parametrize("use_fast", FAST)
@pytest.mark.parametrize("name", BEST_FIT)
def test_a_recorded_segment_free_counts_when_the_block_is_idle(name, use_fast):
    pool = _pool(name, use_fast, capacity=256 * MiB, increase_size=16 * MiB)
    a = pool.malloc(MiB)
    base = pool.layout().segments[0].addr
    pool.release_segment(base, 16 * MiB)      # a is live there: kept
    assert pool.segment_frees == 0
    pool.free(a)
    pool.release_segment(base, 16 * MiB)
    assert (pool.segment_frees, pool.reserved) == (1, 0)


@pytest.mark.parametrize("use_fast", FAST)
@pytest.mark.parametrize("name", BEST_FIT)
def test_growth_and_borrowing_are_not_the_slow_path(name, use_fast):
    """Without VMM a first failure grows the pool or borrows from the other allocator; no sync."""
    pool = _pool(name, use_fast, capacity=64 * MiB, increase_size=16 * MiB)
    pool.malloc(12 * MiB)                     # the common allocator's first block (4 MiB idle)
    pool.malloc(14 * MiB, pool="persistent")  # the persistent allocator's first block (2 MiB idle)
    p = pool.malloc(3 * MiB, pool="persistent")   # own try fails -> borrows the common block's
    assert pool.segment_allocs == 2
    assert pool.layout().segments[0].addr <= p < pool.layout().segments[0].end
    pool.malloc(12 * MiB)                     # own try fails -> a new block
    assert pool.segment_allocs == 3
    assert pool.slow_path_events == 0 and not pool.ooms


@pytest.mark.parametrize("use_fast", FAST)
@pytest.mark.parametrize("name", BEST_FIT)
def test_the_sync_and_retry_after_every_other_way_failed_is_one_slow_path_event(name, use_fast):
    """DoSyncAllEvents + one more Malloc once the borrows and the new block failed: one event per
    request; here the retry finds nothing new (frees apply at once), so it is also an OOM."""
    pool = _pool(name, use_fast, capacity=64 * MiB, increase_size=16 * MiB)
    for _ in range(4):
        pool.malloc(16 * MiB)                 # four full 16 MiB blocks: the device is full
    assert pool.malloc(MiB) is None           # common: own, grow, persistent borrow, sync, retry
    assert pool.slow_path_events == 1 and len(pool.ooms) == 1
    assert pool.malloc(MiB, pool="persistent") is None   # persistent: own (grow), common, grow, sync
    assert pool.slow_path_events == 2 and len(pool.ooms) == 2


@pytest.mark.parametrize("use_fast", FAST)
def test_vmm_first_failure_is_the_slow_path_even_when_the_retry_succeeds(use_fast):
    """With VMM a request whose first Malloc fails syncs all streams, sweeps (eager free) and
    retries: one slow-path event and one sweep, though the retry serves it."""
    pool = _pool("mindspore-vmm", use_fast, capacity=64 * MiB)
    a = pool.malloc(30 * MiB)
    pool.malloc(30 * MiB)
    pool.free(a)                              # 30 MiB idle, still mapped; 4 MiB of chunks left
    assert (pool.slow_path_events, pool.eager_frees) == (0, 0)
    assert pool.malloc(32 * MiB) is not None  # first try cannot map 32 MiB; after the sweep it can
    assert (pool.slow_path_events, pool.eager_frees) == (1, 1)
    assert not pool.ooms
    pool.malloc(MiB)                          # fits in what is mapped: no slow path
    assert pool.slow_path_events == 1
    pool.empty_cache()                        # a sweep, not a request: no slow-path event
    assert (pool.slow_path_events, pool.eager_frees) == (1, 2)
    assert pool.segment_frees == 0            # ranges stay; chunks go back through reserved


@pytest.mark.parametrize("use_fast", FAST)
def test_vmm_a_failed_request_is_one_slow_path_event(use_fast):
    pool = _pool("mindspore-vmm", use_fast, capacity=64 * MiB)
    pool.malloc(60 * MiB)
    assert pool.malloc(8 * MiB) is None
    assert pool.slow_path_events == 1 and len(pool.ooms) == 1
