"""Step templates learned from real recordings: the user's own model, simulated at any shape.

A recording made with :func:`ms_memopt.mindspore.mark_step` (``ms-memopt record``) holds a
``step`` event at every step end whose ``tag`` carries the step's dims
(``dims:seq=32,batch=4``, docs/events.md); a dims-less ``step`` event before them (the setup
mark, ``mark_step()``) ends the prologue. :func:`learn` splits each recording into

* the **prologue**: the events before the setup mark (empty without one: the setup then
  belongs to the first step);
* **steps**, each the events since the previous step event, with the dims of its own mark,
  classified as ``first`` (a recording's first step), ``new_shape`` (the first step at a dims
  value the recording has not run before) and ``repeat``.

Within a class every step must make the same allocations and frees in the same order (the
same pool, stream and tag at each allocation; each free of the same allocation), else an
:class:`~ms_memopt.core.errors.InputError` names the recording, the step and what differs: a
template is never made of steps that do not line up. Each allocation's size is fitted as a
polynomial in the dims that vary across the class's samples: the lowest total degree whose fit
reproduces every recorded size exactly (numpy least squares as the screen, then exact rational
coefficients checked in integers); a position no degree reproduces keeps the size recorded
most often (a constant) and is listed (:attr:`Template.not_exact`). The prologue is fitted the
same way in the dims every recording holds constant (``hidden``, a model width fixed per
process: the weights differ between recordings), at each recording's values; :func:`generate`
evaluates it at the schedule's first step. Recordings whose steps of one class (or prologues)
each make another number of allocations, decided by a dim fixed per recording (a layer count),
give a template over that repeated block count (:attr:`Template.layered`,
:mod:`ms_memopt.templates.layers`: 3 or more consecutive counts showing one repeated
block), else are refused with an :class:`~ms_memopt.core.errors.InputError` that says why and
names the block one more layer inserts. A free refers to the allocation it frees: one of
the same step (``same``), of the prologue (``prologue``), or of the step ``k`` steps back
(``back``; the position there depends on that step's class, so one position per class seen).
Allocations a recording never frees stay never freed; events after the last mark (the
process's exit) are not part of a template.

:func:`generate` turns a template and a schedule (one dims dict per step) into events: the
prologue, then per step the variant its place in the schedule calls for, in the most common
free order of the calibration steps or (``free_order=k``) in the order calibration recording
``free_orders[k]`` freed in. :func:`fidelity` compares generated events with a recording
position by position.

Example:
    >>> from ms_memopt.core.events import Event
    >>> def rec(seqs):
    ...     ev, i = [Event("step", step=0)], 0
    ...     for n, s in enumerate(seqs, 1):
    ...         i += 1; ev += [Event("alloc", id=i, size=64 * s * s + 512), Event("free", id=i),
    ...                        Event("step", step=n, tag=f"dims:seq={s}")]
    ...     return ev
    >>> t = learn([("a", rec([8, 8, 16, 16])), ("b", rec([16, 16, 24, 24])), ("c", rec([24, 8, 8]))])
    >>> [e.size for e in generate(t, [{"seq": 32}, {"seq": 32}]) if e.action == "alloc"]
    [66048, 66048]

The parts live in one module each: the data and its JSON file in
:mod:`ms_memopt.templates.format`, learning in :mod:`ms_memopt.templates.learning`, the events
of a schedule in :mod:`ms_memopt.templates.generating`, the comparison with a recording in
:mod:`ms_memopt.templates.fidelity`; this module names them all, as before the split.
"""
from __future__ import annotations

from ms_memopt.templates.classes import CLASSES
from ms_memopt.templates.fidelity import fidelity
from ms_memopt.templates.format import (FORMAT, LAYERED_VERSION, MAX_SCHEDULE_ROWS, MAX_TEMPLATE_DEGREE, VERSION,
                                        Template, dims_tag, load_template, parse_dims_tag, read_schedule,
                                        save_template, template_from_dict)
from ms_memopt.templates.generating import flat_template, free_order_of, generate
from ms_memopt.templates.drawn import drawn_free_order
from ms_memopt.templates.learning import learn, learn_files

__all__ = ["Template", "learn", "learn_files", "generate", "flat_template", "free_order_of", "drawn_free_order",
           "load_template",
           "save_template", "fidelity", "parse_dims_tag", "dims_tag", "read_schedule", "template_from_dict",
           "CLASSES", "FORMAT", "VERSION", "LAYERED_VERSION", "MAX_TEMPLATE_DEGREE", "MAX_SCHEDULE_ROWS"]
