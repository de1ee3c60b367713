"""A seeded synthetic training trace, shared by tests and benchmarks.

:func:`synthetic_trace` imitates the alloc/free pattern of a Transformer training loop without
any framework: persistent weights at the start; per step a forward pass that saves activations
layer by layer (sizes scale with a sequence length drawn from a few shapes, so steps differ) and
frees short-lived temporaries a few events later; a backward pass that frees the saved
activations last-in-first-out and allocates weight gradients; an optimizer phase that frees the
gradients; and now and then a small long-lived per-shape cache tensor (bounded, oldest evicted).
Sizes in bytes, ``time`` is the event index, ``step`` events mark step boundaries.

Example:
    >>> trace = synthetic_trace(2000, seed=1)
    >>> len(trace.events), trace.format
    (2000, 'synthetic')
"""
from __future__ import annotations

import random

from ms_memopt.core.events import Event, Trace

__all__ = ["synthetic_trace"]

_KiB, _MiB = 2**10, 2**20


def _log_uniform(rng: random.Random, low: int, high: int, align: int = 512) -> int:
    value = int(low * (high / low) ** rng.random())
    return max(align, value - value % align)


def synthetic_trace(n_events: int = 1_000_000, *, seed: int = 0, layers: int = 24,
                    activations_per_layer: int = 6, temporaries_per_layer: int = 4, weights: int = 96,
                    shapes: int = 8, cache_limit: int = 16) -> Trace:
    """Build a synthetic trace of exactly ``n_events`` events (the last step is cut short).

    Args:
        n_events: number of events.
        seed: the random seed; the same arguments give the same trace.
        layers: Transformer layers per forward pass.
        activations_per_layer: tensors saved for backward per layer (256 KiB - 64 MiB each at the
            longest sequence).
        temporaries_per_layer: short-lived tensors per layer (512 B - 4 MiB), freed 1-3 events later.
        weights: persistent weight tensors (1 - 64 MiB), allocated first and never freed.
        shapes: distinct sequence lengths; a step's activations scale with its length.
        cache_limit: live per-shape cache tensors kept at most (oldest freed first).
    """
    rng = random.Random(seed)
    events: list[Event] = []
    append = events.append
    next_id = 1
    act_base = [[_log_uniform(rng, 256 * _KiB, 64 * _MiB) for _ in range(activations_per_layer)]
                for _ in range(layers)]
    scales = sorted(rng.uniform(0.25, 1.0) for _ in range(max(1, shapes)))
    weight_sizes = [_log_uniform(rng, _MiB, 64 * _MiB) for _ in range(weights)]

    def alloc(size: int, tag: str, pool: str | None = None) -> int:
        nonlocal next_id
        ident = next_id
        next_id += 1
        append(Event("alloc", ident, size, None, 0, pool, len(events), tag, None))
        return ident

    def free(ident: int) -> None:
        append(Event("free", ident, 0, None, 0, None, len(events), None, None))

    for size in weight_sizes:
        if len(events) >= n_events:
            break
        alloc(size, "weight", "persistent")
    caches: list[int] = []
    seen_shapes: set[int] = set()
    step = 0
    while len(events) < n_events:
        step += 1
        append(Event("step", None, 0, None, 0, None, len(events), None, step))
        shape = rng.randrange(len(scales))
        scale = scales[shape]
        if shape not in seen_shapes or rng.random() < 0.02:
            seen_shapes.add(shape)
            caches.append(alloc(_log_uniform(rng, 64 * _KiB, 8 * _MiB), "cache"))
            if len(caches) > cache_limit:
                free(caches.pop(0))
        pending: list[tuple[int, int]] = []  # (free after this many more events, id)
        saved: list[list[int]] = []

        def tick() -> None:
            for index in range(len(pending) - 1, -1, -1):
                left, ident = pending[index]
                if left <= 0:
                    free(ident)
                    pending.pop(index)
                else:
                    pending[index] = (left - 1, ident)

        for layer in range(layers):
            kept = []
            for base in act_base[layer]:
                kept.append(alloc(max(512, int(base * scale) // 512 * 512), "activation"))
                tick()
            for _ in range(temporaries_per_layer):
                pending.append((rng.randint(1, 3), alloc(_log_uniform(rng, 512, 4 * _MiB), "temporary")))
                tick()
            saved.append(kept)
        for _, ident in pending:
            free(ident)
        pending.clear()
        grads = []
        for layer in reversed(range(layers)):
            work = alloc(_log_uniform(rng, 512, 16 * _MiB), "temporary")
            for ident in reversed(saved[layer]):
                free(ident)
            grads.append(alloc(weight_sizes[layer % len(weight_sizes)] if weight_sizes else 512, "gradient"))
            free(work)
        append(Event("mark", None, 0, None, 0, None, len(events), "optimizer_start", None))
        for ident in grads:
            free(ident)
        append(Event("mark", None, 0, None, 0, None, len(events), "optimizer_end", None))
    del events[n_events:]
    return Trace(events, source=f"synthetic(n_events={n_events}, seed={seed})", format="synthetic",
                 meta={"seed": seed, "steps": step, "layers": layers, "time_unit": "event"})
