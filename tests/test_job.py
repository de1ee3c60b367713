"""The job simulator: rank streams, the job's death at its first rank, executors, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ms_memopt.simulation.job import JobResult, median_job_oom_step, reproducible_figures, simulate_jobs
from ms_memopt.simulation.spec import JobSpec, RankStream, job_from_recipe, rank_streams, stream_seed
from ms_memopt.simulation.simulate import simulate_policy
from test_simulate import MiB, small_cfg, small_spec

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "dense_100b_1024x910c.yaml"


def _recipe():
    if not RECIPE.exists():
        pytest.skip("recipes/dense_100b_1024x910c.yaml not in this tree")
    from ms_memopt.config.recipe import load_recipe
    return load_recipe(RECIPE)


def small_job(steps: int = 80, groups: int = 3, policies=("baseline",), seed: int = 0) -> JobSpec:
    """Two pipeline stages x ``groups`` data-parallel groups of a deliberately tight small card
    (stage 0 holds 3 micro-batches in flight, stage 1 two), tensor parallel 2."""
    streams = [RankStream(stage=s, data_parallel=g, rank=(s * groups + g) * 2, tensor_parallel=2,
                          seed=stream_seed(seed, s, g)) for s in range(2) for g in range(groups)]
    return JobSpec(specs={0: small_spec(in_flight=3), 1: small_spec(in_flight=2)},
                   cfg=small_cfg(steps=steps, capacity=104 * MiB), streams=streams,
                   policies=tuple(policies), seed=seed)


# --- streams -------------------------------------------------------------------------------------

def test_every_stream_of_the_100b_job_stage_major_with_its_own_seed():
    recipe = _recipe()
    streams = rank_streams(recipe)
    assert len(streams) == 8 * 16                 # tensor-parallel peers share a stream
    assert [(s.stage, s.data_parallel) for s in streams[:2]] == [(0, 0), (0, 1)]
    assert [s.rank for s in streams] == list(range(0, 1024, 8))
    assert streams[-1].ranks == range(1016, 1024)
    assert streams[0].seed == recipe.memopt.workload.seed
    assert len({s.seed for s in streams}) == len(streams)
    assert rank_streams(recipe, seed=1)[5].seed != streams[5].seed


def test_a_sample_is_stratified_over_stages_and_deterministic():
    recipe = _recipe()
    sample = rank_streams(recipe, ranks=12)
    assert len(sample) == 12 and len(set(sample)) == 12
    assert sorted({s.stage for s in sample}) == list(range(8))
    assert sum(s.stage == 0 for s in sample) == 2
    assert sample == rank_streams(recipe, ranks=12)
    assert set(sample) <= set(rank_streams(recipe))
    only_first = rank_streams(recipe, stages=[0])
    assert len(only_first) == 16 and {s.stage for s in only_first} == {0}
    assert rank_streams(recipe, ranks=1000) == rank_streams(recipe)


def test_each_stage_has_its_own_workload():
    job = job_from_recipe(_recipe(), ranks=8, steps=2)
    assert sorted(job.specs) == list(range(8))
    assert [job.specs[s].in_flight for s in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]


def test_bad_stage_and_sample_size_are_input_errors():
    from ms_memopt.core.errors import InputError

    recipe = _recipe()
    with pytest.raises(InputError, match="--stages"):
        rank_streams(recipe, stages=[8])
    with pytest.raises(InputError, match="--ranks"):
        rank_streams(recipe, ranks=0)


# --- the job dies at its first rank -------------------------------------------------------------

def test_job_dies_at_its_first_rank_and_a_policy_saves_it_only_if_every_rank_survives():
    job = small_job(policies=("baseline", "compact"))
    result = simulate_jobs([job], workers=1)[0]
    base = result["baseline"]
    alone = {o.stream: simulate_policy(job.specs[o.stream.stage], "baseline", job.cfg, seed=o.stream.seed)
             for o in base.outcomes}
    # every rank's run is the one-card simulation of its stream
    assert {s: r.oom_step for s, r in alone.items()} == {o.stream: o.result.oom_step for o in base.outcomes}
    failed = [(r.oom_step, s.rank, s) for s, r in alone.items() if r.oom_step is not None]
    assert failed and len(failed) < len(alone)          # some ranks fail, not all
    step, rank, stream = min(failed)
    assert base.job_oom_step == step
    d = base.to_dict()
    assert (d["job_oom_step"], d["job_oom_rank"], d["job_oom_stage"]) == (step, rank, stream.stage)
    assert d["job_oom_ranks"] == [rank, rank + 1]
    assert d["ranks"] == 6 and d["distribution"]["oom_ranks"] == len(failed)
    assert d["distribution"]["oom_step_min"] == step
    assert d["first_rank"]["oom_step"] == step and d["first_rank"]["rank"] == rank
    assert len(d["rank_results"]) == 6
    compact = result["compact"]
    assert compact.job_oom_step is None or compact.job_oom_step > step
    if compact.job_oom_step is None:
        assert compact.to_dict()["job_oom_rank"] is None and compact.first is None


def test_a_one_stream_job_is_the_one_card_simulation():
    job = small_job(groups=1)
    job.streams = job.streams[:1]
    r = simulate_jobs([job], workers=1)[0]["baseline"].outcomes[0].result.to_dict()
    alone = simulate_policy(job.specs[0], "baseline", job.cfg, seed=job.seed).to_dict()
    r.pop("seconds"), alone.pop("seconds")
    assert r == alone


def test_median_job_oom_step_counts_survivors_as_later():
    def job(step):
        r = JobResult("baseline", 0, 100)
        from ms_memopt.simulation.job import RankOutcome
        from ms_memopt.simulation.simulate import PolicyResult
        r.outcomes.append(RankOutcome(RankStream(0, 0, 0, 1, 0), PolicyResult("baseline", 0, 100, oom_step=step)))
        return r

    assert median_job_oom_step([job(10), job(30), job(None)]) == 30
    assert median_job_oom_step([job(10), job(None), job(None)]) is None


# --- executors ----------------------------------------------------------------------------------

def test_results_identical_inline_on_local_processes_and_on_dask():
    pytest.importorskip("distributed")
    jobs = [small_job(steps=30, groups=2, policies=("baseline", "compact")),
            small_job(steps=30, groups=2, policies=("baseline", "compact"), seed=1)]
    inline = reproducible_figures(simulate_jobs(jobs, workers=1))
    local = reproducible_figures(simulate_jobs(jobs, executor="local", workers=2))
    dask = reproducible_figures(simulate_jobs(jobs, executor="dask", workers=2, processes=False))
    assert inline == local == dask
    assert len(inline) == 2 * 4 * 2


def test_progress_counts_every_rank_stream():
    seen = []
    simulate_jobs([small_job(steps=3)], workers=1, on_stream=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 6) for i in range(1, 7)]


def test_unknown_executor_and_address_without_engine_are_input_errors():
    from ms_memopt.core.errors import InputError
    from ms_memopt.simulation.executors import run_tasks

    with pytest.raises(InputError, match="--executor"):
        run_tasks(abs, [1], executor="spark")
    with pytest.raises(InputError, match="--address"):
        run_tasks(abs, [1], executor="local", address="tcp://127.0.0.1:8786")


# --- the CLI ------------------------------------------------------------------------------------

def test_cli_job_json_and_timeline(tmp_path, capsys):
    _recipe()
    from ms_memopt.cli import main

    code = main(["simulate", str(RECIPE), "--steps", "2", "--ranks", "2", "--policy", "baseline,pool",
                 "--workers", "1", "--out", str(tmp_path), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == 2
    for policy in ("baseline", "pool"):
        p = out["policies"][policy]
        assert p["job_oom_step"] is None and p["job_oom_rank"] is None and p["job_oom_stage"] is None
        assert p["ranks"] == 2 and [r["stage"] for r in p["rank_results"]] == [0, 1]
    rows = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in rows} == {r["rank"] for r in out["policies"]["baseline"]["rank_results"]}
    assert (tmp_path / "fragmentation.png").stat().st_size > 0


@pytest.mark.parametrize("argv, where", [
    (["--stages", "9"], "--stages"),
    (["--stages", "x"], "--stages"),
    (["--ranks", "0"], "--ranks"),
    (["--address", "tcp://127.0.0.1:1"], "--address"),
    (["--compact-trigger", "sometimes"], "--compact-trigger"),
])
def test_cli_bad_job_options_exit_2(argv, where, capsys):
    _recipe()
    from ms_memopt.cli import main

    assert main(["simulate", str(RECIPE), "--steps", "1", *argv]) == 2
    assert where in capsys.readouterr().err


def test_cli_compact_trigger_from_flag_and_recipe(tmp_path, capsys):
    """``--compact-trigger`` and ``memopt.compact_trigger`` select the compact policy's warning
    (the flag wins); a bad recipe value exits 2 naming the key path."""
    _recipe()
    from ms_memopt.cli import main

    base = ["--steps", "1", "--ranks", "1", "--policy", "baseline", "--workers", "1", "--json"]
    assert main(["simulate", str(RECIPE), *base]) == 0
    assert json.loads(capsys.readouterr().out)["compact_trigger"] == "forecast"
    assert main(["simulate", str(RECIPE), *base, "--compact-trigger", "margin"]) == 0
    assert json.loads(capsys.readouterr().out)["compact_trigger"] == "margin"
    text = RECIPE.read_text().replace("  compact_every: 500\n", "  compact_every: 500\n  compact_trigger: margin\n")
    assert "compact_trigger: margin" in text
    recipe = tmp_path / "margin.yaml"
    recipe.write_text(text)
    assert main(["simulate", str(recipe), *base]) == 0
    assert json.loads(capsys.readouterr().out)["compact_trigger"] == "margin"
    assert main(["simulate", str(recipe), *base, "--compact-trigger", "forecast"]) == 0
    assert json.loads(capsys.readouterr().out)["compact_trigger"] == "forecast"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("compact_trigger: margin", "compact_trigger: sometimes"))
    assert main(["simulate", str(bad), *base]) == 2
    err = capsys.readouterr().err
    assert "memopt.compact_trigger" in err and "forecast, margin" in err and "Traceback" not in err


def test_report_of_a_job_timeline_counts_ranks_not_seeds(tmp_path):
    """A job's timeline rows carry ``rank``: the report's table speaks of ranks (each with its
    own seed), earliest OOM first, never of seeds."""
    from ms_memopt.report.build import build_report

    rows = []
    for rank, seed, oom in ((0, 111, 300), (5, 222, 250), (9, 333, None)):
        rows += [{"policy": "baseline", "rank": rank, "stage": rank // 4, "seed": seed, "step": s, "kind": "scan",
                  "free_total": 8 * 2**30, "largest_free": 2**30, "frag_ratio": 3.0} for s in (100, 200)]
        if oom:
            rows.append({"policy": "baseline", "rank": rank, "stage": rank // 4, "seed": seed, "step": oom,
                         "kind": "oom", "free_total": 8 * 2**30, "largest_free": 2**30, "frag_ratio": 7.0,
                         "tag": "allreduce", "size": 4_200_000_000, "oom_kind": "fragmentation"})
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = build_report(tmp_path).read_text()
    assert "| policy | ranks | OOM (earliest rank first) |" in text
    assert ("| baseline | 3 | rank 5 (stage 1, seed 222): step 250 (fragmentation, allreduce 3.91 GiB); "
            "rank 0 (stage 0, seed 111): step 300") in text
    assert "| seeds |" not in text and "rank streams" in text


def test_a_huge_job_must_be_sampled():
    from dataclasses import replace

    from ms_memopt.core.errors import InputError
    from ms_memopt.simulation.spec import MAX_STREAMS

    recipe = _recipe()
    huge = replace(recipe, parallel=replace(recipe.parallel, data_parallel=MAX_STREAMS))
    with pytest.raises(InputError, match="--ranks"):
        rank_streams(huge)
    sample = rank_streams(huge, ranks=16)
    assert len(set(sample)) == 16 and max(s.data_parallel for s in sample) < MAX_STREAMS


def test_job_level_controls_and_ablation_on_the_tight_small_card():
    """The seed study's controls and ablation hold at job level: the job dies with every
    mechanism on, and survives with every mechanism off or with either growth mechanism off."""
    from dataclasses import replace

    def run(change):
        job = small_job(steps=100, groups=2)
        job.specs = {stage: change(spec) for stage, spec in job.specs.items()}
        return simulate_jobs([job], workers=1)[0]["baseline"]

    assert run(lambda s: s).job_oom_step is not None
    off = run(lambda s: replace(s, enabled=False))
    assert off.job_oom_step is None and len({o.result.largest_free_min for o in off.outcomes if o.stream.stage == 0}) == 1
    assert run(lambda s: s.without("shape_cache")).job_oom_step is None
    assert run(lambda s: s.without("dynamic_seq")).job_oom_step is None


@pytest.mark.slow
def test_results_identical_on_ray_local_mode_with_progress_across_ranks(monkeypatch):
    """The real Ray, in its local mode (run_tasks starts it with ``ray.init("local", num_cpus=2,
    include_dashboard=False)`` and shuts it down): the same figures as inline for the same
    seeds, and one progress tick per rank stream of both jobs. Local mode is our own instance:
    a RAY_ADDRESS (or the last ``ray start``'s address file) does not send it elsewhere."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    jobs = [small_job(steps=30, groups=2, policies=("baseline", "compact")),
            small_job(steps=30, groups=2, policies=("baseline", "compact"), seed=1)]
    inline = reproducible_figures(simulate_jobs(jobs, workers=1))
    seen = []
    on_ray = reproducible_figures(simulate_jobs(jobs, executor="ray", workers=2,
                                                on_stream=lambda done, total: seen.append((done, total))))
    assert on_ray == inline
    assert seen == [(i, 8) for i in range(1, 9)]
    assert not ray.is_initialized()           # joined here, so left here


@pytest.mark.slow
def test_ray_runs_any_callable_and_raises_the_task_error_on_a_cluster_it_joined():
    """On a Ray already running (as on a cluster the user started), run_tasks takes builtins
    and classes as task functions (``ray.remote`` alone refuses ``abs`` and makes ``int`` an
    actor), raises a failing task's own exception, and leaves the cluster running."""
    ray = pytest.importorskip("ray")
    from ms_memopt.simulation.executors import run_tasks

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        done = []
        assert run_tasks(abs, [-1, 2, -3], executor="ray", on_done=lambda i, v: done.append(i)) == [1, 2, 3]
        assert sorted(done) == [0, 1, 2]
        with pytest.raises(ValueError, match="invalid literal"):
            run_tasks(int, ["1", "x"], executor="ray")
        assert ray.is_initialized()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_unreachable_ray_cluster_is_an_input_error_at_once(address):
    """Ray itself retries an unreachable address for minutes (docs/verified.md); run_tasks
    answers after one refused connection."""
    pytest.importorskip("ray")
    from ms_memopt.core.errors import InputError
    from ms_memopt.simulation.executors import run_tasks

    with pytest.raises(InputError, match="--address: cannot reach the Ray cluster at .*refused"):
        run_tasks(abs, [1], executor="ray", address=address)


def test_cli_unreachable_ray_cluster_exits_2(capsys):
    _recipe()
    pytest.importorskip("ray")
    from ms_memopt.cli import main

    assert main(["simulate", str(RECIPE), "--steps", "1", "--executor", "ray", "--address", "127.0.0.1:1"]) == 2
    assert "--address: cannot reach the Ray cluster" in capsys.readouterr().err


def test_ray_missing_is_an_input_error(monkeypatch):
    import sys

    from ms_memopt.core.errors import InputError
    from ms_memopt.simulation.executors import run_tasks

    monkeypatch.setitem(sys.modules, "ray", None)     # import ray -> ImportError
    with pytest.raises(InputError, match="ray"):
        run_tasks(abs, [1], executor="ray")
