"""Compaction cost: the Arena against numpy's memmove, and live compaction of MindSpore
parameters on CPU.

1. Arena: a >= 1 GiB host arena filled with random 4-100 KiB blocks, every other one freed at
   random (~10,000 live blocks, frag ratio in the hundreds), then ``compact()``. Baselines, in
   the same buffer right after each compaction: one libc memmove (``np.copyto``) of the same
   number of bytes, and one streamed copy of them (``ms_memopt.native.move_runs``, one run).
   ``arena_fraction_of_memmove`` = memmove time / compaction time, median of the per-round
   ratios (spread and best-vs-best beside it); the same fragmentation is compacted again by
   the run-by-run reference loop (the path without the compiled library).
2. Planner: ``plan_compaction`` on the same arena's ``Layout`` (the simulator's path), and its
   effect on synthetic layouts shaped like the field report (printed first).
3. Live: ``live_compact`` of float32 Parameters (default 256 MiB in 64 tensors) on CPU, with and
   without read-back verification -> seconds per GB; plus the extra time of the first training
   step after a compaction in a tiny PyNative job (live_compact calls the public
   ``mindspore.ms_memory_recycle()`` there, so the optimizer's jit graph recompiles).

Usage: python bench/compaction.py [--arena-mib 1024] [--rounds 5] [--live-mib 256]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_memopt import native  # noqa: E402
from ms_memopt.analysis.arena import Arena, ArenaFull  # noqa: E402
from ms_memopt.analysis.compaction import plan_compaction  # noqa: E402
from ms_memopt.core.layout import Block, Layout, Segment  # noqa: E402

GB = 10**9
GiB = 2**30


def _segment(addr: int, items: list[tuple[bool, int, bool]]) -> Segment:
    blocks, cursor = [], addr
    for i, (live, size, pinned) in enumerate(items):
        blocks.append(Block(cursor, size, live, id=(addr + i) if live else None, pinned=pinned))
        cursor += size
    return Segment(addr, cursor - addr, blocks)


def field_report_layout(rng: np.random.Generator, pinned_every: int | None = None) -> Layout:
    """One 96 GB range: 82 GB in 400 tensors, 14 GB free in 9 holes of at most 3 GB."""
    holes = [int(h * GB) for h in (3, 2.5, 2, 2, 1.5, 1, 1, 0.5, 0.5)]
    sizes = (rng.dirichlet(np.ones(400)) * 82 * GB).astype(np.int64)
    after = set(rng.choice(400, len(holes), replace=False).tolist())
    items, k = [], 0
    for i, size in enumerate(sizes.tolist()):
        items.append((True, size, pinned_every is not None and i % pinned_every == 0))
        if i in after:
            items.append((False, holes[k], False))
            k += 1
    return Layout([_segment(0, items)], capacity=96 * GB)


def doubling_pool_layout(rng: np.random.Generator) -> Layout:
    """Segments of 1, 2, ... 32 GiB (a pool grown by doubling), ~70 % of 8-512 MiB blocks live."""
    segments, addr = [], 0
    for k in range(6):
        size, used, items = GiB << k, 0, []
        while used < size:
            block = int(min(rng.integers(8 << 20, 512 << 20), size - used))
            live = bool(rng.random() < 0.7)
            if items and not live and not items[-1][0]:
                items[-1] = (False, items[-1][1] + block, False)
            else:
                items.append((live, block, False))
            used += block
        segments.append(_segment(addr, items))
        addr += size + GiB
    return Layout(segments, capacity=96 * GB)


def planner_examples() -> dict:
    """The planner on synthetic layouts shaped like the field report; sizes in GB."""
    rng = np.random.default_rng(1)
    field = field_report_layout(rng)
    pinned = field_report_layout(rng, pinned_every=25)
    pool = doubling_pool_layout(rng)
    cases = [("field-report shape, one 96 GB range", field, {}),
             ("same, target_largest_free=4.2GB", field, {"target_largest_free": int(4.2 * GB)}),
             ("same, max_bytes=10GB", field, {"max_bytes": 10 * GB}),
             ("field-report shape, every 25th tensor pinned", pinned, {}),
             ("pool of doubling segments 1..32 GiB", pool, {}),
             ("same, evacuate=True", pool, {"evacuate": True})]
    print("planner on example layouts (GB = 1e9 bytes)")
    print(f"{'layout':<46} {'free':>5} {'largest before->after':>22} {'frag before->after':>19} "
          f"{'moved':>6} {'moves':>5} {'released':>8}")
    out = {}
    for name, layout, options in cases:
        t0 = time.perf_counter()
        plan = plan_compaction(layout, **options)
        seconds = time.perf_counter() - t0
        s = plan.summary()
        print(f"{name:<46} {s['free_total_before'] / GB:>5.1f} "
              f"{s['largest_free_before'] / GB:>10.2f} -> {s['largest_free_after'] / GB:>6.2f}    "
              f"{s['frag_ratio_before']:>7.2f} -> {s['frag_ratio_after']:>6.2f}   "
              f"{s['bytes_moved'] / GB:>6.1f} {s['moves']:>5} {s['released_segments']:>8}  ({seconds * 1e3:.0f} ms)")
        out.setdefault("planner_examples", []).append({"layout": name, **s})
    full, target = out["planner_examples"][0], out["planner_examples"][1]
    out["planner_field_full_gb_moved"] = full["bytes_moved"] / GB
    out["planner_field_target_gb_moved"] = target["bytes_moved"] / GB
    print()
    return out


def fragment(arena: Arena, seed: int) -> int:
    """Free everything, fill with random 4-100 KiB blocks, free half of them at random."""
    for h in arena.handles():
        arena.free(h)
    rng = np.random.default_rng(seed)
    handles = []
    while True:
        try:
            handles.append(arena.alloc(int(rng.integers(4 << 10, 100 << 10))))
        except ArenaFull:
            break
    for h, keep in zip(handles, rng.random(len(handles)) < 0.5):
        if not keep:
            arena.free(h)
    return len(arena.handles())


def _timed(fn) -> float:
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def bench_arena(capacity: int, rounds: int) -> dict:
    """Per round: fragment, compact (the default path), then in the same buffer one libc
    memmove (``np.copyto``) and one streamed copy (``native.move_runs``, one run) of the same
    number of bytes; then the same fragmentation again, compacted by the run-by-run reference
    loop (``ctypes.memmove`` per run, the path taken without the compiled library)."""
    arena = Arena(capacity)
    arena.backend.buffer[:] = 7            # touch every page before timing
    buf = arena.backend.buffer
    base = buf.ctypes.data
    rows = []
    for r in range(rounds):
        live = fragment(arena, seed=r)
        frag_before = arena.frag_ratio()
        t0 = time.perf_counter()
        plan = plan_compaction(arena.layout())
        planner_s = time.perf_counter() - t0
        report = arena.compact()
        n = report.bytes_moved
        memmove_s = _timed(lambda: np.copyto(buf[:n], buf[capacity - n:]))
        streamed_s = (_timed(lambda: native.move_runs(base, np.array([capacity - n]), np.array([0]),
                                                      np.array([n]), stream=True))
                      if native.available() else float("nan"))
        fragment(arena, seed=r)
        arena.backend.move_runs = lambda *runs: False      # the run-by-run reference loop
        reference = arena.compact()
        del arena.backend.move_runs
        assert plan.bytes_moved == n == reference.bytes_moved
        rows.append({"live_blocks": live, "frag_before": frag_before, "frag_after": report.frag_ratio_after,
                     "bytes_moved": n, "runs": report.runs, "arena_s": report.seconds,
                     "arena_plan_s": report.plan_seconds, "memmove_s": memmove_s, "streamed_s": streamed_s,
                     "reference_s": reference.seconds, "layout_planner_s": planner_s})
    print(f"{'round':>5} {'live':>6} {'frag before':>11} {'after':>5} {'moved MiB':>9} {'runs':>5} "
          f"{'arena ms':>8} {'(plan)':>6} {'memmove ms':>10} {'streamed ms':>11} {'ratio':>5} "
          f"{'vs streamed':>11} {'ref. loop ms':>12} {'Layout planner ms':>17}")
    for i, row in enumerate(rows):
        print(f"{i:>5} {row['live_blocks']:>6} {row['frag_before']:>11.1f} {row['frag_after']:>5.1f} "
              f"{row['bytes_moved'] / 2**20:>9.1f} {row['runs']:>5} {row['arena_s'] * 1e3:>8.1f} "
              f"{row['arena_plan_s'] * 1e3:>6.1f} {row['memmove_s'] * 1e3:>10.1f} {row['streamed_s'] * 1e3:>11.1f} "
              f"{row['memmove_s'] / row['arena_s']:>5.2f} {row['streamed_s'] / row['arena_s']:>11.2f} "
              f"{row['reference_s'] * 1e3:>12.1f} {row['layout_planner_s'] * 1e3:>17.1f}")
    best_arena = min(rows, key=lambda row: row["arena_s"])
    best_memmove = min(row["memmove_s"] for row in rows)
    ratios = [row["memmove_s"] / row["arena_s"] for row in rows]
    vs_streamed = [row["streamed_s"] / row["arena_s"] for row in rows]
    reference = [row["memmove_s"] / row["reference_s"] for row in rows]
    return {
        "arena_bytes": capacity,
        "native": native.available(),
        "arena_live_blocks": int(statistics.median(row["live_blocks"] for row in rows)),
        "arena_bytes_moved": best_arena["bytes_moved"],
        "arena_runs": int(statistics.median(row["runs"] for row in rows)),
        "arena_fraction_of_memmove": statistics.median(ratios),
        "arena_fraction_of_memmove_spread": [min(ratios), max(ratios)],
        "arena_fraction_of_memmove_best": best_memmove / best_arena["arena_s"],
        "arena_fraction_of_streamed_copy": statistics.median(vs_streamed),
        "arena_reference_loop_fraction_of_memmove": statistics.median(reference),
        "arena_gb_per_s": best_arena["bytes_moved"] / best_arena["arena_s"] / 1e9,
        "memmove_gb_per_s": best_arena["bytes_moved"] / best_memmove / 1e9,
        "arena_plan_seconds_median": statistics.median(row["arena_plan_s"] for row in rows),
        "arena_frag_before": best_arena["frag_before"],
        "arena_frag_after": best_arena["frag_after"],
        "layout_planner_seconds": min(row["layout_planner_s"] for row in rows),
    }


def bench_live(total: int, count: int, rounds: int) -> dict:
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn

    from ms_memopt.mindspore.compaction import live_compact, long_lived_tensors

    per = total // count // 4
    rng = np.random.default_rng(0)
    params = [Parameter(Tensor(rng.standard_normal(per).astype(np.float32)), name=f"p{i}") for i in range(count)]
    nbytes = sum(p.asnumpy().nbytes for p in params)
    verified, unverified = [], []
    for _ in range(rounds):
        verified.append(live_compact(params, verify=True).seconds)
        unverified.append(live_compact(params, verify=False).seconds)

    # first step after a compaction in a tiny PyNative job: the optimizer graph recompiles
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    x, y = Tensor(np.ones((8, 16), np.float32)), Tensor(np.ones((8, 4), np.float32))
    for _ in range(3):
        train(x, y)
    t0 = time.perf_counter()
    train(x, y)
    normal = time.perf_counter() - t0
    live_compact(long_lived_tensors(train, opt))
    t0 = time.perf_counter()
    train(x, y)
    after = time.perf_counter() - t0

    gb = nbytes / 1e9
    print(f"\nlive compaction of {count} float32 Parameters, {nbytes / 2**20:.0f} MiB, best of {rounds}:")
    print(f"  with read-back verification   {min(verified):.3f} s  ({min(verified) / gb:.3f} s/GB)")
    print(f"  without verification          {min(unverified):.3f} s  ({min(unverified) / gb:.3f} s/GB)")
    print(f"  tiny job: normal step {normal * 1e3:.1f} ms, first step after compaction {after * 1e3:.1f} ms "
          f"(optimizer graph recompiles)")
    return {
        "live_bytes": nbytes,
        "live_seconds_per_gb": min(verified) / gb,
        "live_seconds_per_gb_unverified": min(unverified) / gb,
        "live_recompile_seconds": max(after - normal, 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--live-mib", type=int, default=256)
    parser.add_argument("--live-tensors", type=int, default=64)
    parser.add_argument("--no-live", action="store_true", help="skip the MindSpore part")
    args = parser.parse_args()
    examples = planner_examples()
    print(f"arena compaction, {args.arena_mib} MiB host arena, {args.rounds} rounds")
    figures = bench_arena(args.arena_mib << 20, args.rounds)
    low, high = figures["arena_fraction_of_memmove_spread"]
    print(f"\narena compaction throughput = {figures['arena_fraction_of_memmove']:.2f} x libc memmove of the "
          f"same bytes (median of {args.rounds} per-round ratios, {low:.2f}-{high:.2f}; best vs best "
          f"{figures['arena_fraction_of_memmove_best']:.2f}); {figures['arena_fraction_of_streamed_copy']:.2f} x "
          f"one streamed copy of the same bytes; run-by-run reference loop "
          f"{figures['arena_reference_loop_fraction_of_memmove']:.2f} x memmove; compiled path "
          f"{'on' if figures['native'] else 'OFF (library not built)'}; Layout planner on the same arena: "
          f"{figures['layout_planner_seconds'] * 1e3:.0f} ms")
    if not args.no_live:
        figures.update(bench_live(args.live_mib << 20, args.live_tensors, args.rounds))
    figures["planner_field_full_gb_moved"] = examples["planner_field_full_gb_moved"]
    figures["planner_field_target_gb_moved"] = examples["planner_field_target_gb_moved"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
