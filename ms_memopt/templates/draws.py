"""The layouts a template's free-order draws give: every order simulated, grouped by addresses.

MindSpore on CPU draws the order in which it frees a few groups of tensors once per process
(docs/simulation.md, "Templates learned from recordings"): two processes of one command can
place the same allocations at different addresses. No template can know a future process's
draw, so its honest prediction of addresses is a set: the schedule simulated in every free
order the template knows (:attr:`~ms_memopt.templates.template.Template.free_orders`, and the
default), orders that place every allocation alike merged into one layout. A run then matches
one of them; which one its first step tells (:func:`~ms_memopt.templates.template.free_order_of`).

Example:
    >>> from ms_memopt.allocators import create
    >>> from ms_memopt.templates.template import Template
    >>> t = Template(dims=["seq"], prologue={"samples": 1, "seen": [], "basis": [[0]], "ops": []},
    ...              classes={"first": {"samples": 1, "seen": [{"seq": 8}], "basis": [[0], [1]],
    ...                                 "ops": [["a", [0, 512], None, 0, None, True], ["f", "same", 0]]}})
    >>> [o.free_orders for o in draw_outcomes(t, [{"seq": 8}], lambda: create("mindspore-bestfit"))]
    [[None]]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ms_memopt.core.events import Event, Trace
from ms_memopt.replay.replay import ReplayResult, placed_events
from ms_memopt.templates.template import Template, flat_template, generate

__all__ = ["DrawOutcome", "draw_outcomes"]


@dataclass
class DrawOutcome:
    """One layout a process can get: the free orders that give it (entries of the template's
    ``free_orders``; ``None`` is the default order), its events with the model's addresses and
    ``segment_alloc`` events, and what the replay measured (bytes)."""

    free_orders: list[int | None]
    placed: list[Event]
    result: ReplayResult


def draw_outcomes(template: Template, schedule: Sequence[dict[str, int]], make_model: Callable[[], object],
                  *, orders: Sequence[int | None] | None = None,
                  warnings: list[str] | None = None, keep_runtime_leak: bool = False) -> list[DrawOutcome]:
    """The distinct layouts of ``schedule`` over the template's free orders (``orders``: those
    entries only; ``None`` in it is the default order), the default order's first.
    ``make_model()`` returns a fresh allocator model for each replay; ``warnings`` receives
    :func:`~ms_memopt.templates.template.generate`'s (once); ``keep_runtime_leak``: generate's."""
    flat = flat_template(template, schedule, warnings=warnings)     # once: a layered template's count
    by_addresses: dict[tuple, DrawOutcome] = {}
    for n, k in enumerate([None, *range(len(flat.free_orders))] if orders is None else orders):
        events = generate(flat, schedule, free_order=k, warnings=warnings if n == 0 else None,
                          keep_runtime_leak=keep_runtime_leak)
        placed, result = placed_events(Trace(events, source="template", format="template"), make_model(),
                                       segments=True, sample_every=None)
        # the allocations come in one order whatever the frees do, so their addresses name a layout
        key = tuple(e.addr for e in placed if e.action == "alloc")
        if key in by_addresses:
            by_addresses[key].free_orders.append(k)
        else:
            by_addresses[key] = DrawOutcome([k], placed, result)
    return list(by_addresses.values())
