"""The Arena executor: bytes survive compaction, pinned handles stay, failures are safe."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.analysis.arena import Arena, ArenaFull, NumpyBackend
from ms_memopt.analysis.compaction import plan_compaction


def _fill(arena: Arena, handle, seed: int) -> int:
    data = np.random.default_rng(seed).integers(0, 256, handle.nbytes, dtype=np.uint8)
    arena.view(handle).view(np.uint8).reshape(-1)[:] = data
    return zlib.crc32(data.tobytes())


def _check(arena: Arena, sums: dict) -> None:
    for handle, crc in sums.items():
        assert zlib.crc32(arena.read(handle).tobytes()) == crc, f"handle {handle.id} corrupted"
    arena.layout().check()


class _FailingBackend(NumpyBackend):
    """Raises on the ``fail_at``-th move, before touching memory."""

    def __init__(self, capacity: int, fail_at: int) -> None:
        super().__init__(capacity)
        self.fail_at = fail_at
        self.calls = 0

    def move(self, src: int, dst: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected device error")
        super().move(src, dst, nbytes)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "compact", "pin"]),
                         st.integers(1, 700), st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([1, 8, 64]))
def test_random_sequences_keep_every_handle_intact(sequence, alignment):
    arena = Arena(8192, alignment=alignment)
    sums: dict = {}
    for op, size, seed in sequence:
        live = list(sums)
        if op == "alloc":
            try:
                handle = arena.alloc(size)
            except ArenaFull:
                continue
            sums[handle] = _fill(arena, handle, seed)
        elif op == "free" and live:
            handle = live[seed % len(live)]
            arena.free(handle)
            del sums[handle]
        elif op == "pin" and live:
            handle = live[seed % len(live)]
            arena.pin(handle, not handle.pinned)
        elif op == "compact":
            pinned_at = {h: h.offset for h in live if h.pinned}
            bound = [None, size * 8, None][seed % 3]
            target = size * 4 if seed % 3 == 2 else None
            reachable = plan_compaction(arena.layout()).after.largest_free
            report = arena.compact(max_bytes=bound, target_largest_free=target)
            assert bound is None or report.bytes_moved <= bound
            assert target is None or report.largest_free_after >= min(target, reachable)
            assert all(h.offset == off for h, off in pinned_at.items())
            assert report.largest_free_after >= report.largest_free_before
            if bound is None and target is None and not pinned_at and sums:
                assert max(h.offset + h.span for h in sums) == arena.allocated
        _check(arena, sums)
    assert arena.free_total + sum(h.span for h in sums) == arena.capacity


def _fragmented(backend=None, count=40, seed=1):
    arena = Arena(64 * 1024, alignment=64, backend=backend)
    rng = np.random.default_rng(seed)
    handles = [arena.alloc(int(rng.integers(1, 1500))) for _ in range(count)]
    sums = {h: _fill(arena, h, i) for i, h in enumerate(handles)}
    for h in handles[::3] + handles[1::5]:
        if h in sums:
            arena.free(h)
            del sums[h]
    return arena, sums


@pytest.mark.parametrize("fail_at", [1, 2, 5, 9])
def test_backend_failure_mid_compaction_leaves_handles_correct(fail_at):
    arena, sums = _fragmented(_FailingBackend(64 * 1024, fail_at))
    before = arena.largest_free
    with pytest.raises(RuntimeError, match="injected"):
        arena.compact()
    _check(arena, sums)
    assert arena.generation == 1
    # the arena stays usable: the next compaction finishes the job
    report = arena.compact()
    _check(arena, sums)
    assert report.largest_free_after == arena.free_total > before


@pytest.mark.parametrize("fail_after", [0, 3, 7])
def test_exception_between_runs_leaves_handles_correct(fail_after):
    arena, sums = _fragmented()

    def boom(index, total):
        if index == fail_after:
            raise KeyboardInterrupt("injected")

    arena.after_run = boom
    with pytest.raises(KeyboardInterrupt):
        arena.compact()
    _check(arena, sums)
    arena.after_run = None
    arena.compact()
    _check(arena, sums)
    extra = arena.alloc(arena.free_total)   # all free space is one hole now
    assert extra.offset == arena.allocated - extra.span


def test_pinned_handle_never_moves_and_splits_the_arena():
    arena = Arena(4096, alignment=64)
    a, b, c, d = (arena.alloc(256) for _ in range(4))
    sums = {h: _fill(arena, h, i) for i, h in enumerate((b, c, d))}
    arena.pin(c)
    arena.free(a)
    report = arena.compact()
    assert (b.offset, c.offset, d.offset) == (0, 512, 768)
    assert report.moves == 1
    _check(arena, sums)


def test_overlapping_run_moves_like_memmove():
    arena = Arena(1 << 16, alignment=64)
    gap = arena.alloc(64)
    big = arena.alloc(30000)       # moves down by 64 bytes: source and destination overlap
    crc = _fill(arena, big, 3)
    arena.free(gap)
    report = arena.compact()
    assert big.offset == 0 and report.runs == 1 and report.bytes_moved == big.span
    assert zlib.crc32(arena.read(big).tobytes()) == crc


def test_adjacent_blocks_move_as_one_run():
    arena = Arena(1 << 16, alignment=64)
    gap = arena.alloc(640)
    blocks = [arena.alloc(100) for _ in range(10)]
    sums = {h: _fill(arena, h, i) for i, h in enumerate(blocks)}
    arena.free(gap)
    report = arena.compact()
    assert report.moves == 10 and report.runs == 1
    _check(arena, sums)


def test_views_dtypes_and_shapes():
    arena = Arena(4096)
    pad = arena.alloc(100)
    x = arena.alloc(shape=(3, 4), dtype="float32", tag="weight")
    arena.view(x)[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    arena.free(pad)
    arena.compact()
    assert arena.view(x).shape == (3, 4) and arena.view(x).dtype == np.float32
    assert np.array_equal(arena.view(x), np.arange(12, dtype=np.float32).reshape(3, 4))
    with pytest.raises(ValueError):
        arena.alloc(10, dtype="float32")
    arena.free(x)
    with pytest.raises(KeyError):
        arena.view(x)
    with pytest.raises(KeyError):
        arena.free(x)


def test_target_largest_free_and_layout_agree_with_planner():
    arena, sums = _fragmented(count=60, seed=7)
    layout = arena.layout()
    target = arena.largest_free + 4096
    plan = plan_compaction(layout, target_largest_free=target)
    report = arena.compact(target_largest_free=target)
    _check(arena, sums)
    assert report.bytes_moved == plan.bytes_moved
    assert report.largest_free_after == plan.after.largest_free >= target
    assert report.stopped_by == "target_largest_free"
    assert {b.id: b.addr for b in arena.layout().live_blocks()} == {b.id: b.addr for b in plan.layout.live_blocks()}


def test_full_arena_raises():
    arena = Arena(1024)
    arena.alloc(1000)
    with pytest.raises(ArenaFull):
        arena.alloc(100)
