"""The classes of a step: what a template learns one op sequence for, keyed by what is new.

MindSpore's PyNative runtime makes extra allocations the first time it runs a step, and the first
time it meets a new shape; a step it has run before at a seen shape repeats the same allocations
in the same order. Which extra allocations a new step makes depends on *which* of its shapes the
process has not run before, because MindSpore's per-shape state is kept per op, keyed by that op's
input shapes (PyNative's output-abstract cache, ``InferOperation::GetOutputAbstractByCache``: per
primitive, input abstracts -> output abstract; a miss runs the infer): an op on ``[seq, seq]``
(a causal mask) misses only at a new length, an op on ``[batch, seq, hidden]`` at a new pair, an
op on a flattened ``[batch * seq, vocab]`` (a loss) at a new token count. Recorded on MindSpore
2.10 CPU (docs/simulation.md, "Step classes keyed by what is new"): the demo GPT makes 607
allocations at a new length, 605 at a new batch, token count or pair with a seen length, 600 at a
repeat.

So a step is classified by its **novelty**: which of its features the process has not run
before, among each dim, ``tokens`` (the product of the dims: the flattened shape) and ``shape``
(the dims together). The class is named by that set (``new:seq+tokens``; ``shape`` is implied by
any other, so named alone only: ``new:shape``), besides ``first`` (a process's first step) and
``repeat`` (nothing new). A version-1 template's ``new_shape`` class stands for every novelty.

Example:
    >>> classify([{"seq": 16, "batch": 2}, {"seq": 32, "batch": 2}, {"seq": 16, "batch": 4},
    ...           {"seq": 32, "batch": 1}, {"seq": 16, "batch": 2}])
    ['first', 'new:seq+tokens', 'new:batch', 'new:batch', 'repeat']
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Iterable, Sequence

__all__ = ["CLASSES", "FIRST", "REPEAT", "LEGACY_NEW", "FEATURE_NAMES", "features", "classify", "novelty_name",
           "is_class_name", "possible_novelties", "calibration_plan", "is_new"]

FIRST, REPEAT = "first", "repeat"
LEGACY_NEW = "new_shape"
"""A version-1 template's class of every step with something new (one novelty class for all)."""
CLASSES = (FIRST, LEGACY_NEW, REPEAT)
"""The classes of version-1 templates (each learned template names its own: :func:`novelty_name`)."""
FEATURE_NAMES = ("tokens", "shape")
"""The features besides the dims themselves (a dim may not be named so)."""
_PREFIX = "new:"


def features(dims: dict[str, int]) -> dict[str, object]:
    """The shapes of a step a per-shape cache can be keyed by: each dim, ``tokens`` (the product
    of the dims, with 2 dims or more) and ``shape`` (all of them).

    Example:
        >>> features({"seq": 16, "batch": 2})
        {'seq': 16, 'batch': 2, 'tokens': 32, 'shape': (('batch', 2), ('seq', 16))}
    """
    out: dict[str, object] = dict(dims)
    if len(dims) > 1:
        out["tokens"] = math.prod(dims.values())
    out["shape"] = tuple(sorted(dims.items()))
    return out


def novelty_name(new: Iterable[str]) -> str:
    """The class of a step whose features ``new`` are new to the process (``repeat`` for none).

    Example:
        >>> novelty_name({"shape", "tokens", "seq"}), novelty_name({"shape"}), novelty_name(())
        ('new:seq+tokens', 'new:shape', 'repeat')
    """
    new = set(new)
    if not new:
        return REPEAT
    shown = sorted(new - {"shape"}) or ["shape"]
    return _PREFIX + "+".join(shown)


def is_new(name: str) -> bool:
    """Whether ``name`` is a class of steps with something new (``new:...`` or ``new_shape``)."""
    return name == LEGACY_NEW or name.startswith(_PREFIX)


def is_class_name(name: object) -> bool:
    """``first``, ``repeat``, ``new_shape`` or ``new:F+G`` (features: identifiers)."""
    if not isinstance(name, str):
        return False
    if name in CLASSES:
        return True
    return name.startswith(_PREFIX) and all(part.isidentifier() for part in name[len(_PREFIX):].split("+"))


def classify(schedule: Sequence[dict[str, int]]) -> list[str]:
    """The class of every step of one process's ``schedule`` (one dims dict per step)."""
    seen: dict[str, set] = {}
    out = []
    for number, dims in enumerate(schedule):
        values = features(dims)
        if number == 0:
            out.append(FIRST)
        else:
            out.append(novelty_name(name for name, value in values.items() if value not in seen.get(name, ())))
        for name, value in values.items():
            seen.setdefault(name, set()).add(value)
    return out


def _reach(steps: list[dict[str, int]], shapes: list[dict[str, int]], want: set[str],
           beam: int) -> tuple[list[dict[str, int]], frozenset]:
    """The schedule from ``steps`` on that plays the most classes of ``want`` (a beam search)."""
    states = [(steps, frozenset())]
    best = states[0]
    while states:
        grown = []
        for schedule, got in states:
            for shape in shapes:
                kind = classify(schedule + [shape])[-1]
                if kind in want and kind not in got:
                    grown.append((schedule + [shape], got | {kind}))
        grown.sort(key=lambda s: (-len(s[1]), len(s[0])))
        states = grown[:beam]
        if states and len(states[0][1]) > len(best[1]):
            best = states[0]
    return best


def possible_novelties(dims: Sequence[str], marked: int | None = None) -> list[str]:
    """Every class a step of a schedule varying ``dims`` can fall in, besides ``first``;
    ``marked``: how many dims the steps carry (default ``len(dims)``: a dim fixed per process,
    ``batch`` at 4 throughout, is marked but never new, and makes ``tokens`` a feature).

    A new value of any feature makes the shape new; a new dim value makes every feature it
    is part of new but ``tokens`` (a product can repeat: 24 x 2 after 16 x 3).

    Example:
        >>> possible_novelties(["seq"])
        ['new:seq', 'repeat']
        >>> len(possible_novelties(["seq", "batch"])), possible_novelties(["seq"], marked=2)
        (9, ['new:seq+tokens', 'repeat'])
    """
    dims = list(dims)
    if len(dims) == 1:
        with_tokens = (marked or 1) > 1         # one dim varies: the product changes with it
        return [novelty_name({dims[0], "shape"} | ({"tokens"} if with_tokens else set())), REPEAT]
    out = {REPEAT, novelty_name({"shape"})}
    for k in range(1, len(dims) + 1):
        for new in combinations(dims, k):
            out.add(novelty_name(set(new) | {"shape"}))
            out.add(novelty_name(set(new) | {"shape", "tokens"}))
    out.add(novelty_name({"shape", "tokens"}))
    return sorted(out)


def calibration_plan(values: dict[str, Sequence[int]], *, min_processes: int = 3, max_processes: int = 8,
                     beam: int = 64) -> list[list[dict[str, int]]]:
    """Schedules for the fewest calibration processes that together play every class
    :func:`possible_novelties` names, from ``values`` (the values to record per dim), each
    followed by a repeat of every shape it played (the classes' sizes at more shapes).

    A process can make a dim new only as often as it has values left (the first step uses
    one), so with 3 values per dim each process reaches 2 of the 4 classes where the length is
    new: 2 processes or more. Processes up to ``min_processes`` start reaching every class
    again (each class then seen at two shapes or more, its sizes fitted, not assumed). The last
    process then plays every shape of the grid no process played, twice (a repeat at every
    shape: the repeat steps' sizes, which the other classes borrow, fitted on the whole grid). Each process starts at another value of every dim (first steps
    at several shapes); a beam search (``beam`` schedules kept per length, deterministic) picks
    the steps that reach the most classes not reached yet.

    Raises:
        ValueError: ``max_processes`` processes do not reach every class (too few values).

    Example:
        >>> plan = calibration_plan({"seq": [16, 24, 32], "batch": [2, 3, 4]})
        >>> reached = set().union(*(classify(p) for p in plan))
        >>> len(plan), reached == {"first", *possible_novelties(["seq", "batch"])}
        (4, True)
    """
    from itertools import product

    names = list(values)
    want = set(possible_novelties(names)) - {REPEAT}
    reached: set[str] = set()
    plans: list[list[dict[str, int]]] = []
    shapes = [dict(zip(names, combo)) for combo in product(*(values[n] for n in names))]
    while want - reached or len(plans) < min_processes:
        if not want - reached:
            reached = set()             # another round: every class again, at other shapes
        if len(plans) == max_processes:
            raise ValueError(f"{max_processes} processes over {dict(values)} do not play "
                             f"{sorted(want - reached)}: give more values per dim")
        firsts = [plan[0] for plan in plans]
        best = None
        # every start, those no process started at first (first steps at several shapes)
        for start in sorted(shapes, key=lambda shape: shape in firsts):
            found = _reach([start], shapes, want - reached, beam)
            if best is None or len(found[1]) > len(best[1]):
                best = found
        if not best[1]:
            raise ValueError(f"no process over {dict(values)} plays {sorted(want - reached)}: give more values "
                             "per dim")
        reached |= best[1]
        steps = best[0]
        played = []
        for step in steps:
            if step not in played:
                played.append(step)
        plans.append(steps + [dict(s) for s in played])
    # the repeat steps at every shape of the grid (a size like batch * seq**2 needs them all)
    plans[-1] += [dict(s) for s in shapes if all(s not in plan for plan in plans) for _ in range(2)]
    return plans
