"""What fragmentation costs in time: a per-rank, per-step time model and the job's step.

Every constant is a ``memopt.timing`` recipe key (:class:`~ms_memopt.config.recipe.TimingConfig`;
docs/recipes.md gives each one's source, docs/simulation.md the check against the field report).

**One rank, one step** (:func:`rank_step`), from what the simulator counted that step
(:class:`StepCounts`):

* *compute*: the stage's FLOPs of the step's micro-batches at their drawn lengths n
  (per layer and sequence, forward ``2 P n + 4 n^2 h``: the dense matmuls and the attention
  scores and their product, Narayanan et al. 2021; backward twice the forward; recompute one
  more forward; the LM head ``2 V h n`` on the last stage; all split by tensor parallel), plus
  the 1F1B bubble (``(p - 1) / m`` of the micro-batches' time), over
  ``peak_flops x base_efficiency``;
* *host time* (part of compute): host seconds per pool request inside a step
  (``request_seconds``; one request stands for the several ops a PyNative step dispatches
  around it), and at a shape the rank has not run before the kernels built for it
  (``shape_build_seconds`` per request); both 0 (not priced) unless measured, as
  ``bench/timing_cpu.py`` does for the CPU. A template's requests are its real ones; the
  hand-made workload models only the large buffers, so with ``host_requests_per_layer`` set
  its requests are ``host_requests_per_layer`` per layer pass (layer x micro-batch) plus
  ``host_requests_per_step``, the real pool's counts (``bench/timing_cpu.py``);
* *memory stalls*: what the allocator model did that step, each at its cost: blocks taken from
  the device (``segment_allocs``, ``device_alloc_seconds``), idle blocks given back to it
  (:attr:`~ms_memopt.allocators.base.AllocatorModel.segment_frees`, ``device_free_seconds``;
  MindSpore's ``ReleaseFreeBlocks``, counted by the non-VMM MindSpore models, pure-Python and
  compiled), VMM 2 MiB chunks mapped or unmapped (the net change of mapped bytes: a lower
  bound, ``vmm_chunk_seconds``), eager-free sweeps (``defrag_sweep_seconds``; the VMM model,
  pure-Python and compiled), requests on the slow path (``slow_path_seconds``;
  :attr:`~ms_memopt.allocators.base.AllocatorModel.slow_path_events`: every MindSpore model,
  pure-Python and compiled, counts MindSpore's sync-and-retry of ``AllocMemBuf``; of the
  PyTorch models only the pure-Python ones count theirs, the compiled ones report 0), and the
  unfused optimizer's two intermediate FP32 copies, each written and read once (bytes over
  ``hbm_bandwidth``; pool mode runs the fused optimizer: none);
* *compaction*: every byte moved is read and written (``2 x bytes / hbm_bandwidth``) plus
  ``compaction_barrier_seconds`` per compaction.

**The job's step** (:func:`job_steps`): a step ends when its slowest rank ends; a compaction is
a global sync point, so every rank waits for the longest one; then the gradient AllReduce over
data parallel (ring: ``2 (d - 1) / d x gradient bytes / collective_bandwidth``):
``max_r(compute_r + stalls_r) + max_r(compaction_r) + collective``.

Example:
    >>> from ms_memopt.config.recipe import TimingConfig
    >>> c = StepCounts(flops=8e14, model_flops=8e14)
    >>> rank_step(c, TimingConfig(peak_flops=1e15, base_efficiency=0.5))
    (1.6, 0.0, 0.0)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ms_memopt.config.recipe import TimingConfig
from ms_memopt.core.units import aligned

__all__ = ["StepCounts", "TIMING_KEYS", "step_flops", "optimizer_extra_bytes",
           "collective_bytes", "rank_step", "card_factors", "job_steps", "job_timing"]

#: the keys of a policy's ``timing`` object (``simulate --json``), in order
TIMING_KEYS = ("step_seconds_median", "step_seconds_p99", "step_cv", "mfu", "memory_stall_share",
               "compaction_pause_share")


@dataclass(slots=True)
class StepCounts:
    """What one rank did in one step, as counts (the time follows from a :class:`TimingConfig`,
    so other constants re-price a run without simulating it again)."""

    flops: float = 0.0              # FLOPs executed (recompute included), bubble excluded
    model_flops: float = 0.0        # the model's FLOPs (no recompute): what MFU counts
    bubble: float = 0.0             # the 1F1B bubble as a share of the micro-batches' time
    device_allocs: int = 0
    vmm_chunks: int = 0
    defrag_sweeps: int = 0
    slow_path: int = 0
    optimizer_bytes: int = 0        # extra HBM traffic of the unfused optimizer
    compactions: int = 0
    compaction_bytes: int = 0
    requests: int = 0               # allocation requests of the step (the pool's, as the workload makes them)
    new_shape_requests: int = 0     # the step's requests when its shape is new to the rank (kernel builds)
    compaction_tensors: int = 0     # live tensors the step's compactions walked (their host work)
    # last, so that tuples written before it keep their positions (and read as 0 here)
    device_frees: int = 0           # idle blocks given back to the device (AllocatorModel.segment_frees)
    layer_passes: int = 0           # layers x micro-batches of a hand-made step (0: a template's real requests)

    def as_tuple(self) -> tuple:
        return (self.flops, self.model_flops, self.bubble, self.device_allocs, self.vmm_chunks,
                self.defrag_sweeps, self.slow_path, self.optimizer_bytes, self.compactions,
                self.compaction_bytes, self.requests, self.new_shape_requests, self.compaction_tensors,
                self.device_frees, self.layer_passes)

    def host_requests(self, timing: TimingConfig) -> tuple[int, int]:
        """(requests, new-shape requests) the host time is priced on: the workload's own, or for a
        hand-made step with ``timing.host_requests_per_layer`` set, the real pool's count.

        Example:
            >>> from ms_memopt.config.recipe import TimingConfig
            >>> c = StepCounts(requests=43, new_shape_requests=43, layer_passes=2)
            >>> c.host_requests(TimingConfig()), c.host_requests(TimingConfig(host_requests_per_layer=214,
            ...                                                                host_requests_per_step=172))
            ((43, 43), (600, 600))
        """
        if not (self.layer_passes and timing.host_requests_per_layer):
            return self.requests, self.new_shape_requests
        real = round(timing.host_requests_per_layer * self.layer_passes + timing.host_requests_per_step)
        return real, real if self.new_shape_requests else 0



def step_flops(spec, lengths: list[int]) -> tuple[float, float, float]:
    """(FLOPs executed, model FLOPs, bubble share) of one step whose micro-batches have
    ``lengths`` tokens per sequence."""
    b = spec.batch_size
    forward = sum(b * (spec.flops_dense * n + spec.flops_attention * n * n) for n in lengths)
    recompute = 1.0 if spec.recompute_every else 0.0
    m = max(1, len(lengths))
    return (3.0 + recompute) * forward, 3.0 * forward, (spec.pipeline_stages - 1) / m


def optimizer_extra_bytes(spec) -> int:
    """HBM traffic of the unfused AdamW's intermediate copies per step: the workload's two FP32
    copies per parameter group (``optimizer_temp``), each written once and read once."""

    groups = max(1, spec.optimizer_groups)
    return 2 * 2 * groups * aligned(spec.param_bytes * 2 / groups)


def collective_bytes(spec) -> float:
    """Bytes each card sends in the gradient AllReduce over data parallel (ring):
    ``2 (d - 1) / d x grad_bytes``; over ``collective_bandwidth`` it is the collective's time."""
    d = max(1, spec.data_parallel)
    return 2.0 * (d - 1) / d * spec.grad_bytes


def rank_step(c: StepCounts | tuple, timing: TimingConfig) -> tuple[float, float, float]:
    """(compute, memory stalls, compaction) seconds of one rank's step (a tuple is
    :meth:`StepCounts.as_tuple`'s, or an older, shorter one: the missing counts are 0)."""
    if not isinstance(c, StepCounts):
        c = StepCounts(*c)
    requests, new_shape_requests = c.host_requests(timing)
    compute = (c.flops * (1.0 + c.bubble) / (timing.peak_flops * timing.base_efficiency)
               + requests * timing.request_seconds + new_shape_requests * timing.shape_build_seconds)
    stalls = (c.device_allocs * timing.device_alloc_seconds + c.device_frees * timing.device_free_seconds
              + c.vmm_chunks * timing.vmm_chunk_seconds
              + c.defrag_sweeps * timing.defrag_sweep_seconds + c.slow_path * timing.slow_path_seconds
              + c.optimizer_bytes / timing.hbm_bandwidth)
    compaction = (2.0 * c.compaction_bytes / timing.hbm_bandwidth
                  + c.compactions * timing.compaction_barrier_seconds
                  + c.compaction_tensors * timing.compaction_tensor_seconds)
    return compute, stalls, compaction


def job_steps(ranks: list[list[tuple[float, float, float]]], collective: float,
              factors: np.ndarray | None = None) -> list[tuple[float, float, float]]:
    """Each job step as (seconds, memory stalls, compaction pause) from every rank's
    (compute, stalls, compaction) per step: the slowest card's compute and stalls, the longest
    compaction (a global sync point), then the collective. Steps run while every rank runs (a
    job stops at its first rank's OOM). ``factors`` (:func:`card_factors`, shape ranks x cards x
    steps) scales each card's compute: every rank stream stands for that many cards, and the
    step waits for the slowest of all of them.

    Example:
        >>> job_steps([[(1.0, 0.1, 0.0)], [(1.2, 0.0, 0.5)]], collective=0.3)
        [(2.0, 0.0, 0.5)]
    """
    return _steps(*_card_busy(ranks, factors), collective)


def _steps(busy: np.ndarray | None, stalls: np.ndarray | None, pause: np.ndarray | None,
           collective: float) -> list[tuple[float, float, float]]:
    """:func:`job_steps` from :func:`_card_busy`'s arrays."""
    if busy is None:
        return []
    slowest = busy.argmax(axis=0)
    steps = busy.shape[1]
    stall_of = stalls[slowest // (busy.shape[0] // stalls.shape[0]), np.arange(steps)]
    longest = pause.max(axis=0)
    return [(float(b + p + collective), float(st), float(p))
            for b, st, p in zip(busy.max(axis=0), stall_of, longest)]


def card_factors(ranks: int, cards: int, steps: int, jitter: float, seed: int = 0) -> np.ndarray | None:
    """Per rank stream, card it stands for, and step: the factor on that card's compute,
    ``1 + jitter x N(0, 1)`` kept within [0.5, 1.5] (a card is never twice as fast or slow for
    noise alone), drawn from a generator of the job ``seed``'s own (the workload's draws stay
    as they were); ``None`` when ``jitter`` is 0.

    Example:
        >>> f = card_factors(ranks=2, cards=3, steps=4, jitter=0.05)
        >>> f.shape, bool(abs(f.mean() - 1) < 0.1), card_factors(2, 3, 4, 0.0)
        ((2, 3, 4), True, None)
    """
    if jitter <= 0 or ranks < 1 or cards < 1 or steps < 1:
        return None
    rng = np.random.default_rng([seed, 0x6A17])
    return np.clip(1.0 + jitter * rng.standard_normal((ranks, cards, steps)), 0.5, 1.5)


def _card_busy(ranks: list[list[tuple[float, float, float]]], factors: np.ndarray | None):
    """(busy seconds per card and step, stalls per rank and step, compaction per rank and step)
    over the steps every rank completed; ``(None, None, None)`` without ranks or steps."""
    steps = min((len(r) for r in ranks), default=0)
    if steps == 0:
        return None, None, None
    priced = np.array([r[:steps] for r in ranks], dtype=float)        # ranks x steps x 3
    compute, stalls, pause = priced[..., 0], priced[..., 1], priced[..., 2]
    if factors is None:
        return compute + stalls, stalls, pause
    per = factors.shape[1]
    busy = compute[:, None, :] * factors[:, :, :steps] + stalls[:, None, :]
    return busy.reshape(len(ranks) * per, steps), stalls, pause


def job_timing(rank_counts: list[list[tuple]], collectives: list[float], timing: TimingConfig, *,
               cards: int | None = None, seed: int = 0) -> tuple[dict, dict] | None:
    """``(timing, detail)``: a policy's ``timing`` object (:data:`TIMING_KEYS`) over its ranks'
    step counts and collective bytes (:func:`collective_bytes`), and its detail:
    ``rank_step_median`` (each rank's median busy time, compute and stalls, for the
    distribution across ranks), ``step_seconds`` (the job's step times), ``steps`` and
    ``card_cv`` (the coefficient of variation of the cards' busy times at a step, the mean over
    steps: what a job's per-card step times spread by). ``cards``: the job's cards, each rank
    stream standing for an equal share of them (default: one card a stream), each drawing its
    own ``timing.card_jitter`` (:func:`card_factors`, from the job ``seed``). ``None`` when no
    step completed."""
    priced = [[rank_step(c, timing) for c in counts] for counts in rank_counts]
    steps_done = min((len(p) for p in priced), default=0)
    per = max(1, (cards or len(priced)) // max(1, len(priced)))
    factors = card_factors(len(priced), per, steps_done, timing.card_jitter, seed)
    busy, stalls, pause = _card_busy(priced, factors)      # once: cards x steps can be large
    steps = _steps(busy, stalls, pause, max(collectives, default=0.0) / timing.collective_bandwidth)
    if not steps:
        return None
    mean_busy = busy.mean(axis=0)
    card_cv = float(np.mean(np.divide(busy.std(axis=0), mean_busy, out=np.zeros_like(mean_busy),
                                      where=mean_busy > 0)))
    seconds = np.array([s[0] for s in steps])
    n = len(steps)
    model_flops = sum(statistics.fmean(StepCounts(*counts[i]).model_flops for counts in rank_counts)
                      for i in range(n))
    total = float(seconds.sum())
    mean = float(seconds.mean())
    mfu = model_flops / (total * timing.peak_flops) if total > 0 else None
    out = {
        "step_seconds_median": float(np.median(seconds)),
        "step_seconds_p99": float(np.quantile(seconds, 0.99)),
        "step_cv": float(seconds.std() / mean) if mean > 0 else 0.0,
        "mfu": mfu if mfu else None,
        "memory_stall_share": sum(s[1] for s in steps) / total if total > 0 else 0.0,
        "compaction_pause_share": sum(s[2] for s in steps) / total if total > 0 else 0.0,
    }
    extra = {"rank_step_median": [float(np.median([p[0] + p[1] for p in r[:n]])) for r in priced],
             "step_seconds": [float(x) for x in seconds], "steps": n, "card_cv": card_cv,
             "cards_per_stream": per}
    return out, extra
