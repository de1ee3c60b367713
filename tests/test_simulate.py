"""The many-step simulator: controls, compaction, pool mode, determinism, the CLI."""
from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.simulation.simulate import (
    POLICIES,
    PlacedRun,
    PolicySummary,
    SimConfig,
    WatchPoint,
    simulate,
    simulate_policy,
)
from ms_memopt.simulation import simulate as simulate_module
from ms_memopt.workload.step import WorkloadSpec

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "dense_100b_1024x910c.yaml"


def small_spec(**kw) -> WorkloadSpec:
    base = dict(layers=4, micro_batches=6, in_flight=3, seq_length=1024, param_bytes=4 * MiB,
                grad_bytes=8 * MiB, optimizer_bytes=24 * MiB, activation_bytes=3 * MiB,
                workspace_bytes=4 * MiB, p2p_bytes=64 * 1024, allreduce_bytes=12 * MiB,
                seq_min=256, seq_max=1024, seq_align=1, cache_bytes_per_shape=64 * 1024,
                cache_tensors=4, extra_probability=0.1, extra_size=MiB, comm_jitter=0.3,
                long_tail=0.3, seq_distribution="uniform", dynamic_seq=True)
    base.update(kw)
    return WorkloadSpec(**base)


def small_cfg(**kw) -> SimConfig:
    base = dict(steps=60, capacity=128 * MiB, allocator="mindspore",
                allocator_options={"pregrow": True}, scan_every=10, compact_every=20,
                watch={"allreduce": 12 * MiB})
    base.update(kw)
    return SimConfig(**base)


def _layouts_at_watch(spec: WorkloadSpec, cfg: SimConfig, policy: str = "baseline", seed: int = 0):
    """Run the simulator; the layout signature just before the first watched request of each step."""
    sigs: dict[int, list] = {}

    def on_watch(point: WatchPoint) -> None:
        assert point.kind == "watch", f"{point.kind} at step {point.step}"
        if point.step not in sigs:
            layout = point.layout()
            layout.check()
            sigs[point.step] = [(b.addr, b.size, b.live, b.tag) for b in layout.blocks()]

    result = simulate_policy(spec, policy, cfg, seed=seed, on_watch=on_watch)
    return result, sigs


def test_all_mechanisms_off_the_layout_repeats_exactly():
    # through the real simulator (marks, pool-mode phases and all), step after step
    for policy in ("baseline", "pool"):
        result, sigs = _layouts_at_watch(small_spec(enabled=False), small_cfg(steps=8, compact_every=None), policy)
        assert result.oom_step is None
        assert sorted(sigs) == list(range(1, 9))
        assert all(sigs[step] == sigs[2] for step in range(2, 9)), policy


def test_with_variation_the_layout_changes():
    _, sigs = _layouts_at_watch(small_spec(), small_cfg(steps=8, compact_every=None))
    assert len({repr(sig) for step, sig in sigs.items() if step >= 2}) > 1


def test_on_watch_layouts_tag_every_live_block_and_see_the_oom():
    points: list[tuple[str, int, set]] = []

    def on_watch(point: WatchPoint) -> None:
        points.append((point.kind, point.step, {b.tag for b in point.layout().live_blocks()}))

    spec = small_spec(enabled=False, activation_bytes=40 * MiB)
    r = simulate_policy(spec, "baseline", small_cfg(steps=5), seed=0, on_watch=on_watch)
    assert r.oom_step == 1
    assert points[-1][:2] == ("oom", 1)
    assert all(None not in tags for _, _, tags in points)
    ok = []
    simulate_policy(small_spec(), "compact", small_cfg(steps=25), seed=0,
                    on_watch=lambda p: ok.append(None not in {b.tag for b in p.layout().live_blocks()}))
    assert ok and all(ok)          # tags survive a compaction (it moves blocks, ids follow)


def _watched_layouts(run_steps) -> list:
    """Every layout ``on_watch`` sees in ``run_steps(on_watch)``, as (kind, step, policy, blocks with tags)."""
    seen = []

    def on_watch(point: WatchPoint) -> None:
        seen.append((point.kind, point.step, point.policy,
                     [(b.addr, b.size, b.live, b.tag) for b in point.layout().blocks()]))

    run_steps(on_watch)
    return seen


@pytest.mark.parametrize("policy, capacity", [("baseline", 88), ("compact", 88), ("pool", 120)])
def test_on_watch_layouts_on_the_compiled_loop_are_the_hooks_layouts(policy, capacity, monkeypatch):
    # tags noted ahead of each step (the compiled loop) against tags kept by the per-call hooks;
    # at 88 MiB the baseline dies at step 10 and compact runs last-resort compactions
    def run(on_watch):
        simulate(small_spec(), small_cfg(steps=40, capacity=capacity * MiB), policies=(policy,), seeds=[3],
                 on_watch=on_watch)

    ahead = _watched_layouts(run)
    monkeypatch.setattr(simulate_module._Run, "_tag_ahead", lambda self, batch: False)
    assert _watched_layouts(run) == ahead and len(ahead) >= 10


def test_tags_noted_ahead_give_way_to_the_hooks_when_an_id_comes_back(monkeypatch):
    # a tensor id allocated twice in a step, or again while live: its tag is the one of the
    # allocation that placed the live block, as the hooks keep it (the block id 1 named first
    # is no longer any tensor's: no tag)
    def row(action, tid, size=MiB, tag=None):
        return (action, tid, size, None, 0, None, None, tag, None)

    steps = [[row("alloc", 1, tag="a"), row("alloc", 2, tag="w")],
             [row("free", 2), row("alloc", 3, tag="b"), row("free", 3), row("alloc", 3, tag="c"),
              row("alloc", 4, tag="w")],
             [row("alloc", 1, tag="d"), row("alloc", 5, tag="w"), row("free", 1)]]

    def run(on_watch):
        cfg = small_cfg(steps=len(steps), scan_every=0, compact_every=None, watch={"w": MiB})
        r = simulate_module._Run(WorkloadSpec(), "baseline", cfg, 0, None, on_watch)
        for step, batch in enumerate(steps):
            assert r.feed(step, batch)

    ahead = _watched_layouts(run)
    assert [[b[3] for b in blocks if b[2]] for *_, blocks in ahead] == [["a"], ["a", "c"], [None, "c", "w", "d"]]
    monkeypatch.setattr(simulate_module._Run, "_tag_ahead", lambda self, batch: False)
    assert _watched_layouts(run) == ahead


def test_control_no_oom_without_variation():
    r = simulate_policy(small_spec(enabled=False), "baseline", small_cfg(steps=100))
    assert r.oom_step is None
    assert len(set(r.largest_free_by_window)) == 1


def test_growth_when_unbounded_shapes_and_caches():
    # a deliberately tight card: unbounded shape caches end in a fragmentation OOM
    spec = small_spec()
    r = simulate_policy(spec, "baseline", small_cfg(steps=400, capacity=104 * MiB), seed=0)
    bounded = simulate_policy(spec.without("shape_cache"), "baseline",
                              small_cfg(steps=400, capacity=104 * MiB), seed=0)
    assert bounded.oom_step is None
    assert r.oom_step is not None
    assert r.largest_free_min < bounded.largest_free_min


def test_same_seed_same_result_and_seeds_differ():
    spec, cfg = small_spec(), small_cfg()
    a = simulate_policy(spec, "baseline", cfg, seed=7).to_dict()
    b = simulate_policy(spec, "baseline", cfg, seed=7).to_dict()
    c = simulate_policy(spec, "baseline", cfg, seed=8).to_dict()
    for d in (a, b, c):
        d.pop("seconds")
    assert a == b
    assert a != c


def test_baseline_and_compact_identical_up_to_first_compaction():
    spec, cfg = small_spec(), small_cfg(steps=45, compact_every=20, watch={"allreduce": 12 * MiB},
                                         watch_margin=0.0)
    rows = {}
    for policy in ("baseline", "compact"):
        buf = io.StringIO()
        simulate_policy(spec, policy, cfg, seed=1, timeline=buf)
        rows[policy] = [json.loads(line) for line in buf.getvalue().splitlines()]
    first = min(r["step"] for r in rows["compact"] if r["kind"] == "compaction")
    assert first == 20

    def upto(policy):
        return [{k: v for k, v in r.items() if k != "policy"} for r in rows[policy]
                if r["step"] <= first and r["kind"] != "compaction"]
    assert upto("baseline") == upto("compact")
    after_b = [r for r in rows["baseline"] if r["step"] > first]
    after_c = [r for r in rows["compact"] if r["step"] > first and r["kind"] != "compaction"]
    assert after_b != after_c


def test_compaction_in_one_range_leaves_one_hole():
    # one pre-reserved range: the VMM-free MindSpore pool with a persistent pool of its own
    spec = small_spec()
    cfg = small_cfg(steps=40, compact_every=20)
    r = simulate_policy(spec, "compact", cfg, seed=0)
    assert r.compactions >= 2
    assert r.bytes_moved > 0
    assert r.frag_after_compaction_segment_max is not None
    assert r.frag_after_compaction_segment_max <= 0.05


def test_compaction_on_warning_delays_the_oom_of_the_tight_card():
    # the margin trigger: this card's holes do not trend, they jump (a forecast cannot see it)
    spec = small_spec()
    cfg = small_cfg(steps=400, capacity=104 * MiB, compact_every=100, compact_trigger="margin")
    base = simulate_policy(spec, "baseline", cfg, seed=0)
    comp = simulate_policy(spec, "compact", cfg, seed=0)
    assert base.oom_step is not None
    assert comp.oom_step is None or comp.oom_step > base.oom_step + 50
    assert comp.compactions > cfg.steps // cfg.compact_every - 1


def test_pool_mode_never_ooms_and_fixed_regions_never_fragment():
    spec = small_spec()
    r = simulate_policy(spec, "pool", small_cfg(steps=300, capacity=160 * MiB), seed=0)
    assert r.oom_step is None
    worst = r.region_frag_max_by_region
    assert all(worst[name] == 0.0 for name in ("parameters", "gradients", "optimizer", "communication"))
    # chunks filled top down in a ring: at most two free pieces, however wide the length spread
    assert worst["activations"] <= 1.0


@settings(max_examples=60, deadline=None)
@given(in_flight=st.integers(1, 5), extra=st.integers(0, 6), layers=st.integers(1, 4),
       lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_activation_chunk_ring_keeps_free_space_in_two_pieces(in_flight, extra, layers, lengths):
    """1F1B micro-batches of any lengths: each forward keeps ``layers`` x 3 tensors in its chunk,
    the backward frees them last-saved first; the region's free space is never in more than two
    pieces and nothing falls outside the ring."""
    from ms_memopt.allocators.pool import PoolModeAllocator
    from ms_memopt.workload.step import _one_f_one_b

    unit = 4096
    sizes = {m: [n * unit * share for share in (3, 2, 1)] for m, n in enumerate(lengths)}
    ring = (in_flight + 1) * layers * 6 * 64 * unit
    pool = PoolModeAllocator(regions={"activations": ring, "workspace": unit}, chunked=True)
    region = pool.regions["activations"]
    saved: dict[int, list[int]] = {}
    for phase, m in _one_f_one_b(len(lengths), min(in_flight, len(lengths))):
        if phase == "F":
            pool.note_mark(f"forward:{m}", layers * sum(sizes[m]))
            saved[m] = [pool.malloc(size, tag="activation") for _ in range(layers) for size in sizes[m]]
            assert None not in saved[m]
            assert min(saved[m]) >= region.addr and max(saved[m]) < region.addr + region.size
        else:
            pool.note_mark(f"backward:{m}")
            for addr in reversed(saved.pop(m)):
                pool.free(addr)
                assert len(region.free_keys) <= 2
        assert len(region.free_keys) <= 2
    assert region.allocated == 0 and len(region.free_keys) == 1


def test_pool_mode_regions_of_the_100b_recipe_stay_within_ratio_one():
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.config.recipe import load_recipe
    from ms_memopt.simulation.spec import config_from_recipe
    from ms_memopt.simulation.spec import spec_from_recipe

    recipe = load_recipe(RECIPE)
    r = simulate_policy(spec_from_recipe(recipe), "pool", config_from_recipe(recipe, steps=60), seed=1)
    assert r.oom_step is None
    assert r.region_frag_max is not None and r.region_frag_max <= 1.0


def test_oom_kind_and_median():
    spec = small_spec(enabled=False, activation_bytes=40 * MiB)
    r = simulate_policy(spec, "baseline", small_cfg(steps=5), seed=0)
    assert r.oom_step == 1 and r.oom_kind == "capacity"
    runs = [replace(r, seed=i, oom_step=s) for i, s in enumerate([10, 20, None, 40])]
    assert PolicySummary("baseline", runs).median_oom_step == 30
    assert PolicySummary("baseline", runs[2:3] + runs[2:3] + runs[:1]).median_oom_step is None


def test_simulate_runs_every_policy_on_the_same_seeds():
    out = simulate(small_spec(), small_cfg(steps=20, capacity=160 * MiB), seeds=[0, 1])
    assert list(out) == list(POLICIES)
    assert all([r.seed for r in s.seeds] == [0, 1] for s in out.values())


def test_cli_json_out_and_plot(tmp_path, capsys):
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.cli import main

    # one rank stream of the job (tests/test_job.py covers the job figures)
    code = main(["simulate", str(RECIPE), "--steps", "3", "--policy", "baseline,pool", "--ranks", "1",
                 "--seeds", "2", "--out", str(tmp_path), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for policy in ("baseline", "pool"):
        p = out["policies"][policy]
        assert len(p["seeds"]) == 2 and "median_job_oom_step" in p
        for key in ("oom_step", "frag_ratio_max", "largest_free_min", "compactions",
                    "frag_before_compaction", "frag_after_compaction", "bytes_moved", "oom_kind",
                    "free_total_at_oom", "frag_at_oom"):
            assert key in p["seeds"][0]["first_rank"]
    assert "region_frag_max" in out["policies"]["pool"]["seeds"][0]["first_rank"]
    assert (tmp_path / "timeline.jsonl").stat().st_size > 0
    assert (tmp_path / "fragmentation.png").stat().st_size > 0


def test_cli_bad_policy_exits_2(capsys):
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.cli import main

    assert main(["simulate", str(RECIPE), "--policy", "nope"]) == 2
    assert "--policy" in capsys.readouterr().err


def test_calibrated_100b_recipe_largest_free_trends_down():
    """Fast check of the calibration (the 10-seed study is in bench/simulate.py --study)."""
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.config.recipe import load_recipe
    from ms_memopt.simulation.spec import config_from_recipe
    from ms_memopt.simulation.spec import spec_from_recipe

    recipe = load_recipe(RECIPE)
    spec = spec_from_recipe(recipe)
    cfg = config_from_recipe(recipe, steps=80, scan_every=40)
    cfg.allocator_options["pregrow"] = True
    grown = simulate_policy(spec, "baseline", cfg, seed=0)
    steady = simulate_policy(spec.without("dynamic_seq", "shape_cache"), "baseline", cfg, seed=0)
    assert grown.largest_free_by_window[1] < grown.largest_free_by_window[0]
    # the AllReduce moment still varies, so the smallest hole varies a little, without a trend
    assert steady.largest_free_by_window[1] > 0.95 * steady.largest_free_by_window[0]
    assert min(grown.largest_free_by_window) < min(steady.largest_free_by_window)


# --- --export-memory-viz ------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["baseline", "compact", "pool"])
def test_placed_events_round_trip_through_the_torch_snapshot_reader(tmp_path, policy):
    from ms_memopt.core.metrics import measure
    from ms_memopt.io.traces.memory_viz import write_memory_viz
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot

    placed = PlacedRun()
    r = simulate_policy(small_spec(), policy, small_cfg(steps=25, capacity=160 * MiB), seed=0, placed=placed)
    assert r.oom_step is None and placed.final is not None
    if policy == "compact":
        assert r.compactions >= 1 and any(e.tag == "compaction" for e in placed.events)
    path = tmp_path / "viz.pickle"
    write_memory_viz(path, placed.events, placed.final)
    back = read_torch_snapshot(path)
    allocs = [(e.addr, e.size) for e in placed.events if e.action == "alloc"]
    assert [(e.addr, e.size) for e in back.events if e.action == "alloc"] == allocs
    assert sum(e.action == "free" for e in back.events) == sum(e.action == "free" for e in placed.events)
    # the final layout's live bytes are exactly what the recorded events leave allocated
    live: dict[int, int] = {}
    for e in placed.events:
        if e.action == "alloc":
            live[e.addr] = e.size
        else:
            assert live.pop(e.addr, None) is not None, f"free of {e.addr:#x} never allocated"
    assert measure(back.final).allocated == measure(placed.final).allocated >= sum(live.values()) > 0


def test_cli_export_memory_viz_one_file_per_policy(tmp_path, capsys):
    from ms_memopt.cli import main
    from ms_memopt.io.traces.torch_snapshot import read_torch_snapshot

    recipe = ROOT / "recipes" / "demo_cpu.yaml"
    if not recipe.exists():
        pytest.skip("recipes/demo_cpu.yaml not in this tree")
    assert main(["simulate", str(recipe), "--steps", "3", "--policy", "baseline,pool",
                 "--export-memory-viz", str(tmp_path / "sim.pickle"), "--json"]) == 0
    capsys.readouterr()
    for policy in ("baseline", "pool"):
        trace = read_torch_snapshot(tmp_path / f"sim.{policy}.pickle")
        assert any(e.action == "alloc" for e in trace.events) and trace.final.segments
    assert not (tmp_path / "sim.pickle").exists()
    assert main(["simulate", str(recipe), "--steps", "2", "--policy", "pool",
                 "--export-memory-viz", str(tmp_path / "one.pickle")]) == 0
    assert read_torch_snapshot(tmp_path / "one.pickle").events


# --- plots ----------------------------------------------------------------------------------------

def test_size_unit_follows_the_data():
    from ms_memopt.report.plots import size_unit

    assert size_unit(96 * 2**30) == (2**30, "GiB")
    assert size_unit(5 * MiB) == (MiB, "MiB")
    assert size_unit(300 * 1024) == (1024, "KiB")
    assert size_unit(100) == (1, "bytes")


def test_plot_timeline_labels_in_the_unit_of_the_data(tmp_path, monkeypatch):
    import ms_memopt.report.plots as plots

    seen = {}
    real_save = plots.save_figure

    def capture(fig, path, **kw):
        seen["labels"] = [ax.get_ylabel() for ax in fig.axes]
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]   # one below the panels
        seen["legend"] = [t.get_text() for legend in legends for t in legend.get_texts()]
        return real_save(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", capture)
    out = plots.plot_timeline({"rank 0": [(1, 3 * MiB, MiB, 2.0), (5, 3 * MiB, 3 * MiB, 0.0)]},
                              tmp_path / "t.png",
                              markers=[plots.Marker("rank 0", 5, "compaction"),
                                       plots.Marker("rank 0", 1, "predicted_oom")],
                              requests={"allreduce": 2 * MiB})
    assert out.stat().st_size > 0
    assert [label.split("\n")[0] for label in seen["labels"][:2]] == ["free_total (MiB)", "largest_free (MiB)"]
    assert any(t.startswith("rank 0: compaction") for t in seen["legend"])
    assert any("predicted OOM" in t for t in seen["legend"])
    assert any(t.startswith("allreduce request 2.00 MiB") for t in seen["legend"])   # the line that decides an OOM
    with pytest.raises(ValueError):
        plots.plot_timeline({}, tmp_path / "u.png", markers=[plots.Marker("x", 1, "boom")])


def test_timeline_reader_drops_a_torn_line_and_names_a_bad_one(tmp_path):
    from ms_memopt.core.errors import InputError
    from ms_memopt.report.plots import _rows, plot_fragmentation_timeline

    good = '{"policy":"baseline","seed":0,"step":1,"kind":"scan","free_total":2048,"largest_free":1024,"frag_ratio":1.0}\n'
    path = tmp_path / "timeline.jsonl"
    path.write_text(good + good.replace('"step":1', '"step":2') + '{"policy":"base')
    assert [r["step"] for r in _rows(path)] == [1, 2]
    assert plot_fragmentation_timeline(path, tmp_path / "f.png").stat().st_size > 0
    path.write_text(good + "not json\n")
    with pytest.raises(InputError, match="timeline.jsonl:2"):
        _rows(path)
    path.write_text(good + '{"policy":"baseline","step":3,"kind":"scan"}\n')
    with pytest.raises(InputError, match="timeline.jsonl:2.*free_total"):
        _rows(path)


def test_recipe_compact_triggers_are_the_simulators():
    from ms_memopt.config import recipe as recipe_module
    from ms_memopt.simulation.simulate import COMPACT_TRIGGERS

    assert recipe_module._COMPACT_TRIGGERS == COMPACT_TRIGGERS


@pytest.mark.parametrize("name, model", [("mindspore", "mindspore"), ("mindspore_vmm", "mindspore-vmm"),
                                         ("torch", "torch"), ("torch_expandable", "torch-expandable"),
                                         ("pool", "mindspore")])
def test_every_recipe_allocator_name_simulates(tmp_path, name, model):
    """Recipe names use ``_``; the MindSpore pool's set-up keys reach only MindSpore's models;
    ``pool`` (pool-mode training for ``run``) simulates its baseline on MindSpore's pool."""
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.config.recipe import load_recipe
    from ms_memopt.simulation.spec import config_from_recipe
    from ms_memopt.simulation.spec import spec_from_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.read_text().replace("    name: mindspore\n", f"    name: {name}\n", 1))
    recipe = load_recipe(path)
    cfg = config_from_recipe(recipe, steps=3)
    assert cfg.allocator == model
    assert ("increase_size" in cfg.allocator_options) == (model == "mindspore")
    out = simulate(spec_from_recipe(recipe), cfg, seeds=[0])
    assert all(s.seeds[0].oom_step is None for s in out.values())


@pytest.mark.parametrize("args, key, text", [
    (["--allocator", "pool"], "--allocator", "--policy pool"),
    (["--allocator", "torch", "--allocator-option", "bogus=1"], "--allocator-option", "max_split_size_mb"),
])
def test_cli_bad_allocator_choice_exits_2(capsys, args, key, text):
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.cli import main

    assert main(["simulate", str(RECIPE), "--steps", "2", "--ranks", "1", *args]) == 2
    err = capsys.readouterr().err
    assert key in err and text in err and "Traceback" not in err
