"""Which layouts of a simulation to draw as a memory map (the picture of "14 GB free and no
4.2 GB piece").

:class:`LayoutCollector` hooks into :func:`ms_memopt.simulation.simulate.simulate` (``on_watch``) and keeps
the pool's layout at chosen steps, at an OOM, or, for a policy that survives, at its worst
moment; ``ms-memopt simulate --out`` and ``make demo`` write them to ``layouts.jsonl``, which
:func:`ms_memopt.report.build.build_report` draws with :func:`ms_memopt.report.memory_map.plot_memory_map`.
"""
from __future__ import annotations

from dataclasses import replace

from ms_memopt.core.metrics import measure
from ms_memopt.core.units import format_size
from ms_memopt.simulation.spec import JobSpec
from ms_memopt.simulation.simulate import simulate
from ms_memopt.workload.step import WATCH_TAG
from ms_memopt.io.layouts import LayoutSnapshot

__all__ = ["LayoutCollector", "simulated_layouts"]


class LayoutCollector:
    """An ``on_watch`` hook of :func:`ms_memopt.simulation.simulate.simulate`: keeps the layout just before
    the first watched request (the AllReduce bucket) of each of ``steps``, per policy of
    ``policies`` and seed ``seed``, and the layout at an OOM whenever it happens. With ``worst``,
    a policy that never runs out of memory contributes its worst moment instead: the layout
    before the watched request that found the least room (largest hole minus request).

    Example:
        >>> from ms_memopt.simulation.simulate import SimConfig, simulate
        >>> from ms_memopt.workload.step import WorkloadSpec
        >>> collector = LayoutCollector([1, 2], policies=("baseline",), worst=False)
        >>> _ = simulate(WorkloadSpec(enabled=False), SimConfig(steps=2), policies=("baseline",), on_watch=collector)
        >>> [snap.label for snap in collector.snapshots()]
        ['baseline step 1', 'baseline step 2']
    """

    def __init__(self, steps: list[int], *, policies: tuple[str, ...] = ("baseline", "pool"),
                 seed: int = 0, worst: bool = True) -> None:
        self.steps = set(steps)
        self.worst = worst
        self.policies = tuple(policies)
        self.seed = seed
        self._taken: dict[tuple[str, int], LayoutSnapshot] = {}
        self._oom: dict[str, LayoutSnapshot] = {}
        self._worst: dict[str, tuple[int, LayoutSnapshot]] = {}   # policy -> (room, layout)

    def __call__(self, point) -> None:
        if point.policy not in self.policies or point.seed != self.seed:
            return
        if point.kind == "oom":
            event = point.event
            self._oom[point.policy] = LayoutSnapshot(
                point.step, f"{point.policy} step {point.step}:\nOOM ({_request(event)})",
                point.layout())
            return
        if point.step in self.steps and (point.policy, point.step) not in self._taken:
            self._taken[point.policy, point.step] = LayoutSnapshot(
                point.step, f"{point.policy} step {point.step}", point.layout())
        if not self.worst:
            return
        room = point.model.largest_free() - point.event.size
        worst = self._worst.get(point.policy)
        if worst is None or room < worst[0]:
            layout = point.layout()
            self._worst[point.policy] = (room, LayoutSnapshot(
                point.step, f"{point.policy} step {point.step}: worst moment\n(largest hole "
                f"{format_size(measure(layout).largest_free)},\n{_request(point.event)})",
                layout))

    def snapshots(self) -> list[LayoutSnapshot]:
        """Per policy (in the order given) by step, each policy's OOM (or worst moment) last."""
        out = []
        for policy in self.policies:
            out += [snap for (p, _), snap in sorted(self._taken.items(), key=lambda kv: kv[0][1]) if p == policy]
            if policy in self._oom:
                out.append(self._oom[policy])
            elif policy in self._worst:
                out.append(self._worst[policy][1])
        return out


def simulated_layouts(job: JobSpec, steps: list[int], *, policies: tuple[str, ...] = ("baseline", "pool"),
                      seed: int = 0) -> list[LayoutSnapshot]:
    """The simulated pool just before the watched request (the AllReduce bucket) of each of
    ``steps``, per policy; a policy that runs out of memory first contributes its layout at the
    OOM, on the job's first pipeline stage (``job``: :func:`~ms_memopt.simulation.spec.job_from_recipe`).
    One run of :func:`ms_memopt.simulation.simulate.simulate` up to the last step, collected by a
    :class:`LayoutCollector` (``make demo`` hooks the collector into its main simulation instead).
    """
    spec = job.specs[min(job.specs)]
    cfg = replace(job.cfg, steps=max(steps), watch=dict(job.cfg.watch))
    # the workload tags its gradient bucket WATCH_TAG whatever the recipe calls its watched request
    cfg.watch.setdefault(WATCH_TAG, spec.allreduce_bytes)
    collector = LayoutCollector(steps, policies=policies, seed=seed, worst=False)
    simulate(spec, cfg, policies=tuple(policies), seeds=[seed], on_watch=collector)
    return collector.snapshots()


def _request(event) -> str:
    """``grad_workspace 304.20 MiB``, or ``a 192.00 KiB request`` when the request has no tag."""
    size = format_size(event.size)
    return f"{event.tag} {size}" if event.tag else f"a {size} request"
