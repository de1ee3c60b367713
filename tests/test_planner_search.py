"""The exact search (MiniMalloc's method): its compiled twin, generated strip instances, the
kept-aside structure, and how `pack` stops and reports optimality."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.analysis.planner import Buffer, lower_bound, pack, validate
from ms_memopt.analysis.planner import _native
from ms_memopt.analysis.planner.generate import cut_strip
from ms_memopt.analysis.planner.greedy import greedy_place
from ms_memopt.analysis.planner.search import PREORDERS, search_place
from ms_memopt.cli import main
from ms_memopt.core.placement import arena_of
from ms_memopt.io.traces.instances import read_instance, write_instance
from test_planner import _optimum_by_permutations  # the brute-force optimum (tests/ is on sys.path)

DSA = Path(__file__).resolve().parents[2] / "shared" / "data" / "dsa"


def _native_or_skip():
    if _native.library() is None:
        pytest.skip(f"the compiled search is unavailable here: {_native.unavailable_reason()}")


@st.composite
def small_instances(draw):
    n = draw(st.integers(1, 12))
    result = []
    for i in range(n):
        lower = draw(st.integers(0, 9))
        result.append(Buffer(f"b{i}", lower, draw(st.integers(lower + 1, 10)), draw(st.integers(0, 7))))
    return result


# ---------------------------------------------------------------- the compiled twin

@given(small_instances(), st.integers(0, 6), st.sampled_from(sorted(PREORDERS)))
@settings(max_examples=80, deadline=None)
def test_native_and_python_visit_the_same_nodes_and_return_the_same_offsets(buffers, slack, prefer):
    _native_or_skip()
    capacity = max(0, lower_bound(buffers) + slack - 3)  # below, at and above the bound
    python = search_place(buffers, capacity, prefer=prefer, engine="python")
    native = search_place(buffers, capacity, prefer=prefer, engine="native")
    assert (python.offsets, python.exhausted, python.nodes) == (native.offsets, native.exhausted, native.nodes)
    if native.offsets is not None:
        assert validate(buffers, native.offsets, capacity=capacity) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_and_python_agree_on_generated_strips_under_a_node_limit(seed):
    _native_or_skip()
    inst = cut_strip(seed, pieces=40, drop=0.05)
    for prefer in PREORDERS:
        python = search_place(inst.buffers, inst.capacity, prefer=prefer, node_limit=400, engine="python")
        native = search_place(inst.buffers, inst.capacity, prefer=prefer, node_limit=400, engine="native")
        assert (python.offsets, python.exhausted, python.nodes) == \
            (native.offsets, native.exhausted, native.nodes)


def test_pure_python_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("MS_MEMOPT_PURE_PYTHON", "1")
    assert _native.library() is None and "MS_MEMOPT_PURE_PYTHON" in _native.unavailable_reason()
    bufs = [Buffer("a", 0, 3, 4), Buffer("b", 3, 9, 4), Buffer("c", 0, 9, 4)]
    assert search_place(bufs, 8).offsets is not None  # the Python search runs
    with pytest.raises(RuntimeError, match="unavailable"):
        search_place(bufs, 8, engine="native")


def test_search_proves_infeasible_targets():
    bufs = [Buffer("a", 0, 3, 4), Buffer("b", 3, 9, 4), Buffer("c", 0, 9, 4)]
    for engine in ("python", "auto"):
        assert search_place(bufs, 7, engine=engine).exhausted
        found = search_place(bufs, 8, engine=engine)
        assert validate(bufs, found.offsets, capacity=8) == []


@st.composite
def shared_lifetime_instances(draw):
    """Few distinct lifetimes, so buffers of the same lifetime (and identical ones) abound."""
    spans = [(lo, draw(st.integers(lo + 1, 6))) for lo in draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))]
    n = draw(st.integers(2, 7))
    return [Buffer(f"b{i}", *draw(st.sampled_from(spans)), draw(st.integers(1, 4))) for i in range(n)]


@given(shared_lifetime_instances(), st.sampled_from(sorted(PREORDERS)))
@settings(max_examples=150, deadline=None)
def test_symmetry_rules_keep_the_search_exact(buffers, prefer):
    # identical buffers in rank order, same-lifetime stacks in rank order: the optimum is still
    # found, and one byte less is still proven impossible
    optimum = _optimum_by_permutations(buffers)
    found = search_place(buffers, optimum, prefer=prefer)
    assert found.offsets is not None and validate(buffers, found.offsets, capacity=optimum) == []
    assert search_place(buffers, optimum - 1, prefer=prefer).exhausted


@st.composite
def decomposing_instances(draw):
    """Short buffers in a few time windows bridged by longer ones: once the bridges are placed,
    the windows are independent parts, each searched with its own ranking."""
    n = draw(st.integers(3, 7))
    result = []
    for i in range(n):
        if draw(st.booleans()):  # inside one window [4w, 4w + 4)
            window = 4 * draw(st.integers(0, 2))
            lower = window + draw(st.integers(0, 2))
            upper = draw(st.integers(lower + 1, window + 4))
        else:  # a bridge across window boundaries
            lower = draw(st.integers(0, 6))
            upper = draw(st.integers(lower + 3, 12))
        result.append(Buffer(f"b{i}", lower, upper, draw(st.integers(1, 6))))
    return result


@given(decomposing_instances(), st.sampled_from(sorted(PREORDERS)), st.sampled_from(["python", "auto"]))
@settings(max_examples=120, deadline=None)
def test_parts_ranked_by_their_own_live_totals_keep_the_search_exact(buffers, prefer, engine):
    # each decomposed part is re-ranked by the unplaced bytes of its sections at that moment;
    # the optimum must still be found and one byte less still proven impossible
    optimum = _optimum_by_permutations(buffers)
    found = search_place(buffers, optimum, prefer=prefer, engine=engine)
    assert found.offsets is not None and validate(buffers, found.offsets, capacity=optimum) == []
    assert search_place(buffers, optimum - 1, prefer=prefer, engine=engine).exhausted


@given(decomposing_instances(), st.integers(0, 4), st.sampled_from(sorted(PREORDERS)))
@settings(max_examples=80, deadline=None)
def test_native_and_python_agree_on_decomposing_instances(buffers, slack, prefer):
    _native_or_skip()
    capacity = lower_bound(buffers) + slack
    python = search_place(buffers, capacity, prefer=prefer, engine="python")
    native = search_place(buffers, capacity, prefer=prefer, engine="native")
    assert (python.offsets, python.exhausted, python.nodes) == (native.offsets, native.exhausted, native.nodes)


# ---------------------------------------------------------------- generated strips

def test_cut_strip_is_a_valid_packing_with_the_challenging_sets_grain():
    inst = cut_strip(seed=4, pieces=150)
    assert validate(inst.buffers, inst.offsets, capacity=inst.capacity) == []
    assert lower_bound(inst.buffers) == inst.capacity  # nothing dropped: a perfect packing
    assert all(b.size % 1024 == 0 and b.lower % 1024 == 0 and b.upper % 1024 == 0 for b in inst.buffers)
    holes = cut_strip(seed=4, pieces=150, drop=0.1)
    assert len(holes.buffers) == 135 and cut_strip(seed=4, pieces=150).buffers == inst.buffers


# seeds the compiled search packs in well under a CPU second (the Python reference, run when no
# compiler is there, needs 10-20x that)
@pytest.mark.parametrize("seed, drop", [(0, 0.0), (1, 0.0), (7, 0.1), (3, 0.05), (5, 0.1), (6, 0.0)])
def test_generated_strips_fit_their_capacity_where_greedy_does_not(seed, drop):
    inst = cut_strip(seed, pieces=120, drop=drop)
    greedy = arena_of(inst.buffers, greedy_place(inst.buffers, order="size", fit="best"))
    solution = pack(inst.buffers, capacity=inst.capacity, time_limit=120)
    assert solution.fits and solution.valid, (seed, drop, solution.arena / inst.capacity)
    assert validate(inst.buffers, solution.offsets, capacity=inst.capacity) == []
    assert greedy > inst.capacity  # greedy alone does not fit them


def test_generated_strip_through_the_cli(tmp_path, capsys):
    inst = cut_strip(seed=2, pieces=100)
    path = tmp_path / "strip.csv"
    write_instance(inst.buffers, path)
    assert main(["pack", str(path), "--capacity", str(inst.capacity), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["optimal"] and report["gap"] == 0.0
    assert report["proven_bound"] == inst.capacity and report["stopped"] == "bound reached"


# ---------------------------------------------------------------- stopping and reporting

def test_stalled_search_stops_long_before_the_time_limit():
    # 2,000 buffers that the search cannot close: it must give up after `stall` seconds without
    # progress, not use the whole (very long) limit
    inst = cut_strip(seed=11, pieces=2000, drop=0.2)
    solution = pack(inst.buffers, time_limit=600, stall=0.5)
    assert solution.valid
    if not solution.optimal:
        assert solution.stopped == "stalled" and solution.seconds < 300
        assert solution.gap == pytest.approx(solution.arena / solution.best_bound - 1)
        assert solution.gap > 0


def test_pack_reports_when_the_capacity_was_first_met(tmp_path, capsys):
    inst = cut_strip(seed=2, pieces=100)
    solution = pack(inst.buffers, capacity=inst.capacity, time_limit=120)
    assert solution.fits and 0 <= solution.fit_seconds <= solution.seconds
    assert pack(inst.buffers, time_limit=1).fit_seconds is None  # no capacity asked for
    loose = pack(inst.buffers, capacity=10 * inst.capacity, time_limit=5)
    assert loose.fits and loose.fit_seconds <= loose.seconds  # greedy already fits
    path = tmp_path / "strip.csv"
    write_instance(inst.buffers, path)
    assert main(["pack", str(path), "--capacity", str(inst.capacity), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["fit_seconds"] <= report["seconds"]


def test_solution_reports_its_gap_and_why_it_stopped():
    bufs = [Buffer("a", 0, 2, 4), Buffer("b", 1, 3, 4), Buffer("c", 2, 4, 4)]
    solution = pack(bufs)
    assert solution.optimal and solution.gap == 0.0 and solution.best_bound == 8
    assert solution.stopped == "bound reached"
    with pytest.raises(Exception, match="stall"):
        pack(bufs, stall=-1)


def test_cli_says_whether_the_result_is_proven_optimal(tmp_path, capsys):
    path = tmp_path / "i.csv"
    path.write_text("id,lower,upper,size\na,0,2,4\nb,1,3,4\nc,2,4,4\n")
    assert main(["pack", str(path)]) == 0
    assert "yes, proven (equals the lower bound)" in capsys.readouterr().out
    assert main(["pack", str(path), "--stall", "-2"]) == 2
    assert "--stall" in capsys.readouterr().err


# ---------------------------------------------------------------- shared data

def _shared(relative: str) -> Path:
    path = DSA / relative
    if not path.exists():
        pytest.skip(f"shared data {path} is absent (it lives beside the repository, not in it)")
    return path


def test_somas_resnet50_reaches_its_lower_bound():
    buffers = read_instance(_shared("somas/resnet50.csv"))
    solution = pack(buffers, time_limit=60)
    assert solution.valid and solution.ratio <= 1.001
    if _native.library() is not None:  # ~1 CPU s compiled; the Python reference may stall above
        assert solution.arena == solution.lower_bound and solution.optimal


@pytest.mark.parametrize("prefer", sorted(PREORDERS))
def test_minimalloc_a_with_every_preorder_is_valid_when_found(prefer):
    buffers = read_instance(_shared("minimalloc/A.1048576.csv"))
    result = search_place(buffers, 1_048_576, prefer=prefer, node_limit=20_000)
    if result.offsets is not None:
        assert validate(buffers, result.offsets, capacity=1_048_576) == []
    else:
        assert not result.exhausted  # A fits, so the search can never prove otherwise
