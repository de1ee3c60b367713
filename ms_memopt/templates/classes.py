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
           "is_class_name", "possible_novelties", "playable_classes", "calibration_plan",
           "is_new"]

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


def _step_class(seen: dict[str, set], values: dict[str, object]) -> str:
    """The class of a step at features ``values`` after a process ran features ``seen`` (not its first)."""
    return novelty_name(name for name, value in values.items() if value not in seen.get(name, ()))


def _search(shapes: list[dict[str, int]], want: set[str],
            cap: int = 2048) -> tuple[dict[frozenset, dict[int, tuple[int, ...]]], dict[str, set[int]]]:
    """What one process can play over ``shapes``: every set of classes of ``want`` it can play,
    with per start (a shape's index) the shortest order of shapes that plays it, and per class
    the shapes where a step can fall in it.

    What a step is new in depends only on the shapes run before, not on their order, and a step
    at a shape already run is a repeat: the search walks the sets of shapes run, a shape added
    at each depth (filler steps that play no class wanted included: a token count seen before
    needs one), keeping per set only the class sets no other of that set contains. ``cap``
    states a depth bound a grid of many shapes (those that play the most classes kept)."""
    feats = [features(shape) for shape in shapes]
    # a state: (start, the shapes run, the classes played) -> the shortest order of those shapes
    states: dict[tuple[int, frozenset, frozenset], tuple[int, ...]] = {
        (i, frozenset([i]), frozenset()): (i,) for i in range(len(shapes))}
    best: dict[frozenset, dict[int, tuple[int, ...]]] = {}
    where: dict[str, set[int]] = {}
    while states:
        for (start, _, got), order in states.items():
            known = best.setdefault(got, {}).get(start)
            if known is None or (len(order), order) < (len(known), known):
                best[got][start] = order
        grown: dict[tuple[int, frozenset, frozenset], tuple[int, ...]] = {}
        for (start, ran, got), order in states.items():
            seen: dict[str, set] = {}
            for i in ran:
                for name, value in feats[i].items():
                    seen.setdefault(name, set()).add(value)
            for j in range(len(shapes)):
                if j in ran:
                    continue
                kind = _step_class(seen, feats[j])
                if kind in want:
                    where.setdefault(kind, set()).add(j)
                key = (start, ran | {j}, got | {kind} if kind in want else got)
                if key not in grown or order + (j,) < grown[key]:
                    grown[key] = order + (j,)
        by_ran: dict[tuple[int, frozenset], list[frozenset]] = {}
        for start, ran, got in grown:
            by_ran.setdefault((start, ran), []).append(got)
        states = {(*key, got): grown[(*key, got)] for key, gots in by_ran.items() for got in gots
                  if not any(got < other for other in gots)}
        if len(states) > cap:
            states = dict(sorted(states.items(), key=lambda s: (-len(s[0][2]), s[1]))[:cap])
    return best, where


def _grid(values: dict[str, Sequence[int]]) -> list[dict[str, int]]:
    from itertools import product

    names = list(values)
    return [dict(zip(names, combo)) for combo in product(*(list(dict.fromkeys(values[n])) for n in names))]


def playable_classes(values: dict[str, Sequence[int]]) -> dict[str, list[dict[str, int]]]:
    """Each class a step of a process playing ``values`` (per dim) can fall in, besides
    ``first``, with the shapes where it can (in the grid's order).

    A class that needs a token count seen before at another shape (``new:seq``, ``new:batch``,
    ``new:batch+seq``, ``new:shape``) is playable only where two shapes of the grid share one
    (``16 x 4`` and ``32 x 2``): over lengths 17, 19, 23 and batches 2, 3, 5 it never occurs.

    Example:
        >>> sorted(playable_classes({"seq": [17, 19, 23], "batch": [2, 3, 5]}))
        ['new:batch+seq+tokens', 'new:batch+tokens', 'new:seq+tokens', 'new:tokens', 'repeat']
        >>> playable_classes({"seq": [16, 32, 40], "batch": [2, 3, 4]})["new:batch+seq"]
        [{'seq': 16, 'batch': 4}, {'seq': 32, 'batch': 2}]
    """
    shapes = _grid(values)
    want = set(possible_novelties(list(values))) - {REPEAT}
    _, where = _search(shapes, want)
    out = {kind: [shapes[j] for j in sorted(js)] for kind, js in sorted(where.items())}
    out[REPEAT] = list(shapes)
    return dict(sorted(out.items()))


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


def calibration_plan(values: dict[str, Sequence[int]], *, min_processes: int = 3,
                     max_combinations: int = 200_000) -> list[list[dict[str, int]]]:
    """Schedules for the fewest calibration processes that together play every class a step
    over ``values`` (the values to record per dim) can fall in (:func:`playable_classes`), each
    followed by a repeat of every shape it played (the classes' sizes at more shapes).

    A process can make a dim new only as often as it has values left (the first step uses
    one), and some classes exclude each other in one process (``new:seq``: ``16 x 4`` before
    ``32 x 2``; ``new:batch``: ``32 x 2`` before ``16 x 4``), so every set of classes one
    process can play is searched (:func:`_search`: over the sets of shapes run, filler steps
    included), and the fewest of those sets that cover every playable class are taken (every
    combination of 1, 2, ... processes, up to ``max_combinations`` a count, then one at a time,
    the process that plays the most classes not played yet). Processes up to ``min_processes``
    then play again the classes played once (each at another shape: its sizes fitted, not
    assumed). Each process starts at another shape where it can (first steps at several
    shapes). The last process then plays every shape of the grid no process played, twice (a
    repeat at every shape: the repeat steps' sizes, which the other classes borrow, fitted on
    the whole grid). Never fails: a class no process over ``values`` can play is not asked for
    (:func:`playable_classes` names what is).

    Example:
        >>> plan = calibration_plan({"seq": [16, 32, 40], "batch": [2, 3, 4]})
        >>> reached = set().union(*(classify(p) for p in plan))
        >>> len(plan), reached == {"first", *possible_novelties(["seq", "batch"])}
        (4, True)
    """
    shapes = _grid(values)
    want = set(possible_novelties(list(values))) - {REPEAT}
    best, _ = _search(shapes, want)
    playable = frozenset().union(*best)
    # the class sets no other contains: a process playing a smaller one is never needed
    sets = sorted((got for got in best if got and not any(got < other for other in best)),
                  key=lambda got: (-len(got), sorted(got)))
    chosen: list[frozenset] = []
    for count in range(1, len(sets) + 1):
        if math.comb(len(sets), count) > max_combinations:
            break
        chosen = next((list(c) for c in combinations(sets, count) if frozenset().union(*c) == playable), [])
        if chosen:
            break
    while left := playable - frozenset().union(*chosen):
        chosen.append(max(sets, key=lambda got: (len(got & left), len(got))))
    plans: list[list[dict[str, int]]] = []
    starts: set[int] = set()

    def add(got: frozenset, start: int) -> None:
        starts.add(start)
        steps = [dict(shapes[i]) for i in best[got][start]]
        plans.append(steps + [dict(s) for s in steps])

    for got in chosen:
        # another start than the processes before where this class set allows one
        add(got, min(best[got], key=lambda i: (i in starts, len(best[got][i]), best[got][i])))
    while len(plans) < min_processes:
        again = {k for k in playable if sum(k in got for got in chosen) == 1}
        # a process not recorded yet: another start, the classes played once again
        fresh = [(got, i) for got in best if got for i in best[got] if i not in starts]
        if not fresh:
            break
        got, start = max(fresh, key=lambda c: (len(c[0] & again), len(c[0]), -len(best[c[0]][c[1]])))
        chosen.append(got)
        add(got, start)
    # the repeat steps at every shape of the grid (a size like batch * seq**2 needs them all)
    if plans:
        plans[-1] += [dict(s) for s in shapes if all(s not in plan for plan in plans) for _ in range(2)]
    else:       # one shape: its first step, and a repeat
        plans = [[dict(shapes[0]), dict(shapes[0])]]
    return plans
