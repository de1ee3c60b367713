"""The time model (issue 26): step time, stragglers and MFU of the whole job, per policy
(:mod:`ms_memopt.simulation.timing`, ``memopt.timing`` recipe keys)."""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
from pathlib import Path

import pytest

from ms_memopt.config.recipe import TimingConfig, load_recipe, recipe_from_dict
from ms_memopt.core.errors import InputError
from ms_memopt.simulation.job import JobResult, RankOutcome, simulate_jobs
from ms_memopt.simulation.spec import RankStream, job_from_recipe
from ms_memopt.simulation.simulate import PolicyResult
from ms_memopt.simulation.timing import TIMING_KEYS, StepCounts, job_steps, rank_step, step_flops
from ms_memopt.simulation.spec import spec_from_recipe
from docs_table import documented_keys

ROOT = Path(__file__).resolve().parents[1]
BIG = ROOT / "recipes" / "dense_100b_1024x910c.yaml"
DEMO = ROOT / "recipes" / "demo_cpu.yaml"
TINY = {"model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                   "seq_length": 64, "vocab_size": 256}}}


def _sane(t: dict) -> None:
    assert list(t) == list(TIMING_KEYS)
    assert 0 < t["step_seconds_median"] <= t["step_seconds_p99"]
    assert t["step_cv"] >= 0
    assert 0 < t["mfu"] < 1
    assert 0 <= t["memory_stall_share"] <= 1 and 0 <= t["compaction_pause_share"] <= 1


@pytest.fixture(scope="module")
def demo_results():
    """The CPU demo recipe, 25 steps (a compaction at step 20), every policy, one rank, in-process."""
    job = job_from_recipe(load_recipe(DEMO), steps=25)
    return simulate_jobs([job], workers=1)[0]


def test_simulate_json_has_a_timing_object_per_policy(capsys):
    from ms_memopt.cli import main

    code = main(["simulate", str(BIG), "--steps", "3", "--ranks", "1", "--workers", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for policy, figures in out["policies"].items():
        assert "job_oom_step" in figures and "first_rank" in figures      # the existing keys stay
        _sane(figures["timing"])
        assert figures["timing"]["compaction_pause_share"] == 0.0          # no compaction in 3 steps
    base, pool = out["policies"]["baseline"]["timing"], out["policies"]["pool"]["timing"]
    assert base["memory_stall_share"] > 0 == pool["memory_stall_share"]   # the unfused optimizer's copies
    assert pool["step_seconds_median"] < base["step_seconds_median"]
    # the 910C card's MFU is in the field report's range (31-42 %), not a made-up 90 %
    assert 0.25 < pool["mfu"] < 0.5


def test_human_table_shows_timing(capsys):
    from ms_memopt.cli import main

    assert main(["simulate", str(DEMO), "--steps", "3", "--ranks", "1", "--workers", "1", "--policy", "pool"]) == 0
    text = capsys.readouterr().out
    assert "step_med" in text and "mfu" in text


def test_compaction_costs_time_only_where_it_runs(demo_results):
    timing = {p: r.timing() for p, r in demo_results.items()}
    for t in timing.values():
        _sane(t)
    assert demo_results["compact"].first.result.compactions if demo_results["compact"].first else True
    assert sum(o.result.compactions for o in demo_results["compact"].outcomes) >= 1
    assert timing["compact"]["compaction_pause_share"] > 0
    assert timing["baseline"]["compaction_pause_share"] == 0 == timing["pool"]["compaction_pause_share"]


def test_more_hbm_bandwidth_shortens_the_compaction_pause(demo_results):
    job = demo_results["compact"]
    pauses = []
    for bandwidth in (1e9, 2e9, 4e9):
        figures = job.timing_figures(TimingConfig(hbm_bandwidth=bandwidth, compaction_barrier_seconds=0.0,
                                                  compaction_tensor_seconds=0.0))
        t, detail = figures
        pauses.append(t["compaction_pause_share"] * sum(detail["step_seconds"]))
    assert pauses[0] > pauses[1] > pauses[2] > 0
    assert pauses[0] == pytest.approx(2 * pauses[1]) and pauses[1] == pytest.approx(2 * pauses[2])
    # and per step: rank_step's compaction term is 2 x bytes / bandwidth + the barrier per compaction
    c = StepCounts(compactions=1, compaction_bytes=10**9)
    assert rank_step(c, TimingConfig(hbm_bandwidth=1e12, compaction_barrier_seconds=0.5))[2] == pytest.approx(0.502)


def test_a_faster_card_shortens_the_step_and_keeps_mfu(demo_results):
    job = demo_results["pool"]
    slow, fast = job.timing(TimingConfig(peak_flops=1e12)), job.timing(TimingConfig(peak_flops=2e12))
    assert fast["step_seconds_median"] < slow["step_seconds_median"]
    assert fast["mfu"] == pytest.approx(slow["mfu"], rel=0.05)   # the same efficiency (collective is ~0 here)


def test_job_step_is_the_slowest_rank_plus_the_collective():
    # rank A: 1.0 s compute + 0.2 s stalls; rank B: 1.1 s + 0, and a 0.5 s compaction (a sync point)
    steps = job_steps([[(1.0, 0.2, 0.0), (1.0, 0.0, 0.0)], [(1.1, 0.0, 0.5), (0.9, 0.0, 0.0)]], collective=0.25)
    assert steps[0] == pytest.approx((1.2 + 0.5 + 0.25, 0.2, 0.5))
    assert steps[1] == pytest.approx((1.0 + 0.25, 0.0, 0.0))
    # through a JobResult: two ranks' counts, priced; the job runs only while every rank does
    timing = TimingConfig(peak_flops=1.0, base_efficiency=1.0, collective_bandwidth=1.0)

    def outcome(rank: int, flops: list[float], collective: float) -> RankOutcome:
        r = PolicyResult("baseline", 0, len(flops), collective_bytes=collective)
        r.step_counts = [StepCounts(flops=f, model_flops=f).as_tuple() for f in flops]
        return RankOutcome(RankStream(0, rank, rank, 1, rank), r)

    job = JobResult("baseline", 0, 3, [outcome(0, [2.0, 4.0, 3.0], 0.5), outcome(1, [3.0, 1.0], 1.0)],
                    timing_config=timing)
    t, detail = job.timing_figures()
    assert detail["step_seconds"] == [4.0, 5.0]          # max(2, 3) + 1, max(4, 1) + 1
    assert t["step_seconds_median"] == 4.5
    # MFU: the ranks' mean model FLOPs per step over (job step x peak)
    assert t["mfu"] == pytest.approx((2.5 + 2.5) / 9.0)
    # the collective is priced from the bytes: half the bandwidth, twice the 1 s
    slower = job.timing_figures(dataclasses.replace(timing, collective_bandwidth=0.5))[1]
    assert slower["step_seconds"] == [5.0, 6.0]


def test_flops_follow_the_standard_formula():
    # whole job of the 100B recipe, every stage at full length: 72 B s L h^2 (1 + s/6h + V/12Lh)
    # (Narayanan et al. 2021; SwiGLU's 3hf is within 1 % of 8h^2 here), counted per card, times cards
    recipe = load_recipe(BIG)
    m, par = recipe.model, recipe.parallel
    total = 0.0
    for stage in range(par.pipeline_stage):
        spec = spec_from_recipe(recipe, stage=stage)
        total += step_flops(spec, [m.seq_length] * spec.micro_batches)[1] * par.model_parallel
    total *= par.data_parallel
    s, h, L, V = m.seq_length, m.hidden_size, m.num_layers, m.vocab_size
    batch = par.data_parallel * par.micro_batch_num * recipe.train.batch_size
    megatron = 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert total == pytest.approx(megatron, rel=0.03)
    # recompute adds one forward: 4/3 of the FLOPs executed
    spec = dataclasses.replace(spec_from_recipe(recipe), recompute_every=3)
    executed, model, _ = step_flops(spec, [s] * spec.micro_batches)
    assert executed == pytest.approx(model * 4 / 3)


# --- the recipe keys --------------------------------------------------------------------------

def _tiny(**timing) -> dict:
    data = copy.deepcopy(TINY)
    data["memopt"] = {"timing": timing}
    return data


def test_recipe_timing_keys_reach_the_simulator():
    recipe = recipe_from_dict(_tiny(peak_flops="1.5e12", hbm_bandwidth=3e11, base_efficiency=0.25))
    assert recipe.memopt.timing == TimingConfig(peak_flops=1.5e12, hbm_bandwidth=3e11, base_efficiency=0.25)
    job = job_from_recipe(recipe, steps=1)
    assert job.cfg.timing == recipe.memopt.timing
    assert recipe_from_dict(copy.deepcopy(TINY)).memopt.timing == TimingConfig()


@pytest.mark.parametrize("key, value", [
    ("base_efficiency", 1.5), ("base_efficiency", 0), ("peak_flops", 0), ("peak_flops", "fast"),
    ("hbm_bandwidth", -1), ("collective_bandwidth", 0), ("device_alloc_seconds", -0.001),
    ("device_free_seconds", -0.001),
    ("vmm_chunk_seconds", "x"), ("defrag_sweep_seconds", -1), ("slow_path_seconds", float("nan")),
    ("compaction_barrier_seconds", -5), ("hbm_bandwith", 1e12),
])
def test_bad_timing_values_name_the_key(key, value):
    with pytest.raises(InputError) as info:
        recipe_from_dict(_tiny(**{key: value}))
    assert f"memopt.timing.{key}" in str(info.value) or (key == "hbm_bandwith" and "hbm_bandwidth" in str(info.value))


def test_docs_table_lists_exactly_the_timing_keys_with_their_defaults():
    documented = documented_keys("timing")
    fields = {f.name: f.default for f in dataclasses.fields(TimingConfig)}
    assert set(documented) == set(fields)
    for key, default in fields.items():
        assert float(documented[key]) == default, f"timing.{key}: docs say {documented[key]}, the schema {default}"


def test_the_loader_takes_every_timing_default_from_the_schema():
    tree = ast.parse((ROOT / "ms_memopt" / "config" / "recipe.py").read_text(encoding="utf-8"))
    reader = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_read_timing")
    literal = [ast.unparse(c) for c in ast.walk(reader) if isinstance(c, ast.Call)
               and getattr(c.func, "attr", None) == "get" and len(c.args) >= 5 and isinstance(c.args[4], ast.Constant)]
    assert not literal, literal
    # no default of a timing key is written a second time in the package
    names = {f.name for f in dataclasses.fields(TimingConfig)}
    found = []
    for path in sorted((ROOT / "ms_memopt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name == "TimingConfig":
                continue
            if isinstance(node, ast.Call):
                found += [f"{path.name}:{node.lineno} {kw.arg}" for kw in node.keywords
                          if kw.arg in names and isinstance(kw.value, ast.Constant)]
    assert not found, found


def test_report_has_a_step_time_section(tmp_path, capsys):
    from ms_memopt.cli import main

    assert main(["simulate", str(DEMO), "--steps", "25", "--ranks", "1", "--workers", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "timing.json").read_text())["policies"]
    assert set(saved) == {"baseline", "compact", "pool"}
    assert len(saved["pool"]["step_seconds"]) == 25 and len(saved["pool"]["rank_step_median"]) == 1
    report = (tmp_path / "report.md").read_text()
    assert "## Step time" in report and "step_time.png" in report
    assert (tmp_path / "step_time.png").stat().st_size > 0


def test_sweep_has_the_timing_columns_and_sweeps_a_timing_key(tmp_path, capsys):
    from ms_memopt.cli import main

    code = main(["sweep", str(DEMO), "--set", "memopt.timing.hbm_bandwidth=1e9,4e9", "--steps", "25",
                 "--ranks", "1", "--workers", "1", "--policy", "compact", "--out", str(tmp_path), "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(set(TIMING_KEYS) <= set(r) for r in rows)
    slow, fast = rows
    # (the share need not fall: the unfused optimizer's copies slow down with the bandwidth too)
    assert slow["compaction_pause_share"] > 0 and fast["compaction_pause_share"] > 0
    assert slow["step_seconds_p99"] > fast["step_seconds_p99"]


def test_stalls_come_from_what_the_allocator_did(demo_results):
    # the demo pool grows in 1 MiB blocks (pregrow: false): its first steps take blocks from the device
    counts = [StepCounts(*c) for o in demo_results["baseline"].outcomes for c in o.result.step_counts]
    assert sum(c.device_allocs for c in counts) > 0
    assert all(c.optimizer_bytes > 0 for c in counts)                   # the unfused optimizer, every step
    pool = [StepCounts(*c) for o in demo_results["pool"].outcomes for c in o.result.step_counts]
    assert all(c.optimizer_bytes == 0 and c.device_allocs == 0 for c in pool)
    cheap = demo_results["baseline"].timing(TimingConfig(device_alloc_seconds=0.0))
    dear = demo_results["baseline"].timing(TimingConfig(device_alloc_seconds=1.0))
    assert dear["memory_stall_share"] > cheap["memory_stall_share"]
    assert dear["step_seconds_p99"] > cheap["step_seconds_p99"]


def test_vmm_chunk_maps_are_counted():
    job = job_from_recipe(load_recipe(DEMO), steps=3, policies=("baseline",))
    job.cfg.allocator, job.cfg.allocator_options = "mindspore-vmm", {}
    result = simulate_jobs([job], workers=1)[0]["baseline"]
    counts = [StepCounts(*c) for c in result.outcomes[0].result.step_counts]
    assert counts[0].vmm_chunks > 0                         # the first step maps its activations' chunks


def test_a_compaction_pays_host_work_per_live_tensor(demo_results):
    job = demo_results["compact"]
    counts = [StepCounts(*c) for o in job.outcomes for c in o.result.step_counts]
    compacted = [c for c in counts if c.compactions]
    assert compacted and all(c.compaction_tensors > 0 for c in compacted)
    assert all(c.compaction_tensors == 0 for c in counts if not c.compactions)
    c = StepCounts(compactions=1, compaction_bytes=0, compaction_tensors=1000)
    assert rank_step(c, TimingConfig(compaction_barrier_seconds=0.0, compaction_tensor_seconds=2e-5))[2] == \
        pytest.approx(0.02)


def test_every_card_draws_its_own_jitter_and_the_job_waits_for_the_slowest():
    from ms_memopt.simulation.timing import card_factors, job_timing

    counts = [[StepCounts(flops=1e12, model_flops=1e12).as_tuple()] * 200 for _ in range(4)]
    timing = TimingConfig(peak_flops=1e12, base_efficiency=1.0)
    calm, calm_detail = job_timing(counts, [0.0] * 4, timing, cards=64)
    assert calm["step_seconds_median"] == pytest.approx(1.0) and calm_detail["card_cv"] == 0
    jittered = TimingConfig(peak_flops=1e12, base_efficiency=1.0, card_jitter=0.05)
    t, detail = job_timing(counts, [0.0] * 4, jittered, cards=64)
    assert detail["cards_per_stream"] == 16
    assert 0.04 < detail["card_cv"] < 0.06                  # the cards' spread is the jitter
    # the slowest of 64 cards is about 2.4 sigma above the mean: the job's step is longer
    assert 1.08 < t["step_seconds_median"] < 1.16
    more, _ = job_timing(counts, [0.0] * 4, jittered, cards=1024)
    assert more["step_seconds_median"] > t["step_seconds_median"]
    # the same job seed draws the same factors; another seed others
    assert job_timing(counts, [0.0] * 4, jittered, cards=64)[0] == t
    assert job_timing(counts, [0.0] * 4, jittered, cards=64, seed=1)[0] != t
    assert card_factors(2, 2, 10, 3.0).min() >= 0.5 and card_factors(2, 2, 10, 3.0).max() <= 1.5


def test_idle_blocks_given_back_are_priced_at_device_free_seconds():
    c = StepCounts(device_frees=3, device_allocs=1)
    timing = TimingConfig(device_free_seconds=0.01, device_alloc_seconds=0.5)
    assert rank_step(c, timing)[1] == pytest.approx(0.53)
    assert rank_step(c, TimingConfig(device_free_seconds=0.0, device_alloc_seconds=0.5))[1] == pytest.approx(0.5)
    assert TimingConfig().device_free_seconds == TimingConfig().device_alloc_seconds   # the same assumption


def test_new_counts_come_last_so_older_tuples_keep_their_positions():
    c = StepCounts(flops=1.0, device_allocs=2, slow_path=4, new_shape_requests=5, device_frees=7, layer_passes=3)
    t = c.as_tuple()
    assert t[-2:] == (7, 3) and StepCounts(*t) == c
    older = t[:-2]                          # a tuple written before device_frees and layer_passes existed
    assert StepCounts(*older).device_frees == 0 and StepCounts(*older).slow_path == 4
    assert rank_step(older, TimingConfig()) == rank_step(StepCounts(*older), TimingConfig())


def test_the_simulator_counts_the_idle_blocks_a_model_gave_back():
    """_stall_start/_stall_add: the model's segment_frees since the step began (a compaction's
    fresh model starts its own count), beside the slow-path events."""
    from ms_memopt.allocators import create
    from ms_memopt.simulation.simulate import _Run

    run = object.__new__(_Run)              # the counting lines only, no workload
    run.model = create("mindspore", capacity=64 * 2**20, increase_size=16 * 2**20)
    run._stall_counts = [0, 0, 0, 0, 0]
    start = run._stall_start()
    blocks = [run.model.malloc(10 * 2**20) for _ in range(3)]
    for addr in blocks[:2]:
        run.model.free(addr)
    run.model.empty_cache()                 # two idle blocks go back
    run.model.malloc(64 * 2**20)            # cannot be served: one slow-path request
    run._stall_add(start)
    allocs, _, _, slow, freed = run._stall_counts
    assert (allocs, slow, freed) == (3, 1, 2)


def test_pool_mode_as_the_field_ran_it_recomputes_and_pays_one_forward_more(tmp_path):
    from ms_memopt.config.recipe import recipe_from_dict
    from ms_memopt.core.errors import InputError
    from ms_memopt.io.yamltext import parse_yaml

    data = parse_yaml(DEMO.read_text(), source=str(DEMO))
    data["memopt"]["pool_checkpoint_every"] = 1
    recipe = recipe_from_dict(data, source=str(DEMO))
    job = job_from_recipe(recipe, steps=12)
    assert job.pool_specs is not None and job.pool_specs[0].recompute_every == 1
    assert job.specs[0].recompute_every == 0
    results = simulate_jobs([job], workers=1)[0]
    for policy, ratio in (("baseline", 1.0), ("compact", 1.0), ("pool", 4 / 3)):
        counts = [StepCounts(*c) for c in results[policy].outcomes[0].result.step_counts]
        assert counts and all(c.flops == pytest.approx(ratio * c.model_flops) for c in counts), policy
    # recompute keeps less: pool mode's peak is below the baseline's
    peak = {p: results[p].outcomes[0].result.peak_allocated for p in ("baseline", "pool")}
    assert peak["pool"] < peak["baseline"]
    data["memopt"]["pool_checkpoint_every"] = 99
    with pytest.raises(InputError, match=r"memopt\.pool_checkpoint_every.*at most the layers"):
        recipe_from_dict(data, source=str(DEMO))


# --- the CPU timing profile (recipes/demo_cpu.yaml, measured by bench/timing_cpu.py) -----------

#: the keys bench/timing_cpu.py measures and recipes/demo_cpu.yaml sets from it
CPU_PROFILE_KEYS = ("peak_flops", "base_efficiency", "hbm_bandwidth", "device_alloc_seconds",
                    "compaction_barrier_seconds", "request_seconds", "shape_build_seconds")


def _timing_section_lines(path: Path) -> list[str]:
    """The ``key: value`` lines of ``memopt.timing`` in a recipe file (comments kept)."""
    lines, inside, indent = [], False, None
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped == "timing:":
            inside, indent = True, len(line) - len(line.lstrip())
            continue
        if inside and stripped and not stripped.startswith("#"):
            if len(line) - len(line.lstrip()) <= indent:
                break
            lines.append(stripped)
    return lines


def test_the_cpu_demo_recipe_carries_the_measured_cpu_profile():
    """Every measured key is set in the demo recipe, each with a comment naming the bench, and
    the values are a CPU's (not the 910C defaults); no measured value is asserted."""
    lines = _timing_section_lines(DEMO)
    keys = {line.split(":", 1)[0]: line for line in lines}
    assert set(CPU_PROFILE_KEYS) <= set(keys), set(CPU_PROFILE_KEYS) - set(keys)
    for key in CPU_PROFILE_KEYS:
        assert "bench/timing_cpu.py" in keys[key], f"memopt.timing.{key}: no comment naming bench/timing_cpu.py"
    timing, default = load_recipe(DEMO).memopt.timing, TimingConfig()
    assert timing.request_seconds > 0 and timing.shape_build_seconds >= 0
    assert timing.peak_flops < default.peak_flops and timing.hbm_bandwidth < default.hbm_bandwidth
    for key in CPU_PROFILE_KEYS:
        assert getattr(timing, key) == float(keys[key].split(":", 1)[1].split("#")[0]), key


def test_simulate_of_the_cpu_demo_prices_its_steps_with_the_cpu_profile(capsys):
    """``ms-memopt simulate recipes/demo_cpu.yaml --json``: every policy's step is at least its
    requests' host time under the recipe's profile, and equals the re-pricing of its counts with
    that profile (not with the 910C defaults)."""
    from ms_memopt.cli import main

    recipe = load_recipe(DEMO)
    profile = recipe.memopt.timing
    assert main(["simulate", str(DEMO), "--steps", "12", "--ranks", "1", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    job = job_from_recipe(recipe, steps=12)
    assert job.cfg.timing == profile
    results = simulate_jobs([job], workers=1)[0]
    for policy, figures in out["policies"].items():
        _sane(figures["timing"])
        result = results[policy]
        assert figures["timing"] == pytest.approx(result.timing(profile))
        assert figures["timing"] != pytest.approx(result.timing(TimingConfig()))
        counts = [StepCounts(*c) for c in result.outcomes[0].result.step_counts]
        host = sorted(c.requests * profile.request_seconds for c in counts)
        assert figures["timing"]["step_seconds_median"] >= host[len(host) // 2] > 0, policy


def test_a_hand_made_step_is_priced_on_the_real_pools_request_count(demo_results):
    """The hand-made workload makes only the large buffers: with host_requests_per_layer the
    host time is priced per layer pass (layer x micro-batch) plus per step, not on its own
    requests; 0 keeps its own."""
    recipe = load_recipe(DEMO)
    job = demo_results["baseline"]
    counts = [StepCounts(*c) for c in job.outcomes[0].result.step_counts]
    passes = recipe.model.num_layers * recipe.parallel.micro_batch_num
    assert all(c.layer_passes == passes for c in counts)
    own = TimingConfig(request_seconds=1e-3, host_requests_per_layer=0.0)
    real = TimingConfig(request_seconds=1e-3, host_requests_per_layer=214, host_requests_per_step=172)
    c = counts[-1]
    assert c.requests < 100 and c.host_requests(own) == (c.requests, c.new_shape_requests)
    assert c.host_requests(real)[0] == 214 * passes + 172
    assert rank_step(c, real)[0] - rank_step(c, own)[0] == pytest.approx((214 * passes + 172 - c.requests) * 1e-3)
