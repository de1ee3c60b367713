"""The cures on a model's own learned steps (issue 41): purposes learned from lifetimes, pool mode's
regions by purpose, compaction that helps on a pool of many blocks and never makes a run die
sooner, and the bound the best placement of the same steps sets.

The property tests draw whole models: a few layers whose forward keeps activations of sizes linear
and quadratic in the sequence length, short-lived workspace, a backward that frees the activations
in an order of its own (the free order a process draws) and makes one gradient per parameter kept
to the next step, and an optimizer whose update makes three outputs per parameter (MindSpore's
``AdamWeightDecay`` on CPU), recorded by three processes at several lengths and learned with
``learn`` as a user's recordings are.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ms_memopt.allocators import create
from ms_memopt.analysis.compaction.model import largest_piece, try_compaction
from ms_memopt.analysis.compaction.planner import plan_compaction, plan_opening
from ms_memopt.analysis.purposes import learn_purposes
from ms_memopt.cli import main
from ms_memopt.config.recipe import recipe_from_dict
from ms_memopt.core.events import Event
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.replay.loop import drive
from ms_memopt.simulation.simulate import simulate
from ms_memopt.simulation.spec import config_from_recipe, spec_from_recipe
from ms_memopt.templates.template import dims_tag, learn, save_template

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20


class Model:
    """A drawn model, recorded as MindSpore's CPU pool records a PyNative training step."""

    def __init__(self, layers: list[tuple[int, int]], params: list[int], order: list[int], workspace: int) -> None:
        self.layers, self.params, self.order, self.workspace = layers, params, order, workspace

    def record(self, seqs: list[int]) -> list[Event]:
        events, next_id, grads = [Event("step")], [0], []

        def alloc(size: int) -> int:
            next_id[0] += 1
            events.append(Event("alloc", id=next_id[0], size=size))
            return next_id[0]

        for seq in seqs:
            acts = []
            for linear, quadratic in self.layers:          # forward: activations kept for backward
                acts.append(alloc(linear * seq))
                acts.append(alloc(quadratic * seq * seq))
                events.append(Event("free", id=alloc(self.workspace * seq)))
            new = []
            for k in self.order:                          # backward: the process's own free order
                events.append(Event("free", id=acts[k]))
                if k < len(self.params):
                    new.append(alloc(self.params[k]))
            new += [alloc(size) for size in self.params[len(new):]]
            for size, old in zip(self.params, grads or [None] * len(self.params)):   # the optimizer's update
                outs = [alloc(size) for _ in range(3)]
                for out in outs:
                    events.append(Event("free", id=out))
                if old is not None:
                    events.append(Event("free", id=old))
            grads = new
            events.append(Event("step", tag=dims_tag({"seq": seq})))
        events += [Event("free", id=g) for g in grads]        # the process's exit
        return events


@st.composite
def models(draw) -> Model:
    layers = draw(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 16)).map(lambda t: (t[0] * 512, t[1] * 64)),
                           min_size=1, max_size=3))
    params = draw(st.lists(st.integers(1, 64).map(lambda n: n * 1024), min_size=1, max_size=4))
    order = draw(st.permutations(range(2 * len(layers))))
    return Model(layers, params, list(order), draw(st.integers(1, 32)) * 256)


def _template(model: Model, path: Path) -> Path:
    runs = [[8, 16, 16, 24], [16, 24, 24, 8], [24, 8, 8, 16]]
    save_template(learn([(f"p{i}", model.record(seqs)) for i, seqs in enumerate(runs)]), path)
    return path


def _recipe(template: Path, capacity: int | None, *, block: str, steps: int = 40):
    data = {"model": {"model_config": {"num_layers": 1, "hidden_size": 8, "num_heads": 1, "seq_length": 24,
                                       "vocab_size": 8}},
            "memopt": {"device": {"hbm": capacity or 1 << 40, "cards": 1},
                       "allocator": {"name": "mindspore_bestfit", "pregrow": False, "increase_size": block},
                       "workload": {"template": str(template), "steps": steps, "dynamic_seq": True,
                                    "seq_min": 8, "seq_max": 24, "seq_align": 8},
                       "scan_every": 4, "compact_every": 8}}
    return recipe_from_dict(data, source=str(template))


def _run(recipe, policies=("baseline", "compact")):
    return {p: s.seeds[0] for p, s in simulate(spec_from_recipe(recipe), config_from_recipe(recipe),
                                               policies=policies).items()}


# --- purposes from lifetimes ------------------------------------------------------------------------
def test_purposes_of_a_drawn_model_are_its_own():
    model = Model([(4096, 64), (2048, 128)], [8192, 1024, 4096], [3, 1, 2, 0], 512)
    found = learn_purposes(model.record([8, 16, 16, 24]))
    p = found.purposes
    assert (p["parameters"].count, p["parameters"].bytes, p["parameters"].in_pool) == (3, 13312, False)
    assert found.states_per_parameter == 2 and p["optimizer"].bytes == 2 * 13312
    assert (p["gradients"].count, p["gradients"].bytes) == (3, 13312)
    assert p["activations"].count == 4 and p["workspace"].count >= 2


def _record(tmp_path: Path, model: str, seqs: str) -> tuple[Path, dict]:
    env = dict(os.environ, PYTHONHASHSEED="0", PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    out, truth = tmp_path / f"{model}.jsonl", tmp_path / f"{model}.truth.json"
    done = subprocess.run([sys.executable, "-m", "ms_memopt", "record", "--no-progress", "--out", str(out), "--",
                           "python", str(REPO / "bench/workloads/template_run.py"), "--model", model, "--seqs", seqs,
                           "--layers", "1", "--hidden", "32", "--vocab", "64", "--truth", str(truth)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, json.loads(truth.read_text())


@pytest.mark.parametrize("model", ["gpt", "gqa"])
def test_learn_reports_the_real_models_parameters_and_adam_states(tmp_path, capsys, model):
    """A real MindSpore run (CPU, PyNative, AdamWeightDecay): the weights and Adam's two states per
    weight never enter the CPU pool, and learn infers them from the gradients and the update."""
    recording, truth = _record(tmp_path, model, "8,12,12,16")
    assert main(["learn", str(recording), "--out", str(tmp_path / "m.template.json"), "--json"]) == 0
    purposes = json.loads(capsys.readouterr().out)["purposes"]["purposes"]
    for name in ("parameters", "optimizer"):
        assert abs(purposes[name]["bytes"] - truth[name]["bytes"]) <= 0.1 * truth[name]["bytes"], (name, purposes)
        assert purposes[name]["count"] == truth[name]["count"]
    assert purposes["gradients"]["bytes"] == truth["parameters"]["bytes"]


# --- compaction on a pool of many blocks ------------------------------------------------------------------
def _blocks(*segments: tuple[int, list[tuple[int, bool]]]) -> Layout:
    out = []
    for addr, pieces in segments:
        blocks, at = [], addr
        for size, live in pieces:
            blocks.append(Block(at, size, live, id=at if live else None))
            at += size
        out.append(Segment(addr, at - addr, blocks))
    return Layout(out)


def test_holes_spread_over_blocks_join_only_when_emptied_blocks_go_back():
    # four 128 KiB blocks, each a quarter used, at the low end already: sliding gains nothing; emptying
    # three into the fourth's hole gives back 384 KiB, one piece on the card
    layout = _blocks(*[(k * MiB, [(32 * KiB, True), (96 * KiB, False)]) for k in range(4)])
    assert plan_compaction(layout).after.largest_free == 96 * KiB
    plan = plan_compaction(layout, evacuate=True)
    assert len(plan.released) == 3 and plan.layout.reserved == 128 * KiB
    assert largest_piece(plan.layout, capacity=512 * KiB) == 384 * KiB > largest_piece(layout, capacity=512 * KiB)


def test_a_piece_is_opened_across_blocks_when_every_block_is_nearly_full():
    layout = _blocks((0, [(80 * KiB, True), (48 * KiB, False)]), (MiB, [(16 * KiB, True), (40 * KiB, True),
                                                                       (72 * KiB, False)]))
    assert plan_compaction(layout, evacuate=True).after.largest_free == 72 * KiB
    plan = plan_opening(layout, 100 * KiB)
    assert plan.after.largest_free >= 100 * KiB and plan.bytes_moved == 40 * KiB


def test_a_compaction_that_would_not_raise_the_largest_piece_is_not_run_and_says_why():
    model = create("mindspore-bestfit", 1 * MiB, increase_size=128 * KiB)
    addrs = {i: model.malloc(64 * KiB) for i in range(4)}     # two full blocks, nothing to gain
    done = try_compaction(model, addrs, lambda: create("mindspore-bestfit", 1 * MiB, increase_size=128 * KiB))
    assert done.model is model and "would not raise the largest piece" in done.skipped


def test_a_last_resort_compaction_serves_the_failing_request():
    """Without it the request fails; with it (drive's on_oom) the blocks emptied by compaction go
    back to the card and the request gets a new one."""
    capacity = 512 * KiB

    def fresh():
        return create("mindspore-bestfit", capacity, increase_size=128 * KiB)

    events = [Event("alloc", id=i, size=64 * KiB) for i in range(8)]
    events += [Event("free", id=i) for i in (0, 3, 4, 7)]            # every block half used
    events.append(Event("alloc", id=99, size=200 * KiB))
    plain = drive(events, fresh())
    assert plain.oom_index == len(events) - 1

    def last_resort(index, event, model):
        done = try_compaction(model, addr_of, fresh, need=event.size)
        return None if done.skipped else done.model

    addr_of: dict[int, int] = {}
    saved = drive(events, fresh(), addr_of=addr_of, on_oom=last_resort)
    assert saved.oom_index is None and not saved.model.ooms and 99 in addr_of
    assert saved.model.segment_frees >= 2


# --- never worse than the baseline --------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(model=models(), share=st.integers(65, 100), block=st.sampled_from(["64KiB", "128KiB", "1MiB"]))
def test_compact_never_dies_before_the_baseline(tmp_path_factory, model, share, block):
    template = _template(model, tmp_path_factory.mktemp("cure") / "m.template.json")
    free = _run(_recipe(template, None, block=block), ("baseline",))["baseline"]
    capacity = max(free.peak_reserved * share // 100, 4096)
    at = _run(_recipe(template, capacity, block=block))
    baseline, compact = at["baseline"].oom_step, at["compact"].oom_step
    assert compact is None or (baseline is not None and compact >= baseline), (share, block, baseline, compact)


# --- pool mode's regions by purpose, and the bound ----------------------------------------------------------
def test_pool_mode_on_a_template_has_a_region_per_learned_purpose(tmp_path):
    model = Model([(4096, 64), (2048, 128)], [8192, 1024, 4096], [3, 1, 2, 0], 512)
    template = _template(model, tmp_path / "m.template.json")
    recipe = _recipe(template, 4 * MiB, block="1MiB")
    from ms_memopt.simulation.pool_sizing import pool_for_workload

    pool = pool_for_workload(spec_from_recipe(recipe), capacity=4 * MiB)
    assert {s.pool for s in pool.layout().segments} >= {"gradients", "activations", "workspace"}
    assert _run(recipe, ("pool",))["pool"].oom_step is None


def test_simulate_says_what_the_best_placement_of_the_steps_needs(tmp_path, capsys):
    model = Model([(4096, 64), (2048, 128)], [8192, 1024, 4096], [3, 1, 2, 0], 512)
    template = _template(model, tmp_path / "m.template.json")
    schedule = tmp_path / "s.csv"
    schedule.write_text("seq\n" + "".join(f"{s}\n" for s in (8, 24, 16, 24, 8, 16)))
    assert main(["simulate", str(template), "--schedule", str(schedule), "--capacity", "64KiB", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    need = out["placement_need"]
    assert need["need"] >= need["live_peak"] > 64 * KiB
    assert "no policy can save this below" in need["says"]
    assert main(["simulate", str(template), "--schedule", str(schedule), "--capacity", "8MiB"]) == 0
    assert "comes closest" in capsys.readouterr().out
