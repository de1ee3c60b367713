"""What-if on a recorded trace: the same allocation sequence under the simulator's policies.

A recording (``ms-memopt record``, a pool log, any trace) is one real sequence of requests.
Replayed under a smaller ``capacity`` it shows whether *that* sequence dies of
fragmentation; replayed under a policy it shows whether the policy saves it:

============  ================================================================================
``baseline``  the allocator model as recorded (``mindspore-bestfit`` for a CPU recording)
``compact``   the same model; at every ``compact_every``-th ``step`` event (the recording's
              step ends) the layout is compacted when that raises the largest piece
              (:func:`~ms_memopt.analysis.compaction.model.try_compaction`, as the simulator's
              ``compact`` policy does), and at a request that fails a last-resort compaction runs
              and the request is asked again; the replay goes on from the compacted layout
``pool``      pool mode (:class:`~ms_memopt.allocators.pool.PoolModeAllocator`) with a region per
              purpose the recording's lifetimes show (:func:`~ms_memopt.analysis.purposes.learn_purposes`:
              parameters, optimizer states, gradients, activations, workspace), each sized from
              the recording itself
============  ================================================================================

A tag that pool mode knows (``activation``, ``allreduce``, ...; the simulator's traces have them)
is kept as is; an allocation without one is tagged with its learned purpose (what fits none goes
to ``workspace``). Each region's need is the peak of its bytes at once in the recording (512-byte
aligned; the fixed regions, parameters and optimizer, exactly), the rest of ``capacity`` is
shared among the others (:func:`~ms_memopt.core.poolplan.share_capacity`): pool mode is told the
future of the recording, a best case for it, and the report says so.

Example:
    >>> from ms_memopt.core.events import Event, Trace
    >>> t = Trace([Event("alloc", id=1, size=4096), Event("step"), Event("alloc", id=2, size=512),
    ...            Event("free", id=2), Event("step", tag="dims:seq=8")])
    >>> [e.tag for e in lifetime_tags(t).events if e.action == "alloc"]
    ['parameter', 'workspace']
"""
from __future__ import annotations

import dataclasses

from ms_memopt.allocators import create
from ms_memopt.allocators.base import AllocatorModel
from ms_memopt.allocators.pool import REGION_OF_TAG, PoolModeAllocator
from ms_memopt.analysis.purposes import TAG_OF_PURPOSE, learn_purposes
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Trace
from ms_memopt.core.metrics import measure
from ms_memopt.core.poolplan import share_capacity
from ms_memopt.core.units import aligned
from ms_memopt.replay.replay import ReplayResult, replay

__all__ = ["WHATIF_POLICIES", "lifetime_tags", "pool_regions", "replay_policy"]

WHATIF_POLICIES = ("baseline", "compact", "pool")
_FIXED = ("parameters", "optimizer")


def lifetime_tags(trace: Trace) -> Trace:
    """A copy of ``trace`` whose allocations carry the tag of their learned purpose, the tag pool
    mode routes by (module doc); known tags are kept. A ``persistent``-pool allocation is a
    parameter whatever its lifetime (MindSpore keeps Parameters there)."""
    of = learn_purposes(trace.events).of

    def tag_of(event) -> str:
        if event.pool == "persistent":
            return "parameter"
        return TAG_OF_PURPOSE.get(of.get(event.id, "")) or "workspace"
    events = [dataclasses.replace(e, tag=tag_of(e)) if e.action == "alloc" and (e.tag is None or e.tag not in REGION_OF_TAG)
              else e for e in trace.events]
    return dataclasses.replace(trace, events=events)


def pool_regions(trace: Trace, capacity: int) -> dict[str, int]:
    """Region sizes (bytes) for a trace tagged by :func:`lifetime_tags`: each region's peak bytes
    at once, the rest of ``capacity`` shared among the regions whose use varies.

    Raises:
        InputError: the fixed regions (parameters, optimizer) alone need ``capacity`` or more.
    """
    size_of: dict[int, tuple[str, int]] = {}
    now: dict[str, int] = {}
    peak: dict[str, int] = {}
    for event in trace.events:
        if event.action == "alloc":
            region = REGION_OF_TAG.get(event.tag or "", "workspace")
            size_of[event.id] = (region, aligned(event.size))
            now[region] = now.get(region, 0) + size_of[event.id][1]
            peak[region] = max(peak.get(region, 0), now[region])
        elif event.action == "free" and event.id in size_of:
            region, size = size_of.pop(event.id)
            now[region] -= size
    fixed = sum(aligned(peak[name]) for name in _FIXED if peak.get(name))
    if fixed >= capacity:
        raise InputError(f"the long-lived tensors of this recording (parameters, optimizer states) need {fixed} "
                         f"bytes at once, more than the capacity {capacity}: no room for the other regions",
                         key="--capacity")
    peak.setdefault("workspace", 512)
    return share_capacity(peak, capacity, fixed=_FIXED)


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
                         "long_lived": sum(e.action == "alloc" and e.tag in ("parameter", "optimizer")
                                           for e in tagged.events)}
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
    from ms_memopt.analysis.compaction.model import try_compaction

    # the compacted layout brings its pool blocks along: a fresh model must not pre-grow its own
    # on top of them (as the simulator's compaction, simulation.simulate)
    regrown = {k: v for k, v in options.items() if k not in ("pregrow", "init_size")}
    stats = {"name": "compact", "every": compact_every, "compactions": 0, "last_resort": 0, "skipped": 0,
             "bytes_moved": 0, "frag_before_max": None, "frag_after_max": None}

    def compacted(current: AllocatorModel, addr_of: dict[int, int], need: int | None = None) -> AllocatorModel | None:
        done = try_compaction(current, addr_of, lambda: create(allocator, capacity, **regrown), need=need)
        if done.skipped is not None:
            stats["skipped"] += 1
            return None
        stats["compactions"] += 1
        stats["bytes_moved"] += done.bytes_moved
        for key, layout in (("frag_before_max", done.before), ("frag_after_max", done.after)):
            ratio = measure(layout).frag_ratio
            if ratio is not None and (stats[key] is None or ratio > stats[key]):
                stats[key] = ratio
        return done.model

    def at_step(step: int, current: AllocatorModel, addr_of: dict[int, int]) -> AllocatorModel:
        if step % compact_every:
            return current
        return compacted(current, addr_of) or current

    def at_oom(index: int, event, current: AllocatorModel, addr_of: dict[int, int]) -> AllocatorModel | None:
        new = compacted(current, addr_of, need=event.size)
        stats["last_resort"] += new is not None
        return new

    result = replay(trace, model, on_step=at_step, on_oom=at_oom)
    result.policy = stats
    return result
