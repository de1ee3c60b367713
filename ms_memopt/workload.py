"""The alloc/free event stream of training steps on one card of a mixed-precision Transformer.

One step of a pipeline stage under 1F1B, as :class:`~ms_memopt.events.Event` objects:

* **prologue** (once): BF16 weights, FP32 gradient accumulation buffers and FP32 Adam states
  (master copy, m, v), from the persistent pool, one tensor per layer.
* **forward**, per micro-batch and layer: the P2P receive buffer of the stage input, a
  transient workspace (attention scores, MLP intermediate), and the BF16 activations saved for
  backward. With recompute segments (``recompute_every = k``) only the input of each
  k-layer segment is kept; the backward recomputes the segment's activations first.
* **backward**, per micro-batch and layer in reverse: a gradient workspace, the BF16 weight
  gradient that is cast and added into the FP32 accumulation buffer, then the saved
  activations are freed. 1F1B keeps at most ``in_flight`` micro-batches' activations alive.
* **communication**: ReduceScatter buckets and the AllReduce buffer (the *watched* request,
  4.2 GB in the field report) allocated contiguously after the last backward, then freed.
* **optimizer step**: per parameter group, the FP32 cast of the gradient and the update
  temporary (two intermediate copies of a non-fused AdamW), then a ``mark`` ``optimizer_end``.

Real jobs are not identical step to step. Each mechanism below is a small seeded function,
switchable under ``memopt.workload`` (all off → every step is the same event list):

============== ===========================================================================
``dynamic_seq``  per micro-batch token count (dynamic shapes / packing slack): activations
                 scale with the length; lengths are quantised to ``granularity`` tokens, or
                 drawn from a finite set of ``shapes`` (the bounded control)
``shape_cache``  the first time a shape is seen, small tensors built for it (RoPE tables,
                 position ids, masks, op workspaces) are allocated mid-forward and *live on*;
                 ``limit`` bounds the cache (LRU), ``0`` = unbounded
``extras``       occasional allocations: evaluation forward passes, checkpoint staging
                 copies, logging reductions
``comm_jitter``  the AllReduce buffer is requested at a varying moment inside the last
                 micro-batch's backward instead of after it
============== ===========================================================================

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

from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

import numpy as np

from .events import Event

__all__ = ["DynamicSeq", "ShapeCache", "Extras", "CommJitter", "WorkloadSpec", "StepWorkload",
           "iter_events", "spec_from_recipe", "WATCH_TAG"]

#: The tag of the AllReduce buffer request (the default watched request).
WATCH_TAG = "allreduce"
_ALIGN = 512


def _aligned(nbytes: float) -> int:
    """Bytes rounded up to the 512-byte granule every pool uses, at least one granule."""
    n = int(nbytes)
    return max(_ALIGN, (n + _ALIGN - 1) // _ALIGN * _ALIGN)


# --- mechanism settings ----------------------------------------------------------------------
@dataclass
class DynamicSeq:
    """Dynamic sequence lengths (unpadded batches, packing slack).

    The length of each micro-batch is ``seq_length * (1 - (1 - min_fraction) * X)`` with
    ``X ~ Beta(1, tail)`` (a smaller ``tail`` gives more short sequences), rounded down to
    ``granularity`` tokens. With ``shapes > 0`` the length is instead one of ``shapes`` fixed
    lengths evenly spread over ``[min_fraction, 1] * seq_length`` (a finite set of shapes).
    """

    enabled: bool = True
    min_fraction: float = 0.5
    tail: float = 3.0
    granularity: int = 64
    shapes: int = 0


@dataclass
class ShapeCache:
    """Tensors cached per new shape that live on (RoPE tables, position ids, masks, workspaces).

    On the first micro-batch with a new length, ``tensors`` tensors of
    ``bytes_per_shape * length / seq_length / tensors`` bytes each are allocated one per layer
    group, in the middle of the forward pass, and never freed. ``limit > 0`` bounds the
    cache to that many shapes (least recently used shape freed first).
    """

    enabled: bool = True
    bytes_per_shape: int = 10 * 2**20
    tensors: int = 4
    limit: int = 0


@dataclass
class Extras:
    """Occasional extra allocations; each interval ``0`` switches that kind off.

    Evaluation every ``eval_every`` steps (a forward over ``eval_micro_batches`` micro-batches,
    no saved activations beyond one layer), checkpoint staging every ``checkpoint_every``
    steps (the BF16 weights copied in ``checkpoint_chunks`` chunks before the host copy),
    logging reductions every ``log_every`` steps (``log_tensors`` small tensors).
    """

    enabled: bool = True
    eval_every: int = 200
    eval_micro_batches: int = 2
    checkpoint_every: int = 250
    checkpoint_chunks: int = 8
    log_every: int = 10
    log_tensors: int = 4
    log_bytes: int = 64 * 2**10


@dataclass
class CommJitter:
    """The AllReduce buffer is requested before one of the last ``spread_layers`` backward
    layers of the last micro-batch (uniformly drawn) rather than after the backward."""

    enabled: bool = True
    spread_layers: int = 4


@dataclass
class WorkloadSpec:
    """One card's training step, sizes in bytes (per card, per micro-batch at full length).

    ``activation_bytes`` is what one layer saves for backward for one micro-batch of
    ``seq_length`` tokens; ``workspace_bytes`` the transient peak inside a layer;
    ``recompute_every = k > 0`` keeps only each k-layer segment's input (``input_bytes``)
    and recomputes the segment in backward; ``in_flight`` is how many micro-batches' forward
    activations 1F1B keeps alive (the pipeline depth on the first stage).
    """

    layers: int = 15
    micro_batches: int = 16
    in_flight: int = 8
    seq_length: int = 8192
    param_bytes: int = int(3.1 * 2**30)
    grad_bytes: int = int(6.1 * 2**30)
    optimizer_bytes: int = int(18.4 * 2**30)
    activation_bytes: int = int(0.43 * 2**30)
    workspace_bytes: int = int(0.6 * 2**30)
    input_bytes: int = 0
    recompute_every: int = 0
    p2p_bytes: int = 24 * 2**20
    allreduce_bytes: int = 4_200_000_000
    bucket_bytes: int = 256 * 2**20
    buckets: int = 4
    optimizer_groups: int = 8
    enabled: bool = True
    dynamic_seq: DynamicSeq = field(default_factory=DynamicSeq)
    shape_cache: ShapeCache = field(default_factory=ShapeCache)
    extras: Extras = field(default_factory=Extras)
    comm_jitter: CommJitter = field(default_factory=CommJitter)

    def __post_init__(self) -> None:
        if self.input_bytes <= 0:
            # the layer input is one hidden-state tensor; about 1/17 of the selective-recompute
            # saved set (2sbh of 34sbh, Korthikanti et al. 2022)
            self.input_bytes = max(_ALIGN, self.activation_bytes // 17)
        self.in_flight = max(1, min(self.in_flight, self.micro_batches))

    def mechanisms(self) -> dict[str, bool]:
        """Which variation mechanisms are on (all ``False`` when ``enabled`` is off)."""
        return {name: bool(self.enabled and getattr(self, name).enabled)
                for name in ("dynamic_seq", "shape_cache", "extras", "comm_jitter")}

    def with_mechanisms(self, **switches: bool) -> "WorkloadSpec":
        """A copy with some mechanisms switched (``spec.with_mechanisms(shape_cache=False)``)."""
        out = WorkloadSpec(**{f.name: getattr(self, f.name) for f in fields(self)
                              if f.name not in ("dynamic_seq", "shape_cache", "extras", "comm_jitter")},
                           **{name: type(getattr(self, name))(**asdict(getattr(self, name)))
                              for name in ("dynamic_seq", "shape_cache", "extras", "comm_jitter")})
        for name, on in switches.items():
            getattr(out, name).enabled = bool(on)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


# --- the generator ---------------------------------------------------------------------------
class StepWorkload:
    """Generates the event lists of one card's steps; ids are unique across the whole run.

    Args:
        spec: the step's shape and the variation mechanisms.
        seed: seeds the one ``numpy.random.Generator`` all mechanisms draw from.
    """

    def __init__(self, spec: WorkloadSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._next_id = 0
        self._mech = spec.mechanisms()
        self._cache: OrderedDict[int, list[tuple[int, int]]] = OrderedDict()  # length -> [(id, size)]
        self.shapes_seen: set[int] = set()
        self._events: list[Event] = []

    # ids and emitters --------------------------------------------------------------------
    def _alloc(self, size: int, tag: str, pool: str | None = None) -> int:
        self._next_id += 1
        self._events.append(Event("alloc", id=self._next_id, size=size, tag=tag, pool=pool))
        return self._next_id

    def _free(self, tid: int) -> None:
        self._events.append(Event("free", id=tid))

    def _mark(self, tag: str, step: int) -> None:
        self._events.append(Event("mark", tag=tag, step=step))

    # the parts -------------------------------------------------------------------------------
    def prologue(self) -> list[Event]:
        """Persistent tensors allocated once before step 1: weights, FP32 gradient
        accumulation, optimizer states (one tensor per layer each), in that order."""
        s = self.spec
        self._events = []
        for total, tag in ((s.param_bytes, "parameter"), (s.grad_bytes, "gradient"),
                           (s.optimizer_bytes, "optimizer")):
            for _ in range(s.layers):
                self._alloc(_aligned(total / s.layers), tag, pool="persistent")
        out, self._events = self._events, []
        return out

    def step(self, step: int) -> list[Event]:
        """The events of training step ``step`` (1-based), starting with its ``step`` event."""
        s = self.spec
        self._events = [Event("step", step=step)]
        lengths = [self._sequence_length() for _ in range(s.micro_batches)]
        jitter_layer = self._allreduce_moment()
        saved: dict[int, list[list[int]]] = {}
        # 1F1B: in_flight forwards, then alternate one forward / one backward, then drain
        order: list[tuple[str, int]] = [("F", m) for m in range(s.in_flight)]
        for m in range(s.in_flight, s.micro_batches):
            order += [("B", m - s.in_flight), ("F", m)]
        order += [("B", m) for m in range(s.micro_batches - s.in_flight, s.micro_batches)]
        allreduce_id = None
        for phase, m in order:
            if phase == "F":
                saved[m] = self._forward(step, lengths[m])
            else:
                last = m == s.micro_batches - 1
                allreduce_id = self._backward(saved.pop(m), lengths[m],
                                              jitter_layer if last else None)
        if allreduce_id is None:
            allreduce_id = self._alloc(s.allreduce_bytes, WATCH_TAG)
        self._communicate(allreduce_id)
        self._optimizer()
        self._mark("optimizer_end", step)
        self._extras(step)
        out, self._events = self._events, []
        return out

    # mechanisms (each a small function drawing from self.rng) ---------------------------------
    def _sequence_length(self) -> int:
        """Tokens in one micro-batch (``dynamic_seq``); ``seq_length`` when switched off."""
        s, d = self.spec, self.spec.dynamic_seq
        if not self._mech["dynamic_seq"]:
            return s.seq_length
        if d.shapes > 0:
            if d.shapes == 1:
                return s.seq_length
            k = int(self.rng.integers(d.shapes))
            frac = d.min_fraction + (1.0 - d.min_fraction) * k / (d.shapes - 1)
            return max(d.granularity, int(s.seq_length * frac) // d.granularity * d.granularity)
        x = self.rng.beta(1.0, d.tail)
        length = s.seq_length * (1.0 - (1.0 - d.min_fraction) * x)
        return max(d.granularity, int(length) // d.granularity * d.granularity)

    def _cache_shape(self, length: int) -> None:
        """``shape_cache``: a new shape allocates its cached tensors, which stay live."""
        self.shapes_seen.add(length)
        if not self._mech["shape_cache"]:
            return
        c = self.spec.shape_cache
        if length in self._cache:
            self._cache.move_to_end(length)
            return
        size = _aligned(c.bytes_per_shape * length / self.spec.seq_length / max(1, c.tensors))
        self._cache[length] = [(self._alloc(size, "shape_cache"), size) for _ in range(max(1, c.tensors))]
        while c.limit > 0 and len(self._cache) > c.limit:
            _, tensors = self._cache.popitem(last=False)
            for tid, _ in tensors:
                self._free(tid)

    def _allreduce_moment(self) -> int | None:
        """``comm_jitter``: the backward layer (counted from the last) before which the
        AllReduce buffer is requested; ``None`` = after the whole backward."""
        c = self.spec.comm_jitter
        if not self._mech["comm_jitter"]:
            return None
        return int(self.rng.integers(min(c.spread_layers, self.spec.layers)))

    def _extras(self, step: int) -> None:
        """``extras``: evaluation, checkpoint staging, logging, on their intervals."""
        if not self._mech["extras"]:
            return
        s, x = self.spec, self.spec.extras
        if x.log_every and step % x.log_every == 0:
            ids = [self._alloc(_aligned(x.log_bytes * (1 + self.rng.random())), "logging")
                   for _ in range(x.log_tensors)]
            for tid in ids:
                self._free(tid)
        if x.checkpoint_every and step % x.checkpoint_every == 0:
            chunk = _aligned(s.param_bytes / max(1, x.checkpoint_chunks))
            for _ in range(x.checkpoint_chunks):
                self._free(self._alloc(chunk, "checkpoint"))
        if x.eval_every and step % x.eval_every == 0:
            for _ in range(x.eval_micro_batches):
                length = self._sequence_length()
                scale = length / s.seq_length
                prev = None
                for _layer in range(s.layers):
                    ws = self._alloc(_aligned(s.workspace_bytes * scale), "eval")
                    out = self._alloc(_aligned(s.input_bytes * scale), "eval")
                    self._free(ws)
                    if prev is not None:
                        self._free(prev)
                    prev = out
                self._free(prev)

    # step phases -----------------------------------------------------------------------------
    def _forward(self, step: int, length: int) -> list[list[int]]:
        """One micro-batch forward; returns the saved tensor ids per layer."""
        s = self.spec
        scale = length / s.seq_length
        act = _aligned(s.activation_bytes * scale)
        inp = _aligned(s.input_bytes * scale)
        ws_size = _aligned(s.workspace_bytes * scale)
        recv = self._alloc(_aligned(s.p2p_bytes * scale), "p2p")
        saved: list[list[int]] = []
        k = s.recompute_every
        cache_at = s.layers // 2   # shape tensors are built lazily where the op first runs
        for layer in range(s.layers):
            ws = self._alloc(ws_size, "workspace")
            if layer == cache_at:
                self._cache_shape(length)
            if k and layer % k != 0:
                saved.append([])
            elif k:
                saved.append([self._alloc(inp, "checkpoint_input")])
            else:
                saved.append([self._alloc(act, "activation")])
            self._free(ws)
            if layer == 0:
                self._free(recv)
        send = self._alloc(_aligned(s.p2p_bytes * scale), "p2p")
        self._free(send)
        return saved

    def _backward(self, saved: list[list[int]], length: int, allreduce_before: int | None) -> int | None:
        """One micro-batch backward, last layer first; may request the AllReduce buffer."""
        s = self.spec
        scale = length / s.seq_length
        act = _aligned(s.activation_bytes * scale)
        ws_size = _aligned(s.workspace_bytes * scale)
        grad_size = _aligned(s.param_bytes / s.layers)
        k = s.recompute_every
        allreduce_id = None
        recv = self._alloc(_aligned(s.p2p_bytes * scale), "p2p")
        recomputed: list[int] = []
        for back_index, layer in enumerate(reversed(range(s.layers))):
            if allreduce_before is not None and back_index == s.layers - 1 - allreduce_before:
                allreduce_id = self._alloc(s.allreduce_bytes, WATCH_TAG)
            if k and (layer % k == k - 1 or layer == s.layers - 1):
                # recompute the whole segment's activations before its backward
                first = layer - layer % k
                recomputed = [self._alloc(act, "recompute") for _ in range(first, layer + 1)]
            ws = self._alloc(ws_size, "grad_workspace")
            wgrad = self._alloc(grad_size, "weight_grad")   # BF16, cast-added into FP32 buffer
            self._free(wgrad)
            self._free(ws)
            if k:
                self._free(recomputed.pop())
            for tid in saved[layer]:
                self._free(tid)
            if layer == 0:
                self._free(recv)
        send = self._alloc(_aligned(s.p2p_bytes * scale), "p2p")
        self._free(send)
        return allreduce_id

    def _communicate(self, allreduce_id: int) -> None:
        """ReduceScatter buckets allocated back to back, then the AllReduce completes."""
        s = self.spec
        buckets = [self._alloc(_aligned(s.bucket_bytes), "reduce_scatter") for _ in range(s.buckets)]
        for tid in buckets:
            self._free(tid)
        self._free(allreduce_id)

    def _optimizer(self) -> None:
        """Non-fused AdamW per parameter group: FP32 grad cast and update temporary."""
        s = self.spec
        groups = max(1, s.optimizer_groups)
        temp = _aligned(s.param_bytes * 2 / groups)   # FP32 copy of the group's parameters
        for _ in range(groups):
            cast = self._alloc(temp, "optimizer_temp")
            update = self._alloc(temp, "optimizer_temp")
            self._free(update)
            self._free(cast)


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


def spec_from_recipe(recipe) -> WorkloadSpec:
    """Build the :class:`WorkloadSpec` of a recipe (see :mod:`ms_memopt.recipe`)."""
    raise NotImplementedError("filled in once ms_memopt.recipe exists")
