"""A free order no calibration process drew, read from a running process's first step.

MindSpore on CPU draws the order in which it frees a few runs of a backward's intermediates once
per process, at its first backward (docs/simulation.md, "Templates learned from recordings"), so
a held-out process may draw an order none of the calibration processes drew: no layout of the
template (:mod:`~ms_memopt.templates.draws`) then holds it. Its first step shows the draw.
:func:`drawn_free_order` compares that step's frees with the template's first step, finds the
runs of frees (frees with no allocation between them) that the process freed in another order,
and applies each run's order to every run of every class that frees the same allocations (the
same size polynomials, pool, stream and tag, in the same order): a process draws one order for
all its steps. Only the first step of the recording is read.

Example:
    >>> from ms_memopt.core.events import Event
    >>> t = Template(dims=["seq"], prologue={"samples": 1, "seen": [], "basis": [[0]], "ops": []},
    ...              classes={"first": {"samples": 1, "seen": [{"seq": 8}], "basis": [[0], [1]], "ops": [
    ...                  ["a", [0, 512], None, 0, None, True], ["a", [0, 64], None, 0, None, True],
    ...                  ["f", "same", 0], ["f", "same", 1]]}})
    >>> rec = [Event("alloc", id=1, size=4096), Event("alloc", id=2, size=512), Event("free", id=2),
    ...        Event("free", id=1), Event("step", step=1, tag="dims:seq=8")]
    >>> entry, evidence = drawn_free_order(t, [{"seq": 8}], rec)
    >>> evidence["runs"][0]["default"], evidence["runs"][0]["drawn"]
    ([0, 1], [1, 0])
"""
from __future__ import annotations

from typing import Sequence

from ms_memopt.core.events import Event
from ms_memopt.templates.classes import FIRST
from ms_memopt.templates.format import Template, parse_dims_tag
from ms_memopt.templates.generating import first_step, flat_template
from ms_memopt.templates.polynomial import evaluate

__all__ = ["drawn_free_order"]


def _runs(ops: list) -> list[tuple[int, int]]:
    """The runs of two or more consecutive frees of this step's allocations: ``(start, end)``."""
    out, start = [], None
    for i, op in enumerate(list(ops) + [["a"]]):
        if op[0] == "f" and op[1] == "same":
            start = i if start is None else start
            continue
        if start is not None and i - start > 1:
            out.append((start, i))
        start = None
    return out


def _signature(ops: list, start: int, end: int) -> tuple:
    """What a run frees, in the order of its allocations: each one's size polynomial, pool,
    stream and tag (a run of another class freeing the same tensors has the same)."""
    allocs = [op for op in ops if op[0] == "a"]
    return tuple((tuple(map(str, allocs[i][1])), allocs[i][2], allocs[i][3], allocs[i][4])
                 for i in sorted(op[2] for op in ops[start:end]))


def _apply(ops: list, orders: dict[tuple, list[int]]) -> tuple[list, int]:
    """``ops`` with every run whose signature ``orders`` names freed in that order (ranks of
    its allocations); how many runs changed."""
    out, changed = [list(op) for op in ops], 0
    for start, end in _runs(ops):
        order = orders.get(_signature(ops, start, end))
        if order is None or len(order) != end - start:
            continue
        members = sorted(ops[start:end], key=lambda op: op[2])
        reordered = [list(members[r]) for r in order]
        if reordered != out[start:end]:
            out[start:end] = reordered
            changed += 1
    return out, changed


def drawn_free_order(template: Template, schedule: Sequence[dict[str, int]],
                     recorded: Sequence[Event], name: str = "the recording") -> tuple[dict | None, dict]:
    """The free order a process drew, from ``recorded``'s first step (the prologue and the events
    up to its first step mark: nothing after it is read), as an entry for
    :attr:`Template.free_orders` (its ``recording``: ``name``; ``None`` when the first step frees as the template's default
    does, or does not line up with it), and the evidence: per run of frees the process freed in
    another order, its class, the allocations it frees (sizes at ``schedule``'s first step), the
    default order and the drawn one (ranks of the run's allocations in allocation order), and
    how many runs of each class the draw reorders.

    A first step whose frees are not the template's in another order within runs (another
    allocation count, a free moved elsewhere) gives ``None`` and says why (``evidence["why"]``).
    """
    flat = flat_template(template, schedule[:1]) if schedule else template
    first = flat.classes.get(FIRST)
    step = list(first_step(list(recorded)))
    evidence: dict = {"runs": [], "reordered": {}, "why": None}
    if first is None or not schedule:
        evidence["why"] = "the template has no first step"
        return None, evidence
    if not any(e.action == "step" and parse_dims_tag(e.tag) is not None for e in step):
        evidence["why"] = "the recording has no step mark with dims"
        return None, evidence
    ops = first.get("ops_after", {}).get(None, first["ops"])
    prologue_allocs = sum(1 for op in flat.prologue["ops"] if op[0] == "a")
    allocs_template = prologue_allocs + sum(1 for op in ops if op[0] == "a")
    ordinal: dict[int, int] = {}
    frees: list[int] = []
    for e in step:
        if e.action == "alloc":
            ordinal[e.id] = len(ordinal)
        elif e.action == "free" and e.id in ordinal:
            frees.append(ordinal[e.id] - prologue_allocs)   # this step's own allocations: >= 0
    if len(ordinal) != allocs_template:
        evidence["why"] = (f"its prologue and first step make {len(ordinal)} allocations, the template's "
                           f"{allocs_template}: not the same steps")
        return None, evidence
    own = [op[2] for op in ops if op[0] == "f" and op[1] == "same"]
    mine = [f for f in frees if f >= 0]
    if sorted(own) != sorted(mine):
        evidence["why"] = "its first step frees other allocations than the template's"
        return None, evidence
    point = [schedule[0][n] for n in flat.dims]
    sizes = [evaluate(op[1], first["basis"], point) for op in ops if op[0] == "a"]
    orders: dict[tuple, list[int]] = {}
    clashes: set[tuple] = set()
    at = 0                  # this step's frees, in the template's order, as the runs come
    runs = {start: end for start, end in _runs(ops)}
    i = 0
    while i < len(ops):
        op = ops[i]
        if op[0] == "f" and op[1] == "same":
            end = runs.get(i, i + 1)
            default = [o[2] for o in ops[i:end]]
            drawn = mine[at:at + len(default)]
            if sorted(drawn) != sorted(default):
                evidence["why"] = (f"its first step frees allocation #{drawn[0] if drawn else '?'} where the "
                                   f"template frees #{default[0]}: a free moved out of its run, not a drawn order")
                return None, evidence
            if end - i > 1:
                members = sorted(default)
                ranks = [members.index(x) for x in drawn]
                signature = _signature(ops, i, end)
                if signature in orders and orders[signature] != ranks:
                    clashes.add(signature)
                orders.setdefault(signature, ranks)
                if drawn != default:
                    evidence["runs"].append({"class": FIRST, "op": i, "allocations": members,
                                             "sizes": [sizes[x] for x in members],
                                             "default": [members.index(x) for x in default], "drawn": ranks})
            at += len(default)
            i = end
        else:
            i += 1
    if not evidence["runs"]:
        evidence["why"] = "its first step frees in the template's default order"
        return None, evidence
    for signature in clashes:       # runs alike drawn in two orders: only the first step's own
        del orders[signature]
    parts: dict[str, dict] = {}
    for label, part in flat.classes.items():
        mine_ops, changed = _apply(part["ops"], orders)
        after = {}
        for prev, other in part.get("ops_after", {}).items():
            after[prev], more = _apply(other, orders)
            changed += more
        if label == FIRST:          # the first step exactly as the process freed it
            mine_ops, at = [list(o) for o in ops], 0
            for k, o in enumerate(mine_ops):
                if o[0] == "f" and o[1] == "same":
                    mine_ops[k] = ["f", "same", mine[at]]
                    at += 1
        if changed or label == FIRST:
            parts[label] = {"ops": mine_ops, **({"ops_after": after} if after else {})}
            evidence["reordered"][label] = changed
    return {"recording": name, "from_first_step": True, "parts": parts}, evidence
