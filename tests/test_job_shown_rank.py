"""The rank a job is shown by (its memory map, its layouts) is run again once the job is done, with
what it keeps, instead of every rank keeping them (issue 43: the ranks run compiled): the same
figures, the view of the rank the job is judged by, and a sweep's callback sees it."""
from __future__ import annotations

from ms_memopt.simulation.job import ShowRank, reproducible_figures, simulate_jobs
from test_job import small_job


def test_the_shown_rank_is_the_job_s_closest_and_the_figures_are_unchanged():
    job = small_job(steps=60, policies=("baseline", "compact"))
    plain = simulate_jobs([job], workers=1)[0]
    seen = []
    shown = simulate_jobs([job], workers=2, show=ShowRank(layouts=True),
                          on_job=lambda index, result: seen.append((index, result["baseline"].view)))[0]
    assert reproducible_figures([plain]) == reproducible_figures([shown])
    base = shown["baseline"]
    assert base.view is not None and base.view.stream == base.closest.stream
    assert base.view.snapshots and all(result.view is base.view for result in shown.values())
    assert plain["baseline"].view is None
    assert seen and seen[0][0] == 0 and seen[0][1] is base.view


def test_a_view_with_nothing_to_keep_is_the_rank_alone():
    job = small_job(steps=40)
    base = simulate_jobs([job], workers=1, show=ShowRank())[0]["baseline"]
    assert base.view is not None and base.view.stream == base.closest.stream and not base.view.snapshots


def test_a_background_view_waits_for_the_same_layouts():
    # ShowRank.background: the shown rank's run goes on in a process of its own; wait() gives
    # the layouts the job's own rerun gives
    from ms_memopt.io.layouts import layout_to_dict

    job = small_job(steps=60, policies=("baseline", "compact"))
    here = simulate_jobs([job], workers=2, show=ShowRank(layouts=True))[0]["baseline"].view
    there = simulate_jobs([job], workers=2, show=ShowRank(layouts=True, background=True))[0]["baseline"].view
    assert there.pending is not None and not there.snapshots
    assert there.wait() is there and there.pending is None and there.stream == here.stream

    def drawn(view) -> list:
        return [layout_to_dict(snap.layout, step=snap.step, label=snap.label) for snap in view.snapshots]

    assert drawn(there) == drawn(here) and drawn(here)


def test_a_background_view_closed_before_it_finished_stops_its_process():
    job = small_job(steps=400, policies=("baseline", "compact"))
    view = simulate_jobs([job], workers=2, show=ShowRank(layouts=True, background=True))[0]["baseline"].view
    process = next(iter(view.pending._pool._processes.values()))
    view.close()
    assert view.pending is None and not process.is_alive() and not view.snapshots


def test_ctrl_c_in_simulate_s_report_stops_the_shown_rank_s_process(tmp_path, monkeypatch):
    import multiprocessing
    from pathlib import Path

    from ms_memopt.cli import main
    from ms_memopt.report import build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_report", interrupted)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "demo_cpu.yaml"
    assert main(["simulate", str(recipe), "--steps", "200", "--workers", "2", "--out", str(tmp_path)]) == 130
    assert multiprocessing.active_children() == []
