"""A learned step template as the simulator's workload (issue 23, item 3), and the recipe key
that names one (``memopt.workload.template``)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ms_memopt.config.recipe import WorkloadConfig, load_recipe, recipe_from_dict
from ms_memopt.core.errors import InputError
from ms_memopt.templates.template import generate, save_template
from ms_memopt.templates.workload import WATCH, TemplateWorkload, recorded_dims
from ms_memopt.workload.step import draw_sequence_length
from tests.test_template import learned

TINY = {"model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 32,
                                   "vocab_size": 256}},
        "memopt": {"device": {"hbm": "1GiB"}}}


def _plain(rows):
    """The template's own events of some steps' rows: no step events, marks or watched tags."""
    return [(r[0], r[1], r[2]) for r in rows if r[0] in ("alloc", "free")]


def test_a_given_schedule_gives_the_template_s_own_events():
    template = learned()
    schedule = [{"seq": s, "batch": b} for s, b in [(8, 2), (16, 2), (16, 2), (24, 4), (8, 2), (32, 6)]]
    work = TemplateWorkload(template, schedule=schedule)
    rows = work.prologue_rows()
    for step in range(1, len(schedule) + 1):
        rows += work.step_rows(step)
        assert work.dims == schedule[step - 1] and work.lengths == [schedule[step - 1]["seq"]]
    want = [(e.action, e.id, e.size) for e in generate(template, schedule) if e.action in ("alloc", "free")]
    assert _plain(rows) == want
    assert work.shapes_seen == {(("batch", b), ("seq", s)) for s, b in [(8, 2), (16, 2), (24, 4), (32, 6)]}
    with pytest.raises(InputError, match="the schedule has 6 steps; step 7"):
        work.step_rows(7)


def test_each_step_is_framed_and_its_largest_request_is_watched():
    work = TemplateWorkload(learned(), schedule=[{"seq": 16, "batch": 2}] * 3)
    rows = work.step_rows(2)
    assert rows[0][0] == "step" and rows[0][-1] == 2
    assert rows[-1][0] == "mark" and rows[-1][7] == "optimizer_end"
    allocs = [r for r in rows if r[0] == "alloc"]
    watched = [r for r in allocs if r[7] == WATCH]
    assert len(watched) == 1 and watched[0][2] == max(r[2] for r in allocs)
    assert all(r[-1] == 2 for r in rows)                 # every row carries its step


def test_drawn_steps_follow_the_recipe_s_length_rule_with_the_card_s_seed():
    template = learned()
    rules = WorkloadConfig(dynamic_seq=True, seq_min=8, seq_max=32, seq_align=8)
    work = TemplateWorkload(template, rules=rules, seq_length=32, seed=11)
    rng = np.random.default_rng(11)
    for step in range(1, 41):         # past the first generation: the stream is extended
        work.step_rows(step)
        assert work.dims == {"seq": draw_sequence_length(rng, rules, 32), "batch": recorded_dims(template)["batch"]}
    again = TemplateWorkload(template, rules=rules, seq_length=32, seed=11)
    assert _plain(again.step_rows(3)) == _plain(work.step_rows(3))       # regeneration changes nothing
    other = TemplateWorkload(template, rules=rules, seq_length=32, seed=12)
    assert [other.step_rows(s) and other.dims["seq"] for s in range(1, 41)] != \
           [work.step_rows(s) and work.dims["seq"] for s in range(1, 41)]


def test_without_a_seq_dim_drawn_lengths_are_an_error():
    template = copy.deepcopy(learned())
    template.dims = ["batch"]
    with pytest.raises(InputError, match="has no 'seq' dim"):
        TemplateWorkload(template, rules=WorkloadConfig(dynamic_seq=True), seq_length=32)


def test_the_recipe_key_is_relative_to_the_recipe_and_must_be_a_template(tmp_path):
    save_template(learned(), tmp_path / "models" / "mine.template.json")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  model_config: {num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 32,"
                      " vocab_size: 256}\nmemopt:\n  workload:\n    template: models/mine.template.json\n")
    assert load_recipe(recipe).memopt.workload.template == str(tmp_path / "models" / "mine.template.json")
    for value, why in (("models/mine.json", "NAME.template.json"), ("gone.template.json", "existing step template"),
                       (3, "NAME.template.json")):
        data = copy.deepcopy(TINY)
        data["memopt"]["workload"] = {"template": value}
        with pytest.raises(InputError, match=why) as err:
            recipe_from_dict(data, source=str(recipe))
        assert err.value.key == "memopt.workload.template"



def _template_recipe(tmp_path, **workload):
    save_template(learned(), tmp_path / "toy.template.json")
    lines = ["model:", "  model_config: {num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 32, vocab_size: 256}",
             "runner_config: {batch_size: 4}",
             "parallel_config: {data_parallel: 2, model_parallel: 1, pipeline_stage: 1, micro_batch_num: 1}",
             "memopt:", "  device: {hbm: 160KiB, cards: 2}", "  compact_every: 10",
             "  allocator: {name: mindspore_bestfit}",
             "  timing: {request_seconds: 1.0e-4, shape_build_seconds: 1.0e-3}",
             "  workload:", "    template: toy.template.json", "    steps: 60", "    dynamic_seq: true",
             "    seq_min: 8", "    seq_max: 32", "    seq_align: 8"]
    lines += [f"    {k}: {v}" for k, v in workload.items()]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_recipe_naming_a_template_runs_the_job_under_every_policy(tmp_path, capsys):
    import json

    from ms_memopt.cli import main

    recipe = _template_recipe(tmp_path)
    assert main(["simulate", str(recipe), "--json", "--workers", "1", "--out", str(tmp_path / "out")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == 2 and set(out["policies"]) == {"baseline", "compact", "pool"}
    for policy, result in out["policies"].items():
        assert result["job_oom_step"] is None, policy
        assert result["timing"]["step_seconds_median"] > 0
    # every 10 steps of 60 a periodic compaction is planned; on a learned template one runs only
    # when the next step would fail without it, and the result says why the others did not
    compact = out["policies"]["compact"]["first_rank"]
    assert compact["compactions"] + compact["compactions_skipped"] == 6
    assert all("the next step fits the pool as it is" in s["why"] or "would not raise the largest piece" in s["why"]
               for s in compact["compaction_skips"])
    assert (tmp_path / "out" / "memory_map.png").is_file()


def test_template_steps_are_priced_per_request_and_per_new_shape():
    from ms_memopt.simulation.spec import config_from_recipe
    from ms_memopt.simulation.simulate import simulate_policy
    from ms_memopt.simulation.timing import StepCounts
    from ms_memopt.simulation.spec import spec_from_recipe

    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(_template_recipe(Path(tmp)))
        spec = spec_from_recipe(recipe)
        result = simulate_policy(spec, "baseline", config_from_recipe(recipe, steps=30))
    counts = [StepCounts(*c) for c in result.step_counts]
    assert len(counts) == 30 and all(c.requests > 0 for c in counts)
    new = [c for c in counts if c.new_shape_requests]
    assert 1 <= len(new) <= result.shapes_seen and all(c.new_shape_requests == c.requests for c in new)


def _schedule(tmp_path, lengths):
    path = tmp_path / "s.csv"
    path.write_text("seq,batch\n" + "".join(f"{n},4\n" for n in lengths))
    return path


def test_a_bare_template_runs_as_a_one_card_job_with_policies_report_and_memory_map(tmp_path, capsys):
    import json

    from ms_memopt.cli import main

    save_template(learned(), tmp_path / "toy.template.json")
    schedule = _schedule(tmp_path, [8, 16, 32, 8, 24] * 8)
    args = ["simulate", str(tmp_path / "toy.template.json"), "--schedule", str(schedule)]
    assert main(args + ["--json", "--workers", "1", "--out", str(tmp_path / "out")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == 1 and out["steps"] == 40 and set(out["policies"]) == {"baseline", "compact", "pool"}
    assert out["allocator"] == "mindspore-bestfit"
    for policy, result in out["policies"].items():
        assert result["job_oom_step"] is None, policy
        assert result["timing"] is None and "recipe" in result["timing_note"]     # no model FLOPs to price
        assert result["first_rank"]["peak_allocated"] > 0
    for name in ("timeline.jsonl", "layouts.jsonl", "report.md", "memory_map.png"):
        assert (tmp_path / "out" / name).is_file(), name
    assert not (tmp_path / "out" / "timing.json").exists()
    # --steps takes the schedule's first steps, --policy picks, --capacity sets the card
    assert main(args + ["--json", "--workers", "1", "--steps", "10", "--policy", "baseline",
                        "--capacity", "1MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 10 and list(out["policies"]) == ["baseline"] and out["capacity"] == 2**20
    # a job of many ranks needs a recipe; the replay's options do not mix with the job's
    assert main(args + ["--ranks", "4"]) == 2
    assert "memopt.workload.template" in capsys.readouterr().err
    assert main(args + ["--steps", "41"]) == 2
    assert "schedule's rows" in capsys.readouterr().err
    assert main(args + ["--export-events", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o2")]) == 2
    assert "--out" in capsys.readouterr().err
    # the replay takes --steps too: the schedule's first steps
    assert main(args + ["--export-events", str(tmp_path / "x.jsonl"), "--steps", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 5


def test_a_recipe_takes_its_template_steps_from_a_schedule(tmp_path):
    from ms_memopt.simulation.spec import config_from_recipe
    from ms_memopt.simulation.simulate import simulate_policy
    from ms_memopt.simulation.spec import spec_from_recipe

    _schedule(tmp_path, [32] * 30)
    recipe = load_recipe(_template_recipe(tmp_path, schedule="s.csv", steps=30))
    assert recipe.memopt.workload.schedule == str(tmp_path / "s.csv")
    result = simulate_policy(spec_from_recipe(recipe), "baseline", config_from_recipe(recipe))
    assert result.shapes_seen == 1 and result.steps == 30
    # the schedule's length bounds the run; a schedule needs a template; it must exist
    with pytest.raises(InputError, match="step 31"):
        simulate_policy(spec_from_recipe(recipe), "baseline", config_from_recipe(recipe, steps=31))
    path = _template_recipe(tmp_path, schedule="missing.csv")
    with pytest.raises(InputError, match=r"memopt\.workload\.schedule.*existing schedule file"):
        load_recipe(path)
    path.write_text(path.read_text().replace("    template: toy.template.json\n", ""))
    _schedule(tmp_path, [8])
    path.write_text(path.read_text().replace("missing.csv", "s.csv"))
    with pytest.raises(InputError, match="only with memopt.workload.template"):
        load_recipe(path)


def test_the_workload_runs_the_prologue_and_layer_count_of_its_schedule():
    """A prologue fitted in hidden and a repeated block count: the simulator's steps are the
    template's at the schedule's own hidden and layers, prologue included (not the dims
    recorded most often)."""
    from tests.test_template import LAYER_RUNS, hidden_record

    from ms_memopt.templates.template import learn

    template = learn([(f"h{h}_L{n}_{i}", hidden_record(h, seqs, layers=n))
                      for h in (32, 48, 64) for n in (2, 3, 4) for i, seqs in enumerate(LAYER_RUNS)])
    schedule = [{"seq": s, "hidden": 80, "layers": 6} for s in (12, 12, 20)]
    work = TemplateWorkload(template, schedule=schedule)
    rows = work.prologue_rows() + [r for step in (1, 2, 3) for r in work.step_rows(step)]
    got = [(r[0], r[2]) for r in rows if r[0] in ("alloc", "free")]
    want = [(e.action, e.size) for e in hidden_record(80, [12, 12, 20], layers=6) if e.action in ("alloc", "free")]
    assert [s for a, s in got if a == "alloc"] == [s for a, s in want if a == "alloc"]
