"""The compiled fast path (ms_memopt.allocators.fast) against the pure-Python reference models:
identical addresses, OOMs, counters and layouts on random traces (hypothesis) and on every
recorded trace (the committed fixtures, the shared PyTorch snapshots and placement instances)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.allocators import create
from ms_memopt.allocators import fast
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.replay.replay import replay
from ms_memopt.io.traces import load_trace

_NOT_BUILT = ("the compiled fast path is not built, or stale (a StaleBuildWarning says so: a .c or .h of "
              "ms_memopt/allocators/fast changed "
              "since the build; `pip install -e .` / `make setup` builds it with gcc)")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler here: the pure-Python models run")
def test_the_fast_path_is_built_where_a_compiler_is():
    """With gcc present the build must have worked: a C error would otherwise only show as the
    skipped tests below (the optional build keeps installs without a compiler working)."""
    assert fast.FAST_MODELS, _NOT_BUILT


needs_fast = pytest.mark.skipif(not fast.FAST_MODELS, reason=_NOT_BUILT)

MiB = 2**20
ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parents[1] / "shared" / "data"
# every committed fixture that is an event trace (a pool debug dump is a layout, not a trace)
FIXTURES = sorted(p for p in (ROOT / "data").rglob("*")
                  if p.is_file() and p.name != "README.md" and not p.name.startswith("MemoryDebugInfo"))
SHARED_TRACES = sorted(p for p in SHARED.rglob("*") if p.suffix in (".pickle", ".csv")) if SHARED.exists() else []

# (model name, options): every option the fast models take, small capacities so OOMs happen
CONFIGS = [
    ("mindspore", dict(capacity=256 * MiB, increase_size=16 * MiB)),
    ("mindspore", dict(capacity=256 * MiB, increase_size=16 * MiB, pregrow=True)),
    ("mindspore", dict(capacity=200 * MiB, increase_size=8 * MiB, grow="add", small_pool=True)),
    ("mindspore", dict(increase_size=8 * MiB, init_size=40 * MiB)),
    ("mindspore-bestfit", dict(capacity=256 * MiB, increase_size=16 * MiB)),
    ("mindspore-bestfit", dict(capacity=256 * MiB, increase_size=16 * MiB, pregrow=True, small_pool=True)),
    ("torch", dict(capacity=256 * MiB)),
    ("torch", dict(capacity=200 * MiB, roundup_power2_divisions=4)),
    ("torch", dict(roundup_power2_divisions=1)),
    # max_split_size_mb's oversize rules and release, garbage collection's passes by age
    ("torch", dict(capacity=256 * MiB, max_split_size_mb=21)),
    ("torch", dict(capacity=200 * MiB, max_split_size_mb=64, roundup_power2_divisions=4)),
    ("torch", dict(max_split_size_mb=32)),
    ("torch", dict(capacity=256 * MiB, garbage_collection_threshold=0.6)),
    ("torch", dict(capacity=160 * MiB, garbage_collection_threshold=0.3, max_split_size_mb=24)),
    ("torch-npu", dict(capacity=256 * MiB, max_split_size_mb=21, garbage_collection_threshold=0.8)),
    ("torch-npu", dict(capacity=256 * MiB, garbage_collection_threshold=0.5, page_size_1g=True)),
    ("torch-expandable", dict(capacity=256 * MiB)),
    ("torch-expandable", dict(capacity=160 * MiB, roundup_power2_divisions=2)),
    ("torch-expandable", dict()),
    ("mindspore-vmm", dict(capacity=256 * MiB)),
    ("mindspore-vmm", dict(capacity=96 * MiB)),
    ("mindspore-vmm", dict()),
]
FAST_NAMES = ["mindspore", "mindspore-bestfit", "torch", "torch-expandable", "mindspore-vmm", "torch-npu",
              "torch-npu-expandable"]


def _pressed(name: str, capacity: int) -> dict:
    """Options that put ``capacity`` on the model (and small growth units where there are any)."""
    return dict(capacity=capacity) if name.startswith("torch") or name == "mindspore-vmm" else dict(capacity=capacity, increase_size=capacity // 16)


def _state(model):
    # slow-path events (doctor counts them) and idle blocks freed: every model, compiled or not
    slow = model.slow_path_events
    return (model.reserved, model.allocated, model.peak_reserved, model.peak_allocated, model.segment_allocs,
            model.largest_free(), [o.to_dict() for o in model.ooms], model.layout(),
            model.eager_frees if model.name == "mindspore-vmm" else None, slow, model.segment_frees)


_sizes = st.one_of(st.integers(0, 4096), st.integers(0, 3 * MiB), st.sampled_from([512, MiB, 2 * MiB, 16 * MiB]),
                   st.integers(0, 80 * MiB))
_ops = st.lists(st.one_of(
    st.tuples(st.just("malloc"), _sizes, st.sampled_from([None, "persistent", "small"]), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("note_segment_alloc"), st.integers(0, 40).map(lambda k: (1 << 32) + k * 8 * MiB),
              st.sampled_from([2 * MiB, 8 * MiB, 20 * MiB]), st.integers(0, 1)),
    # addresses where MindSpore's blocks start (2**32) and where torch's and VMM's ranges do (2**40)
    st.tuples(st.just("release_segment"), st.sampled_from([1 << 32, 1 << 40]).flatmap(
        lambda base: st.integers(0, 40).map(lambda k: base + k * 8 * MiB)),
              st.sampled_from([2 * MiB, 8 * MiB, 20 * MiB]), st.integers(0, 1)),
), max_size=200)


@needs_fast
@pytest.mark.parametrize("name,options", CONFIGS)
@settings(max_examples=20)
@given(ops=_ops)
def test_random_calls_give_identical_addresses(name, options, ops):
    ref, quick = create(name, fast=False, **options), create(name, fast=True, **options)
    assert type(quick) is fast.FAST_MODELS[name]
    live: list[int] = []
    for op in ops:
        if op[0] == "malloc":
            _, size, pool, stream = op
            got = quick.malloc(size, stream=stream, pool=pool, tag="t")
            assert got == ref.malloc(size, stream=stream, pool=pool, tag="t")
            if got is not None:
                live.append(got)
        elif op[0] == "free":
            if live:
                addr = live.pop(op[1] % len(live))
                ref.free(addr)
                quick.free(addr)
        elif op[0] == "empty_cache":
            ref.empty_cache()
            quick.empty_cache()
        else:
            getattr(ref, op[0])(*op[1:])
            getattr(quick, op[0])(*op[1:])
    assert _state(quick) == _state(ref)


def _same_replay(trace: Trace, name: str, options: dict, sample_every: int | None = 0) -> None:
    results = [replay(trace, create(name, fast=f, **options), sample_every=sample_every) for f in (False, True)]
    ref, quick = (r.to_dict() for r in results)
    for key in ("events_per_s", "cpu_events_per_s"):     # speeds differ
        ref.pop(key), quick.pop(key)
    assert quick == ref
    assert results[1].final_layout == results[0].final_layout


@needs_fast
@pytest.mark.parametrize("name,options", CONFIGS)
@settings(max_examples=12)
@given(data=st.data())
def test_random_traces_replay_identically(name, options, data):
    """Random event streams through the replay engine (the fast path's batch loop, its stops
    at other events and at sample boundaries)."""
    events, live, next_id = [], [], 0
    for _ in range(data.draw(st.integers(0, 300))):
        kind = data.draw(st.sampled_from(["alloc", "alloc", "free", "free", "mark", "step", "segment_alloc",
                                          "empty_cache", "free_unknown"]))
        if kind == "alloc":
            next_id += 1
            live.append(next_id)
            events.append(Event("alloc", id=next_id, size=data.draw(_sizes), tag="a",
                                pool=data.draw(st.sampled_from([None, "persistent"])),
                                addr=data.draw(st.sampled_from([None, 1 << 32]))))
        elif kind == "free" and live:
            events.append(Event("free", id=live.pop(data.draw(st.integers(0, len(live) - 1)))))
        elif kind == "free_unknown":
            events.append(Event("free", id=10**9))
        elif kind == "segment_alloc":
            events.append(Event("segment_alloc", size=16 * MiB, addr=(1 << 32) + 64 * MiB))
        elif kind != "free":
            events.append(Event(kind, tag="forward:0"))
    _same_replay(Trace(events), name, options, sample_every=data.draw(st.sampled_from([0, 1, 7, None])))


def _recorded(path: Path) -> Trace:
    try:
        return load_trace(path)
    except InputError as exc:
        pytest.skip(f"{path.name}: not a trace ({exc})")


@needs_fast
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
@pytest.mark.parametrize("name", FAST_NAMES)
def test_committed_traces_replay_identically(path, name):
    trace = _recorded(path)
    _same_replay(trace, name, {})
    _same_replay(trace, name, _pressed(name, 64 * MiB), sample_every=None)


@needs_fast
@pytest.mark.skipif(not SHARED_TRACES, reason="../shared/data (recorded traces) is absent")
@pytest.mark.parametrize("path", SHARED_TRACES, ids=lambda p: p.name)
@pytest.mark.parametrize("name", FAST_NAMES)
def test_shared_traces_replay_identically(path, name):
    trace = _recorded(path)
    _same_replay(trace, name, {})
    _same_replay(trace, name, _pressed(name, 2**30), sample_every=None)


@needs_fast
def test_create_picks_the_fast_path_and_falls_back():
    assert type(create("mindspore")) is fast.FAST_MODELS["mindspore"]
    assert type(create("mindspore", fast=False)).__module__ == "ms_memopt.allocators.mindspore"
    assert type(create("torch", max_split_size_mb=64, garbage_collection_threshold=0.5)) is fast.FAST_MODELS["torch"]
    assert type(create("torch", fast=False, max_split_size_mb=64)).__module__ == "ms_memopt.allocators.torch"


@pytest.mark.parametrize("name,options", [("mindspore", dict(grow="triple")), ("mindspore", dict(increase_size=0)),
                                          ("mindspore", dict(tie="random")), ("mindspore", dict(pregrow=True)),
                                          ("torch", dict(roundup_power2_divisions=3)),
                                          ("torch", dict(max_split_size_mb=20)),
                                          ("torch", dict(garbage_collection_threshold=1.0)),
                                          ("torch-npu", dict(garbage_collection_threshold="0.5"))])
@needs_fast
def test_fast_model_errors_match_the_reference(name, options):
    with pytest.raises((ValueError, InputError)) as ref:
        create(name, fast=False, **options)
    with pytest.raises((ValueError, InputError)) as quick:
        create(name, fast=True, **options)
    assert type(quick.value) is type(ref.value) and str(quick.value) == str(ref.value)


@pytest.mark.parametrize("allocator,options", [("mindspore", {"pregrow": True}), ("mindspore", {}),
                                               ("mindspore-bestfit", {"increase_size": 16 * MiB}),
                                               ("mindspore-vmm", {})])
@needs_fast
def test_simulate_gives_identical_results(allocator, options):
    """The simulator's batch loop (stops at marks, watched requests and the OOM) and a
    compaction's restore, fast path against reference, all three policies."""
    from ms_memopt.simulation.simulate import POLICIES, simulate
    from test_simulate import small_cfg, small_spec

    results = []
    for use_fast in (False, True):
        cfg = small_cfg(allocator=allocator, allocator_options=dict(options, fast=use_fast), steps=40)
        out = simulate(small_spec(), cfg, policies=POLICIES, seeds=[0, 1])
        # step_counts: what the time model prices (slow-path events, idle blocks freed, ...)
        results.append({p: [dict({k: v for k, v in r.to_dict().items() if k != "seconds"}, step_counts=r.step_counts)
                            for r in s.seeds]
                        for p, s in out.items()})
    assert results[1] == results[0]
    assert any(r["oom_step"] for runs in results[0].values() for r in runs) or \
        any(r["compactions"] for runs in results[0].values() for r in runs)


_region_ops = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(1, 64).map(lambda k: k * 512), st.booleans(), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 10**6)),
    st.tuples(st.just("open_chunk"), st.integers(-1, 96).map(lambda k: k * 512)),
    st.tuples(st.just("close_chunk")),
), max_size=200)


@needs_fast
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=40)
@given(ops=_region_ops)
def test_pool_mode_region_matches_the_reference(chunked, ops):
    """A pool-mode region: ring head, chunks filled top down, carving, best fit, merges."""
    from ms_memopt.allocators.pool import _Region

    size = 256 * 512
    ref, quick = _Region("activations", 1 << 32, size, chunked), fast.FastRegion("activations", 1 << 32, size, chunked)
    live: list[int] = []
    for op in ops:
        if op[0] == "take":
            got = quick.take(op[1], op[2], fallback=op[3])
            assert got == ref.take(op[1], op[2], fallback=op[3])
            if got is not None:
                live.append(got)
                assert quick.size_of(got) == ref.size_of(got)
        elif op[0] == "release":
            if live:
                addr = live.pop(op[1] % len(live))
                assert quick.release(addr) == ref.release(addr)
        else:
            getattr(ref, op[0])(*op[1:])
            getattr(quick, op[0])(*op[1:])
        assert (quick.head, quick.stack_top, quick.allocated) == (ref.head, ref.stack_top, ref.allocated)
    assert quick.free_keys == ref.free_keys and quick.largest_free() == ref.largest_free()
    assert quick.segment() == ref.segment()


# pool mode: small regions so that rings wrap, the cache evicts and regions run out
_POOL_REGIONS = {"parameters": 64 * 512, "activations": 96 * 512, "communication": 32 * 512,
                 "workspace": 48 * 512, "workspace.cache": 40 * 512}
_POOL_TAGS = ["parameter", "activation", "recompute", "allreduce", "p2p", "workspace", "shape_cache",
              "shape_cache", "shape_cache", "unrouted", None]
_pool_ops = st.lists(st.one_of(
    st.tuples(st.just("malloc"), st.one_of(st.integers(0, 20 * 512), st.integers(1, 24).map(lambda k: k * 512)),
              st.sampled_from(_POOL_TAGS),
              st.sampled_from([None, "persistent", "communication", "workspace.cache"])),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("note_mark"), st.sampled_from(["forward:0", "forward:1", "backward:0", "optimizer_end", None]),
              st.integers(0, 60).map(lambda k: k * 512)),
    st.tuples(st.just("drain")),
), min_size=20, max_size=200)


def _pool_models(chunked: bool, regions=None):
    from ms_memopt.allocators.pool import PoolModeAllocator

    regions = regions or _POOL_REGIONS
    return (PoolModeAllocator(capacity=2**20, regions=regions, chunked=chunked),
            fast.FastPoolModeAllocator(capacity=2**20, regions=regions, chunked=chunked))


def _pool_state(model):
    return (model.reserved, model.allocated, model.peak_reserved, model.peak_allocated, model.evictions,
            model.largest_free(), model.region_metrics(), [o.to_dict() for o in model.ooms], model.layout(),
            {name: (list(r.order.items()), r.allocated, r.head) for name, r in model.regions.items()})


@needs_fast
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=40)
@given(ops=_pool_ops)
def test_pool_mode_matches_the_reference(chunked, ops):
    """Pool mode's malloc/free in C: routing, ring and chunk placement, the cache's FIFO
    eviction (and what drain_evicted reports), region OOMs, counters, layouts."""
    ref, quick = _pool_models(chunked)
    live: list[int] = []
    for op in ops:
        if op[0] == "malloc":
            _, size, tag, pool = op
            got = quick.malloc(size, pool=pool, tag=tag)
            assert got == ref.malloc(size, pool=pool, tag=tag)
            if got is not None:
                live.append(got)
        elif op[0] == "free":
            if live:
                addr = live.pop(op[1] % len(live))
                ref.free(addr)
                quick.free(addr)
        elif op[0] == "note_mark":
            ref.note_mark(op[1], op[2])
            quick.note_mark(op[1], op[2])
        else:
            assert quick.drain_evicted() == ref.drain_evicted()
    assert _pool_state(quick) == _pool_state(ref)
    assert quick.drain_evicted() == ref.drain_evicted()


def _events_from(ops) -> list[Event]:
    """ops as an event stream: allocs with fresh ids, frees of random live ids, marks."""
    events, live, next_id = [], [], 0
    for op in ops:
        if op[0] == "malloc":
            next_id += 1
            events.append(Event("alloc", id=next_id, size=op[1], tag=op[2], pool=op[3]))
            live.append(next_id)
        elif op[0] == "free" and live:
            events.append(Event("free", id=live.pop(op[1] % len(live))))
        elif op[0] == "note_mark":
            events.append(Event("mark", tag=op[1], size=op[2]))
    return events


@needs_fast
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=40)
@given(ops=_pool_ops, watch=st.sampled_from([None, {"allreduce": 1}, {"shape_cache": 1}]))
def test_pool_mode_batch_loop_forgets_evicted_tensors_as_simulate_does(chunked, ops, watch):
    """``_run(..., forget=True)`` against simulate's loop over the reference: after every
    malloc the evicted addresses are drained and their tensors leave address_of; the batch stops
    at marks, watched requests (served here through ``malloc``, as simulate does) and OOMs."""
    ref, quick = _pool_models(chunked)
    events = _events_from(ops)
    ref_addr: dict[int, int] = {}
    ref_stop = None
    for index, event in enumerate(events):
        if event.action == "alloc":
            addr = ref.malloc(event.size, pool=event.pool, tag=event.tag)
            if addr is None:
                ref_stop = index
                break
            gone = set(ref.drain_evicted())
            for tid in [t for t, a in ref_addr.items() if a in gone]:
                del ref_addr[tid]
            ref_addr[event.id] = addr
        elif event.action == "free":
            addr = ref_addr.pop(event.id, None)
            if addr is not None:
                ref.free(addr)
        else:
            ref.note_mark(event.tag, event.size)
    addr_of: dict[int, int] = {}
    index, stop = 0, None
    while index < len(events):
        index, _, _, _, oom = quick._run(events, index, len(events), addr_of, watch, False, True)
        if oom:
            stop = index
            break
        if index == len(events):
            break
        event = events[index]
        index += 1
        if event.action == "alloc":      # a watched request: served by the Python loop
            addr = quick.malloc(event.size, pool=event.pool, tag=event.tag)
            if addr is None:
                stop = index - 1
                break
            gone = set(quick.drain_evicted())
            for tid in [t for t, a in addr_of.items() if a in gone]:
                del addr_of[tid]
            addr_of[event.id] = addr
        else:
            quick.note_mark(event.tag, event.size)
    assert stop == ref_stop
    assert addr_of == ref_addr
    assert _pool_state(quick) == _pool_state(ref)


@needs_fast
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=25)
@given(ops=_pool_ops, sample_every=st.sampled_from([0, 1, 7, None]))
def test_pool_mode_replays_identically(chunked, ops, sample_every):
    """replay() drives pool mode's batch loop too (no forgetting there, as the reference)."""
    events = _events_from(ops)
    events += [Event("free", id=e.id) for e in events[::3] if e.action == "alloc"]  # frees after evictions
    results = [replay(Trace(list(events)), model, sample_every=sample_every) for model in _pool_models(chunked)]
    ref, quick = (r.to_dict() for r in results)
    # speeds differ; slow-path events are counted by the pure-Python models only (doctor uses them)
    for key in ("events_per_s", "cpu_events_per_s", "slow_path_events"):
        ref.pop(key), quick.pop(key)
    assert quick == ref
    assert results[1].final_layout == results[0].final_layout


@needs_fast
def test_a_model_a_policy_hands_back_with_a_wrapped_malloc_sees_every_call():
    """After a ``step`` event the replay takes the model ``on_step`` returns through
    ``batch_runner``: a wrapped ``malloc`` there must see every allocation, not be bypassed by
    the compiled batch loop."""
    events = [Event("alloc", id=1, size=4096), Event("step", step=1)]
    events += [Event("alloc", id=i, size=4096) for i in range(2, 12)]
    seen = []

    def at_step(step, model, addresses):
        fresh = create("mindspore", fast=True)
        fresh.restore(model.layout())
        inner = fresh.malloc
        fresh.malloc = lambda size, **kw: (seen.append(size), inner(size, **kw))[1]
        return fresh

    replay(Trace(events), create("mindspore", fast=True), on_step=at_step, sample_every=0)
    assert len(seen) == 10


# ---------------------------------------------------------------- one C file per model

FAST_DIR = ROOT.parent / "ms_memopt" / "allocators" / "fast"


def test_each_model_has_its_own_c_file_and_the_module_dispatches_through_it():
    """``fast/<reference module>.c`` holds each model's C twin and its Model record; the module
    file (run loop, methods, type) names no model: no ``kind`` dispatch is left in it."""
    from ms_memopt.allocators import MODELS
    from ms_memopt.core._build_hash import EXTENSIONS

    hashed = set(EXTENSIONS["ms_memopt.allocators.fast._fastpool"])
    in_folder = {f"ms_memopt/allocators/fast/{p.name}" for p in FAST_DIR.iterdir() if p.suffix in (".c", ".h")}
    assert in_folder == hashed, "every .c and .h of the fast path is built and hashed"
    kinds = {}
    assert set(MODELS) == set(FAST_NAMES) | {"pool"}
    for name, (module, _) in MODELS.items():
        source = FAST_DIR / (module.rsplit(".", 1)[1] + ".c")     # the reference's file name
        assert source.is_file(), f"{name}: no {source.name}"
        text = source.read_text()
        found = re.findall(r'const Model fp_\w+_model = \{\s*\.kind = "(\w+)"', text)
        assert found, f"{source.name} defines no Model record"
        kinds[name] = found
    assert kinds["pool"] == ["region", "poolmode"]
    module = (FAST_DIR / "_fastpool.c").read_text()
    assert "KIND_" not in module and "->kind ==" not in module and "_malloc(c" not in module
    for path in FAST_DIR.glob("*.[ch]"):
        assert "KIND_" not in path.read_text(), f"{path.name}: a kind switch is back"
    assert (FAST_DIR / "fastpool.h").is_file() and (FAST_DIR / "common.c").is_file()


@needs_fast
def test_pool_mode_routing_is_c_and_matches_the_reference():
    """region_for's rule (tag's route, else the region named ``pool``, else the workspace; a
    route to a missing region serves from the workspace) answered by C, with route overrides,
    an empty route name, a "" route and a plan without a workspace; the C malloc never calls
    the Python region_for."""
    from ms_memopt.allocators.pool import PoolModeAllocator

    route = {"activation": "workspace", "p2p": "missing", "": "communication", "optimizer": "", "x": "workspace.cache"}
    tags = [None, "", "activation", "p2p", "optimizer", "x", "parameter", "shape_cache", "other"]
    pools = [None, "", "persistent", "communication", "workspace.cache", "missing"]
    for regions in (_POOL_REGIONS, {k: v for k, v in _POOL_REGIONS.items() if k != "workspace"}):
        ref = PoolModeAllocator(capacity=2**20, regions=regions, route=route)
        quick = fast.FastPoolModeAllocator(capacity=2**20, regions=regions, route=route)
        for tag in tags:
            for pool in pools:
                want = ref.region_for(tag, pool)
                got = quick.region_for(tag, pool)
                assert (got and got.name) == (want and want.name), (tag, pool)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast.FastPoolModeAllocator, "region_for", lambda *a: pytest.fail("C called region_for"))
            for tag in tags:
                for pool in pools:
                    assert quick.malloc(1000, tag=tag, pool=pool) == ref.malloc(1000, tag=tag, pool=pool)
        assert _pool_state(quick) == _pool_state(ref)
