"""A whole training job: every distinct card stream of a recipe, simulated; the job dies at its
first rank.

A 1024-card job stops when *any* card runs out of memory. Cards differ by

* **pipeline stage**: each stage has its own workload (layers, micro-batches in flight under
  1F1B, communication; :func:`ms_memopt.simulation.spec.spec_from_recipe` with ``stage=``), and
* **data-parallel group**: each sees different data, so different sequence lengths and so a
  different layout; each (stage, data-parallel group) stream gets its own seed.

Tensor-parallel peers see the same shapes and make the same requests, so one stream stands for
the ``model_parallel`` cards of its group. A job of ``pipeline_stage x data_parallel`` streams
(the 100B recipe: 8 x 16 = 128 streams for 1024 cards) is simulated stream by stream, each
through :func:`ms_memopt.simulation.simulate.simulate` under every policy in lock step, the streams in
parallel on local processes or on a Dask or Ray cluster (:mod:`ms_memopt.simulation.executors`). The
job's OOM step under a policy is the earliest OOM over its ranks; a policy saves the job only
if every rank survives.

Seeds: the stream of stage 0, data-parallel group 0 takes the job seed itself (so a one-card
recipe simulates exactly as :func:`~ms_memopt.simulation.simulate.simulate` does); every other stream
takes ``numpy.random.SeedSequence([job_seed, stage, group])``'s first 32-bit word. A sample
(``ranks=N``) is drawn deterministically from the job seed. Streams and seeds never depend on
the executor or the number of workers, so results are identical on every executor.

Example:
    >>> from ms_memopt.config.recipe import load_recipe
    >>> job = job_from_recipe(load_recipe("recipes/dense_100b_1024x910c.yaml"), ranks=4,
    ...                       steps=2, policies=("baseline",))          # doctest: +SKIP
    >>> simulate_jobs([job], workers=1)[0]["baseline"].job_oom_step     # doctest: +SKIP
"""
from __future__ import annotations

import io
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ms_memopt.core.errors import InputError
from ms_memopt.simulation.executors import Background, report_progress, start_task
from ms_memopt.simulation.simulate import PolicyResult, SimConfig, simulate
from ms_memopt.simulation.spec import JobSpec, RankStream
from ms_memopt.workload.step import WorkloadSpec

__all__ = [
    "JobResult",
    "RankOutcome",
    "RankView",
    "ShowRank",
    "median_job_oom_step",
    "record_placed",
    "reproducible_figures",
    "simulate_jobs",
]



@dataclass
class RankOutcome:
    """One stream's run under one policy."""

    stream: RankStream
    result: PolicyResult

    def to_dict(self) -> dict:
        r = self.result
        return {"rank": self.stream.rank, "stage": self.stream.stage,
                "data_parallel": self.stream.data_parallel, "seed": self.stream.seed,
                "oom_step": r.oom_step, "oom_kind": r.oom_kind, "oom_tag": r.oom_tag,
                "free_total_at_oom": r.free_total_at_oom, "largest_free_min": r.largest_free_min,
                "compactions": r.compactions, "peak_allocated": r.peak_allocated}


@dataclass
class JobResult:
    """One policy over every simulated stream of one job.

    The job dies at its first rank: ``job_oom_step`` is the earliest OOM step over the ranks
    (``None`` when every rank survives: only then does the policy save the job). Ranks that
    fail at the same step are ordered by rank (the simulator has no clock across cards).
    """

    policy: str
    seed: int
    steps: int
    outcomes: list[RankOutcome] = field(default_factory=list)
    #: the time model's constants (``memopt.timing``); ``None``: the defaults
    timing_config: object = None
    #: the job's cards, for the time model's per-card draws (:attr:`JobSpec.cards`; 0: one a stream)
    cards: int = 0
    #: what the job kept of the rank it is judged by (:func:`simulate_jobs` ``show``), else ``None``
    view: "RankView | None" = field(default=None, repr=False)

    def timing_figures(self, timing=None) -> tuple[dict, dict] | None:
        """``(timing, detail)``: the policy's ``timing`` object (:data:`ms_memopt.simulation.timing.TIMING_KEYS`)
        and its detail (the job's step times, each rank's median busy time), priced with
        ``timing`` (default: the job's ``memopt.timing``); ``None`` when no step completed."""
        from ms_memopt.config.recipe import TimingConfig
        from ms_memopt.simulation.timing import job_timing

        timing = timing or self.timing_config or TimingConfig()
        return job_timing([o.result.step_counts for o in self.outcomes],
                          [o.result.collective_bytes for o in self.outcomes], timing,
                          cards=self.cards or None, seed=self.seed)

    def timing(self, timing=None) -> dict | None:
        """The policy's ``timing`` object (see :meth:`timing_figures`)."""
        figures = self.timing_figures(timing)
        return None if figures is None else figures[0]

    @property
    def first(self) -> RankOutcome | None:
        """The rank that kills the job, or ``None``."""
        failed = [o for o in self.outcomes if o.result.oom_step is not None]
        return min(failed, key=lambda o: (o.result.oom_step, o.stream.rank), default=None)

    @property
    def closest(self) -> RankOutcome | None:
        """The rank that kills the job, or when none does the one with the smallest
        ``largest_free`` seen (the closest call)."""
        first = self.first
        if first is not None or not self.outcomes:
            return first
        return min(self.outcomes, key=lambda o: (o.result.largest_free_min or 0, o.stream.rank))

    @property
    def job_oom_step(self) -> int | None:
        first = self.first
        return None if first is None else first.result.oom_step

    def distribution(self) -> dict:
        """OOM steps across ranks: how many failed, and quantiles over every simulated rank
        (a survivor counts as later than any step, so a quantile past the failures is
        ``None``), overall and per pipeline stage."""
        def summary(outcomes: list[RankOutcome]) -> dict:
            steps = sorted(o.result.oom_step for o in outcomes if o.result.oom_step is not None)
            n = len(outcomes)

            def q(p: float) -> float | None:
                if not steps:
                    return None
                padded = steps + [float("inf")] * (n - len(steps))
                value = statistics.median(padded) if p == 0.5 else float(np.quantile(padded, p, method="lower"))
                return None if value == float("inf") else value

            return {"ranks": n, "oom_ranks": len(steps), "oom_step_min": steps[0] if steps else None,
                    "oom_step_p10": q(0.1), "oom_step_median": q(0.5), "oom_step_p90": q(0.9),
                    "oom_step_max": steps[-1] if steps else None}

        out = summary(self.outcomes)
        out["by_stage"] = {str(stage): summary([o for o in self.outcomes if o.stream.stage == stage])
                           for stage in sorted({o.stream.stage for o in self.outcomes})}
        return out

    def to_dict(self, *, rank_results: bool = True) -> dict:
        first, closest = self.first, self.closest
        out = {"policy": self.policy, "seed": self.seed, "steps": self.steps,
               "job_oom_step": self.job_oom_step,
               "job_oom_rank": None if first is None else first.stream.rank,
               "job_oom_stage": None if first is None else first.stream.stage,
               "job_oom_ranks": None if first is None else [first.stream.ranks.start, first.stream.ranks.stop - 1],
               "ranks": len(self.outcomes),
               "distribution": self.distribution(),
               # the failing rank's full figures (or, when the job survives, the closest call's)
               "first_rank": None if closest is None else dict(closest.result.to_dict(), rank=closest.stream.rank,
                                                               stage=closest.stream.stage)}
        figures = self.timing_figures()
        out["timing"] = None if figures is None else figures[0]
        if figures is not None:
            ranks = figures[1]["rank_step_median"]
            out["timing_detail"] = {"steps": figures[1]["steps"],
                                    "collective_seconds": max(o.result.collective_bytes for o in self.outcomes)
                                    / (self.timing_config or _default_timing()).collective_bandwidth,
                                    "card_cv": figures[1]["card_cv"],
                                    "cards_per_stream": figures[1]["cards_per_stream"],
                                    "rank_step_median_min": min(ranks), "rank_step_median_max": max(ranks),
                                    "rank_step_cv": float(np.std(ranks) / np.mean(ranks)) if np.mean(ranks) else 0.0}
        if rank_results:
            out["rank_results"] = [o.to_dict() for o in self.outcomes]
        return out


def _default_timing():
    from ms_memopt.config.recipe import TimingConfig

    return TimingConfig()


def median_job_oom_step(results: list[JobResult]) -> float | None:
    """Median job OOM step over job seeds (``None`` when fewer than half the jobs die; a job
    that survives counts as later than any step)."""
    steps = [r.job_oom_step for r in results]
    dead = sorted(s for s in steps if s is not None)
    if not dead or 2 * len(dead) < len(steps):
        return None
    med = statistics.median(dead + [float("inf")] * (len(steps) - len(dead)))
    return None if med == float("inf") else med


# --- running -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShowRank:
    """What to keep of the rank a job is judged by (:attr:`JobResult.closest`: its first failing
    rank, or the closest call), taken by the job's own run of it: ``layouts``, its pool at each
    policy's OOM or worst moment (:class:`~ms_memopt.simulation.snapshots.LayoutCollector`); ``placed``,
    the policies whose events with the model's addresses to keep (:class:`~ms_memopt.simulation.simulate.PlacedRun`).

    The ranks run without them; once every rank is done, the shown one runs again with them (the
    same seed: the same run). Layouts keep the compiled loop (their tags are noted a step ahead),
    about 1.5x a plain run; placed events see every call on the loop's pure-Python path.
    ``background``: that run goes on in a local process of its own while the caller writes what
    does not need it (simulate's report); the view's figures arrive with :meth:`RankView.wait`.
    """

    layouts: bool = False
    placed: tuple[str, ...] = ()
    background: bool = False


@dataclass
class RankView:
    """What :class:`ShowRank` kept of one rank: its stream, layouts and placed runs per policy;
    ``pending`` the run still collecting them (:attr:`ShowRank.background`) until :meth:`wait`."""

    stream: RankStream
    snapshots: list = field(default_factory=list)
    placed: dict = field(default_factory=dict)
    pending: Background | None = field(default=None, repr=False, compare=False)

    def wait(self) -> "RankView":
        """This view with its figures: the background run's, once it has finished."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            done = pending.result()[2]
            self.snapshots, self.placed = done.snapshots, done.placed
        return self

    def close(self) -> None:
        """Stop a background run still going (its caller failed or was interrupted)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.close()


@dataclass(frozen=True)
class _Task:
    stream: RankStream
    spec: WorkloadSpec
    cfg: SimConfig
    policies: tuple[str, ...]
    timeline: bool
    show: ShowRank | None = None
    pool_spec: WorkloadSpec | None = None      # the pool policy's own workload (JobSpec.pool_specs)


class _RankTimeline(io.StringIO):
    """A timeline sink that stamps each JSON row with the stream's rank and stage."""

    def __init__(self, stream: RankStream) -> None:
        super().__init__()
        self._prefix = f'{{"rank":{stream.rank},"stage":{stream.stage},'

    def write(self, text: str) -> int:
        return super().write(self._prefix + text[1:] if text.startswith("{") else text)


def _pool_mode_misfit(spec: WorkloadSpec, cfg: SimConfig) -> str | None:
    """Why pool mode's regions cannot be reserved on this card, or ``None`` when they can."""
    from ms_memopt.simulation.pool_sizing import pool_for_workload

    try:
        pool_for_workload(spec, capacity=cfg.capacity, fast=False)
    except InputError as exc:
        return exc.message
    return None


def _run_stream(task: _Task) -> list:
    """Worker: every policy on one stream, in lock step (one generated event stream); returns
    ``[results per policy, timeline text or None, RankView or None]``.

    A pool-mode plan larger than the card cannot even start: its result is an OOM at step 0
    (``oom_tag`` ``"pool_mode"``), so a sweep over small cards reports it instead of stopping."""
    sink = _RankTimeline(task.stream) if task.timeline else None
    cfg = replace(task.cfg, seed=task.stream.seed)
    policies = task.policies
    results: dict[str, PolicyResult] = {}
    pool_spec = task.pool_spec or task.spec
    misfit = _pool_mode_misfit(pool_spec, cfg) if "pool" in policies else None
    if misfit is not None:
        results["pool"] = PolicyResult("pool", task.stream.seed, cfg.steps, oom_step=0, oom_kind="capacity",
                                       oom_tag="pool_mode", oom_size=None)
        policies = tuple(p for p in policies if p != "pool")
    view = collector = None
    if task.show is not None:
        from ms_memopt.simulation.simulate import PlacedRun
        from ms_memopt.simulation.snapshots import LayoutCollector

        view = RankView(task.stream, placed={p: PlacedRun() for p in task.show.placed if p in policies})
        if task.show.layouts:
            collector = LayoutCollector([], policies=task.policies, seed=task.stream.seed)
    # pool mode with its own recompute runs its own workload (the same seed: the same lengths)
    groups = [(task.spec, policies)]
    if task.pool_spec is not None and "pool" in policies:
        groups = [(task.spec, tuple(p for p in policies if p != "pool")), (task.pool_spec, ("pool",))]
    groups = [(spec, group) for spec, group in groups if group]
    steps = _StepProgress(cfg.steps, len(groups))
    for spec, group in groups:
        placed = {p: run for p, run in view.placed.items() if p in group} if view is not None else None
        out = simulate(spec, cfg, policies=group, seeds=[task.stream.seed], timeline=sink,
                       on_watch=collector, placed=placed or None, on_step=steps.step)
        results.update({policy: summary.seeds[0] for policy, summary in out.items()})
    steps.finish()
    if collector is not None:
        view.snapshots = collector.snapshots()
    return [{policy: results[policy] for policy in task.policies}, (sink.getvalue() if sink is not None else None),
            view]


def record_placed(job: JobSpec, stream: RankStream, sinks: dict) -> dict:
    """Simulate one rank stream of ``job`` again (the same seed: the same events and placements),
    each policy named in ``sinks`` recording its placed events into its sink (a list, or any
    object with ``append``, e.g. :class:`~ms_memopt.replay.viz_export.SnapshotSink`); the job's
    own run of every rank keeps none, so only the shown rank is ever recorded.

    Returns ``{policy: PlacedRun}`` (``final``: the model's layout at the end; ``None`` for a
    policy that cannot run on this card, pool mode's regions too large).

    Example:
        >>> from ms_memopt.config.recipe import load_recipe
        >>> from ms_memopt.simulation.spec import job_from_recipe
        >>> job = job_from_recipe(load_recipe("recipes/demo_cpu.yaml"), policies=("baseline",), steps=2, ranks=1)
        >>> events = []
        >>> record_placed(job, job.streams[0], {"baseline": events})["baseline"].final is not None, len(events) > 0
        (True, True)
    """
    from ms_memopt.simulation.simulate import PlacedRun

    cfg = replace(job.cfg, seed=stream.seed)
    spec = job.specs[stream.stage]
    pool_spec = job.pool_specs[stream.stage] if job.pool_specs is not None else spec
    placed = {policy: PlacedRun(events=sink) for policy, sink in sinks.items()}
    groups = [(spec, tuple(p for p in placed if p != "pool"))]
    if "pool" in placed and _pool_mode_misfit(pool_spec, cfg) is None:
        groups.append((pool_spec, ("pool",)))
    for group_spec, group in groups:
        if group:
            simulate(group_spec, cfg, policies=group, seeds=[stream.seed], placed={p: placed[p] for p in group})
    return placed


class _StepProgress:
    """A stream's steps as :func:`~ms_memopt.simulation.executors.report_progress` units: ``steps`` in
    all, however many event loops (``runs``) the stream takes; a run that dies early is topped up
    when the stream finishes, so the job's bar ends at its total."""

    def __init__(self, steps: int, runs: int) -> None:
        self.steps, self.runs = steps, max(1, runs)
        self.done = 0.0
        self.reported = 0

    def step(self, _step: int) -> None:
        self.done += 1 / self.runs
        whole = min(self.steps, int(self.done))
        if whole > self.reported:
            report_progress(whole - self.reported)
            self.reported = whole

    def finish(self) -> None:
        if self.steps > self.reported:
            report_progress(self.steps - self.reported)
            self.reported = self.steps


def _shown_key(result: PolicyResult, stream: RankStream) -> tuple:
    """Orders ranks as :attr:`JobResult.closest` picks them: the first to fail, else the closest call."""
    if result.oom_step is not None:
        return (0, result.oom_step, stream.rank)
    return (1, result.largest_free_min or 0, stream.rank)


def simulate_jobs(jobs: list[JobSpec], *, executor: str = "local", address: str | None = None,
                  workers: int | None = None, progress: bool = False,
                  timeline: io.TextIOBase | None = None,
                  on_stream: Callable[[int, int], None] | None = None,
                  processes: bool = True, show: ShowRank | None = None,
                  on_job: Callable[[int, dict[str, JobResult]], None] | None = None) -> list[dict[str, JobResult]]:
    """Simulate every stream of every job (all in one pool of tasks, so a sweep keeps every
    worker busy), and return per job ``{policy: JobResult}``.

    Args:
        jobs: from :func:`job_from_recipe`.
        executor, address, workers, processes: see :func:`ms_memopt.simulation.executors.run_tasks`.
        progress: a bar on stderr (:func:`ms_memopt.core.progress.progress_bar`): steps done of every
            stream of every job, the rank streams finished, and the time left.
        timeline: receives every stream's samples (JSON lines stamped with ``rank`` and
            ``stage``), job by job in stream order, after the runs.
        on_stream: called as ``on_stream(done, total)`` when a stream finishes.
        show: what the first job keeps of the rank it is judged by (:class:`ShowRank`), set as
            every policy's :attr:`JobResult.view` (with ``background``, still being collected:
            :meth:`RankView.wait`; ``on_job`` sees it so too).
        on_job: called as ``on_job(index, {policy: JobResult})`` as soon as every stream of job
            ``index`` has finished (a sweep writes each point as it goes).
    """
    from ms_memopt.simulation.executors import run_tasks

    tasks, owner = [], []
    for j, job in enumerate(jobs):
        for stream in job.streams:
            tasks.append(_Task(stream, job.specs[stream.stage], job.cfg, job.policies, timeline is not None,
                               None, job.pool_specs[stream.stage] if job.pool_specs is not None else None))
            owner.append(j)
    from ms_memopt.core.progress import progress_bar

    total_steps = sum(task.cfg.steps for task in tasks)
    bar = progress_bar(total_steps, "simulate", "step", enabled=progress,
                       postfix=f"ranks 0/{len(tasks)}")
    finished = [0]
    values: list = [None] * len(tasks)
    left = [len(job.streams) for job in jobs]

    def job_done(j: int) -> None:
        if on_job is not None:
            on_job(j, _job_results(jobs[j], [(tasks[i], values[i]) for i in range(len(tasks)) if owner[i] == j]))

    def on_done(index: int, value) -> None:
        values[index] = value
        finished[0] += 1
        bar.set_postfix_str(f"ranks {finished[0]}/{len(tasks)}", refresh=False)
        if on_stream is not None:
            on_stream(finished[0], len(tasks))
        j = owner[index]
        left[j] -= 1
        if left[j] == 0 and not (show is not None and j == 0):     # the first job's after its shown rank
            job_done(j)

    try:
        run_tasks(_run_stream, tasks, executor=executor, address=address, workers=workers,
                  on_done=on_done, processes=processes, on_progress=bar.update)
        if show is not None and tasks:
            index = _shown_index(tasks, values, owner)
            bar.set_postfix_str(f"ranks {finished[0]}/{len(tasks)}, rank {tasks[index].stream.rank} shown",
                                refresh=False)
            values[index][2] = _show(tasks[index], show, executor, workers)
            job_done(0)
    except BaseException:
        _close_views(values)
        raise
    finally:
        bar.close()
    try:
        return _gather(jobs, tasks, values, owner, timeline)
    except BaseException:
        _close_views(values)
        raise


def _gather(jobs: list[JobSpec], tasks: list, values: list, owner: list,
            timeline: io.TextIOBase | None) -> list[dict[str, JobResult]]:
    """Per job ``{policy: JobResult}`` from the finished ``values``; every stream's timeline
    written to ``timeline``, job by job in stream order."""
    out = []
    for j, job in enumerate(jobs):
        mine = [(task, value) for task, value, o in zip(tasks, values, owner) if o == j]
        out.append(_job_results(job, mine))
        if timeline is not None:
            for _task, (_results, text, _view) in mine:
                if text:
                    timeline.write(text)
    return out


def _close_views(values: list) -> None:
    """Stop the shown rank's background run, if any (the job failed or was interrupted after it began)."""
    for value in values:
        if value is not None and value[2] is not None:
            value[2].close()


def _show(task: _Task, show: ShowRank, executor: str, workers: int | None) -> RankView:
    """The shown rank's view: its stream run again collecting what ``show`` asks (in the
    background when it says so), or the rank alone when it asks nothing."""
    if not (show.layouts or show.placed):
        return RankView(task.stream)
    again = replace(task, show=show, timeline=False)
    if show.background:
        return RankView(task.stream, pending=start_task(_run_stream, again, executor=executor, workers=workers))
    return _run_stream(again)[2]


def _shown_index(tasks: list, values: list, owner: list) -> int:
    """The task of the first job's rank it is judged by (:func:`_shown_key` of its first policy's
    result: the first to fail, else the closest call), from the finished ``values``."""
    return min((i for i in range(len(tasks)) if owner[i] == 0),
               key=lambda i: _shown_key(values[i][0][tasks[i].policies[0]], tasks[i].stream))


def _job_results(job: JobSpec, streams: list) -> dict[str, JobResult]:
    """``{policy: JobResult}`` of one job from its streams' ``(task, [results, timeline, view])``."""
    out = {p: JobResult(p, job.seed, job.cfg.steps, timing_config=job.cfg.timing, cards=job.cards)
           for p in job.policies}
    for task, (results, _text, view) in streams:
        for policy, result in results.items():
            out[policy].outcomes.append(RankOutcome(task.stream, result))
            if view is not None:
                out[policy].view = view
    return out


def reproducible_figures(results: list[dict[str, JobResult]]) -> list[tuple[str, RankStream, dict]]:
    """Every rank's figures of :func:`simulate_jobs` results but wall-clock ``seconds``: what
    must be identical whichever executor ran the same jobs (tests, ``bench/scaling.py``)."""
    out = []
    for job in results:
        for policy, result in job.items():
            for outcome in result.outcomes:
                figures = outcome.result.to_dict()
                figures.pop("seconds")
                out.append((policy, outcome.stream, figures))
    return out
