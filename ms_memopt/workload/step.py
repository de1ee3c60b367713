"""The alloc/free event stream of training steps on one card of a mixed-precision Transformer.

One step of a pipeline stage under 1F1B, as :class:`~ms_memopt.core.events.Event` objects:

* **prologue** (once): BF16 weights, FP32 gradient accumulation buffers and FP32 Adam states
  (master copy, m, v), from the persistent pool, one tensor per layer.
* **forward**, per micro-batch and layer: the P2P receive buffer of the stage input, a
  transient workspace (several tensors: attention, MLP intermediates), and the BF16
  activations saved for backward (several tensors per layer). With recompute segments
  (``recompute_every = k``) only the input of each k-layer segment is kept; the backward
  recomputes the segment's activations first.
* **backward**, per micro-batch and layer in reverse: a gradient workspace, the BF16 weight
  gradient that is cast and added into the FP32 accumulation buffer, then the saved
  activations are freed. 1F1B keeps at most ``in_flight`` micro-batches' activations alive.
* **communication**: ReduceScatter/AllGather buckets (when configured) and the AllReduce
  buffer (the *watched* request, 4.2 GB in the field report), then freed.
* **optimizer step**: per parameter group, the FP32 cast of the gradient and the update
  temporary (two intermediate copies of a non-fused AdamW), then a ``mark`` ``optimizer_end``.

Real jobs are not identical step to step. Each mechanism is a small seeded method, switchable
under ``memopt.workload`` (``enabled: false`` → every step is the same event list):

================== =========================================================================
dynamic lengths    ``dynamic_seq``, ``seq_distribution``, ``seq_min/max``, ``seq_align``,
                   ``seq_buckets``, ``long_tail``: per micro-batch token count; activations,
                   workspaces and P2P buffers scale with it (:func:`draw_sequence_length`)
per-shape caches   ``shape_cache.bytes_per_shape`` (0 = off), ``max_shapes`` (LRU bound): the
                   first time a length is seen, tensors built for it (RoPE tables, position
                   ids, masks, op workspaces of forward and backward ops) *live on*
                   (:meth:`_cache_shape`)
extra allocations  ``extra_allocs.probability`` (0 = off), ``size``, ``lifetime_steps``:
                   evaluation / checkpoint staging / logging tensors at a random moment
                   (:meth:`_extra_moment`)
comm jitter        ``comm_jitter`` (0 = off): the AllReduce buffer is requested before one of
                   the last ``comm_jitter`` share of the backward layer passes
                   (:meth:`_allreduce_moment`)
================== =========================================================================

Every random draw comes from one ``numpy.random.Generator`` seeded with ``seed``, in a fixed
order, so a seed gives the same stream every time.

Example:
    >>> spec = WorkloadSpec(layers=2, micro_batches=2, in_flight=1, param_bytes=2**20,
    ...                     grad_bytes=2**21, optimizer_bytes=3 * 2**21,
    ...                     activation_bytes=2**20, workspace_bytes=2**19, p2p_bytes=2**16,
    ...                     allreduce_bytes=2**21, bucket_bytes=2**20, buckets=1)
    >>> gen = StepWorkload(spec, seed=0)
    >>> events = gen.prologue() + gen.step(1)
    >>> sum(e.size for e in events if e.action == "alloc" and e.pool == "persistent")
    9437184
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np

from ms_memopt.config.recipe import WorkloadConfig, schema_keys, seq_range
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.core.units import aligned

__all__ = [
    "WATCH_TAG", "MAX_STEP_EVENTS", "events_per_step", "check_step_size",
    "StepWorkload",
    "WorkloadSpec",
    "RUN_KEYS",
    "draw_sequence_length",
    "sequence_lengths",
    "iter_events",
]

#: The tag of the AllReduce buffer request (the default watched request).
WATCH_TAG = "allreduce"

#: a step is generated as one list of events; more than this many (estimated by
#: :func:`events_per_step`) would take gigabytes and minutes per step, so it is refused
MAX_STEP_EVENTS = 1_000_000
_ALIGN = 512



# --- mechanism settings (the keys of ``memopt.workload``) --------------------------------------
#: the ``memopt.workload`` keys that are not settings of a step (they are the run's: how many
#: steps, the generator's seed); every other key is a :class:`WorkloadSpec` field
RUN_KEYS = ("seed", "steps")

_CONFIG_DEFAULTS = WorkloadConfig()


def _config_value(config: WorkloadConfig, key: str) -> Any:
    """The value of a dotted ``memopt.workload`` key (``shape_cache.max_shapes``) in ``config``."""
    return functools.reduce(getattr, key.split("."), config)


def _from_config(key: str) -> Any:
    """A :class:`WorkloadSpec` field that is the ``memopt.workload`` key ``key``: its default is
    that key's default in :class:`~ms_memopt.config.recipe.WorkloadConfig` (the one place defaults
    are written), and :func:`spec_from_recipe` fills it from the recipe's value."""
    schema_keys(WorkloadConfig)[key]          # a KeyError here names a key the schema lacks
    return field(default=_config_value(_CONFIG_DEFAULTS, key), metadata={"key": key})


@dataclass
class WorkloadSpec:
    """One card's training step, sizes in bytes (per card, per micro-batch at ``seq_length``).

    Shape of the step: ``activation_bytes`` is what one layer saves for backward for one
    micro-batch of ``seq_length`` tokens; ``workspace_bytes`` the transient peak inside a layer;
    ``recompute_every = k > 0`` keeps only each k-layer segment's input (``input_bytes``) and
    recomputes the segment in backward; ``in_flight`` is how many micro-batches' activations
    1F1B keeps alive (the pipeline depth on the first stage).

    Variation (``memopt.workload``; ``enabled = False`` switches every mechanism off):

    The variation fields are the ``memopt.workload`` keys (field metadata ``key``), with
    :class:`~ms_memopt.config.recipe.WorkloadConfig`'s defaults: every mechanism off unless asked for.

    * ``dynamic_seq`` with the rules of :func:`draw_sequence_length` (``seq_distribution``,
      ``seq_min``/``seq_max``, ``long_tail``, ``seq_align``, ``seq_buckets``; ``seq_min`` and
      ``seq_max`` ``None``: from ``seq_length``).
    * ``cache_bytes_per_shape`` (0 = off) and ``cache_max_shapes`` (``None`` = unbounded, else
      LRU over that many shapes): per new shape, ``cache_tensors`` tensors live on; the share
      ``cache_backward_share`` of them belongs to backward ops and is built in the backward.
    * ``extra_probability`` (0 = off), ``extra_size``, ``extra_lifetime_steps``: per step, with
      that probability, one extra tensor (evaluation, checkpoint staging, logging) at a random
      moment of the step, freed at the start of the step ``extra_lifetime_steps`` later.
    * ``comm_jitter`` (0 = off): the AllReduce buffer is requested before one of the last
      ``comm_jitter`` share of the step's backward layer passes instead of after the backward.
    * ``moe_load_cv`` (0 = off; needs ``moe_layers``): MoE routing. The layers listed in
      ``moe_layers`` exchange tokens by all-to-all: per pass, a dispatch receive buffer and a
      combine buffer (``alltoall_bytes`` in all, at the balanced load) live for the layer, and
      the routed activations (``expert_activation_bytes``) are kept for the backward, which
      takes the same buffers again. Each is scaled by the card's routed load: its
      ``moe_local_experts`` of ``moe_experts`` experts receive the share
      ``Beta(a L, a (E - L))`` of the tokens (the marginal of a Dirichlet over the experts
      with per-expert load coefficient of variation ``moe_load_cv``, ``a = 1/cv^2``), drawn
      per micro-batch and MoE layer, times ``E / L`` (1 at the balanced load).
    """

    layers: int = 15
    micro_batches: int = 16
    in_flight: int = 8
    seq_length: int = 8192
    param_bytes: int = int(3.1 * 2**30)
    grad_bytes: int = int(6.1 * 2**30)
    optimizer_bytes: int = int(18.4 * 2**30)
    activation_bytes: int = int(0.415 * 2**30)
    workspace_bytes: int = 2**30
    input_bytes: int = 0
    recompute_every: int = 0
    p2p_bytes: int = 16 * 2**20
    allreduce_bytes: int = 4_200_000_000
    bucket_bytes: int = 0
    buckets: int = 0
    optimizer_groups: int = 8
    activation_split: tuple[float, ...] = (0.35, 0.3, 0.2, 0.15)
    #: the share of ``activation_bytes`` that grows with the square of the length: the attention
    #: probabilities kept without flash attention (0: all linear, as with flash attention). A
    #: recorded MindSpore layer keeps ``a s + b s^2`` bytes (bench/workload_vs_template.py)
    activation_quadratic_share: float = 0.0
    workspace_split: tuple[float, ...] = (0.5, 0.3, 0.2)
    enabled: bool = _from_config("enabled")
    dynamic_seq: bool = _from_config("dynamic_seq")
    seq_distribution: str = _from_config("seq_distribution")
    seq_min: int | None = _from_config("seq_min")
    seq_max: int | None = _from_config("seq_max")
    seq_align: int = _from_config("seq_align")
    seq_buckets: tuple[int, ...] = _from_config("seq_buckets")
    long_tail: float = _from_config("long_tail")
    cache_bytes_per_shape: int = _from_config("shape_cache.bytes_per_shape")
    cache_max_shapes: int | None = _from_config("shape_cache.max_shapes")
    cache_tensors: int = 4
    cache_backward_share: float = 0.5
    extra_probability: float = _from_config("extra_allocs.probability")
    extra_size: int = _from_config("extra_allocs.size")
    extra_lifetime_steps: int = _from_config("extra_allocs.lifetime_steps")
    comm_jitter: float = _from_config("comm_jitter")
    moe_layers: tuple[int, ...] = ()
    alltoall_bytes: int = 0
    expert_activation_bytes: int = 0
    moe_experts: int = 1
    moe_local_experts: int = 1
    moe_load_cv: float = _from_config("moe_load_cv")
    #: a learned step template's path: the simulator runs its steps instead of this class's
    #: (:class:`~ms_memopt.templates.workload.TemplateWorkload`)
    template: str | None = _from_config("template")
    #: with a template, the steps' dims from a CSV (``simulate T.template.json --schedule``) instead of drawn
    schedule: str | None = _from_config("schedule")
    # the time model's view of the step (ms_memopt.simulation.timing; 0: no compute counted): forward FLOPs
    # per token and per token squared of the stage's layers per card and sequence, sequences per
    # micro-batch, pipeline stages (the 1F1B bubble), data-parallel ways (the gradient AllReduce)
    flops_dense: float = 0.0
    flops_attention: float = 0.0
    batch_size: int = 1
    pipeline_stages: int = 1
    data_parallel: int = 1

    def __post_init__(self) -> None:
        self.seq_min, self.seq_max = seq_range(self.seq_length, self.seq_min, self.seq_max)
        if self.input_bytes <= 0:
            # the layer input is one hidden-state tensor: 2sbh of the ~34sbh a layer saves
            self.input_bytes = max(_ALIGN, self.activation_bytes // 17)
        self.in_flight = max(1, min(self.in_flight, self.micro_batches))
        self.seq_buckets = tuple(sorted(self.seq_buckets))

    #: the switchable mechanisms and the value that switches each off
    OFF: ClassVar[dict] = {"dynamic_seq": False, "shape_cache": 0, "extra_allocs": 0.0, "comm_jitter": 0.0,
                           "moe_routing": 0.0}
    _FIELD: ClassVar[dict] = {"dynamic_seq": "dynamic_seq", "shape_cache": "cache_bytes_per_shape",
              "extra_allocs": "extra_probability", "comm_jitter": "comm_jitter",
              "moe_routing": "moe_load_cv"}

    def mechanisms(self) -> dict[str, bool]:
        """Which variation mechanisms are on (all ``False`` when ``enabled`` is off; MoE
        routing only with MoE layers)."""
        on = {name: bool(self.enabled and getattr(self, attr)) for name, attr in self._FIELD.items()}
        on["moe_routing"] = on["moe_routing"] and bool(self.moe_layers)
        return on

    def without(self, *names: str) -> WorkloadSpec:
        """A copy with the named mechanisms switched off (``spec.without("shape_cache")``)."""
        unknown = set(names) - set(self._FIELD)
        if unknown:
            raise ValueError(f"unknown mechanisms {sorted(unknown)}; expected some of {sorted(self._FIELD)}")
        return replace(self, **{self._FIELD[n]: self.OFF[n] for n in names})

    def to_dict(self) -> dict:
        return asdict(self)


# --- the generator ---------------------------------------------------------------------------
_EXTRA_KINDS = ("eval", "checkpoint", "logging")


class StepWorkload:
    """Generates the event lists of one card's steps; ids are unique across the whole run.

    Args:
        spec: the step's shape and the variation mechanisms.
        seed: seeds the one ``numpy.random.Generator`` all mechanisms draw from.
    """

    def __init__(self, spec: WorkloadSpec, seed: int = 0) -> None:
        check_step_size(spec)
        self.spec = spec
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._next_id = 0
        self._mech = spec.mechanisms()
        self._cache: OrderedDict[int, list[int]] = OrderedDict()  # length -> live tensor ids
        self._extras_due: dict[int, list[int]] = {}                # step -> ids to free then
        self.shapes_seen: set[int] = set()
        self._events: list[tuple] = []
        self._moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        #: the token counts of the last generated step's micro-batches (:func:`draw_sequence_length`)
        self.lengths: list[int] = []

    # ids and emitters --------------------------------------------------------------------
    # rows: tuples of Event's fields in its order (action, id, size, addr, stream, pool, time,
    # tag, step); a tuple costs a fifth of an Event, and simulate reads rows as they are
    def _alloc(self, size: int, tag: str, pool: str | None = None) -> int:
        self._next_id += 1
        self._events.append(("alloc", self._next_id, size, None, 0, pool, None, tag, None))
        return self._next_id

    def _free(self, tid: int) -> None:
        self._events.append(("free", tid, 0, None, 0, None, None, None, None))

    # a layer's tensors come in groups: one call per group, not per tensor (the hot path)
    def _allocs(self, sizes: list[int], tag: str) -> list[int]:
        """One alloc per size, in order; their ids."""
        first = self._next_id + 1
        self._next_id += len(sizes)
        self._events.extend([("alloc", first + i, size, None, 0, None, None, tag, None) for i, size in enumerate(sizes)])
        return list(range(first, self._next_id + 1))

    def _frees(self, tids) -> None:
        """One free per id, in the order given."""
        self._events.extend([("free", tid, 0, None, 0, None, None, None, None) for tid in tids])

    # the parts -------------------------------------------------------------------------------
    def prologue(self) -> list[Event]:
        """Persistent tensors allocated once before step 1: weights, FP32 gradient
        accumulation, optimizer states (one tensor per layer each), in that order."""
        return [Event(*row) for row in self.prologue_rows()]

    def step(self, step: int) -> list[Event]:
        """The events of training step ``step`` (1-based): its ``step`` event, the 1F1B
        forward/backward passes (each opened by a ``mark`` ``"forward:M"`` / ``"backward:M"``,
        M the micro-batch), the communication, the optimizer and a ``mark``
        ``"optimizer_end"`` (where compaction may run)."""
        return [Event(*row) for row in self.step_rows(step)]

    def prologue_rows(self) -> list[tuple]:
        """:meth:`prologue` as rows: tuples of the :class:`~ms_memopt.core.events.Event` fields in
        their order (``Event(*row)`` is the event); what :mod:`ms_memopt.simulation.simulate` consumes."""
        s = self.spec
        self._events = []
        for total, tag in ((s.param_bytes, "parameter"), (s.grad_bytes, "gradient"),
                           (s.optimizer_bytes, "optimizer")):
            for _ in range(s.layers):
                self._alloc(aligned(total / s.layers), tag, pool="persistent")
        out, self._events = self._events, []
        return out

    def step_rows(self, step: int) -> list[tuple]:
        """:meth:`step` as rows (see :meth:`prologue_rows`)."""
        s = self.spec
        self._events = [("step", None, 0, None, 0, None, None, None, step)]
        for tid in self._extras_due.pop(step, ()):
            self._free(tid)
        # every draw of the step happens here, in a fixed order, so that a seed fixes the stream
        lengths = self.lengths = [draw_sequence_length(self.rng, s, s.seq_length)
                                  for _ in range(s.micro_batches)]
        loads = self._routed_loads()
        passes = s.micro_batches * s.layers
        allreduce_at = self._allreduce_moment(passes)
        extra_at = self._extra_moment(2 * passes)
        saved: dict[int, list[list[int]]] = {}
        counters = {"pass": 0, "backward": 0}
        hooks = {"allreduce_at": allreduce_at, "extra_at": extra_at, "allreduce_id": None,
                 "step": step, "loads": loads}
        for phase, m in _one_f_one_b(s.micro_batches, s.in_flight):
            # a named moment per pass: pool mode places a micro-batch's activations by it
            if phase == "F":
                self._events.append(("mark", None, self._kept_bytes(lengths[m]), None, 0, None, None,
                                     f"forward:{m}", step))
                saved[m] = self._forward(lengths[m], counters, hooks, m)
            else:
                self._events.append(("mark", None, 0, None, 0, None, None, f"backward:{m}", step))
                self._backward(saved.pop(m), lengths[m], counters, hooks, m)
        if hooks["allreduce_id"] is None:
            hooks["allreduce_id"] = self._alloc(s.allreduce_bytes, WATCH_TAG)
        self._communicate(hooks["allreduce_id"])
        self._optimizer()
        self._events.append(("mark", None, 0, None, 0, None, None, "optimizer_end", step))
        out, self._events = self._events, []
        return out

    # mechanisms (each a small function drawing from self.rng) ---------------------------------
    def _routed_loads(self) -> np.ndarray | None:
        """``moe_routing``: the card's routed load per micro-batch and MoE layer, relative to
        the balanced load (mean 1); ``None`` when the mechanism is off or no layer is MoE."""
        s = self.spec
        if not s.moe_layers or not s.alltoall_bytes and not s.expert_activation_bytes:
            return None
        if not self._mech["moe_routing"]:
            return np.ones((s.micro_batches, len(s.moe_layers)))
        a = 1.0 / (s.moe_load_cv ** 2)
        local, experts = s.moe_local_experts, max(s.moe_experts, s.moe_local_experts + 1)
        share = self.rng.beta(a * local, a * (experts - local), size=(s.micro_batches, len(s.moe_layers)))
        return share * experts / local

    def _moe_sizes(self, hooks: dict, micro_batch: int, layer: int, scale: float) -> tuple[int, int] | None:
        """(all-to-all buffer, routed activations) of one MoE layer pass; ``None`` for a dense layer."""
        loads = hooks["loads"]
        index = self._moe_index.get(layer)
        if loads is None or index is None:
            return None
        load = loads[micro_batch, index] * scale
        s = self.spec
        return aligned(s.alltoall_bytes / 2 * load), aligned(s.expert_activation_bytes * load)

    def _cache_shape(self, length: int, part: int) -> None:
        """``shape_cache``: a new shape allocates its cached tensors, which stay live; they are
        built where their ops first run, so part ``part`` (of ``cache_tensors``) comes at its
        own layer of the forward. An LRU over ``cache_max_shapes`` shapes frees the oldest."""
        if part == 0:
            self.shapes_seen.add(length)
        if not self._mech["shape_cache"]:
            return
        s = self.spec
        entry = self._cache.get(length)
        if entry is not None and len(entry) > part:
            if part == 0:
                self._cache.move_to_end(length)
            return
        if entry is None:
            entry = self._cache[length] = []
        n = max(1, s.cache_tensors)
        entry.append(self._alloc(aligned(s.cache_bytes_per_shape * length / s.seq_length / n), "shape_cache"))
        if part == 0:
            while s.cache_max_shapes and len(self._cache) > s.cache_max_shapes:
                for tid in self._cache.popitem(last=False)[1]:
                    self._free(tid)

    def _allreduce_moment(self, passes: int) -> int | None:
        """``comm_jitter``: index of the backward layer pass before which the AllReduce buffer
        is requested, among the step's last ``comm_jitter`` share; ``None`` = after backward."""
        if not self._mech["comm_jitter"]:
            return None
        window = max(1, int(np.ceil(self.spec.comm_jitter * passes)))
        return passes - 1 - int(self.rng.integers(window))

    def _extra_moment(self, passes: int) -> int | None:
        """``extra_allocs``: the layer pass (forward or backward) before which this step's
        extra tensor is allocated, or ``None`` when the step has none."""
        if not self._mech["extra_allocs"]:
            return None
        if self.rng.random() >= self.spec.extra_probability:
            return None
        return int(self.rng.integers(passes))

    def _maybe_extra(self, counters: dict, hooks: dict) -> None:
        if hooks["extra_at"] is not None and counters["pass"] == hooks["extra_at"]:
            s = self.spec
            kind = _EXTRA_KINDS[hooks["step"] % len(_EXTRA_KINDS)]
            tid = self._alloc(aligned(s.extra_size), kind)
            self._extras_due.setdefault(hooks["step"] + max(1, s.extra_lifetime_steps), []).append(tid)
        counters["pass"] += 1

    # step phases -----------------------------------------------------------------------------
    def _cache_layers(self, phase: str) -> dict[int, list[int]]:
        """Where the cached tensors of a new shape are built: layer -> parts. The first
        ``cache_backward_share`` of the parts belong to forward ops, spread over the forward;
        the rest to backward ops (their own per-shape workspaces), spread over the backward."""
        s = self.spec
        n = max(1, s.cache_tensors)
        n_back = int(round(n * s.cache_backward_share))
        parts = range(n - n_back) if phase == "forward" else range(n - n_back, n)
        count = max(1, len(parts))
        out: dict[int, list[int]] = {}
        for i, part in enumerate(parts):
            out.setdefault(i * s.layers // count, []).append(part)
        return out

    def _activation_scale(self, length: int) -> float:
        """A layer's saved bytes at ``length`` tokens relative to ``seq_length``: linear, but for
        the share ``activation_quadratic_share`` (attention probabilities) that goes with the square."""
        r = length / self.spec.seq_length
        q = self.spec.activation_quadratic_share
        return r + q * (r * r - r) if q else r

    def _saved_sizes(self, length: int) -> tuple[list[int], int]:
        """Bytes of one layer's saved tensors, and of a recompute segment's input."""
        s = self.spec
        scale = self._activation_scale(length)
        return ([aligned(s.activation_bytes * scale * share) for share in s.activation_split],
                aligned(s.input_bytes * (length / s.seq_length)))

    def _kept_bytes(self, length: int) -> int:
        """What one micro-batch's forward keeps for its backward (the ``forward:M`` mark's size)."""
        acts, inp = self._saved_sizes(length)
        k = self.spec.recompute_every
        return -(-self.spec.layers // k) * inp if k else self.spec.layers * sum(acts)

    def _forward(self, length: int, counters: dict, hooks: dict, micro_batch: int = 0) -> list[list[int]]:
        """One micro-batch forward; returns the saved tensor ids per layer."""
        s = self.spec
        scale = length / s.seq_length
        acts, inp = self._saved_sizes(length)
        wss = [aligned(s.workspace_bytes * scale * share) for share in s.workspace_split]
        recv = self._alloc(aligned(s.p2p_bytes * scale), "p2p")
        saved: list[list[int]] = []
        k = s.recompute_every
        cache_at = self._cache_layers("forward")
        for layer in range(s.layers):
            self._maybe_extra(counters, hooks)
            ws = self._allocs(wss, "workspace")
            for part in cache_at.get(layer, ()):
                self._cache_shape(length, part)
            if not k:
                saved.append(self._allocs(acts, "activation"))
            elif layer % k == 0:
                saved.append([self._alloc(inp, "checkpoint_input")])
            else:
                saved.append([])
            moe = self._moe_sizes(hooks, micro_batch, layer, scale)
            if moe is not None:
                # dispatch receive and combine buffers live for the layer; without recompute the
                # routed activations are kept for the backward
                buffers = [self._alloc(moe[0], "alltoall") for _ in range(2)]
                if not k:
                    saved[-1].append(self._alloc(moe[1], "expert_activation"))
                for tid in reversed(buffers):
                    self._free(tid)
            self._frees(reversed(ws))
            if layer == 0:
                self._free(recv)
        self._free(self._alloc(aligned(s.p2p_bytes * scale), "p2p"))
        return saved

    def _backward(self, saved: list[list[int]], length: int, counters: dict, hooks: dict,
                  micro_batch: int = 0) -> None:
        """One micro-batch backward, last layer first; may request the AllReduce buffer."""
        s = self.spec
        scale = length / s.seq_length
        act = aligned(s.activation_bytes * self._activation_scale(length))
        wss = [aligned(s.workspace_bytes * scale * share) for share in s.workspace_split]
        grad_size = aligned(s.param_bytes / s.layers)
        k = s.recompute_every
        recv = self._alloc(aligned(s.p2p_bytes * scale), "p2p")
        recomputed: list[int] = []
        cache_at = self._cache_layers("backward")
        for back_index, layer in enumerate(reversed(range(s.layers))):
            if counters["backward"] == hooks["allreduce_at"]:
                hooks["allreduce_id"] = self._alloc(s.allreduce_bytes, WATCH_TAG)
            counters["backward"] += 1
            self._maybe_extra(counters, hooks)
            if k and (layer % k == k - 1 or layer == s.layers - 1):
                # recompute the whole segment's activations before its backward
                recomputed = [self._alloc(act, "recompute") for _ in range(layer - layer % k, layer + 1)]
            ws = self._allocs(wss, "grad_workspace")
            for part in cache_at.get(back_index, ()):
                self._cache_shape(length, part)
            moe = self._moe_sizes(hooks, micro_batch, layer, scale)
            buffers = [self._alloc(moe[0], "alltoall") for _ in range(2)] if moe is not None else []
            if moe is not None and k:        # recompute regenerates the routed activations
                buffers.append(self._alloc(moe[1], "expert_activation"))
            wgrad = self._alloc(grad_size, "weight_grad")   # BF16, cast-added into the FP32 buffer
            frees = [wgrad, *reversed(buffers), *reversed(ws)]
            if k:
                frees.append(recomputed.pop())
            frees.extend(reversed(saved[layer]))
            if layer == 0:
                frees.append(recv)
            self._frees(frees)
        self._free(self._alloc(aligned(s.p2p_bytes * scale), "p2p"))

    def _communicate(self, allreduce_id: int) -> None:
        """ReduceScatter buckets allocated back to back, then the AllReduce completes."""
        s = self.spec
        buckets = [self._alloc(aligned(s.bucket_bytes), "reduce_scatter") for _ in range(s.buckets)]
        for tid in buckets:
            self._free(tid)
        self._free(allreduce_id)

    def _optimizer(self) -> None:
        """Non-fused AdamW per parameter group: the FP32 gradient cast and the update
        temporary, two intermediate FP32 copies of the group."""
        s = self.spec
        groups = max(1, s.optimizer_groups)
        temp = aligned(s.param_bytes * 2 / groups)
        for _ in range(groups):
            cast = self._alloc(temp, "optimizer_temp")
            update = self._alloc(temp, "optimizer_temp")
            self._free(update)
            self._free(cast)


def _one_f_one_b(micro_batches: int, in_flight: int) -> Iterator[tuple[str, int]]:
    """The 1F1B pass order, ``("F"|"B", micro-batch)``, generated (not a list per step)."""
    for m in range(in_flight):
        yield "F", m
    for m in range(in_flight, micro_batches):
        yield "B", m - in_flight
        yield "F", m
    for m in range(micro_batches - in_flight, micro_batches):
        yield "B", m


def events_per_step(spec: WorkloadSpec) -> int:
    """An upper estimate of the events of one step (allocations, frees, marks); the 100B
    recipe's first stage (15 layers, 16 micro-batches) makes about 5,500, estimated 7,000.

    Example:
        >>> events_per_step(WorkloadSpec(layers=2, micro_batches=1)) < 200
        True
    """
    per_layer = 4 * len(spec.workspace_split) + 2 * len(spec.activation_split) + 8
    moe = 14 * len(spec.moe_layers)           # all-to-all buffers and routed activations, both passes
    return (spec.micro_batches * (spec.layers * per_layer + moe + 12) + 4 * spec.optimizer_groups
            + 2 * spec.buckets + 20)


def check_step_size(spec: WorkloadSpec) -> None:
    """Refuse a workload whose steps are too big to generate (:data:`MAX_STEP_EVENTS`).

    Raises:
        InputError: names ``parallel_config.micro_batch_num`` (and the layers per stage).
    """
    estimate = events_per_step(spec)
    if estimate > MAX_STEP_EVENTS:
        raise InputError(
            f"{spec.micro_batches} micro-batches x {spec.layers} layers per stage make about {estimate:,} "
            f"memory events per step, more than the simulator generates per step ({MAX_STEP_EVENTS:,}); "
            f"simulate fewer micro-batches (the fragmentation pattern repeats per micro-batch) or fewer "
            f"layers per stage", key="parallel_config.micro_batch_num")


def draw_sequence_length(rng: np.random.Generator, rules, seq_length: int) -> int:
    """Tokens of one micro-batch (the simulator) or one step (``ms-memopt run``): the one rule
    of ``memopt.workload``'s length keys, for both.

    ``rules`` is a :class:`~ms_memopt.config.recipe.WorkloadConfig` or a :class:`WorkloadSpec`
    (the same attribute names). ``seq_length`` when ``enabled`` or ``dynamic_seq`` is off.
    Else, in ``[seq_min, seq_max]``: ``fixed`` is ``seq_max``; ``uniform`` uniform;
    ``lognormal`` packed rows, ``seq_max`` minus a log-normal packing slack (median
    ``seq_max / 32``, sigma 1), except that with probability ``long_tail`` the row is drawn
    uniformly instead (short rows: shard ends, split documents). With ``seq_buckets`` the
    length pads up to the smallest bucket that holds it (the largest when none does); else it
    is rounded *down* to a multiple of ``seq_align``, kept within the multiples inside
    ``[seq_min, seq_max]`` (at least ``seq_align``). Draws from ``rng``: ``fixed`` none,
    ``uniform`` one, ``lognormal`` one more when ``long_tail`` > 0 (whether the row is short).

    Example:
        >>> rules = WorkloadConfig(dynamic_seq=True, seq_distribution="lognormal", long_tail=0.2,
        ...                        seq_min=1000, seq_max=8192, seq_align=64)
        >>> rng = np.random.default_rng(0)
        >>> [draw_sequence_length(rng, rules, 8192) for _ in range(4)]
        [7936, 1088, 7808, 7488]
        >>> draw_sequence_length(np.random.default_rng(0), WorkloadConfig(), 8192)
        8192
    """
    if not (rules.enabled and rules.dynamic_seq):
        return seq_length
    lo, hi = seq_range(seq_length, rules.seq_min, rules.seq_max)
    if rules.seq_distribution == "fixed":
        length = hi
    elif rules.seq_distribution == "uniform" or (rules.long_tail and rng.random() < rules.long_tail):
        length = rng.uniform(lo, hi)
    else:   # lognormal packing slack: rows are nearly full, now and then much shorter
        length = hi - rng.lognormal(np.log(hi / 32), 1.0)
    length = int(min(max(length, lo), hi))
    if rules.seq_buckets:
        return min((b for b in rules.seq_buckets if b >= length), default=max(rules.seq_buckets))
    align = max(1, rules.seq_align)
    high = max(align, hi // align * align)
    low = min(high, max(align, -(-lo // align) * align))
    return min(max(length // align * align, low), high)


def sequence_lengths(rules, steps: int, seq_length: int, seed: int | None = None) -> list[int] | None:
    """``ms-memopt run``'s sequence length of each of ``steps`` steps: one
    :func:`draw_sequence_length` per step from ``numpy.random.Generator(seed)`` (default
    ``rules.seed``, ``memopt.workload.seed``); ``None`` when every step takes ``seq_length``.

    Example:
        >>> sequence_lengths(WorkloadConfig(dynamic_seq=True, seq_min=8, seq_max=32, seq_align=4), 4, 32)
        [20, 12, 8, 8]
        >>> sequence_lengths(WorkloadConfig(), 4, 32) is None
        True
    """
    rng = np.random.default_rng(rules.seed if seed is None else seed)
    lengths = [draw_sequence_length(rng, rules, seq_length) for _ in range(steps)]
    return None if all(n == seq_length for n in lengths) else lengths


def iter_events(spec: WorkloadSpec, steps: int, seed: int = 0) -> Iterator[Event]:
    """The whole run as one stream: the prologue, then steps 1..``steps`` (generated lazily,
    so memory stays constant however many steps).

    Example:
        >>> spec = WorkloadSpec(enabled=False)
        >>> sum(1 for e in iter_events(spec, 2) if e.action == "step")
        2
    """
    gen = StepWorkload(spec, seed)
    yield from gen.prologue()
    for step in range(1, steps + 1):
        yield from gen.step(step)



def spec_settings(config: WorkloadConfig) -> dict:
    """The :class:`WorkloadSpec` fields that are ``memopt.workload`` keys, from ``config``.

    Example:
        >>> spec_settings(WorkloadConfig(comm_jitter=0.5))["comm_jitter"]
        0.5
    """
    return {f.name: _config_value(config, f.metadata["key"]) for f in fields(WorkloadSpec) if "key" in f.metadata}


