"""The one event loop (ms_memopt.replay.loop.drive): the compiled and the pure-Python paths give the
same results, the hooks see what they promise, and the job keeps its shown rank without a rerun."""
from __future__ import annotations

import random

import pytest

from ms_memopt.allocators import create
from ms_memopt.allocators.fast import AVAILABLE
from ms_memopt.core.events import FIELDS, Event
from ms_memopt.replay.loop import drive
from ms_memopt.io.traces.synthetic import synthetic_trace

MODELS = ["mindspore", "mindspore-bestfit", "mindspore-vmm", "torch", "torch-expandable"]


def _random_events(seed: int, n: int = 3000) -> list[Event]:
    rng = random.Random(seed)
    live, events, next_id = [], [], 0
    for i in range(n):
        if live and rng.random() < 0.45:
            events.append(Event("free", id=live.pop(rng.randrange(len(live)))))
        elif rng.random() < 0.02:
            events.append(Event("mark", tag="optimizer_end"))
        elif rng.random() < 0.01:
            events.append(Event("step", step=i))
        else:
            next_id += 1
            live.append(next_id)
            events.append(Event("alloc", id=next_id, size=rng.choice([512, 4096, 3 << 20, 40 << 20, 300 << 20]),
                                tag=rng.choice([None, "activation", "watched"])))
    return events


def _figures(run, model) -> tuple:
    layout = model.layout()
    return (run.stopped_at, run.allocs, run.oom_index, dict(run.addr_of), model.peak_allocated,
            model.peak_reserved, model.segment_allocs, [(o.size, o.event_index) for o in model.ooms],
            sorted((s.addr, s.size) for s in layout.segments), sorted((b.addr, b.size) for b in layout.live_blocks()))


@pytest.mark.skipif(not AVAILABLE, reason="the compiled fast path is not built")
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stop_on_oom", [False, True])
def test_compiled_and_python_paths_agree(name, stop_on_oom):
    events = _random_events(7)
    runs = []
    for hooked in (False, True):
        model = create(name, 2 << 30)
        seen = []
        hooks = {"on_alloc": lambda i, e, a: seen.append(i)} if hooked else {}
        run = drive(events, model, stop_on_oom=stop_on_oom, watch={"watched"}, on_watch=lambda i, e, m: None,
                    sample_every=97, on_sample=lambda i, m: None, **hooks)
        runs.append((_figures(run, model), run.samples))
        if hooked:
            assert seen == [i for i, e in enumerate(events[:run.stopped_at + 1]) if e.action == "alloc"]
    assert runs[0] == runs[1]
    assert runs[0][0][2] is not None, "the case should run out of memory"


@pytest.mark.parametrize("name", MODELS)
def test_rows_and_events_give_the_same_run(name):
    events = synthetic_trace(4000, seed=3).events
    rows = [tuple(getattr(e, f) for f in FIELDS) for e in events]
    a, b = create(name), create(name)
    assert _figures(drive(events, a), a) == _figures(drive(rows, b), b)


def test_hooks_order_and_model_swap():
    events = [Event("alloc", id=1, size=4096, tag="w"), Event("mark", tag="m", size=1), Event("step", step=1),
              Event("alloc", id=2, size=4096), Event("free", id=1), Event("free", id=9)]
    calls = []
    other = create("mindspore")

    def at_step(i, e, m):
        calls.append(("step", i))
        return other

    run = drive(events, create("mindspore"), watch={"w"},
                on_watch=lambda i, e, m: calls.append(("watch", i)),
                on_alloc=lambda i, e, a: calls.append(("alloc", i)),
                on_free=lambda i, e, a: calls.append(("free", i)),
                on_mark=lambda i, e, m: calls.append(("mark", i)), on_step=at_step)
    # the free of id 1 reaches the new model: the hook owns what it swapped in (compaction restores)
    assert calls == [("watch", 0), ("alloc", 0), ("mark", 1), ("step", 2), ("alloc", 3), ("free", 4)]
    assert run.model is other and run.stopped_at == len(events)


def test_stop_on_oom_stops_at_the_failed_request():
    events = [Event("alloc", id=1, size=1 << 30), Event("alloc", id=2, size=8 << 30), Event("alloc", id=3, size=512)]
    model = create("mindspore", 2 << 30)
    run = drive(events, model, stop_on_oom=True)
    assert (run.oom_index, run.stopped_at, run.allocs) == (1, 1, 2)
    assert model.ooms[-1].event_index == 1


def test_the_job_keeps_its_shown_rank_as_a_separate_run_would_see_it():
    from ms_memopt.config.recipe import load_recipe
    from ms_memopt.simulation.job import ShowRank, simulate_jobs
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.simulation.simulate import PlacedRun, simulate
    from ms_memopt.simulation.snapshots import LayoutCollector

    recipe = load_recipe("recipes/dense_100b_1024x910c.yaml")
    job = job_from_recipe(recipe, ranks=3, steps=4, policies=("baseline", "pool"))
    plain = simulate_jobs([job], workers=1)[0]
    shown = simulate_jobs([job], workers=1, show=ShowRank(layouts=True, placed=("baseline",)))[0]
    assert [o.result.to_dict() | {"seconds": 0} for o in plain["baseline"].outcomes] == \
           [o.result.to_dict() | {"seconds": 0} for o in shown["baseline"].outcomes]
    view = shown["baseline"].view
    assert view is not None and view.stream == shown["baseline"].closest.stream
    # what a second simulation of that rank (the old way) records
    collector = LayoutCollector([], policies=job.policies, seed=view.stream.seed)
    placed = {"baseline": PlacedRun()}
    simulate(job.specs[view.stream.stage], job.cfg, policies=job.policies, seeds=[view.stream.seed],
             on_watch=collector, placed=placed)
    assert [(s.step, s.label) for s in collector.snapshots()] == [(s.step, s.label) for s in view.snapshots]
    assert placed["baseline"].events == view.placed["baseline"].events
