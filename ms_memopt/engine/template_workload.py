"""A learned step template as the simulator's workload: the user's own model, step by step.

:class:`TemplateWorkload` has the interface :func:`ms_memopt.engine.simulate.simulate` drives
(``prologue_rows``, ``step_rows``, ``lengths``, ``shapes_seen``), like the hand-made
:class:`~ms_memopt.engine.workload.StepWorkload`, so every policy, the job of many ranks, the
executors, the forecast, the time model and the reports run on real steps. Each step's dims come
from a schedule (``--schedule FILE.csv``: one row a step) or are drawn per step from the recipe's
``memopt.workload`` sequence-length rules (:func:`~ms_memopt.engine.workload.draw_sequence_length`,
the rule ``ms-memopt run`` trains with) with the card's own seed: the dim called ``seq`` takes the
drawn length, every other dim keeps the value the template was recorded at most often.

What a template does not have, this class adds, and says so:

* the *watched request* (where the simulator samples ``largest_free`` against a request): the
  largest allocation of each step, tagged :data:`~ms_memopt.engine.workload.WATCH_TAG` (tags do
  not change where a model places a block);
* the ``optimizer_end`` mark that ends a step (where the ``compact`` policy compacts).

Example:
    >>> from ms_memopt.engine.template import Template
    >>> part = {"samples": 2, "seen": [{"seq": 8}, {"seq": 16}], "basis": [[0], [1]],
    ...         "ops": [["a", [0, 64], "common", 0, None, True], ["f", "same", 0]]}
    >>> template = Template(dims=["seq"], prologue={"samples": 1, "seen": [], "basis": [[0]], "ops": []},
    ...                     classes={"first": part, "repeat": part, "new_shape": part})
    >>> work = TemplateWorkload(template, schedule=[{"seq": 8}, {"seq": 16}])
    >>> [(row[0], row[2], row[7]) for row in work.step_rows(2)]
    [('step', 0, None), ('alloc', 1024, 'allreduce'), ('free', 0, None), ('mark', 0, 'optimizer_end')]
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import FIELDS, ROW_INDEX, Event
from ms_memopt.engine.template import Template, generate
from ms_memopt.engine.workload import WATCH_TAG, draw_sequence_length

__all__ = ["TemplateWorkload", "SEQ_DIM", "recorded_dims"]

#: the dim that takes the recipe's sequence-length rules
SEQ_DIM = "seq"
_TAG, _STEP, _SIZE, _ACTION = ROW_INDEX["tag"], ROW_INDEX["step"], ROW_INDEX["size"], ROW_INDEX["action"]


def recorded_dims(template: Template) -> dict[str, int]:
    """Per dim, the value the template's steps were recorded at most often (ties: the larger).

    Example:
        >>> from ms_memopt.engine.template import Template
        >>> t = Template(dims=["seq", "batch"], prologue={}, classes={"repeat": {"seen": [
        ...     {"seq": 16, "batch": 4}, {"seq": 24, "batch": 4}, {"seq": 32, "batch": 2}]}})
        >>> recorded_dims(t)
        {'seq': 32, 'batch': 4}
    """
    counts: dict[str, Counter] = {name: Counter() for name in template.dims}
    for part in template.classes.values():
        for dims in part.get("seen", ()):
            for name in template.dims:
                if name in dims:
                    counts[name][dims[name]] += 1
    return {name: max(c.items(), key=lambda kv: (kv[1], kv[0]))[0] if c else 0 for name, c in counts.items()}


def _row(event: Event, step: int | None = None) -> tuple:
    row = tuple(getattr(event, name) for name in FIELDS)
    return row if step is None else row[:_STEP] + (step,) + row[_STEP + 1:]


class TemplateWorkload:
    """The steps of ``template`` for the simulator.

    Args:
        template: a learned template (:func:`ms_memopt.engine.template.load_template`).
        schedule: the dims of each step, in order (the run ends with it: asking for a step past
            its end is an error); or ``None`` to draw them.
        rules: the sequence-length rules (a :class:`~ms_memopt.config.recipe.WorkloadConfig` or
            :class:`~ms_memopt.engine.workload.WorkloadSpec`) when drawing; ``None`` keeps every
            dim at its recorded value.
        seq_length: the recipe's sequence length (``seq_max`` defaults to it).
        seed: seeds the draws (one ``numpy`` generator, one draw sequence per step).
    """

    def __init__(self, template: Template, *, schedule: Sequence[dict[str, int]] | None = None,
                 rules=None, seq_length: int | None = None, seed: int = 0) -> None:
        self.template = template
        self.seed = seed
        self.rules = rules
        self.base = recorded_dims(template)
        self.seq_length = seq_length if seq_length is not None else self.base.get(SEQ_DIM, 0)
        if rules is not None and SEQ_DIM not in template.dims and rules.enabled and rules.dynamic_seq:
            raise InputError(f"the recipe draws sequence lengths but the template has no {SEQ_DIM!r} dim (its "
                             f"dims: {', '.join(template.dims) or 'none'}); record with "
                             f"mark_step({SEQ_DIM}=...) or turn memopt.workload.dynamic_seq off",
                             key="memopt.workload.template")
        self._fixed = None if schedule is None else [dict(d) for d in schedule]
        self._rng = np.random.default_rng(seed)
        self._schedule: list[dict[str, int]] = []
        self._steps: list[list[tuple]] = []          # rows of generated steps 1..len
        self.shapes_seen: set[tuple] = set()
        #: the dims of the last step asked for; ``lengths`` its sequence length (a list, as the
        #: hand-made workload's micro-batches)
        self.dims: dict[str, int] = {}
        self.lengths: list[int] = []
        self.warnings: list[str] = []

    # the interface the simulator drives -----------------------------------------------------
    def prologue_rows(self) -> list[tuple]:
        """What the template allocates before its first step (weights, optimizer state), as rows."""
        return [_row(e) for e in generate(self.template, [])]

    def step_rows(self, step: int) -> list[tuple]:
        """Step ``step`` (1-based) as rows: a ``step`` event, the template's events at the step's
        dims (its largest allocation tagged as the watched request), an ``optimizer_end`` mark."""
        if step > len(self._steps):
            self._generate(step)
        self.dims = self._schedule[step - 1]
        self.shapes_seen.add(tuple(sorted(self.dims.items())))
        self.lengths = [self.dims.get(SEQ_DIM, self.seq_length)]
        return self._steps[step - 1]

    def to_dict(self) -> dict:
        """What the run is made of, for ``--json``."""
        return {"template_dims": self.template.dims, "recorded_dims": self.base,
                "schedule": "given" if self._fixed is not None else ("drawn" if self.rules is not None else "fixed")}

    # ------------------------------------------------------------------------------------------
    def _draw(self) -> dict[str, int]:
        dims = dict(self.base)
        if self.rules is not None and SEQ_DIM in dims:
            dims[SEQ_DIM] = draw_sequence_length(self._rng, self.rules, self.seq_length)
        return dims

    def _generate(self, step: int) -> None:
        """Generate steps 1..n (n at least twice what was there: the template's frees refer to
        earlier steps, so the stream is generated from the prologue on, and doubling keeps the
        total work linear)."""
        want = max(step, 2 * len(self._steps), 16)
        if self._fixed is not None:
            if step > len(self._fixed):
                raise InputError(f"the schedule has {len(self._fixed)} steps; step {step} was asked for",
                                 key="--schedule")
            want = min(want, len(self._fixed))
            self._schedule = self._fixed[:want]
        else:
            while len(self._schedule) < want:
                self._schedule.append(self._draw())
        warnings: list[str] = []
        events = generate(self.template, self._schedule, warnings=warnings)
        self.warnings = warnings
        prologue = sum(1 for _ in generate(self.template, []))
        self._steps = []
        chunk: list[tuple] = []
        number = 1
        for event in events[prologue:]:
            if event.action == "step":
                self._steps.append(self._finish(number, chunk))
                chunk, number = [], number + 1
            else:
                chunk.append(_row(event, number))

    @staticmethod
    def _finish(step: int, rows: list[tuple]) -> list[tuple]:
        sizes = [(row[_SIZE], i) for i, row in enumerate(rows) if row[_ACTION] == "alloc"]
        if sizes:
            _, at = max(sizes, key=lambda si: (si[0], -si[1]))      # the first of the largest
            row = rows[at]
            rows[at] = row[:_TAG] + (WATCH_TAG,) + row[_TAG + 1:]
        return ([("step", None, 0, None, 0, None, None, None, step)] + rows
                + [("mark", None, 0, None, 0, None, None, "optimizer_end", step)])
