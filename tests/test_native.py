"""ms_memopt.native against its pure-Python references: identical bytes, identical numbers."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"ms_memopt.native is unavailable: {native.unavailable_reason()}")


def test_library_is_built_where_ci_installs_the_package():
    if os.environ.get("CI") != "true":
        pytest.skip("only CI promises a fresh `pip install` with a C compiler")
    assert native.available()


def _reference_moves(buf: np.ndarray, runs) -> None:
    for src, dst, size in runs:
        buf[dst:dst + size] = buf[src:src + size].copy()   # memmove semantics


runs_strategy = st.lists(st.tuples(st.integers(0, 40000), st.integers(0, 40000), st.integers(0, 20000)),
                         min_size=1, max_size=12)


@needs_native
@settings(max_examples=200, deadline=None)
@given(runs_strategy, st.booleans())
def test_move_runs_equals_memmove_run_by_run(runs, stream):
    """Any runs, any overlap, any alignment, streamed or not: the bytes of run-by-run memmove."""
    buf = np.random.default_rng(len(runs)).integers(0, 256, 60000, dtype=np.uint8)
    expected = buf.copy()
    _reference_moves(expected, runs)
    src, dst, size = (np.array(column, dtype=np.int64) for column in zip(*runs))
    moved = native.move_runs(buf.ctypes.data, src, dst, size, stream=stream)
    assert moved == int(size.sum())
    np.testing.assert_array_equal(buf, expected)


@needs_native
def test_streamed_slide_of_a_large_buffer_is_byte_exact():
    """A slide toward offset 0 as compaction makes it (runs overlapping their own source,
    shifts smaller than a cache line included), past the streaming threshold."""
    rng = np.random.default_rng(0)
    n = native.STREAM_TOTAL_BYTES + (1 << 20)
    buf = rng.integers(0, 256, n, dtype=np.uint8)
    sizes = rng.integers(4096, 300_000, 600)
    holes = rng.integers(1, 5000, 600)
    src, dst, cursor, target = [], [], 0, 0
    for size, hole in zip(sizes.tolist(), holes.tolist()):
        cursor += hole
        if cursor + size > n:
            break
        src.append(cursor)
        dst.append(target)
        cursor += size
        target += size
    runs = list(zip(src, dst, sizes[:len(src)].tolist()))
    expected = buf.copy()
    _reference_moves(expected, runs)
    native.move_runs(buf.ctypes.data, np.array(src), np.array(dst), sizes[:len(src)])
    np.testing.assert_array_equal(buf, expected)


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arena_compaction_in_one_call_equals_run_by_run(seed):
    """Arena.compact() takes the one-call path unless a hook watches between runs; both paths
    leave the same buffer and the same offsets."""
    from ms_memopt.analysis.arena import Arena, ArenaFull

    arenas = [Arena(1 << 20), Arena(1 << 20)]
    arenas[1].after_run = lambda index, runs: None          # forces the run-by-run loop
    for arena in arenas:
        rng = np.random.default_rng(seed)
        arena.backend.buffer[:] = rng.integers(0, 256, arena.capacity, dtype=np.uint8)
        handles = []
        while True:
            try:
                handles.append(arena.alloc(int(rng.integers(1, 9000))))
            except ArenaFull:
                break
        for handle in handles:
            if rng.random() < 0.5:
                arena.free(handle)
    reports = [arena.compact() for arena in arenas]
    assert reports[0].runs == reports[1].runs > 1
    np.testing.assert_array_equal(arenas[0].backend.buffer, arenas[1].backend.buffer)
    assert [h.offset for h in arenas[0].handles()] == [h.offset for h in arenas[1].handles()]


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=5), st.integers(0, 2**32 - 1),
       st.floats(0, 0.1), st.floats(1e-5, 1e-1), st.floats(0.0, 0.99), st.floats(0.0, 0.9999),
       st.floats(1e-8, 1e-3))
def test_adamw_equals_the_numpy_reference_bit_for_bit(lengths, seed, wd, lr, beta1, beta2, eps):
    """Several float32 pieces (lengths around the 8-lane vector width, tails included), three steps."""
    rng = np.random.default_rng(seed)
    pieces = [[rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32),
               rng.random(n).astype(np.float32)] for n in lengths]          # w, m, v >= 0
    expected = [[a.copy() for a in piece] for piece in pieces]
    for t in range(3):
        grads = [rng.standard_normal(n).astype(np.float32) for n in lengths]
        step = lr * np.sqrt(1 - beta2 ** (t + 1)) / (1 - beta1 ** (t + 1)) if beta1 ** (t + 1) < 1 else lr
        for (w, m, v), g in zip(expected, grads):
            native.adamw_reference(w, m, v, g, lr * wd, step, beta1, beta2, eps)
        columns = [[piece[i].ctypes.data for piece in pieces] for i in range(3)]
        native.adamw(*columns, [g.ctypes.data for g in grads], lengths,
                     np.full(len(lengths), lr * wd), np.full(len(lengths), step), beta1, beta2, eps)
    for got, want in zip(pieces, expected):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def _bits16(values: np.ndarray, kind: int) -> np.ndarray:
    return values.astype(np.float16).view(np.uint16) if kind == native.FLOAT16 else native.round_bfloat16(values)


def _widen16(bits: np.ndarray, kind: int) -> np.ndarray:
    if kind == native.FLOAT16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


@needs_native
@pytest.mark.parametrize("kind", [1, 2])
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_adamw_16_bit_pieces_update_the_master_and_write_the_parameter_once(kind, lengths, seed):
    """float16/bfloat16 pieces: the float32 master, m and v as the float32 reference with the
    gradient widened; the parameter = the new master rounded to nearest even."""
    rng = np.random.default_rng(seed)
    masters = [rng.standard_normal(n).astype(np.float32) for n in lengths]
    moments = [[rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32)] for n in lengths]
    grads = [_bits16(rng.standard_normal(n).astype(np.float32), kind) for n in lengths]
    params = [np.zeros(n, np.uint16) for n in lengths]
    expected = [(w.copy(), m.copy(), v.copy()) for w, (m, v) in zip(masters, moments)]
    for (w, m, v), g in zip(expected, grads):
        native.adamw_reference(w, m, v, _widen16(g, kind), 1e-3, 2e-3, 0.9, 0.999, 1e-6)
    count = len(lengths)
    native.adamw([w.ctypes.data for w in masters], [m.ctypes.data for m, _ in moments],
                 [v.ctypes.data for _, v in moments], [g.ctypes.data for g in grads], lengths,
                 np.full(count, 1e-3), np.full(count, 2e-3), 0.9, 0.999, 1e-6,
                 out=[p.ctypes.data for p in params], kind=np.full(count, kind))
    for w, (m, v), p, (w_ref, m_ref, v_ref) in zip(masters, moments, params, expected):
        np.testing.assert_array_equal(w, w_ref)
        np.testing.assert_array_equal(m, m_ref)
        np.testing.assert_array_equal(v, v_ref)
        np.testing.assert_array_equal(p, _bits16(w_ref, kind))


@needs_native
@pytest.mark.parametrize("kind", [1, 2])
def test_16_bit_conversions_match_numpy_on_every_half_and_edge_values(kind):
    """Widening: all 65,536 16-bit patterns (read back through m with beta1 = 0, m = 0).
    Rounding: zeros, subnormals, the overflow edge, infinities, NaN and random bit patterns
    (written as the parameter with decay = step = 0: the parameter is the master rounded)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    n = len(bits)
    m, v, w, out = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.uint16)
    native.adamw([w.ctypes.data], [m.ctypes.data], [v.ctypes.data], [bits.ctypes.data], [n], [0.0], [0.0],
                 0.0, 0.0, 1.0, out=[out.ctypes.data], kind=[kind])
    widened = _widen16(bits, kind)
    nan = np.isnan(widened)
    np.testing.assert_array_equal(np.isnan(m), nan)
    np.testing.assert_array_equal(m[~nan], widened[~nan])

    rng = np.random.default_rng(kind)
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65519.996, 65520.0, 1e5, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5,
                        6.09e-5, 1e-40, np.inf, -np.inf, np.nan, 3.3895314e38], np.float32)
    values = np.concatenate([special, rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    n = len(values)
    w, m, v, g, out = values.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    native.adamw([w.ctypes.data], [m.ctypes.data], [v.ctypes.data], [g.ctypes.data], [n], [0.0], [0.0],
                 0.9, 0.999, 1.0, out=[out.ctypes.data], kind=[kind])
    finite = np.isfinite(values)
    np.testing.assert_array_equal(w[finite], values[finite])   # (-0.0 becomes +0.0; inf - 0 * inf is NaN)
    nan = np.isnan(w)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _bits16(w, kind)
    np.testing.assert_array_equal(out[~nan], expected[~nan])
    assert np.isnan(_widen16(out[nan], kind)).all()
