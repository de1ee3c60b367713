"""What each allocation of a recording is for, learned from its lifetime alone.

A recording with step marks (``ms-memopt record`` of a run that calls ``mark_step``, a learned
template's events, a profiler capture cut at its step markers) says when each allocation was made
and freed relative to the steps. That is enough to tell the purposes the field report's pool mode
separates, without a tag from the framework:

================  ==================================================================================
purpose           lifetime
================  ==================================================================================
``parameters``    held before the first step ends and never freed, in the order the model creates them
``optimizer``     never freed, made after the parameters (with the optimizer or at its first step), in
                  sizes that mirror the parameters (Adam: two per parameter)
``gradients``     made in a step's backward (after the step's peak of live bytes) and kept past the
                  step's end, in sizes that mirror the parameters (PyNative keeps them until the next
                  optimizer step)
``activations``   made in a step's forward, freed in its backward: alive across the step's peak
``workspace``     short-lived: made and freed on one side of the step's peak, or around it with no
                  other allocation made meanwhile (an op's scratch)
``unclassified``  what fits none: kept past a step that did not make it in backward (a cached
                  output), or never freed after the first step (the runtime's own leak)
================  ==================================================================================

Where the pool holds no weights (MindSpore's CPU backend keeps a ``Parameter`` and the optimizer's
states in their own host tensors; only their gradients and the optimizer's update outputs pass
through the pool), the parameters are *inferred* from the gradients (one per trainable parameter,
of its size) and the optimizer's states per parameter from the update: at the end of a step each
parameter's update makes ``1 + states`` outputs of its size at once (MindSpore's
``AdamWeightDecay``: the parameter, ``m`` and ``v``). :class:`Purpose` says which figures were
seen in the pool and which were inferred.

Example: a prologue with two weights and their Adam states, then steps whose forward keeps one
activation over the peak and whose backward makes two gradients kept to the next step:

    >>> from ms_memopt.core.events import Event
    >>> ev = [Event("alloc", id=1, size=4096), Event("alloc", id=2, size=1024)]
    >>> ev += [Event("alloc", id=i, size=s) for i, s in ((3, 4096), (4, 4096), (5, 1024), (6, 1024))]
    >>> ev += [Event("step")]
    >>> nid = 10
    >>> for step in (1, 2, 3):
    ...     ev += [Event("alloc", id=nid + 1, size=512), Event("free", id=nid + 1),
    ...            Event("alloc", id=nid, size=8192), Event("alloc", id=nid + 2, size=4096),
    ...            Event("alloc", id=nid + 3, size=1024), Event("free", id=nid)]
    ...     ev += [Event("free", id=nid - 6), Event("free", id=nid - 5)] if step > 1 else []
    ...     ev += [Event("step", tag=f"dims:seq={step}")]
    ...     nid += 8
    >>> ev += [Event("free", id=nid - 6), Event("free", id=nid - 5)]     # the process's exit
    >>> found = learn_purposes(ev)
    >>> {name: (p.count, p.bytes) for name, p in found.purposes.items() if p.count}
    {'parameters': (2, 5120), 'optimizer': (4, 10240), 'gradients': (2, 5120), 'activations': (1, 8192), 'workspace': (1, 512)}
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ms_memopt.core.events import Event

__all__ = ["PURPOSES", "TAG_OF_PURPOSE", "Purpose", "Purposes", "learn_purposes", "purpose_of_ids"]

#: the purposes, in the order a report lists them
PURPOSES = ("parameters", "optimizer", "gradients", "activations", "workspace", "unclassified")
#: the request tag each purpose's allocations carry in a simulation (pool mode routes by tag:
#: :data:`ms_memopt.allocators.pool.REGION_OF_TAG`)
TAG_OF_PURPOSE = {"parameters": "parameter", "optimizer": "optimizer", "gradients": "gradient",
                  "activations": "activation", "workspace": "workspace", "unclassified": None}
#: a pool-held set of persistent tensors whose sizes cover at least this share of the parameter
#: signature's bytes, times a whole number, is the optimizer's states
_MIRROR_SHARE = 0.9


@dataclass
class Purpose:
    """One purpose's figures (bytes): ``count`` allocations of ``bytes`` in all. Persistent
    purposes (parameters, optimizer) count what is held at once; per-step purposes (gradients,
    activations, workspace, unclassified) count what one step makes (the recording's last full
    step). ``peak``: the most bytes of this purpose alive at once in that step (persistent: the
    same as ``bytes``). ``in_pool``: the figures were seen in the pool; ``False`` when they are
    inferred (``how`` says from what)."""

    count: int = 0
    bytes: int = 0
    peak: int = 0
    in_pool: bool = True
    how: str = ""


@dataclass
class Purposes:
    """Every purpose of one recording (:data:`PURPOSES`), the purpose of each allocation id
    (``of``), and the optimizer's states per parameter (``None``: unknown)."""

    purposes: dict[str, Purpose]
    of: dict[int, str] = field(default_factory=dict)
    states_per_parameter: int | None = None
    steps: int = 0

    def to_dict(self) -> dict:
        """JSON-ready: ``{purpose: {count, bytes, peak, in_pool, how}}`` plus the states per
        parameter and the steps read."""
        return {"purposes": {name: asdict(p) for name, p in self.purposes.items()},
                "states_per_parameter": self.states_per_parameter, "steps": self.steps}


@dataclass
class _Life:
    id: int
    size: int
    made: int                 # event index of the alloc
    step: int                 # -1: before the first step (the prologue); else the step's number (0-based)
    freed: int | None = None  # event index of the free (None: never)
    freed_step: int | None = None


def _lives(events: Sequence[Event]) -> tuple[list[_Life], list[int]]:
    """Every allocation's life, and the event index of each step mark. A setup mark (a ``step``
    event with no dims before any with dims) ends the prologue and starts step 0."""
    marks = [i for i, e in enumerate(events) if e.action == "step"]
    lives: list[_Life] = []
    live: dict = {}
    step = -1
    for i, e in enumerate(events):
        if e.action == "step":
            step += 1
        elif e.action == "alloc":
            if e.id in live:
                continue
            life = _Life(e.id, e.size, i, step)
            live[e.id] = life
            lives.append(life)
        elif e.action == "free":
            life = live.pop(e.id, None)
            if life is not None:
                life.freed, life.freed_step = i, step
    return lives, marks


def _step_peak(lives: list[_Life], start: int, end: int) -> int:
    """The event index in ``[start, end)`` where the step's own transient allocations (made and
    freed in it) hold the most bytes: the turn from forward to backward. What the step keeps
    (gradients) is left out, or the peak would follow the last gradient."""
    delta: dict[int, int] = {}
    for life in lives:
        if start <= life.made < end and life.freed is not None and life.freed < end:
            delta[life.made] = delta.get(life.made, 0) + life.size
            delta[life.freed] = delta.get(life.freed, 0) - life.size
    held = best = 0
    at = start
    for index in sorted(delta):
        held += delta[index]
        if held > best:
            best, at = held, index
    return at


def _update_groups(events: Sequence[Event], start: int, end: int, sizes: set[int]) -> list[int]:
    """The optimizer's update at a step's end: runs of consecutive allocations of one parameter
    size made before any of them is freed; the length of each run."""
    runs: list[int] = []
    size = count = 0
    for e in events[start:end]:
        if e.action == "alloc":
            if e.size == size:
                count += 1
                continue
            if count and size in sizes:
                runs.append(count)
            size, count = e.size, 1
        elif e.action == "free" and count:
            if size in sizes:
                runs.append(count)
            size = count = 0
    if count and size in sizes:
        runs.append(count)
    return runs


def learn_purposes(events: Iterable[Event], *, ended: bool = True) -> Purposes:
    """The purpose of every allocation of a recording with step marks, by its lifetime (see the
    module docstring); a recording without step marks has only persistent and unclassified
    allocations.

    Args:
        events: the recording's events (``step`` events mark the step ends; a first ``step``
            event without dims ends the prologue).
        ended: the events run to the process's end, so an allocation never freed was never
            freed (``False``: a stream cut after its last step, whose last step's kept
            allocations would be freed later, as a simulator's generated steps).

    Returns:
        :class:`Purposes`: the figures per purpose and each allocation id's purpose.
    """
    events = list(events)
    lives, marks = _lives(events)
    last_mark = marks[-1] if marks else len(events)
    first_end = marks[1] if len(marks) > 1 and events[marks[0]].tag is None else (marks[0] if marks else len(events))
    of: dict[int, str] = {}
    # persistent: never freed while the recording's steps ran, made before the first step ended
    persistent = _persistent(lives, last_mark, first_end)
    held = {life.id for life in persistent}
    # per step: the peak parts forward from backward
    bounds = list(zip([-1] + marks, marks)) if marks else []
    gradients: list[_Life] = []
    last_full: tuple[int, int] | None = None
    by_step: dict[int, list[_Life]] = {}
    for life in lives:
        by_step.setdefault(life.step, []).append(life)
    made_at = [life.made for life in lives]          # sorted: lives are in allocation order
    for number, (begin, end) in enumerate(bounds):
        step = number - 1                       # the prologue is step -1
        if step < 0 or end <= begin:
            continue
        mine = by_step.get(step, [])
        if not mine:
            continue
        peak = _step_peak(mine, begin, end)
        last_full = (begin, end)
        for life in mine:
            if life.id in of or life.id in held:
                continue
            kept = life.freed is None or life.freed > end
            if life.freed is None and (ended or end != last_mark):
                of[life.id] = "unclassified"    # never freed after the first step: the runtime's own
            elif kept:
                of[life.id] = "gradients" if life.made > peak else "unclassified"
                if life.made > peak:
                    gradients.append(life)
            elif life.made <= peak < life.freed and _outlives_an_allocation(made_at, life):
                of[life.id] = "activations"
            else:
                of[life.id] = "workspace"
    signature = Counter(life.size for life in gradients if life.step == (gradients[-1].step if gradients else 0))
    parameters, optimizer, rest = _split_persistent(persistent, signature)
    for life in parameters:
        of[life.id] = "parameters"
    for life in optimizer:
        of[life.id] = "optimizer"
    for life in rest:
        of[life.id] = "unclassified"
    for life in lives:
        of.setdefault(life.id, "unclassified")
    found = {name: Purpose() for name in PURPOSES}
    for life in parameters + optimizer:
        p = found[of[life.id]]
        p.count += 1
        p.bytes += life.size
        p.peak = p.bytes
    if last_full is not None:
        _count_step(found, of, lives, *last_full)
    states = None
    if optimizer and parameters:
        states = round(sum(life.size for life in optimizer) / max(1, sum(life.size for life in parameters)))
    if not parameters and signature:
        count, total = sum(signature.values()), sum(s * n for s, n in signature.items())
        found["parameters"] = Purpose(count, total, total, in_pool=False,
                                      how="not in the pool (the weights live in their own host tensors); one per "
                                          "gradient, of its size")
        last_grad = max(life.made for life in gradients if last_full[0] < life.made < last_full[1]) \
            if last_full is not None and any(last_full[0] < life.made < last_full[1] for life in gradients) else None
        states = None if last_grad is None else _inferred_states(events, last_grad + 1, last_full[1], set(signature))
        if states is not None:
            found["optimizer"] = Purpose(states * sum(signature.values()),
                                         states * sum(s * n for s, n in signature.items()),
                                         states * sum(s * n for s, n in signature.items()), in_pool=False,
                                         how=f"not in the pool; {states} state(s) per parameter, from the optimizer's "
                                             f"update: {states + 1} outputs of each parameter's size at a step's end")
    return Purposes(found, of, states, max(0, len(marks) - 1))


def _persistent(lives: list[_Life], last_mark: int, first_end: int) -> list[_Life]:
    """Never freed while the steps ran, made before the first step ended; less the runtime's own
    leak, which every later step repeats (MindSpore's CPU PyNative op arguments, 0 to 64 B, are
    never freed): the first step's never-freed allocations of the sizes a later step also leaves."""
    kept = [life for life in lives if (life.freed is None or life.freed > last_mark) and life.made < first_end]
    later = [life for life in lives if life.freed is None and life.made >= first_end]
    if not later:
        return kept
    last_step = max(life.step for life in later)
    leak = Counter(life.size for life in later if life.step == last_step)
    out = []
    for life in kept:
        if life.step >= 0 and life.freed is None and leak[life.size] > 0:
            leak[life.size] -= 1
            continue
        out.append(life)
    return out


def _outlives_an_allocation(made_at: list[int], life: _Life) -> bool:
    """Another allocation is made while ``life`` lives: it is not an op's workspace, made and
    freed around one moment (the step's peak may fall on one)."""
    return bisect_right(made_at, life.made) < len(made_at) and made_at[bisect_right(made_at, life.made)] < life.freed


def _split_persistent(persistent: list[_Life], signature: Counter) -> tuple[list[_Life], list[_Life], list[_Life]]:
    """The persistent allocations as parameters (the first of each size of the parameter
    signature, in creation order), the optimizer's states (later ones that mirror the signature
    a whole number of times) and the rest. Without gradients the signature is the prefix of the
    persistent allocations that the rest mirrors best."""
    if not persistent:
        return [], [], []
    if not signature:
        signature = _mirrored_prefix(persistent)
    parameters, later = _take_sizes(persistent, Counter(signature))
    if not parameters:
        return [], [], list(persistent)
    # at most 8 states a parameter
    optimizer, rest = _take_sizes(later, Counter({size: n * 8 for size, n in signature.items()}))
    mirrored = sum(life.size for life in optimizer)
    total = sum(life.size for life in parameters)
    if total and mirrored < _MIRROR_SHARE * total:
        rest, optimizer = rest + optimizer, []            # too little mirrors the parameters: not states
    return parameters, optimizer, rest


def _take_sizes(lives: list[_Life], want: Counter) -> tuple[list[_Life], list[_Life]]:
    """The allocations taken in order while ``want`` (size -> count) still asks for their size,
    and the others."""
    taken, left = [], []
    for life in lives:
        if want[life.size] > 0:
            want[life.size] -= 1
            taken.append(life)
        else:
            left.append(life)
    return taken, left


def _mirrored_prefix(persistent: list[_Life]) -> Counter:
    """The prefix of the persistent allocations (the parameters) whose sizes the rest repeats
    most: the split that mirrors the most bytes, the shortest on ties."""
    sizes = [life.size for life in persistent]
    best, best_at = 0, len(sizes)
    for at in range(1, len(sizes)):
        head, tail = Counter(sizes[:at]), Counter(sizes[at:])
        mirrored = sum(min(tail[s], 8 * n) * s for s, n in head.items())
        covered = sum(head[s] * s for s in head if tail[s] >= head[s])
        if covered >= _MIRROR_SHARE * sum(s * n for s, n in head.items()) and mirrored > best:
            best, best_at = mirrored, at
    return Counter(sizes[:best_at])


def _count_step(found: dict[str, Purpose], of: dict[int, str], lives: list[_Life], begin: int, end: int) -> None:
    """Per-step purposes: what the step ``(begin, end]`` makes, and each purpose's peak there."""
    delta: dict[str, dict[int, int]] = {}
    for life in lives:
        if not begin < life.made < end:
            continue
        name = of[life.id]
        if name in ("parameters", "optimizer"):
            continue
        p = found[name]
        p.count += 1
        p.bytes += life.size
        changes = delta.setdefault(name, {})
        changes[life.made] = changes.get(life.made, 0) + life.size
        if life.freed is not None and life.freed < end:
            changes[life.freed] = changes.get(life.freed, 0) - life.size
    for name, changes in delta.items():
        held = peak = 0
        for index in sorted(changes):
            held += changes[index]
            peak = max(peak, held)
        found[name].peak = peak


def _inferred_states(events: Sequence[Event], start: int, end: int, sizes: set[int]) -> int | None:
    """States per parameter from the optimizer's update (``events[start:end]``, after a step's
    last gradient): the most common number of outputs made at once per parameter size, less the
    parameter itself."""
    runs = _update_groups(events, start, end, sizes)
    if not runs:
        return None
    outputs = Counter(runs).most_common(1)[0][0]
    return outputs - 1 if outputs > 1 else None


def purpose_of_ids(events: Iterable[Event]) -> dict[int, str]:
    """Each allocation id's purpose (:func:`learn_purposes`'s ``of``)."""
    return learn_purposes(events).of
