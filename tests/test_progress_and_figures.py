"""Long commands show progress and stop cleanly; figures pass their check.

Progress: :func:`ms_memopt.core.progress.progress_bar` (whole lines in a file), the steps every
rank stream reports from its worker process (:func:`ms_memopt.simulation.executors.report_progress`),
a sweep's partial file and Ctrl-C. Figures: :func:`ms_memopt.report.figure_check.figure_problems`
finds each kind of defect it names, and the project's figures drawn from awkward data pass it.
"""
from __future__ import annotations

import io
import json
import multiprocessing
import time
import warnings

import pytest

from ms_memopt.cli import main
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.progress import progress_bar
from ms_memopt.io.layouts import LayoutSnapshot
from ms_memopt.report.figure_check import FigureWarning, figure_problems
from ms_memopt.report.memory_map import plot_memory_map
from ms_memopt.report.plots import Marker, plot_step_times, plot_timeline, pyplot
from ms_memopt.simulation.executors import run_tasks
from test_job import RECIPE, small_job     # tests/ is on sys.path

MiB = 2**20


# --- progress -------------------------------------------------------------------------------------

def test_progress_in_a_file_is_whole_lines_and_nothing_when_disabled():
    stream = io.StringIO()
    with progress_bar(10, "simulate", "step", stream=stream, file_interval=0) as bar:
        for _ in range(10):
            bar.update(1)
    text = stream.getvalue()
    assert "\r" not in text and "simulate" in text
    assert any("10/10" in line for line in text.splitlines())
    quiet = io.StringIO()
    with progress_bar(10, "simulate", "step", stream=quiet, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


class _Counter:
    """Stands in for the tqdm bar: what simulate_jobs asks it to show."""

    def __init__(self, total, *args, **kwargs) -> None:
        self.total, self.n, self.postfix = total, 0, ""
        _Counter.last = self

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def close(self) -> None:
        pass


@pytest.mark.parametrize("workers", [1, 2])
def test_every_step_of_every_stream_is_counted_and_each_job_reported_when_done(monkeypatch, workers):
    from ms_memopt.simulation.job import simulate_jobs

    monkeypatch.setattr("ms_memopt.core.progress.progress_bar", _Counter)
    jobs = [small_job(steps=3, groups=1, seed=0), small_job(steps=3, groups=1, seed=1)]
    finished = {}
    results = simulate_jobs(jobs, workers=workers, progress=True,
                            on_job=lambda index, result: finished.setdefault(index, result))
    streams = sum(len(job.streams) for job in jobs)
    assert _Counter.last.total == 3 * streams and _Counter.last.n == 3 * streams   # from the workers too
    assert _Counter.last.postfix == f"ranks {streams}/{streams}"
    assert sorted(finished) == [0, 1]
    for index, job in enumerate(results):
        assert {p: r.job_oom_step for p, r in finished[index].items()} == {p: r.job_oom_step for p, r in job.items()}


def _stop(index, value):
    raise KeyboardInterrupt


def test_ctrl_c_stops_the_local_workers_at_once():
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        # the first task returns at once; the others would sleep 60 s each
        run_tasks(time.sleep, [0, 60, 60], executor="local", workers=2, on_done=_stop)
    assert time.perf_counter() - started < 30
    assert multiprocessing.active_children() == []


def test_an_interrupted_sweep_keeps_its_finished_points_and_a_complete_one_cleans_up(tmp_path, monkeypatch, capsys):
    from ms_memopt.simulation import job as job_module

    real = job_module.simulate_jobs

    def first_point_then_ctrl_c(jobs, **kwargs):
        kwargs["on_job"](0, real(jobs[:1], workers=1)[0])
        raise KeyboardInterrupt

    argv = ["sweep", str(RECIPE), "--set", "memopt.device.hbm=48GiB,96GiB", "--steps", "1", "--ranks", "1",
            "--workers", "1", "--policy", "baseline", "--out", str(tmp_path)]
    monkeypatch.setattr(job_module, "simulate_jobs", first_point_then_ctrl_c)
    assert main(argv) == 130
    assert "1 of 2 grid points" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "sweep.partial.jsonl").read_text().splitlines()]
    assert [(r["memopt.device.hbm"], r["policy"]) for r in rows] == [("48GiB", "baseline")]
    assert not (tmp_path / "sweep.csv").exists()
    monkeypatch.setattr(job_module, "simulate_jobs", real)
    assert main(argv) == 0
    assert (tmp_path / "sweep.csv").is_file() and not (tmp_path / "sweep.partial.jsonl").exists()


# --- the figure check -------------------------------------------------------------------------------

def _figure():
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ax.plot([0, 10], [0, 1], label="data")
    return fig, ax


def test_a_clean_figure_has_no_problem():
    fig, ax = _figure()
    ax.set_title("a title")
    ax.set_xlabel("step")
    fig.tight_layout()
    assert figure_problems(fig) == []
    pyplot().close(fig)


def test_each_defect_is_found():
    fig, ax = _figure()
    fig.suptitle("a title far too long for its figure " * 4)
    ax.text(5, 0.5, "here")
    ax.text(5, 0.5, "and here")
    ax.text(9.9, 0.95, "a label running off the axes")
    ax.legend(loc="upper left")
    ax.plot([0.5, 1, 1.5], [0.9, 0.95, 0.9])       # where the legend sits
    problems = "\n".join(figure_problems(fig))
    pyplot().close(fig)
    assert "cut at the edge of the figure" in problems
    assert "'here' overlaps 'and here'" in problems
    assert "runs out of the axes" in problems
    assert "the legend covers a line" in problems
    fig, ax = _figure()
    ax.set_xlim(-1, 20)
    problems = "\n".join(figure_problems(fig))
    pyplot().close(fig)
    assert "the x axis runs to 20 past the data (to 10)" in problems


def _no_figure_warning(draw) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draw()
    problems = [str(w.message) for w in caught if issubclass(w.category, FigureWarning)]
    assert problems == []


def test_timeline_with_forecasts_beyond_the_run_and_a_changing_request_passes(tmp_path):
    samples = [(step, 6 * MiB, (5 - step % 3) * MiB, 0.2 * (step % 4)) for step in range(1, 21)]
    series = {"baseline": samples, "compact": samples[:10] + [(s, f, lf + MiB, r) for s, f, lf, r in samples[10:]]}
    markers = [Marker("baseline", 1200, "forecast", 2 * MiB, low=900, high=None),
               Marker("compact", 1300, "forecast", 2 * MiB, low=1000, high=1500),
               Marker("baseline", 20, "oom", MiB), Marker("compact", 10, "compaction", MiB, 3 * MiB)]
    request = [(step, (1 + step % 2) * MiB) for step in range(1, 21)]
    _no_figure_warning(lambda: plot_timeline(series, tmp_path / "t.png", markers=markers, requests={"step_largest": request},
                                             title="a long title " * 12))


def test_step_times_and_a_memory_map_of_narrow_regions_pass(tmp_path):
    times = {"baseline": {"step_seconds": [1.0 + 0.01 * (i % 7) for i in range(474)], "rank_step_median": [1.0, 1.1]},
             "compact": {"step_seconds": [1.0 + 0.01 * (i % 7) for i in range(1000)], "rank_step_median": [1.0]}}
    _no_figure_warning(lambda: plot_step_times(times, tmp_path / "s.png", title="the job's step time"))
    regions = [Segment(i * MiB, MiB // (1 if i % 3 else 40), [Block(i * MiB, MiB // (1 if i % 3 else 40), True)],
                       pool=name) for i, name in enumerate(["parameters", "gradients", "optimizer", "activations"])]
    snaps = [LayoutSnapshot(1, "pool step 1", Layout(regions)), LayoutSnapshot(2, "pool step 2", Layout(regions))]
    _no_figure_warning(lambda: plot_memory_map(snaps, tmp_path / "m.png", title="regions side by side"))
