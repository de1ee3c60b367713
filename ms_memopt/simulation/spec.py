"""A recipe (or a bare step template) read once into the job's whole specification.

This is the one place a simulation reads a :class:`~ms_memopt.config.recipe.Recipe`:
:func:`job_from_recipe` turns it into a :class:`JobSpec` (the rank streams, each pipeline stage's
:class:`~ms_memopt.workload.step.WorkloadSpec` with its compute for the time model, the simulator's
:class:`~ms_memopt.simulation.simulate.SimConfig` with its timing constants). The simulator, the job and
the time model take that spec and never read the recipe again; the command line and the library call
the same function.

Example:
    >>> from ms_memopt.config.recipe import load_recipe
    >>> job = job_from_recipe(load_recipe("recipes/demo_cpu.yaml"), steps=4)    # doctest: +SKIP
    >>> job.cfg.steps, len(job.streams)                                         # doctest: +SKIP
    (4, 1)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import GRANULE
from ms_memopt.simulation.simulate import POLICIES, SimConfig
from ms_memopt.templates.workload import WATCH, watched_bytes
from ms_memopt.workload.step import WATCH_TAG, WorkloadSpec, spec_settings

__all__ = ["MAX_STREAMS", "RankStream", "JobSpec", "stream_seed", "rank_streams", "job_from_recipe",
           "spec_from_recipe", "config_from_recipe", "stage_flops_fields"]

#: more distinct streams than this are refused unless sampled (``ranks=N``): a 1024-card job
#: has 128 (a 16k-card job ~2,000); each stream is a full simulation
MAX_STREAMS = 4096


@dataclass(frozen=True)
class RankStream:
    """One distinct card stream of a job.

    ``rank`` is the global rank of the first card of its tensor-parallel group (MindSpore's
    order: stage-major, then data-parallel group, tensor-parallel peers innermost), which
    stands for ranks ``rank .. rank + tensor_parallel - 1``.
    """

    stage: int
    data_parallel: int
    rank: int
    tensor_parallel: int
    seed: int

    @property
    def ranks(self) -> range:
        """Every global rank that makes this stream's requests (its tensor-parallel peers)."""
        return range(self.rank, self.rank + self.tensor_parallel)


def stream_seed(job_seed: int, stage: int, data_parallel: int) -> int:
    """The workload seed of one stream: the stream of stage 0, data-parallel group 0 takes the job
    seed itself (so a one-card recipe simulates exactly as
    :func:`~ms_memopt.simulation.simulate.simulate` does); every other stream takes
    ``numpy.random.SeedSequence([job_seed, stage, group])``'s first 32-bit word
    (:mod:`ms_memopt.simulation.job`).

    Example:
        >>> stream_seed(7, 0, 0)
        7
        >>> stream_seed(7, 0, 1) == stream_seed(7, 0, 1) != stream_seed(7, 1, 0)
        True
    """
    if stage == 0 and data_parallel == 0:
        return int(job_seed)
    return int(np.random.SeedSequence([int(job_seed), stage, data_parallel]).generate_state(1)[0])


def rank_streams(recipe, *, seed: int | None = None, ranks: int | None = None,
                 stages: list[int] | None = None) -> list[RankStream]:
    """The job's distinct card streams, stage-major (``stage x data_parallel``), or a sample.

    Args:
        recipe: a :class:`~ms_memopt.config.recipe.Recipe`.
        seed: the job seed (default ``memopt.workload.seed``).
        ranks: simulate only this many streams: a stratified sample, the stages taken in turn
            from the first (the fullest under 1F1B), each stage's data-parallel groups in an
            order drawn from the job seed. ``None``: every stream.
        stages: only these pipeline stages (``None``: all).

    Raises:
        InputError: a stage outside the recipe, a sample size below 1, or more than
            :data:`MAX_STREAMS` streams without a sample.
    """
    par = recipe.parallel
    seed = recipe.memopt.workload.seed if seed is None else seed
    all_stages = list(range(par.pipeline_stage))
    if stages is not None:
        bad = [s for s in stages if s not in all_stages]
        if bad or not stages:
            raise InputError(f"expected pipeline stages among 0..{par.pipeline_stage - 1}, got "
                             f"{', '.join(map(str, bad)) or '(none)'}", key="--stages")
        all_stages = sorted(set(stages))
    if ranks is not None and ranks < 1:
        raise InputError(f"expected a positive number of rank streams, got {ranks}", key="--ranks")
    dp, tp = par.data_parallel, par.model_parallel

    def stream(stage: int, group: int) -> RankStream:
        return RankStream(stage=stage, data_parallel=group, rank=(stage * dp + group) * tp,
                          tensor_parallel=tp, seed=stream_seed(seed, stage, group))

    total = len(all_stages) * dp
    if ranks is None or ranks >= total:
        if total > MAX_STREAMS:
            raise InputError(f"{len(all_stages)} pipeline stages x {dp} data-parallel groups are {total:,} distinct "
                             f"card streams, more than {MAX_STREAMS:,} to simulate one by one; sample them with "
                             f"--ranks N", key="parallel_config.data_parallel")
        return [stream(s, g) for s in all_stages for g in range(dp)]
    # stage i % S takes its (i // S)-th group of an order drawn from the job seed
    rng = np.random.default_rng([int(seed), 0x5A4D])
    per_stage = -(-ranks // len(all_stages))
    orders = {s: [int(g) for g in rng.choice(dp, size=min(dp, per_stage), replace=False)] for s in all_stages}
    picked = [stream(all_stages[i % len(all_stages)], orders[all_stages[i % len(all_stages)]][i // len(all_stages)])
              for i in range(ranks)]
    return sorted(picked, key=lambda s: s.rank)


@dataclass
class JobSpec:
    """One job to simulate: a workload per pipeline stage, the simulator settings, its streams."""

    specs: dict[int, WorkloadSpec]
    cfg: SimConfig
    streams: list[RankStream]
    policies: tuple[str, ...] = POLICIES
    seed: int = 0
    label: str = ""
    #: the job's cards (data x tensor x pipeline parallel); the time model's straggler draws
    #: give every stream an equal share of them (0: one card a stream)
    cards: int = 0
    #: the ``pool`` policy's own workload per stage, when it recomputes where the others do not
    #: (``memopt.pool_checkpoint_every``); ``None``: every policy runs ``specs``
    pool_specs: dict[int, WorkloadSpec] | None = None


def job_from_recipe(recipe, *, policies: tuple[str, ...] = POLICIES, seed: int | None = None,
                    ranks: int | None = None, stages: list[int] | None = None, label: str = "",
                    **overrides) -> JobSpec:
    """The :class:`JobSpec` of a recipe: its streams (:func:`rank_streams`), each stage's
    workload, and :func:`config_from_recipe` with ``overrides``
    (``steps=...``, ``capacity=...``)."""
    seed = recipe.memopt.workload.seed if seed is None else seed
    streams = rank_streams(recipe, seed=seed, ranks=ranks, stages=stages)
    from ms_memopt.analysis.estimate import estimate

    plan = estimate(recipe)     # once for every stage (it covers them all)
    specs = {stage: spec_from_recipe(recipe, stage=stage, plan=plan) for stage in sorted({s.stage for s in streams})}
    cfg = config_from_recipe(recipe, **overrides)
    pool_specs = None
    k = recipe.memopt.pool_checkpoint_every
    if k is not None and "pool" in policies and k != recipe.memopt.checkpoint_every:
        recomputing = replace(recipe, memopt=replace(recipe.memopt, checkpoint_every=k))
        pool_plan = estimate(recomputing)
        pool_specs = {stage: spec_from_recipe(recomputing, stage=stage, plan=pool_plan) for stage in specs}
    return JobSpec(specs=specs, cfg=cfg, streams=streams, policies=tuple(policies), seed=seed, label=label,
                   cards=recipe.parallel.cards, pool_specs=pool_specs)


def _recipe_allocator(allocator) -> tuple[str, dict]:
    """The model name and options of ``baseline`` and ``compact`` for a recipe's
    ``memopt.allocator`` (recipe names use ``_``, model names ``-``).

    ``increase_size``, ``pregrow`` and ``init_size`` set up MindSpore's pool and only reach its
    models. ``pool`` (train in pool mode, for ``ms-memopt run``) simulates its baseline on
    MindSpore's pool: pool mode itself is the ``pool`` policy, with regions from the plan."""
    name = allocator.name.replace("_", "-")
    if name == "pool":
        name = "mindspore"
    if name not in ("mindspore", "mindspore-bestfit"):
        return name, {}
    options = {"increase_size": allocator.increase_size}
    if allocator.pregrow:
        options["pregrow"] = True
    elif allocator.init_size:
        options["init_size"] = allocator.init_size
    return name, options


def config_from_recipe(recipe, **overrides) -> SimConfig:
    """The :class:`SimConfig` a recipe asks for (``memopt.scan_every``, ``compact_every``,
    ``compact_trigger``, ``watch``, ``allocator``; capacity = ``memopt.device.hbm``)."""
    mem = recipe.memopt
    name, options = _recipe_allocator(mem.allocator)
    watch = dict(mem.watch) or {WATCH_TAG: 4_200_000_000}
    if mem.workload.template:       # a template's watched request is each step's largest
        from ms_memopt.simulation.spec import spec_from_recipe

        watch = {WATCH: watched_bytes(spec_from_recipe(recipe))}
    cfg = SimConfig(steps=mem.workload.steps, capacity=recipe.capacity, allocator=name,
                    allocator_options=options, scan_every=mem.scan_every,
                    compact_every=mem.compact_every, watch=watch, seed=mem.workload.seed,
                    timing=mem.timing)
    if mem.compact_trigger is not None:
        cfg.compact_trigger = mem.compact_trigger
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    return cfg


def spec_from_recipe(recipe, *, stage: int = 0, plan=None) -> WorkloadSpec:
    """The :class:`WorkloadSpec` of one pipeline stage of a recipe (default: the first, which
    holds the most micro-batches in flight), sizes from :mod:`ms_memopt.analysis.estimate` (``plan``:
    the recipe's :func:`~ms_memopt.analysis.estimate.estimate`, when the caller has it already)."""
    from ms_memopt.analysis import estimate as est
    from ms_memopt.simulation.spec import stage_flops_fields

    model, par, mem = recipe.model, recipe.parallel, recipe.memopt
    w = mem.workload
    stage_est = (plan or est.estimate(recipe)).stages[stage]
    regions = stage_est.regions
    layers = stage_est.layers
    shape = dict(seq=model.seq_length, micro_batch=recipe.train.batch_size,
                 tensor_parallel=par.model_parallel, sequence_parallel=par.use_seq_parallel)
    selective = bool(recipe.recompute.select_recompute)
    factor = mem.activation_factor
    activation = est.layer_activation_bytes(model, **shape, recompute="selective" if selective else "none",
                                            comm_kept=not recipe.recompute.mp_comm_recompute)
    k = mem.checkpoint_every or 0
    if recipe.recompute.recompute is True:
        k = layers
    comm = stage_est.communication
    buckets = [comm.get("reduce_scatter_bucket", 0), comm.get("allgather_bucket", 0)]
    return WorkloadSpec(
        layers=layers,
        micro_batches=par.micro_batch_num,
        in_flight=stage_est.in_flight,
        seq_length=model.seq_length,
        param_bytes=regions["parameters"],
        grad_bytes=regions["gradients"],
        optimizer_bytes=regions["optimizer"],
        activation_bytes=int(activation * factor),
        activation_quadratic_share=_quadratic_share(model, shape, selective, recipe),
        workspace_bytes=regions.get("workspace", mem.workspace),
        input_bytes=int(est.layer_input_bytes(model, **shape) * factor),
        recompute_every=k if k and k < layers or k == layers else 0,
        p2p_bytes=max(GRANULE, comm.get("p2p_buffers", 0) // 2),
        allreduce_bytes=comm.get("allreduce_bucket") or mem.watch.get(WATCH_TAG, 0) or GRANULE,
        bucket_bytes=max(buckets),
        buckets=sum(1 for b in buckets if b),
        **spec_settings(w),
        **_moe_fields(recipe, stage, factor),
        **stage_flops_fields(recipe, stage),
    )


def _quadratic_share(model, shape: dict, selective: bool, recipe) -> float:
    """The share of a layer's activation bytes at ``seq`` that is quadratic in the length (the
    attention probabilities; 0 with flash attention): from the formula ``A(s) = a s + b s^2`` at
    ``seq`` and twice it, ``A(2s) - 2 A(s) = 2 b s^2``."""
    from ms_memopt.analysis import estimate as est
    if model.use_flash_attention or selective:
        return 0.0
    kept = dict(recompute="none", comm_kept=not recipe.recompute.mp_comm_recompute)
    at_seq = est.layer_activation_bytes(model, **shape, **kept)
    at_twice = est.layer_activation_bytes(model, **{**shape, "seq": 2 * shape["seq"]}, **kept)
    return max(0.0, min(1.0, (at_twice - 2 * at_seq) / (2 * at_seq))) if at_seq else 0.0


def _moe_fields(recipe, stage: int, factor: float) -> dict:
    """The MoE routing part of a stage's spec (nothing for a dense model): its MoE layers,
    all-to-all buffers and routed activations (:mod:`ms_memopt.analysis.estimate`) and the experts on
    one card; the routing load variation is ``memopt.workload.moe_load_cv``."""
    from ms_memopt.analysis import estimate as est
    moe = recipe.model.moe
    if moe is None:
        return {}
    return {"moe_layers": est.stage_moe_layers(recipe, stage),
            "alltoall_bytes": est.alltoall_bytes(recipe),
            "expert_activation_bytes": int(est.routed_activation_bytes(recipe) * factor),
            "moe_experts": moe.num_experts,
            "moe_local_experts": max(1, moe.num_experts // recipe.parallel.expert_parallel)}


def stage_flops_fields(recipe, stage: int) -> dict:
    """The :class:`~ms_memopt.workload.step.WorkloadSpec` fields of one stage's compute: forward
    FLOPs per token of its layers (``flops_dense``, dense matmuls ``2 P``; the LM head on the
    last stage) and per token squared (``flops_attention``, ``4 h_q`` per layer), per card
    (split by tensor parallel), per sequence; sequences per micro-batch; pipeline stages and
    data-parallel ways. MoE layers are counted as dense layers (every expert's weights): an
    upper bound."""
    from ms_memopt.analysis.estimate import layer_split

    model, par = recipe.model, recipe.parallel
    t = par.model_parallel
    layers = recipe.stage_layers()[stage]
    dense_layer, _ = layer_split(model, False, t, par.expert_parallel)
    dense = 2.0 * dense_layer * layers
    if stage == par.pipeline_stage - 1:
        dense += 2.0 * model.vocab_size * model.hidden_size / t
    attention = 4.0 * model.num_heads * model.head_dim * layers / t
    return {"flops_dense": dense, "flops_attention": attention, "batch_size": recipe.train.batch_size,
            "pipeline_stages": par.pipeline_stage, "data_parallel": par.data_parallel}
