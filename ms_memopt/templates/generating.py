"""The events of a schedule from a step template: :func:`generate`, :func:`flat_template`
(a layered template at the schedule's count) and :func:`free_order_of` (the free order a
recorded process drew, read from its first step). See :mod:`ms_memopt.templates.template`.
"""
from __future__ import annotations

from typing import Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.templates.classes import LEGACY_NEW, REPEAT, classify, is_new
from ms_memopt.templates.format import Template, dims_key, dims_tag, parse_dims_tag, show_dims, template_from_dict
from ms_memopt.templates.layers import expand
from ms_memopt.templates.polynomial import evaluate

__all__ = ["first_step", "flat_template", "free_order_of", "generate"]


# --- generating ---------------------------------------------------------------------------
def generate(template: Template, schedule: Sequence[dict[str, int]], *, warnings: list[str] | None = None,
             first_id: int = 1, free_order: int | None = None, prologue_only: bool = False,
             keep_runtime_leak: bool = False) -> list[Event]:
    """The events of ``schedule`` (one dims dict per step): the prologue, then each step's
    variant (``first``, ``new_shape``, ``repeat``) with its sizes evaluated at its dims, and a
    ``step`` event (tag ``dims:...``) at each step end.

    ``free_order``: ``None`` frees in the most common order of the calibration steps; ``k``
    in the order calibration recording ``template.free_orders[k]["recording"]`` freed in
    (MindSpore draws a few free orders once per process: docs/simulation.md, "Templates
    learned from recordings").

    ``prologue_only``: only the prologue, at the dims of the schedule's first step (those it was
    fitted in, such as ``hidden`` or ``layers``, are fixed per run).

    ``keep_runtime_leak``: also make the allocations ``learn`` recognised as MindSpore's own leak
    (op arguments its CPU PyNative ops never free, marked ``"runtime"``); by default they are
    left out: the model's memory, not the runtime's.

    A step's class is what is new in it (:func:`ms_memopt.templates.classes.classify`): the
    class that covers that novelty, a version-1 template's ``new_shape``, else the recorded
    novelty class nearest to it (a warning: the calibration lacks it, ``Template.lacks``).

    ``warnings`` (a list) receives what is extrapolated: a dim a class never saw vary, a
    free whose target step's class the template never saw there, a layer count never recorded.

    A template over a repeated block count (:attr:`Template.layered`) generates at the
    schedule's count (one for the whole schedule): a recorded count's own template (its own
    ``free_orders``), or one built from the largest recorded count with every recorded count's
    free orders (:func:`flat_template` gives it).

    Raises:
        InputError: a schedule step whose dims differ from the template's, or a class the
            schedule needs that the template has no sample of.
    """
    if template.layered:
        return _generate_layered(template, schedule, warnings=warnings, first_id=first_id, free_order=free_order,
                                 prologue_only=prologue_only, keep_runtime_leak=keep_runtime_leak)
    names = template.dims
    events: list[Event] = []
    next_id = first_id
    live: set[int] = set()
    notes: dict[str, int] = {}

    def note(text: str) -> None:
        notes[text] = notes.get(text, 0) + 1

    mapping: dict = {}
    if free_order is not None and not 0 <= free_order < len(template.free_orders):
        raise InputError(f"free order {free_order}: the template has {len(template.free_orders)} "
                         "(0.." + str(len(template.free_orders) - 1) + ")" if template.free_orders else
                         f"free order {free_order}: the template's recordings all freed in one order")
    own = template.free_orders[free_order]["parts"] if free_order is not None else {}

    def run(part: dict, point: list[int], prologue_ids: list[int], history: list, kind: str = "prologue") -> list[int]:
        nonlocal next_id
        ids: list[int] = []
        basis = part["basis"]
        prev = history[-1][0] if history else None
        order = own.get(kind, part)
        for op in order.get("ops_after", {}).get(prev, order["ops"]):
            what = op[0]
            if what == "a" and len(op) > 6 and not keep_runtime_leak:
                ids.append(None)        # MindSpore's own leak, left out (never freed: no free refers to it)
            elif what == "a":
                events.append(Event("alloc", id=next_id, size=evaluate(op[1], basis, point), stream=op[3] or 0,
                                    pool=op[2], tag=op[4]))
                ids.append(next_id)
                live.add(next_id)
                next_id += 1
            elif what == "e":
                events.append(Event("empty_cache"))
            else:
                target = None
                if op[1] == "same":
                    target = ids[op[2]] if op[2] < len(ids) else None
                elif op[1] == "prologue":
                    target = prologue_ids[op[2]] if op[2] < len(prologue_ids) else None
                else:
                    back = op[2]
                    if back <= len(history):
                        cls, their, their_point = history[-back]
                        pos = op[3].get(cls)
                        if pos is None:     # never recorded after such a step: align the two steps' sizes
                            known = next(iter(op[3]))
                            pos = _mapped(template, known, cls, their_point, mapping).get(op[3][known])
                            note(f"a {kind} step {back} after a {cls} step was never recorded: what it frees of "
                                 f"that step found by aligning the {known} and {cls} steps' sizes"
                                 + ("" if pos is not None else " failed; it stays live"))
                        if pos is not None and pos < len(their):
                            target = their[pos]
                if target is not None and target in live:
                    live.discard(target)
                    events.append(Event("free", id=target))
        return ids

    # the prologue at the run's dims (those it was fitted in are fixed per recorded run)
    start = schedule[0] if schedule else _most_seen(template.prologue.get("seen") or [])
    prologue_point = [start.get(n, 0) for n in names]
    fixed = [n for j, n in enumerate(names) if any(e[j] for e in template.prologue["basis"])]
    prologue_ids = run(template.prologue, prologue_point, [], [])
    if prologue_only:
        return events
    history: list[tuple[str, list[int], list[int]]] = []
    for number, dims in enumerate(schedule, 1):
        if set(dims) != set(names):
            raise InputError(f"schedule step {number} has dims {sorted(dims)}; the template's are {sorted(names)}")
    covering = _covering(template)
    for number, (dims, novelty) in enumerate(zip(schedule, classify(schedule)), 1):
        kind = covering.get(novelty) or _nearest(template, novelty, note)
        part = template.classes.get(kind) if kind else None
        if part is None:
            raise InputError(f"schedule step {number} ({show_dims(dims)}) is a {novelty} step and the template has none: "
                             + ("record runs that change shape mid-run" if is_new(novelty) else
                                "record runs with more steps"))
        point = [dims[n] for n in names]
        for name in fixed:
            if dims[name] != start[name]:
                note(f"the prologue depends on {name} (fixed in every recorded run); the schedule changes it after "
                     f"its first step, the prologue stays that of {name}={start[name]}")
        for j, name in enumerate(names):
            values = {s.get(name) for s in part["seen"]}
            # (sizes the repeat steps share come from their fit, over the values they were seen at)
            spanned = len({s.get(name) for s in template.classes.get(REPEAT, {}).get("seen", [])}) > 1
            if len(values) == 1 and dims[name] not in values and not (spanned and kind != REPEAT):
                note(f"{kind} steps were recorded at {name}={next(iter(values))} only; {name}={dims[name]} uses "
                     "those sizes unchanged")
        ids = run(part, point, prologue_ids, history, kind)
        history.append((kind, ids, point))
        events.append(Event("step", step=number, tag=dims_tag({n: dims[n] for n in names})))
    if warnings is not None:
        warnings.extend(f"{text} (x{count})" if count > 1 else text for text, count in notes.items())
    return events


def _covering(template: Template) -> dict[str, str]:
    """Novelty -> the template's class for it (a merged class covers several)."""
    out = {name: name for name in template.classes}
    for name, part in template.classes.items():
        for novelty in part.get("covers", []):
            out[novelty] = name
    return out


def _features_of(name: str) -> set[str]:
    return set(name.partition(":")[2].split("+")) if name.startswith("new:") else set()


def _nearest(template: Template, novelty: str, note) -> str | None:
    """The class for a novelty the calibration never recorded: a version-1 template's
    ``new_shape``, else the novelty class sharing the most features (then the most samples)."""
    if not is_new(novelty):
        return None
    if LEGACY_NEW in template.classes:
        return LEGACY_NEW
    want = _features_of(novelty)
    options = [(name, c) for name, part in template.classes.items() if is_new(name)
               for c in part.get("covers", [name])]
    if not options:
        return None
    name, closest = max(options, key=lambda o: (len(want & _features_of(o[1])) - len(want ^ _features_of(o[1])),
                                                template.classes[o[0]]["samples"]))
    note(f"a {novelty} step was never recorded (ms-memopt learn lists what the calibration lacks): simulated as "
         f"{closest}")
    return name


def free_order_of(template: Template, schedule: Sequence[dict[str, int]],
                  recorded: Sequence[Event]) -> tuple[int | None, float]:
    """The free order a process drew, read from its first step: ``(k, match)`` where ``k`` is the
    entry of :attr:`Template.free_orders` (``None``: the default order) whose first step of
    ``schedule`` frees in the order closest to ``recorded``'s first step (ties: the default),
    and ``match`` the share of those frees in the same place (1.0: the same order).

    MindSpore on CPU draws some free orders once per process, at its first backward
    (docs/simulation.md, "Templates learned from recordings"), so a running process's first
    step fixes the order of all its later steps: simulate them with ``free_order=k``.

    Example:
        >>> from ms_memopt.core.events import Event
        >>> t = Template(dims=[], prologue={"samples": 1, "seen": [], "basis": [[]], "ops": []}, classes={})
        >>> free_order_of(t, [], [Event("step", tag="dims:seq=8")])
        (None, 1.0)
    """
    want = _free_sequence(first_step(list(recorded)))
    best: tuple[float, int, int | None] | None = None
    flat = flat_template(template, schedule[:1]) if schedule else template
    for rank, k in enumerate([None, *range(len(flat.free_orders))]):
        got = _free_sequence(first_step(generate(flat, list(schedule[:1]), free_order=k, keep_runtime_leak=True))
                             ) if schedule else []
        match = sum(1 for a, b in zip(want, got) if a == b) / len(want) if want else 1.0
        if best is None or match > best[0]:
            best = (match, rank, k)
    return best[2], best[0]


def first_step(events: list[Event]) -> list[Event]:
    """The events up to the first step mark with dims (the prologue and the first step)."""
    for i, e in enumerate(events):
        if e.action == "step" and parse_dims_tag(e.tag) is not None:
            return events[:i + 1]
    return events


def _free_sequence(events: list[Event]) -> list[int]:
    """The allocations freed, in order, each named by its allocation's ordinal."""
    ordinal: dict[int, int] = {}
    out: list[int] = []
    for e in events:
        if e.action == "alloc":
            ordinal[e.id] = len(ordinal)
        elif e.action == "free" and e.id in ordinal:
            out.append(ordinal[e.id])
    return out


def _generate_layered(template: Template, schedule: Sequence[dict[str, int]], *, warnings: list[str] | None,
                      first_id: int, free_order: int | None, prologue_only: bool = False,
                      keep_runtime_leak: bool = False) -> list[Event]:
    """:func:`generate` over a repeated block count: on :func:`flat_template`'s template."""
    return generate(flat_template(template, schedule, warnings=warnings), schedule, warnings=warnings,
                    first_id=first_id, free_order=free_order, prologue_only=prologue_only,
                    keep_runtime_leak=keep_runtime_leak)


def flat_template(template: Template, schedule: Sequence[dict[str, int]], *,
                  warnings: list[str] | None = None) -> Template:
    """The flat template ``schedule`` runs on: ``template`` itself, or for a template over a
    repeated block count (:attr:`Template.layered`) the schedule's count's (recorded, or built
    from the recorded ones: :func:`ms_memopt.templates.layers.expand`), with the free
    orders (:attr:`Template.free_orders`) it has at that count.

    Raises:
        InputError: a schedule that changes the count, or has none.
    """
    if not template.layered:
        return template


    dim = template.layered["dim"]
    values = {step.get(dim) for step in schedule}
    if len(values) > 1:
        raise InputError(f"the schedule changes {dim} ({sorted(map(str, values))}); a repeated block count is fixed "
                         "per run: one schedule per count")
    recorded = sorted(int(c) for c in template.layered["counts"])
    count = next(iter(values)) if values else recorded[-1]
    if count is None:
        raise InputError(f"schedule step 1 has no {dim}; the template's dims are {template.dims}")
    flat = template_from_dict(expand(template.layered, count), f"{dim}={count}")
    # sizes do not depend on the count (the blocks do): no "recorded at one value only" notes
    for part in [flat.prologue, *flat.classes.values()]:
        part["seen"] = [{**seen, dim: count} for seen in part["seen"]]
    if count not in recorded and warnings is not None:
        warnings.append(f"{dim}={count} was never recorded (recorded: {recorded}): its steps are built from "
                        f"{dim}={recorded[-1]}'s with the repeated blocks {dim} adds")
    return flat


def _most_seen(seen: list[dict]) -> dict:
    """The dims recorded most often (the first of them on a tie); ``{}`` for none."""
    keys = [dims_key(s) for s in seen]
    return dict(max(keys, key=keys.count)) if keys else {}


def _mapped(template: Template, known: str, target: str, point: list[int], cache: dict) -> dict[int, int]:
    """Allocation position in a ``known`` step -> the same allocation in a ``target`` step at
    ``point``: the two size sequences aligned (longest matching runs, :mod:`difflib`)."""
    key = (known, target, tuple(point))
    if key not in cache:
        from difflib import SequenceMatcher

        def sizes(name: str) -> list[tuple]:
            part = template.classes[name]
            return [(evaluate(op[1], part["basis"], point), op[2], op[3], op[4])
                    for op in part["ops"] if op[0] == "a"]
        out: dict[int, int] = {}
        matcher = SequenceMatcher(None, sizes(known), sizes(target), autojunk=False)
        for block in matcher.get_matching_blocks():
            for i in range(block.size):
                out[block.a + i] = block.b + i
        cache[key] = out
    return cache[key]
