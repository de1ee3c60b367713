"""A learned step template as the simulator's workload: the user's own model, step by step.

:class:`TemplateWorkload` has the interface :func:`ms_memopt.simulation.simulate.simulate` drives
(``prologue_rows``, ``step_rows``, ``lengths``, ``shapes_seen``), like the hand-made
:class:`~ms_memopt.workload.step.StepWorkload`, so every policy, the job of many ranks, the
executors, the forecast, the time model and the reports run on real steps. Each step's dims come
from a schedule (``--schedule FILE.csv``: one row a step) or are drawn per step from the recipe's
``memopt.workload`` sequence-length rules (:func:`~ms_memopt.workload.step.draw_sequence_length`,
the rule ``ms-memopt run`` trains with) with the card's own seed: the dim called ``seq`` takes the
drawn length, every other dim keeps the value the template was recorded at most often.

What a template does not have, this class adds, and says so:

* the *watched request* (where the simulator samples ``largest_free`` against a request): the
  largest allocation of each step, tagged :data:`WATCH` (tags do not change where a model places
  a block);
* a tag for each untagged allocation's purpose, learned from its lifetime in the generated steps
  (:func:`~ms_memopt.analysis.purposes.learn_purposes`: ``parameter``, ``optimizer``,
  ``gradient``, ``activation``, ``workspace``): pool mode's regions route by tag, and the
  memory map colours by it;
* the ``optimizer_end`` mark that ends a step (where the ``compact`` policy compacts).

Example:
    >>> from ms_memopt.templates.template import Template
    >>> part = {"samples": 2, "seen": [{"seq": 8}, {"seq": 16}], "basis": [[0], [1]],
    ...         "ops": [["a", [0, 64], "common", 0, None, True], ["f", "same", 0]]}
    >>> template = Template(dims=["seq"], prologue={"samples": 1, "seen": [], "basis": [[0]], "ops": []},
    ...                     classes={"first": part, "repeat": part, "new_shape": part})
    >>> work = TemplateWorkload(template, schedule=[{"seq": 8}, {"seq": 16}])
    >>> [(row[0], row[2], row[7]) for row in work.step_rows(2)]
    [('step', 0, None), ('alloc', 1024, 'step_largest'), ('free', 0, None), ('mark', 0, 'optimizer_end')]
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from collections import Counter
from typing import Sequence

import numpy as np

from ms_memopt.analysis.purposes import TAG_OF_PURPOSE, learn_purposes
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import FIELDS, ROW_INDEX, Event
from ms_memopt.templates.template import Template, generate, load_template, read_schedule
from ms_memopt.workload.step import StepWorkload, draw_sequence_length

__all__ = ["TemplateWorkload", "SEQ_DIM", "WATCH", "make_workload", "recorded_dims", "template_of",
           "watched_bytes", "peak_by_pool", "peak_by_tag", "recipe_for_template", "UNBOUNDED"]

#: the dim that takes the recipe's sequence-length rules
SEQ_DIM = "seq"
#: the tag of each step's largest request, the one the simulator watches on a template
WATCH = "step_largest"
#: the capacity of a bare template's card when none is given: 1 TiB, more than any step asks for
UNBOUNDED = 1 << 40
_TAG, _STEP, _SIZE, _ACTION, _POOL, _ID = (ROW_INDEX[k] for k in ("tag", "step", "size", "action", "pool", "id"))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> Template:
    return load_template(path)


def template_of(spec) -> Template | None:
    """The template a :class:`~ms_memopt.workload.step.WorkloadSpec` names (loaded once per
    process and file version), or None."""
    if not spec.template:
        return None
    try:
        mtime = os.path.getmtime(spec.template)
    except OSError as exc:
        raise InputError(f"cannot read the step template: {exc}", source=spec.template,
                         key="memopt.workload.template") from None
    return _load(spec.template, mtime)


def make_workload(spec, seed: int = 0):
    """The workload the simulator runs for ``spec`` and one card's ``seed``: the template's steps
    when ``spec.template`` names one (its ``seq`` drawn by the spec's length rules, or the steps
    of ``spec.schedule``, a CSV), else the hand-made :class:`~ms_memopt.workload.step.StepWorkload`."""
    template = template_of(spec)
    if template is None:
        return StepWorkload(spec, seed)
    schedule = read_schedule(spec.schedule, template.dims) if spec.schedule else None
    return TemplateWorkload(template, schedule=schedule, rules=None if schedule else spec,
                            seq_length=spec.seq_length, seed=seed)


def recipe_for_template(path: str, schedule: str, *, capacity: int | None = None, steps: int | None = None,
                        template: Template | None = None):
    """The one-card recipe a bare template (``ms-memopt simulate T.template.json --schedule
    CSV``) runs under, so that it gets every policy, ``--out``'s report and memory map, the
    forecast and the executors exactly as a recipe naming the template does
    (``memopt.workload.template`` and ``memopt.workload.schedule``).

    The card is the recorded pool's (the template's ``allocator``, blocks of 1 MiB as MindSpore's
    CPU pool takes them, none pre-grown) with ``capacity`` bytes (default :data:`UNBOUNDED`); the
    run has the schedule's steps (``steps``: the first that many). A template records no model:
    the recipe's ``model`` section only satisfies the schema (one layer, the schedule's longest
    ``seq``), so its FLOPs mean nothing and the caller must not report the time model.
    ``template``: the one at ``path``, when the caller has loaded it already.

    Example:
        >>> import pathlib, tempfile
        >>> from ms_memopt.templates.template import Template, save_template
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> part = {"samples": 1, "seen": [{"seq": 8}], "basis": [[0]], "ops": []}
        >>> save_template(Template(["seq"], part, {"first": part, "repeat": part}), d / "m.template.json")
        >>> _ = (d / "s.csv").write_text("seq\\n8\\n16\\n")
        >>> r = recipe_for_template(str(d / "m.template.json"), str(d / "s.csv"))
        >>> r.memopt.workload.steps, r.memopt.allocator.name, r.memopt.device.hbm == UNBOUNDED
        (2, 'mindspore_bestfit', True)
    """
    from ms_memopt.config.recipe import recipe_from_dict

    template = template or load_template(path)
    rows = read_schedule(schedule, template.dims)
    if steps is not None and not 1 <= steps <= len(rows):
        raise InputError(f"expected 1 to {len(rows)} steps (the schedule's rows), got {steps}", key="--steps")
    longest = max([row.get(SEQ_DIM, 1) for row in rows] + [recorded_dims(template).get(SEQ_DIM, 1), 1])
    data = {
        "model": {"model_config": {"num_layers": 1, "hidden_size": 8, "num_heads": 1, "seq_length": longest,
                                   "vocab_size": 8}},
        "memopt": {
            "device": {"name": "recorded pool", "hbm": capacity if capacity is not None else UNBOUNDED, "cards": 1},
            "allocator": {"name": template.allocator.replace("-", "_"), "pregrow": False, "increase_size": "1MiB"},
            "workload": {"template": str(Path(path).resolve()), "schedule": str(Path(schedule).resolve()),
                         "steps": steps or len(rows), "dynamic_seq": False},
            # about 10 scans a run, so that the compact policy can act on a short schedule
            "scan_every": max(1, min(100, (steps or len(rows)) // 10)),
        },
    }
    return recipe_from_dict(data, source=f"<{path} with {schedule}>")


def watched_bytes(spec) -> int:
    """The request a template run watches: the largest allocation of a repeat step at the
    longest length the spec allows (``seq_max``)."""
    template = template_of(spec)
    dims = dict(recorded_dims(template))
    if SEQ_DIM in dims:
        dims[SEQ_DIM] = spec.seq_max or spec.seq_length
    rows = TemplateWorkload(template, schedule=[dims, dims]).step_rows(2)
    return max((row[_SIZE] for row in rows if row[_ACTION] == "alloc"), default=0)


def peak_by_pool(workload, steps: int) -> dict[str, int]:
    """Per pool (``persistent``, ``common``), the most bytes live at once over the prologue and
    the first ``steps`` steps of ``workload`` (sizes rounded up to MindSpore's 512 B)."""
    return _peaks(workload, steps, lambda row: row[_POOL] or "common")


def peak_by_tag(workload, steps: int) -> dict[str | None, int]:
    """Per request tag (a learned purpose's, :data:`WATCH`, ``None``), the most bytes live at once
    over the prologue and the first ``steps`` steps of ``workload`` (sizes rounded up to 512 B)."""
    return _peaks(workload, steps, lambda row: row[_TAG])


def _peaks(workload, steps: int, key) -> dict:
    live: dict[int, tuple] = {}
    now: Counter = Counter()
    peak: Counter = Counter()
    rows = list(workload.prologue_rows())
    for step in range(1, steps + 1):
        rows += workload.step_rows(step)
    for row in rows:
        if row[_ACTION] == "alloc":
            group, size = key(row), -(-max(row[_SIZE], 1) // 512) * 512
            live[row[_ID]] = (group, size)
            now[group] += size
            peak[group] = max(peak[group], now[group])
        elif row[_ACTION] == "free" and row[_ID] in live:
            group, size = live.pop(row[_ID])
            now[group] -= size
    return dict(peak)


def recorded_dims(template: Template) -> dict[str, int]:
    """Per dim, the value the template's steps were recorded at most often (ties: the larger).

    Example:
        >>> from ms_memopt.templates.template import Template
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


def _tagged(row: tuple, purpose_of: dict[int, str]) -> tuple:
    """An untagged allocation tagged with its purpose (:data:`~ms_memopt.analysis.purposes.TAG_OF_PURPOSE`)."""
    if row[_ACTION] == "alloc" and row[_TAG] is None:
        tag = TAG_OF_PURPOSE.get(purpose_of.get(row[_ID], ""))
        if tag is not None:
            return row[:_TAG] + (tag,) + row[_TAG + 1:]
    return row


class TemplateWorkload:
    """The steps of ``template`` for the simulator.

    Args:
        template: a learned template (:func:`ms_memopt.templates.template.load_template`).
        schedule: the dims of each step, in order (the run ends with it: asking for a step past
            its end is an error); or ``None`` to draw them.
        rules: the sequence-length rules (a :class:`~ms_memopt.config.recipe.WorkloadConfig` or
            :class:`~ms_memopt.workload.step.WorkloadSpec`) when drawing; ``None`` keeps every
            dim at its recorded value.
        seq_length: the recipe's sequence length (``seq_max`` defaults to it).
        seed: seeds the draws (one ``numpy`` generator, one draw sequence per step).
        keep_runtime_leak: also make the allocations ``learn`` recognised as MindSpore's own leak
            (left out by default: :func:`~ms_memopt.templates.template.generate`).
    """

    def __init__(self, template: Template, *, schedule: Sequence[dict[str, int]] | None = None,
                 rules=None, seq_length: int | None = None, seed: int = 0, keep_runtime_leak: bool = False) -> None:
        self.template = template
        self.keep_runtime_leak = keep_runtime_leak
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
        self._prologue: list[tuple] | None = None
        self._prologue_events: list[Event] | None = None
        self._purpose_of: dict[int, str] = {}
        #: the purpose tag of the allocation each step watches (its largest), from the steps generated
        self.watch_tag: str | None = None
        self.shapes_seen: set[tuple] = set()
        #: the dims of the last step asked for; ``lengths`` its sequence length (a list, as the
        #: hand-made workload's micro-batches)
        self.dims: dict[str, int] = {}
        self.lengths: list[int] = []
        self.warnings: list[str] = []

    # the interface the simulator drives -----------------------------------------------------
    def prologue_rows(self) -> list[tuple]:
        """What the template allocates before its first step (weights, optimizer state), as rows,
        at the run's own dims: a prologue is fitted in the dims a recording holds constant
        (``hidden``, ``layers``), so it is generated with the schedule's first step (the
        recorded dims when drawing)."""
        if self._prologue is None:      # generated once: every regeneration of the steps starts with it
            if not self._steps:
                self._generate(1)           # the purposes are learned from the steps too
            self._prologue = [_tagged(_row(e), self._purpose_of) for e in self._first_events()]
        return list(self._prologue)

    def _first_events(self) -> list[Event]:
        if self._prologue_events is None:
            first = self._fixed[0] if self._fixed else dict(self.base)
            self._prologue_events = generate(self.template, [first], prologue_only=True)
        return self._prologue_events

    def step_rows(self, step: int) -> list[tuple]:
        """Step ``step`` (1-based) as rows: a ``step`` event, the template's events at the step's
        dims (its largest allocation tagged as the watched request), an ``optimizer_end`` mark."""
        if step > len(self._steps):
            self._generate(step)
        self.dims = self._schedule[step - 1]
        self.shapes_seen.add(tuple(sorted(self.dims.items())))
        self.lengths = [self.dims.get(SEQ_DIM, self.seq_length)]
        return self._steps[step - 1]

    def peek_rows(self, step: int) -> list[tuple] | None:
        """Step ``step``'s rows without making it the current step (the dims, the shapes seen and
        the lengths stay those of the last step asked for): what the ``compact`` policy looks
        ahead at. ``None`` past a given schedule's end."""
        if self._fixed is not None and step > len(self._fixed):
            return None
        if step > len(self._steps):
            self._generate(step)
        return self._steps[step - 1]

    @property
    def scheduled_steps(self) -> int | None:
        """The steps of a given schedule (asking for more is an error); ``None`` when drawn."""
        return None if self._fixed is None else len(self._fixed)

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
        events = generate(self.template, self._schedule, warnings=warnings, keep_runtime_leak=self.keep_runtime_leak)
        self.warnings = warnings
        prologue = len(self._first_events())
        # a setup mark ends the prologue, as in a recording; the stream is cut after its last step
        self._purpose_of = learn_purposes(events[:prologue] + [Event("step")] + events[prologue:], ended=False).of
        self._steps = []
        chunk: list[tuple] = []
        number = 1
        watched: Counter = Counter()
        for event in events[prologue:]:
            if event.action == "step":
                self._steps.append(self._finish(number, chunk, watched))
                chunk, number = [], number + 1
            else:
                chunk.append(_tagged(_row(event, number), self._purpose_of))
        self.watch_tag = watched.most_common(1)[0][0] if watched else None

    @staticmethod
    def _finish(step: int, rows: list[tuple], watched: Counter) -> list[tuple]:
        sizes = [(row[_SIZE], i) for i, row in enumerate(rows) if row[_ACTION] == "alloc"]
        if sizes:
            _, at = max(sizes, key=lambda si: (si[0], -si[1]))      # the first of the largest
            row = rows[at]
            watched[row[_TAG]] += 1
            rows[at] = row[:_TAG] + (WATCH,) + row[_TAG + 1:]
        return ([("step", None, 0, None, 0, None, None, None, step)] + rows
                + [("mark", None, 0, None, 0, None, None, "optimizer_end", step)])
