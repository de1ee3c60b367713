"""Pool mode's region sizes for a simulated workload: the engine sizes, the allocator takes sizes.

:class:`~ms_memopt.allocators.pool.PoolModeAllocator` is given region sizes (or a
:class:`~ms_memopt.core.poolplan.PoolPlan`); what a :class:`~ms_memopt.workload.step.WorkloadSpec`
needs in each region is decided here, from the workload's own figures.

Example:
    >>> from ms_memopt.workload.step import WorkloadSpec
    >>> pool = pool_for_workload(WorkloadSpec(enabled=False), capacity=96 * 2**30)   # doctest: +SKIP
    >>> sorted(pool.regions)[:2]                                                       # doctest: +SKIP
    ['activations', 'communication']
"""
from __future__ import annotations

from ms_memopt.allocators import model_class
from ms_memopt.allocators.pool import REGION_OF_TAG, PoolModeAllocator
from ms_memopt.core.poolplan import PoolPlan, share_capacity

__all__ = ["moe_load_headroom", "pool_for_workload", "region_sizes_for_template", "region_sizes_for_workload"]

# every region is a whole number of these (PoolModeAllocator rounds a region down to it)
_ALIGN = 512


def pool_for_workload(spec, capacity: int | None = None, *, fast: bool | None = None) -> PoolModeAllocator:
    """A pool-mode model with regions sized for ``spec`` (:func:`region_sizes_for_workload`, or
    for a learned template :func:`region_sizes_for_template`), laid out by :meth:`PoolPlan.build`
    with the activations region a ring; ``fast`` as :func:`~ms_memopt.allocators.model_class`.

    Raises:
        InputError: the regions do not fit in ``capacity``.
    """
    if spec.template:
        sizes, route = region_sizes_for_template(spec, capacity)
        plan = PoolPlan.build(sizes, rings=("activations",) if "activations" in sizes else ())
        return model_class("pool", fast=fast)(capacity=capacity, regions=plan, chunked=True, route=route)
    plan = PoolPlan.build(region_sizes_for_workload(spec, capacity), rings=("activations",))
    return model_class("pool", fast=fast)(capacity=capacity, regions=plan, chunked=True)


#: a template's regions, in the order of the field report's pool mode; each holds the requests
#: whose learned purpose it names (:mod:`ms_memopt.analysis.purposes`)
_TEMPLATE_REGIONS = ("parameters", "optimizer", "gradients", "activations", "workspace")


def region_sizes_for_template(spec, capacity: int | None = None, *,
                              steps: int = 64) -> tuple[dict[str, int], dict[str, str]]:
    """Region sizes (bytes) for a learned template's steps, by the purpose each allocation's
    lifetime shows (the template workload tags them: parameters, optimizer, gradients,
    activations, workspace), and the route of the watched request (the tag of the allocation it
    stands for).

    Each region's need is its peak over a dry run of the prologue and ``steps`` steps at seed 0
    (what is never freed, exactly); with a ``capacity``, what is left after every
    need is shared among the regions whose use changes with the step's dims (gradients,
    activations, workspace) in proportion to their needs, so a longer sequence than the dry run
    drew has room; without one, each of those gets twice its need. A region no allocation asks
    for is left out. When the needs exceed the capacity, the varying regions share what the
    fixed ones leave in the same proportion, and the pool fails where one runs out: pool mode's
    separate regions cannot hold the step in that card.
    """
    from ms_memopt.templates.workload import WATCH, make_workload, peak_by_tag

    work = make_workload(spec, 0)
    # a schedule ends: the dry run stays within it
    peaks = peak_by_tag(work, min(steps, work.scheduled_steps or steps))
    watch_region = REGION_OF_TAG.get(work.watch_tag or "", "workspace")
    need: dict[str, int] = {}
    for tag, peak in peaks.items():
        region = watch_region if tag == WATCH else REGION_OF_TAG.get(tag or "", "workspace")
        need[region] = need.get(region, 0) + peak
    need = {name: need[name] for name in _TEMPLATE_REGIONS if need.get(name)}
    need.setdefault("workspace", _ALIGN)
    return share_capacity(need, capacity, alignment=_ALIGN), {WATCH: watch_region}


def moe_load_headroom(spec, samples: int = 1) -> float:
    """The routed load (relative to the balanced load, 1) a region must hold for ``samples``
    MoE layer passes at once: their mean plus four standard deviations of their sum, capped at
    every token coming to this card (``E / L``). One pass's load is the workload's
    ``Beta(a L, a (E - L)) x E / L`` (``a = 1 / moe_load_cv^2``), whose coefficient of variation
    is ``sqrt((E - L) / (L (a E + 1)))``; ``samples`` independent passes add up to
    ``samples + 4 cv sqrt(samples)``.

    Example: 4 of 16 experts per card, cv 0.2: one pass's load varies by 8.7%, so 1.35.
        >>> from types import SimpleNamespace as S
        >>> round(moe_load_headroom(S(moe_experts=16, moe_local_experts=4, moe_load_cv=0.2)), 2)
        1.35
    """
    experts, local = max(spec.moe_experts, spec.moe_local_experts), max(1, spec.moe_local_experts)
    if spec.moe_load_cv <= 0 or experts <= local:
        return float(samples)
    a = 1.0 / spec.moe_load_cv ** 2
    cv = ((experts - local) / (local * (a * experts + 1))) ** 0.5
    return min(samples + 4 * cv * samples ** 0.5, samples * experts / local)


def region_sizes_for_workload(spec, capacity: int | None = None) -> dict[str, int]:
    """Region sizes (bytes) for one card's workload: parameters and optimizer exactly; the
    activation ring for ``in_flight + 1`` micro-batches at ``seq_max`` plus two layers of slack;
    the communication arena for the AllReduce buffer, the buckets, four P2P buffers and, with
    MoE, the all-to-all dispatch and combine buffers sized by the routed tokens at the load
    :func:`moe_load_headroom` allows; the workspace for the largest transient set (backward
    workspaces + weight gradient, or the optimizer's two FP32 temporaries) plus the routed
    expert activations (kept for the backward by every in-flight micro-batch's MoE layers
    without recompute, one layer's with) and the extra allocations, with 25% slack; the cache
    what is left of ``capacity`` up to 2 GiB (at least 64 shapes' worth).
    """
    scale = spec.seq_max / spec.seq_length if spec.seq_max else 1.0
    per_layer = spec.activation_bytes * scale
    # one chunk more than in flight: a chunk that does not fit before the region's end wraps
    # to its start and leaves up to one chunk unused until the ring comes round
    if spec.recompute_every:
        segments = -(-spec.layers // spec.recompute_every)
        per_mb = segments * spec.input_bytes * scale
        ring = (spec.in_flight + 1) * per_mb + spec.recompute_every * per_layer + per_layer
    else:
        ring = (spec.in_flight + 1) * spec.layers * per_layer + 2 * per_layer
    workspace_set = spec.workspace_bytes * scale + spec.param_bytes / spec.layers
    optimizer_temps = 2 * (spec.param_bytes * 2 / max(1, spec.optimizer_groups))
    extras = spec.extra_size * (spec.extra_lifetime_steps + 1) if spec.extra_probability else 0
    moe_passes = len(spec.moe_layers)
    alltoall = routed = 0.0
    if moe_passes and (spec.alltoall_bytes or spec.expert_activation_bytes):
        # the two buffers of one pass (dispatch receive, combine) live together; without
        # recompute every in-flight micro-batch keeps each MoE layer's routed activations
        alltoall = spec.alltoall_bytes * scale * moe_load_headroom(spec)
        kept = (spec.in_flight + 1) * moe_passes if not spec.recompute_every else 1
        routed = spec.expert_activation_bytes * scale * moe_load_headroom(spec, kept)
    sizes = {
        "parameters": spec.param_bytes + spec.layers * _ALIGN,
        "gradients": spec.grad_bytes + spec.layers * _ALIGN,
        "optimizer": spec.optimizer_bytes + spec.layers * _ALIGN,
        "activations": int(ring * 1.02),
        "communication": int(spec.allreduce_bytes + spec.buckets * spec.bucket_bytes + 4 * spec.p2p_bytes * scale
                             + alltoall) + 2**20,
        "workspace": int((max(workspace_set, optimizer_temps) + routed + extras) * 1.25),
    }
    floor = 64 * spec.cache_bytes_per_shape
    sizes = {k: (v + _ALIGN - 1) // _ALIGN * _ALIGN for k, v in sizes.items()}
    room = (capacity - sum(sizes.values())) if capacity is not None else 2**31
    sizes["workspace.cache"] = int(max(min(room, 2**31), min(floor, max(room, 0)))) // _ALIGN * _ALIGN
    return sizes
