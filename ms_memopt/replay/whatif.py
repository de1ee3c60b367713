"""What-if on a recorded trace: the same allocation sequence under the simulator's policies.

A recording (``ms-memopt record``, a pool log, any trace) is one real sequence of requests.
Replayed under a smaller ``capacity`` it shows whether *that* sequence dies of
fragmentation; replayed under a policy it shows whether the policy saves it:

============  ================================================================================
``baseline``  the allocator model as recorded (``mindspore-bestfit`` for a CPU recording)
``compact``   the same model; at every ``compact_every``-th ``step`` event (the recording's
              step ends) the layout is compacted (:func:`~ms_memopt.analysis.compaction.model.compact_model`,
              as the simulator's ``compact`` policy does) and the replay goes on from it
``pool``      pool mode (:class:`~ms_memopt.allocators.pool.PoolModeAllocator`) with two
              regions sized from the recording itself: ``parameters`` for the long-lived
              tensors, ``workspace`` (the rest of ``capacity``) for everything else
============  ================================================================================

What is long-lived, when tags do not say (a CPU pool log names no tensor): an allocation from
the ``persistent`` pool, or one still live at the next ``step`` event (it outlives the step that
made it: weights, optimizer states, kept outputs), or one never freed. A tag that pool mode
knows (``activation``, ``allreduce``, ...; the simulator's traces have them) is kept as is.
The ``parameters`` region is the peak of the long-lived bytes at once (512-byte aligned), so
pool mode is told the future of the recording: a best case for it, and the report says so.

Example:
    >>> from ms_memopt.core.events import Event, Trace
    >>> t = Trace([Event("alloc", id=1, size=4096), Event("step", step=1), Event("alloc", id=2, size=512),
    ...            Event("free", id=2)])
    >>> [e.tag for e in lifetime_tags(t).events if e.action == "alloc"]
    ['parameter', None]
"""
from __future__ import annotations

import dataclasses

from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.pool import REGION_OF_TAG, PoolModeAllocator
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Trace
from ms_memopt.core.metrics import measure
from ms_memopt.core.units import aligned
from ms_memopt.replay.replay import ReplayResult, replay

__all__ = ["WHATIF_POLICIES", "lifetime_tags", "pool_regions", "replay_policy"]

WHATIF_POLICIES = ("baseline", "compact", "pool")
_LONG = "parameter"      # the tag pool mode sends to its fixed "parameters" region


def lifetime_tags(trace: Trace) -> Trace:
    """A copy of ``trace`` whose allocations carry the tag pool mode routes by (module doc)."""
    live: set[int] = set()
    long_ids: set[int] = set()
    for event in trace.events:
        if event.action == "alloc":
            live.add(event.id)
            if event.pool == "persistent":
                long_ids.add(event.id)
        elif event.action == "free":
            live.discard(event.id)
        elif event.action == "step":
            long_ids.update(live)
    long_ids.update(live)                # never freed
    events = [dataclasses.replace(e, tag=_LONG) if e.action == "alloc" and e.id in long_ids
              and (e.tag is None or e.tag not in REGION_OF_TAG) else e for e in trace.events]
    return dataclasses.replace(trace, events=events)


def pool_regions(trace: Trace, capacity: int) -> dict[str, int]:
    """``{"parameters": peak long-lived bytes, "workspace": the rest of capacity}`` for a trace
    tagged by :func:`lifetime_tags`.

    Raises:
        InputError: the long-lived tensors alone need more than ``capacity``.
    """
    size_of: dict[int, int] = {}
    current = peak = 0
    for event in trace.events:
        if event.action == "alloc" and event.tag == _LONG:
            size_of[event.id] = aligned(event.size)
            current += size_of[event.id]
            peak = max(peak, current)
        elif event.action == "free" and event.id in size_of:
            current -= size_of.pop(event.id)
    if peak >= capacity:
        raise InputError(f"the long-lived tensors of this recording need {peak} bytes at once, more than the "
                         f"capacity {capacity}: no room for a workspace region", key="--capacity")
    return {"parameters": peak, "workspace": capacity - peak}


def replay_policy(trace: Trace, policy: str, *, allocator: str, capacity: int | None,
                  compact_every: int = 1, options: dict | None = None) -> ReplayResult:
    """Replay ``trace`` under ``policy`` (:data:`WHATIF_POLICIES`) with ``allocator`` as the
    recording's own model (created with ``options``); see the module docstring.

    Raises:
        InputError: unknown policy; ``compact`` on a trace without step events; ``pool``
            without a capacity, or with more long-lived bytes than the capacity.
    """
    if policy not in WHATIF_POLICIES:
        raise InputError(f"unknown policy {policy!r}; expected one of {', '.join(WHATIF_POLICIES)}",
                         key="--policy")
    if policy == "pool":
        if capacity is None:
            raise InputError("pool mode splits a device into regions: give --capacity", key="--policy")
        tagged = lifetime_tags(trace)
        regions = pool_regions(tagged, capacity)
        result = replay(tagged, PoolModeAllocator(capacity=capacity, regions=regions))
        result.policy = {"name": "pool", "regions": regions,
                         "long_lived": sum(e.action == "alloc" and e.tag == _LONG for e in tagged.events)}
        return result
    options = dict(options or {})
    model = create(allocator, capacity, **options)
    if policy == "baseline":
        result = replay(trace, model)
        result.policy = {"name": "baseline"}
        return result
    if compact_every <= 0:
        raise InputError(f"expected a positive number of steps, got {compact_every}", key="--compact-every")
    if not any(e.action == "step" for e in trace.events):
        raise InputError("compaction runs at step ends and this trace has no step events; record the run "
                         "with a LayoutScanCallback (ms-memopt record writes its step marks)", key="--policy")
    from ms_memopt.analysis.compaction.model import compact_model

    # the compacted layout brings its pool blocks along: a fresh model must not pre-grow its own
    # on top of them (as the simulator's compaction, simulation.simulate)
    regrown = {k: v for k, v in options.items() if k not in ("pregrow", "init_size")}
    stats = {"name": "compact", "every": compact_every, "compactions": 0, "bytes_moved": 0,
             "frag_before_max": None, "frag_after_max": None}

    def at_step(step: int, current: AllocatorModel, addr_of: dict[int, int]) -> AllocatorModel:
        if step % compact_every:
            return current
        new, before, after, moves = compact_model(current, addr_of, lambda: create(allocator, capacity, **regrown))
        stats["compactions"] += 1
        stats["bytes_moved"] += sum(m.size for m in moves)
        for key, layout in (("frag_before_max", before), ("frag_after_max", after)):
            ratio = measure(layout).frag_ratio
            if ratio is not None and (stats[key] is None or ratio > stats[key]):
                stats[key] = ratio
        return new

    result = replay(trace, model, on_step=at_step)
    result.policy = stats
    return result
