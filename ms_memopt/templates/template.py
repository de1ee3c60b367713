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
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import short_repr
from ms_memopt.core.events import Event
from ms_memopt.templates.alignment import inserted_runs
from ms_memopt.templates.classes import (CLASSES, FEATURE_NAMES, FIRST, LEGACY_NEW, REPEAT, classify, features,
                                         is_class_name, is_new, novelty_name, possible_novelties)
from ms_memopt.templates.layers import expand, learn_layered
from ms_memopt.templates.polynomial import MAX_DEGREE, coef_value, evaluate, fit_sizes

__all__ = ["Template", "learn", "learn_files", "generate", "flat_template", "free_order_of", "load_template", "save_template", "fidelity",
           "parse_dims_tag", "dims_tag", "read_schedule", "CLASSES", "FORMAT", "VERSION"]

FORMAT = "ms-memopt-template"
VERSION = 1
LAYERED_VERSION = 2         # a template over a repeated block count (``layered``); version 1 still reads
_DIMS_PREFIX = "dims:"
_MAX_TEMPLATE_BYTES = 1 << 30      # a template's one JSON line (the 1 MiB line bound of other inputs is too small)


# --- dims in step tags ----------------------------------------------------------------------
def parse_dims_tag(tag: str | None) -> dict[str, int] | None:
    """``"dims:seq=32,batch=4"`` -> ``{"seq": 32, "batch": 4}``; ``None`` for any other tag.

    Example:
        >>> parse_dims_tag("dims:seq=32,batch=4"), parse_dims_tag(None)
        ({'seq': 32, 'batch': 4}, None)
    """
    if not tag or not tag.startswith(_DIMS_PREFIX):
        return None
    out: dict[str, int] = {}
    for part in tag[len(_DIMS_PREFIX):].split(","):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name.isidentifier():
                raise ValueError
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"bad dims tag {tag!r}: expected dims:NAME=INT,NAME=INT") from None
    return out


def dims_tag(dims: dict[str, int]) -> str:
    """The ``step`` event tag for ``dims`` (inverse of :func:`parse_dims_tag`)."""
    return _DIMS_PREFIX + ",".join(f"{k}={v}" for k, v in dims.items())


def _key(dims: dict[str, int]) -> tuple:
    return tuple(sorted(dims.items()))


def _show(dims: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in dims.items()) or "no dims"


# --- the template -------------------------------------------------------------------------
@dataclass
class Template:
    """A learned template (the JSON form is :meth:`to_dict`; see the module docstring).

    ``free_orders``: one entry per calibration recording that freed in another order than the
    most common one somewhere, ``{"recording": path, "parts": {part: {"ops", "ops_after"}}}``
    (only the parts that differ; ``generate(..., free_order=k)``), then the orders no
    calibration process drew of the runs of frees whose order differed between processes
    (``"recording": null, "permutation": [ranks]``: each such run freed in that order of its
    members, ranked by what they free).

    ``layered`` (version 2 of the format): a template over a repeated block count,
    ``{"dim", "base", "counts": {count: flat template dict}}``; the other fields are then the
    largest count's (:func:`generate` picks the schedule's count).

    ``prologue`` and each entry of ``classes`` are dicts: ``samples`` (steps it was learned
    from), ``seen`` (the distinct dims it was recorded at), ``basis`` (monomials: one exponent
    per dim of ``dims``, by increasing degree) and ``ops``: ``["a", coefs, pool, stream, tag,
    exact]`` (``coefs`` multiply the first ``len(coefs)`` monomials; ints or ``"p/q"``
    strings), ``["f", "same", i]``, ``["f", "prologue", i]``, ``["f", "back", k, {class: i}]``
    (``i`` counts allocations), ``["e"]`` (empty_cache).
    """

    dims: list[str]
    prologue: dict
    classes: dict[str, dict]
    pool: str | None = None
    allocator: str = "mindspore-bestfit"
    recordings: list[dict] = field(default_factory=list)
    not_exact: list[dict] = field(default_factory=list)
    positions: int = 0
    free_orders: list[dict] = field(default_factory=list)
    layered: dict | None = None
    lacks: list[dict] = field(default_factory=list)
    #: what each allocation is for, learned from lifetimes in the longest recording
    #: (:meth:`ms_memopt.analysis.purposes.Purposes.to_dict`); ``None`` for templates made before
    purposes: dict | None = None

    @property
    def exact(self) -> int:
        return self.positions - len(self.not_exact)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "pool": self.pool, "allocator": self.allocator,
                "dims": list(self.dims), "recordings": self.recordings,
                "fit": {"positions": self.positions, "exact": self.exact, "not_exact": self.not_exact},
                "prologue": self.prologue, "classes": self.classes,
                **({"free_orders": self.free_orders} if self.free_orders else {}),
                **({"lacks": self.lacks} if self.lacks else {}),
                **({"purposes": self.purposes} if self.purposes else {}),
                **({"version": LAYERED_VERSION, "layered": self.layered} if self.layered else {})}

    def summary(self) -> dict:
        """Counts per class (for the CLI)."""
        def allocs(part: dict) -> int:
            return sum(1 for op in part["ops"] if op[0] == "a")
        return {"dims": self.dims, "allocator": self.allocator, "positions": self.positions, "exact": self.exact,
                "not_exact": len(self.not_exact), "prologue_allocs": allocs(self.prologue),
                "free_orders": len(self.free_orders),
                "classes": {name: {"samples": c["samples"], "allocs": allocs(c), "ops": len(c["ops"]),
                                   "seen": c["seen"], **({"covers": c["covers"]} if "covers" in c else {}),
                                   **({"runtime_kept": c["runtime_kept"]} if "runtime_kept" in c else {})}
                            for name, c in self.classes.items()},
                "lacks": self.lacks,
                **({"purposes": self.purposes} if self.purposes else {}),
                **({"layered": {"dim": self.layered["dim"],
                                "counts": sorted(int(c) for c in self.layered["counts"])}} if self.layered else {})}


# --- learning -----------------------------------------------------------------------------
@dataclass
class _Step:
    recording: str
    number: int | None          # the step event's number (None: the prologue)
    index: int                  # 0-based step index in its recording (-1: prologue)
    dims: dict[str, int]
    kind: str
    ops: list[tuple] = field(default_factory=list)     # ("a", size, pool, stream, tag) / ("f", ref) / ("e",)
    prev: str | None = None     # the class of the step before (None: the first step, the prologue)
    sizes: list[int] = field(default_factory=list)
    kept: set[int] = field(default_factory=set)     # allocation positions the recording never frees

    def where(self) -> str:
        if self.index < 0:
            return f"{self.recording}: prologue"
        return f"{self.recording}: step {self.number} ({self.kind}, {_show(self.dims)})"


def _split(name: str, events: Iterable[Event]) -> tuple[_Step, list[_Step]]:
    """The prologue and the steps of one recording, each op's free resolved to its allocation."""
    events = list(events)
    marks = [i for i, e in enumerate(events) if e.action == "step"]
    dims_marks = []
    for i in marks:
        try:
            dims = parse_dims_tag(events[i].tag)
        except ValueError as exc:
            raise InputError(f"step {events[i].step}: {exc}", source=name) from None
        if dims is not None:
            dims_marks.append((i, dims))
    if not dims_marks:
        raise InputError("no step event with dims (tag dims:NAME=INT,...); record the run with "
                         "ms_memopt.mindspore.mark_step(seq=..., batch=...) at each step end", source=name)
    first_dims = dims_marks[0][0]
    setup = [i for i in marks if i < first_dims and events[i].tag is None]
    start = setup[-1] + 1 if setup else 0
    prologue = _Step(name, None, -1, {}, "prologue")
    steps: list[_Step] = []
    seen: dict[str, set] = {}                       # feature -> the values the process has run
    where: dict[int, tuple[_Step, int]] = {}       # alloc id -> (its step, its alloc position)

    def fill(step: _Step, chunk: list[Event]) -> None:
        for event in chunk:
            if event.action == "alloc":
                where[event.id] = (step, len(step.sizes))
                step.ops.append(("a", event.pool, event.stream, event.tag))
                step.sizes.append(event.size)
            elif event.action == "free":
                owner = where.pop(event.id, None)
                if owner is None:
                    continue          # allocated before the recording (or on a skipped line)
                at, pos = owner
                if at is step:
                    ref = ("same", pos)
                elif at.index < 0:
                    ref = ("prologue", pos)
                else:
                    ref = ("back", step.index - at.index, at.kind, pos)
                step.ops.append(("f",) + ref)
            elif event.action == "empty_cache":
                step.ops.append(("e",))

    fill(prologue, events[:start] if setup else [])
    begin = start
    for index, (mark, dims) in enumerate(dims_marks):
        values = features(dims)
        kind = FIRST if index == 0 else novelty_name(k for k, v in values.items() if v not in seen.get(k, ()))
        for k, v in values.items():
            seen.setdefault(k, set()).add(v)
        step = _Step(name, events[mark].step, index, dims, kind, prev=steps[-1].kind if steps else None)
        fill(step, events[begin:mark])
        steps.append(step)
        begin = mark + 1
    for event in events[begin:]:        # the process's exit: frees there still free (not part of a step)
        if event.action == "free":
            where.pop(event.id, None)
    for step, pos in where.values():
        step.kept.add(pos)
    return prologue, steps


def _describe(op: tuple, sizes: list[int] | None = None, pos: int | None = None) -> str:
    if op[0] == "a":
        extra = "" if sizes is None else f" of {sizes[pos]} B"
        return f"an allocation{extra} (pool {op[1] or 'common'}, stream {op[2]}, tag {op[3]})"
    if op[0] == "e":
        return "empty_cache"
    if op[1] == "same":
        return f"a free of this step's allocation #{op[2]}"
    if op[1] == "prologue":
        return f"a free of the prologue's allocation #{op[2]}"
    if len(op) == 4:
        return f"a free of the #{op[3]} freed allocation of the step {op[2]} back"
    return f"a free of allocation #{op[4]} of the {op[3]} step {op[2]} step(s) back"


def _identities(step: _Step) -> tuple[list, dict]:
    """The step's ops with each free named by what it frees, independent of its place: a free
    of the step ``k`` back is ``("back", k, rank)``, ``rank`` its allocation's rank among the
    frees of that step by allocation order (the same in a ``first`` and a ``repeat`` step when
    the steps allocate the common tensors in one order). Also ``identity -> (class, position)``
    for the back frees."""
    backs: dict[int, list[int]] = {}
    for op in step.ops:
        if op[0] == "f" and op[1] == "back":
            backs.setdefault(op[2], []).append(op[4])
    rank = {k: {pos: r for r, pos in enumerate(sorted(v))} for k, v in backs.items()}
    out, targets = [], {}
    for op in step.ops:
        if op[0] == "f" and op[1] == "back":
            ident = ("f", "back", op[2], rank[op[2]][op[4]])
            targets[ident] = (op[3], op[4])
            out.append(ident)
        else:
            out.append(op)
    return out, targets


def _align(kind: str, samples: list[_Step]) -> tuple[list, dict, list[list[int]], int, dict]:
    """The class's op list, the op lists after a step of a given class where its most common
    free order differs, each sample's sizes, and how many samples free in another order than
    the template; or the error naming what does not line up.

    Allocations must match one to one (count, order, pool, stream, tag), and every sample must
    free the same allocations; where a free happens may differ between samples, and the
    template keeps the most common order. Also each recording's own most common order
    (``{recording: (ops, ops_after)}``): MindSpore 2.10 on CPU frees SoftmaxBackward's three
    intermediates in an order drawn once per process (the same in every step of a process,
    another in the next process), which decides which of two equal holes the next tensor of
    that size takes; a template cannot know a future process's draw, so it keeps every draw
    its calibration processes made (:attr:`Template.free_orders`)."""
    ref = samples[0]
    ref_allocs = [op for op in ref.ops if op[0] == "a"]
    patterns: dict[tuple, int] = {}
    by_prev: dict[str | None, dict[tuple, int]] = {}
    merged_targets: dict[tuple, dict[str, int]] = {}
    ref_frees = None
    for other in samples:
        allocs = [op for op in other.ops if op[0] == "a"]
        if len(allocs) != len(ref_allocs):
            raise InputError(
                f"{other.where()} does not line up with {ref.where()}: {len(allocs)} allocations against "
                f"{len(ref_allocs)}; steps of one class must repeat the same allocations in the same order "
                "(a shape-dependent branch in the model? the setup mark missing?)")
        for i, (a, b) in enumerate(zip(ref_allocs, allocs)):
            if a != b:
                raise InputError(f"{other.where()} does not line up with {ref.where()}: allocation #{i} is "
                                 f"{_describe(b, other.sizes, i)} there, {_describe(a, ref.sizes, i)} here")
        ops, targets = _identities(other)
        frees = sorted((op for op in ops if op[0] != "a"), key=repr)
        if ref_frees is None:
            ref_frees = frees
        elif frees != ref_frees:
            extra = [op for op in frees if op not in ref_frees]
            missing = [op for op in ref_frees if op not in frees]
            what = (f"{_describe(extra[0])} that {ref.where()} does not make" if extra else
                    f"no {_describe(missing[0])[2:]} (which {ref.where()} makes)")
            raise InputError(f"{other.where()} does not line up with {ref.where()}: it makes {what}; "
                             f"{len(frees)} frees against {len(ref_frees)}")
        for ident, (cls, pos) in targets.items():
            slot = merged_targets.setdefault(ident, {})
            if slot.setdefault(cls, pos) != pos:
                raise InputError(f"{other.where()}: the free of the {cls} step {ident[2]} back that is its "
                                 f"#{ident[3]} frees allocation #{pos}, another {kind} step's frees #{slot[cls]}")
        patterns[tuple(ops)] = patterns.get(tuple(ops), 0) + 1
        by_prev.setdefault(other.prev, {}).setdefault(tuple(ops), 0)
        by_prev[other.prev][tuple(ops)] += 1

    def materialise(pattern: tuple) -> list:
        out = []
        for op in pattern:
            if op[0] == "f" and op[1] == "back":
                out.append(["f", "back", op[2], dict(merged_targets[op])])
            else:
                out.append(list(op))
        return out

    best = max(patterns, key=patterns.get)
    # where frees land can depend on the class of the step before (what it left to free)
    after = {prev: materialise(max(counts, key=counts.get)) for prev, counts in by_prev.items()
             if prev is not None and max(counts, key=counts.get) != best}
    reordered = sum(n for prev, counts in by_prev.items() for pattern, n in counts.items()
                    if pattern != (best if prev not in after else max(counts, key=counts.get)))
    # each recording's own order: MindSpore draws some free orders once per process (below)
    own: dict[str, tuple[list, dict]] = {}
    for name in dict.fromkeys(s.recording for s in samples):
        mine = [s for s in samples if s.recording == name]
        counts: dict[tuple, int] = {}
        prevs: dict[str | None, dict[tuple, int]] = {}
        for step in mine:
            pattern = tuple(_identities(step)[0])
            counts[pattern] = counts.get(pattern, 0) + 1
            prevs.setdefault(step.prev, {}).setdefault(pattern, 0)
            prevs[step.prev][pattern] += 1
        top = max(counts, key=counts.get)
        own[name] = (materialise(top), {prev: materialise(max(c, key=c.get)) for prev, c in prevs.items()
                                        if prev is not None and max(c, key=c.get) != top})
    return materialise(best), after, [s.sizes for s in samples], reordered, own


def _free_runs(ops: list) -> dict[int, tuple[int, int]]:
    """The runs of consecutive frees in ``ops``: allocations before the run -> (start, end) op index."""
    out, allocs, start = {}, 0, None
    for i, op in enumerate(list(ops) + [["a"]]):
        if op[0] == "f":
            start = i if start is None else start
            continue
        if start is not None:
            out[allocs] = (start, i)
            start = None
        if op[0] == "a":
            allocs += 1
    return out


def _member_key(op: list) -> tuple:
    return (op[1], op[2]) if op[1] != "back" else (op[1], op[2], sorted(op[3].items()))


def _reordered(ops: list, runs: dict[int, tuple[int, int]], perm: tuple[int, ...]) -> list:
    """``ops`` with each run of ``runs`` (``len(perm)`` frees) freed in ``perm`` order: the
    ``j``-th free is the member of rank ``perm[j]`` by :func:`_member_key`."""
    out = [list(op) if op[0] != "f" or op[1] != "back" else [op[0], op[1], op[2], dict(op[3])] for op in ops]
    for start, end in runs.values():
        members = sorted(ops[start:end], key=_member_key)
        out[start:end] = [members[r] for r in perm]
    return out


def _widened(run: list, lo: int, hi: int) -> tuple[int, int]:
    """``run[lo:hi]`` (frees whose order differed) widened to the neighbouring frees of
    allocations made as close to the span's own as they are to each other: an op's
    intermediates (allocated back to back) whose order only partly differed between processes."""
    same = lambda op: op[0] == "f" and op[1] == "same"
    if not all(same(op) for op in run[lo:hi]):
        return lo, hi
    while True:
        idx = [op[2] for op in run[lo:hi]]
        reach = max(1, max(idx) - min(idx))
        near = lambda op: same(op) and min(abs(op[2] - i) for i in idx) <= reach
        if lo > 0 and near(run[lo - 1]):
            lo -= 1
        elif hi < len(run) and near(run[hi]):
            hi += 1
        else:
            return lo, hi


def _same_spans(ops: list, other: list, spans: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """``spans`` of ``ops`` (by allocations before them) found in ``other``: the run after as
    many allocations, where it holds the same frees at the same offset in the run."""
    mine, theirs = _free_runs(ops), _free_runs(other)
    out = {}
    for key, (lo, hi) in spans.items():
        if key in mine and key in theirs:
            shift = theirs[key][0] - mine[key][0]
            span = other[lo + shift:hi + shift]
            if sorted(map(_member_key, span)) == sorted(map(_member_key, ops[lo:hi])):
                out[key] = (lo + shift, hi + shift)
    return out


def _permuted_orders(parts: dict[str, dict], per_recording: dict[str, dict[str, dict]]) -> list[dict]:
    """Free orders no calibration process drew, for the runs of frees whose order differed
    between processes: every order of their members (runs of 2..4 frees of one length), the
    same order in every such run, as one process draws one order for all of them."""
    from itertools import permutations

    varying: dict[str, dict[int, tuple[int, int]]] = {}
    for label, part in parts.items():
        mine = _free_runs(part["ops"])
        for variants in per_recording.values():
            own = variants.get(label)
            if own is None:
                continue
            theirs = _free_runs(own["ops"])
            for key, (start, end) in mine.items():
                if key not in theirs:
                    continue
                run, other = part["ops"][start:end], own["ops"][slice(*theirs[key])]
                if run == other or len(run) != len(other):
                    continue
                # the span that differs, when it holds the same frees (one that moved to another
                # run is not a draw of the order)
                lo = next(i for i, (x, y) in enumerate(zip(run, other)) if x != y)
                hi = len(run) - next(i for i, (x, y) in enumerate(zip(run[::-1], other[::-1])) if x != y)
                if sorted(map(_member_key, run[lo:hi])) == sorted(map(_member_key, other[lo:hi])):
                    lo, hi = _widened(run, lo, hi)
                    old_span = varying.setdefault(label, {}).get(key)
                    span = (start + lo, start + hi)
                    if old_span:
                        span = (min(span[0], old_span[0]), max(span[1], old_span[1]))
                    varying[label][key] = span
    lengths = [end - start for runs in varying.values() for start, end in runs.values()]
    if not lengths:
        return []
    n = max(set(lengths), key=lengths.count)
    if not 2 <= n <= 4:
        return []
    runs = {label: {k: r for k, r in rs.items() if r[1] - r[0] == n} for label, rs in varying.items()}
    out = []
    for perm in permutations(range(n)):
        variant = {label: {"ops": _reordered(parts[label]["ops"], rs, perm)} for label, rs in runs.items() if rs}
        for label, v in variant.items():
            after = parts[label].get("ops_after")
            if after:
                v["ops_after"] = {prev: _reordered(o, _same_spans(parts[label]["ops"], o, runs[label]), perm)
                                  for prev, o in after.items()}
        if variant:
            out.append({"recording": None, "permutation": list(perm), "parts": variant})
    return out


def _coherent_default(parts: dict[str, dict], synthesized: list[dict]) -> None:
    """Make the default free order one process's draw: the most common order of each class
    and of each class of step before (``ops_after``) may come from different processes, a mix
    no process makes. The draw of the class with the most samples is applied to all of them
    (``parts`` edited in place)."""
    if not synthesized:
        return
    main = max(synthesized[0]["parts"], key=lambda label: parts[label]["samples"])
    for variant in synthesized:
        if variant["parts"][main]["ops"] == parts[main]["ops"]:
            for label, order in variant["parts"].items():
                parts[label]["ops"] = order["ops"]
                if "ops_after" in order:
                    parts[label]["ops_after"] = {prev: o for prev, o in order["ops_after"].items()
                                                 if o != order["ops"]}
                    if not parts[label]["ops_after"]:
                        del parts[label]["ops_after"]
            return



def _constant_dims(names: list[str], steps: list[_Step]) -> dict[str, set[str]]:
    """Per recording, the dims all its steps share one value of; only dims constant in every
    recording are returned for each (a dim the prologue may depend on must be fixed per run)."""
    values: dict[str, dict[str, set[int]]] = {}
    for step in steps:
        for name in names:
            values.setdefault(step.recording, {}).setdefault(name, set()).add(step.dims[name])
    common = set(names)
    for dims in values.values():
        common &= {name for name, seen in dims.items() if len(seen) == 1}
    return {recording: set(common) for recording in values}


def _same_count_across_recordings(kind: str, samples: list[_Step], constant: dict[str, set[str]],
                                  everything: list[_Step], reason: str | None = None) -> None:
    """Refuse recordings whose steps of one class (or prologues) each make their own number
    of allocations: the op sequence then depends on something fixed per run (a layer count,
    a model variant), which a template cannot learn yet (steps that differ within one
    recording are :func:`_align`'s error, which names the step)."""
    counts: dict[str, set[int]] = {}
    first: dict[str, _Step] = {}
    for step in samples:
        counts.setdefault(step.recording, set()).add(len(step.sizes))
        first.setdefault(step.recording, step)
    if any(len(c) > 1 for c in counts.values()) or len({next(iter(c)) for c in counts.values()}) < 2:
        return
    totals = [(name, next(iter(c))) for name, c in counts.items()]
    a, na = totals[0]
    b, nb = next((name, n) for name, n in totals if n != na)
    da, db = first[a].dims, first[b].dims
    differ = [n for n in sorted(constant.get(a, set())) if da.get(n) != db.get(n)]
    if not differ:
        return      # no fixed dim tells the runs apart: _align names the steps that do not line up
    why = ", ".join(f"{n}={da[n]} vs {n}={db[n]}" for n in differ)
    where = "a step" if kind != "prologue" else "in the prologue"
    # what the count adds, from the class that shows it cleanest (repeat steps: no first-step
    # extras, no per-process order of small tensors)
    for cls in ("repeat", "new_shape", "first", "prologue"):
        blocks, repeated = _layer_blocks([s for s in everything if s.kind == cls], constant, differ)
        if repeated:
            break
    if blocks:
        why += "; " + blocks
    raise InputError(f"the op sequence changed between recordings ({na} vs {nb} allocations {where}); a repeated "
                     "block count (layers) is not learnable " + (f"from these recordings ({reason})" if reason else
                                                                 "yet") + ": record each layer count and learn it "
                     "separately "
                     f"({kind if kind == 'prologue' else kind + ' steps'} of {a} and {b}: {why})")



def _layer_blocks(samples: list[_Step], constant: dict[str, set[str]], differ: list[str]) -> tuple[str | None, bool]:
    """What a repeated block count adds to a step, for the error of recordings whose op counts
    differ: the steps of one class at the same step dims, one per recording (allocations as
    size, pool, stream, tag), compared in order of their allocation count. A repeated block
    (a layer's forward, its backward, its optimizer updates) shows as the same runs inserted
    from each count to the next, at the same places (modulo the run: the leftmost place in a
    repeated stretch): the text (``one more layers adds 214 allocations a step in 3 run(s)
    (63, 115, 36 allocations, ...)``, ``None`` when no such comparison is possible) and whether
    the recordings show one repeated block."""
    fixed = set().union(*constant.values()) if constant else set()
    by_recording: dict[str, dict[tuple, _Step]] = {}
    for step in samples:
        key = tuple(sorted((n, v) for n, v in step.dims.items() if n not in fixed))
        by_recording.setdefault(step.recording, {}).setdefault(key, step)
    common = set.intersection(*(set(v) for v in by_recording.values())) if by_recording else set()
    if not common or len(by_recording) < 2:
        return None, False
    key = sorted(common)[0]
    chosen = sorted((steps[key] for steps in by_recording.values()), key=lambda s: len(s.sizes))
    # scalars (<= 8 B) as one token: MindSpore allocates a few in an order drawn per process
    tokens = [[(size if size > 8 else "scalar",) + op[1:] for op, size in zip((o for o in s.ops if o[0] == "a"),
                                                                            s.sizes)] for s in chosen]
    label = ", ".join(differ) or "the run"
    show = lambda s: ",".join(f"{n}={s.dims[n]}" for n in differ) or s.recording
    found: list[list[tuple[int, int]]] = []
    for a, b in zip(range(len(chosen)), range(1, len(chosen))):
        if len(chosen[a].sizes) == len(chosen[b].sizes):
            continue
        runs = inserted_runs(tokens[a], tokens[b])
        if runs is None:
            return (f"{show(chosen[b])}'s {chosen[b].kind} step is not {show(chosen[a])}'s with allocations "
                    "inserted: not a repeated block"), False
        found.append(runs)
    if not found:
        return None, False
    runs = found[0]
    out = (f"one more {label} adds {sum(n for _, n in runs)} allocations a step in {len(runs)} run(s) "
           f"({', '.join(str(n) for _, n in runs)} allocations, inserted at "
           f"{', '.join(f'#{p}' for p, _ in runs)} of {show(chosen[0])}'s {chosen[0].kind} step at "
           f"{_show(dict(key))})")
    # from one count to the next the same runs, each at its place shifted by the runs before it
    # (or by itself too: which copy difflib calls the inserted one)
    for later in found[1:]:
        shift = 0
        same = len(later) == len(runs)
        for (p0, n0), (p1, n1) in zip(runs, later):
            same = same and n0 == n1 and p1 - (p0 + shift) in (0, n0)
            shift += n0
        if not same:
            return out + "; the next count adds other runs: not one repeated block", False
    if len(found) > 1:
        out += f", the same runs again at each further count ({len(found) + 1} counts recorded)"
    return out, True


def _count_dim(parts: list[_Step], constant: dict[str, set[str]]) -> str | None:
    """The dim fixed per recording that decides how many allocations each part makes (a
    layer count), when the recordings' counts differ; ``None`` when they do not (or no fixed
    dim explains them: then :func:`_align` names the steps)."""
    counts: dict[tuple[str, str], set[int]] = {}
    dims: dict[str, dict[str, int]] = {}
    for step in parts:
        counts.setdefault((step.kind, step.recording), set()).add(len(step.sizes))
        if step.index >= 0:
            dims.setdefault(step.recording, step.dims)
    if any(len(c) > 1 for c in counts.values()):
        return None
    kinds = {kind for kind, _ in counts}
    if all(len({next(iter(c)) for (k, _), c in counts.items() if k == kind}) == 1 for kind in kinds):
        return None
    fixed = sorted(set().union(*constant.values())) if constant else []
    candidates = []
    for name in fixed:
        by_value: dict[tuple, int] = {}
        if all(by_value.setdefault((kind, dims[rec][name]), next(iter(c))) == next(iter(c))
               for (kind, rec), c in counts.items() if rec in dims):
            candidates.append(name)
    return "layers" if "layers" in candidates else (candidates[0] if candidates else None)


def _learn_layered(dim: str, recordings: list, steps: list[_Step], prologues: list[_Step],
                   constant: dict[str, set[str]], pool: str | None, max_degree: int) -> Template:
    """A template over the repeated block count ``dim`` (:mod:`ms_memopt.templates.layers`),
    or the refusal naming what does not hold."""


    value = {s.recording: s.dims[dim] for s in steps}
    groups: dict[int, list] = {}
    for name, events in recordings:
        groups.setdefault(value[name], []).append((name, events))
    try:
        layered = learn_layered(dim, groups, lambda recs: learn(recs, pool=pool, max_degree=max_degree))
    except InputError as exc:
        reason = str(exc)
        for kind in dict.fromkeys(s.kind for s in steps):
            _same_count_across_recordings(kind, [s for s in steps if s.kind == kind], constant, steps + prologues,
                                          reason)
        _same_count_across_recordings("prologue", prologues, constant, steps + prologues, reason)
        raise
    largest = max(int(c) for c in layered["counts"])
    out = template_from_dict(layered["counts"][str(largest)], f"{dim}={largest}")
    out.layered = layered
    # free_orders: the largest count's; a count never recorded gets every recorded count's,
    # expanded (template_layers.expand), and a recorded count keeps its own (inside ``layered``):
    # flat_template gives the orders at a schedule's count
    out.recordings = [r for c in sorted(layered["counts"], key=int) for r in layered["counts"][c]["recordings"]]
    return out


# --- classes keyed by what is new (ms_memopt/templates/classes.py) -------------------------
def _lines_up(samples: list[_Step]) -> bool:
    """Whether ``samples`` (of two novelty classes) make one class: the same allocations and
    frees (:func:`_align`), and the same sizes where two of them ran at one shape (but scalars of
    8 B or less: MindSpore allocates a few in an order drawn per process)."""
    try:
        _align("merge", samples)
    except InputError:
        return False
    at: dict[tuple, _Step] = {}
    for step in samples:
        other = at.setdefault(_key(step.dims), step)
        if other.kind != step.kind and any(a != b and max(a, b) > 8 for a, b in zip(other.sizes, step.sizes)):
            return False
    return True


def _merge_novelties(steps: list[_Step]) -> dict[str, list[str]]:
    """Merge the novelty classes whose steps make the same allocations (MindSpore's caches
    that tell them apart are not in this model): ``class -> the novelties it covers``; the
    steps, their previous classes and their frees of earlier steps renamed in place. A merged
    class is named after its novelty with the most samples."""
    groups: dict[str, list[_Step]] = {}
    for step in steps:
        groups.setdefault(step.kind, []).append(step)
    merged: list[tuple[str, list[_Step], list[str]]] = []
    for kind in sorted((k for k in groups if is_new(k)), key=lambda k: (-len(groups[k]), k)):
        for _name, members, kinds in merged:
            if len(members[0].sizes) == len(groups[kind][0].sizes) and \
                    _lines_up(members + groups[kind]):
                members.extend(groups[kind])
                kinds.append(kind)
                break
        else:
            merged.append((kind, list(groups[kind]), [kind]))
    rename = {kind: name for name, _members, kinds in merged for kind in kinds}
    for step in steps:
        step.kind = rename.get(step.kind, step.kind)
        step.prev = rename.get(step.prev, step.prev)
        step.ops = [op if op[0] != "f" or op[1] != "back" else (op[0], op[1], op[2], rename.get(op[3], op[3]), op[4])
                    for op in step.ops]
    return {name: sorted(kinds) for name, _members, kinds in merged}


#: sizes of the non-tensor inputs MindSpore 2.10's CPU PyNative ops never free: an empty axis
#: tuple (0 B), a bool flag (1 B: ReduceSum's keep_dims and skip_mode, MatMul's transpose flags),
#: an int64 scalar or axis tuple (8 B an element: ReduceSum's and Softmax's axis)
RUNTIME_KEPT_SIZES = frozenset({0, 1, *range(8, 65, 8)})


def _runtime_kept(samples: list[_Step]) -> set[int]:
    """The allocation positions of a class that are MindSpore's own leak and nothing else: never
    freed in any sample, one size in every sample, that size an op argument's (0 B, 1 B, 8 B an
    int64: :data:`RUNTIME_KEPT_SIZES`). A tensor the model keeps (a loss appended to a list: 4 B,
    or sizes that follow the dims) does not qualify."""
    out = set()
    for pos in range(len(samples[0].sizes)):
        sizes = {s.sizes[pos] for s in samples}
        if len(sizes) == 1 and next(iter(sizes)) in RUNTIME_KEPT_SIZES and all(pos in s.kept for s in samples):
            out.add(pos)
    return out


def _runtime_summary(sample: _Step, runtime: set[int]) -> dict:
    """``{"allocs", "bytes", "pool_bytes", "sizes"}`` of a class's runtime-kept allocations a step
    (``pool_bytes``: as the pool holds them, 512 B each)."""
    from ms_memopt.core.units import aligned

    sizes = [sample.sizes[p] for p in sorted(runtime)]
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return {"allocs": len(sizes), "bytes": sum(sizes), "pool_bytes": sum(aligned(max(1, x)) for x in sizes),
            "sizes": {str(k): v for k, v in sorted(counts.items())}}


def _rebased(coefs: list, basis: list[list[int]], target: list[list[int]]) -> list | None:
    """``coefs`` over ``basis`` as coefficients over ``target`` (``None``: a monomial missing)."""
    out: list = [0] * len(target)
    for c, exps in zip(coefs, basis):
        if exps not in target:
            if coef_value(c) == 0:
                continue
            return None
        out[target.index(exps)] = c
    while len(out) > 1 and coef_value(out[-1]) == 0:
        out.pop()
    return out


def _borrowed(samples: list[_Step], basis: list, coefs: list, exact: list, donor: dict,
              names: list[str]) -> tuple[list, list, list]:
    """A class's fit with the repeat steps' polynomials where its allocation is one of theirs:
    a class seen at few shapes (a first step per process, a rare novelty) cannot fit a size in
    two dims itself, the repeat steps (many shapes) can. An allocation takes the repeat
    position it aligns with in every sample (:mod:`difflib` on size, pool, stream, tag at the
    sample's dims) when that polynomial reproduces every sample's size."""
    from difflib import SequenceMatcher

    d_basis = donor["basis"]
    d_allocs = [op for op in donor["ops"] if op[0] == "a"]
    if any(_rebased(c, basis, d_basis) is None for c in coefs):
        return basis, coefs, exact          # the donor's basis lacks a monomial this class uses
    candidate: dict[int, int | None] = {}
    points = []
    for step in samples:
        point = [step.dims.get(n, 0) for n in names]
        points.append(point)
        mine = [(size,) + tuple(op[1:4]) for op, size in zip((o for o in step.ops if o[0] == "a"), step.sizes)]
        theirs = [(evaluate(op[1], d_basis, point),) + tuple(op[2:5]) for op in d_allocs]
        mapping = {}
        for block in SequenceMatcher(None, mine, theirs, autojunk=False).get_matching_blocks():
            for i in range(block.size):
                mapping[block.a + i] = block.b + i
        for pos in range(len(mine)):
            at = mapping.get(pos)
            candidate[pos] = at if candidate.get(pos, at) == at else None
    coefs = [_rebased(c, basis, d_basis) for c in coefs]
    exact = list(exact)
    for pos, at in candidate.items():
        if at is None or not d_allocs[at][5]:
            continue
        theirs = d_allocs[at][1]
        if all(evaluate(theirs, d_basis, point) == step.sizes[pos] for step, point in zip(samples, points)):
            coefs[pos], exact[pos] = list(theirs), True
    return d_basis, coefs, exact


def _lacking(names: list[str], steps: list[_Step], constant: dict[str, set[str]], classes: dict) -> list[dict]:
    """What the calibration still lacks: each class a step can fall in that no recorded step
    did (and the shapes to record: a plan, ms_memopt.templates.classes.calibration_plan), and
    each class recorded at one value only of a dim the recordings vary."""
    fixed = set().union(*constant.values()) if constant else set()
    varying = [n for n in names if n not in fixed and len({s.dims[n] for s in steps}) > 1]
    covered = {c for name, part in classes.items() for c in part.get("covers", [name])}
    out = []
    if varying:
        for kind in possible_novelties(varying, marked=len(names)):
            if kind not in covered:
                out.append({"class": kind, "why": "never recorded: no calibration step was new in exactly these"})
    # a class seen at one value of a dim takes the repeat steps' sizes where its allocations are
    # theirs (_borrowed); only without repeat steps varying that dim are its sizes a guess
    spans = {dim for dim in varying if len({s[dim] for s in classes.get(REPEAT, {}).get("seen", [])}) > 1}
    for name, part in classes.items():
        for dim in varying:
            values = sorted({s[dim] for s in part["seen"]})
            if len(values) == 1 and dim not in spans:
                out.append({"class": name, "dim": dim, "why": f"recorded at {dim}={values[0]} only"})
    return out


def learn(recordings: Sequence[tuple[str, Iterable[Event]]], *, pool: str | None = None,
          max_degree: int = MAX_DEGREE) -> Template:
    """Learn a template from ``(name, events)`` recordings (see the module docstring).

    Raises:
        InputError: a recording without dims marks, recordings with different dims names,
            steps of one class (or prologues) that do not line up (names recording and step),
            or recordings at several layer counts that do not show one repeated block.
    """
    prologues: list[_Step] = []
    steps: list[_Step] = []
    info = []
    names: list[str] | None = None
    recordings = [(name, list(events)) for name, events in recordings]
    _refuse_repeats([name for name, _ in recordings])
    for name, events in recordings:
        prologue, own = _split(name, events)
        for step in own:
            if names is None:
                names = list(step.dims)
            elif set(step.dims) != set(names):
                raise InputError(f"step {step.number} has dims {sorted(step.dims)}, the first step seen has "
                                 f"{sorted(names)}; every step of every recording must name the same dims", source=name)
        # the prologue (weights, optimizer) is made at the dims the run holds for good: its
        # sizes are fitted in the dims constant within each recording, at the first step's values
        prologue.dims = dict(own[0].dims) if own else {}
        prologues.append(prologue)
        steps.extend(own)
        info.append({"path": name, "steps": len(own),
                     "classes": {k: sum(1 for s in own if s.kind == k) for k in dict.fromkeys(s.kind for s in own)}})
    if not recordings:
        raise InputError("no recording to learn from")
    names = names or []
    for name in FEATURE_NAMES:
        if name in names:
            raise InputError(f"a dim is named {name!r}, a name step classes use for a feature of every step "
                             f"({', '.join(FEATURE_NAMES)}); rename it in mark_step")
    constant = _constant_dims(names, steps)
    count_dim = _count_dim(steps + prologues, constant)
    if count_dim is not None:
        return _learn_layered(count_dim, recordings, steps, prologues, constant, pool, max_degree)
    for kind in dict.fromkeys(s.kind for s in steps):
        _same_count_across_recordings(kind, [s for s in steps if s.kind == kind], constant, steps + prologues)
    _same_count_across_recordings("prologue", prologues, constant, steps + prologues)
    covers = _merge_novelties(steps)
    not_exact: list[dict] = []
    positions = 0
    per_recording: dict[str, dict[str, dict]] = {}     # recording -> {part: its own free order}
    donor: dict | None = None       # the repeat steps' fit: sizes other classes' steps share with them

    def build(label: str, samples: list[_Step]) -> dict:
        nonlocal positions
        ops, after, sizes, reordered, own = _align(label, samples)
        points = [s.dims for s in samples]
        only = [n for n in names if n in set().union(*constant.values())] if label == "prologue" else None
        basis, coefs, exact = fit_sizes(names, points, [list(x) for x in sizes], max_degree, only=only)
        runtime = _runtime_kept(samples) if label != "prologue" else set()
        if donor is not None and label not in ("prologue", REPEAT):
            basis, coefs, exact = _borrowed(samples, basis, coefs, exact, donor, names)

        def with_sizes(ops: list) -> list:
            out_ops, pos = [], 0
            for op in ops:
                if op[0] == "a":
                    out_ops.append(["a", coefs[pos], op[1], op[2], op[3], exact[pos]] +
                                   (["runtime"] if pos in runtime else []))
                    pos += 1
                else:
                    out_ops.append(op)
            return out_ops

        out_ops = with_sizes(ops)
        grid = [[p.get(n, 0) for n in names] for p in points]
        for pos in range(len(coefs)):
            if not exact[pos]:
                errors = [abs(evaluate(coefs[pos], basis, g) - s[pos]) for g, s in zip(grid, sizes)]
                not_exact.append({"class": label, "alloc": pos, "max_error": max(errors),
                                  "sizes": sorted({s[pos] for s in sizes})[:8]})
        positions += len(coefs)
        seen: list[dict] = []
        for p in points:
            if p and p not in seen:
                seen.append(p)
        part = {"samples": len(samples), "seen": seen, "basis": basis, "ops": out_ops,
                "free_order_variants": reordered}
        if label in covers and covers[label] != [label]:
            part["covers"] = covers[label]
        if runtime:
            part["runtime_kept"] = _runtime_summary(samples[0], runtime)
        if after:
            part["ops_after"] = {prev: with_sizes(o) for prev, o in after.items()}
        default = (part["ops"], part.get("ops_after", {}))
        for name, (mine, mine_after) in own.items():
            variant = {"ops": with_sizes(mine)}
            if mine_after:
                variant["ops_after"] = {prev: with_sizes(o) for prev, o in mine_after.items()}
            if (variant["ops"], variant.get("ops_after", {})) != default:
                per_recording.setdefault(name, {})[label] = variant
        return part

    prologue = build("prologue", prologues)
    classes = {}
    kinds = sorted(dict.fromkeys(s.kind for s in steps), key=lambda k: (k != REPEAT, k != FIRST, k))
    for kind in kinds:          # the repeat steps first: the others borrow their sizes (_borrowed)
        samples = [s for s in steps if s.kind == kind]
        classes[kind] = build(kind, samples)
        if kind == REPEAT:
            donor = classes[kind]
    from ms_memopt.io.traces.ms_pool_log import POOL_NAME
    # the model of the recorded pool: DynamicMemPoolBestFit (CPU) or, for Ascend's default pool, mindspore
    allocator = "mindspore-bestfit" if pool in (None, POOL_NAME) else "mindspore"
    free_orders = [{"recording": name, "parts": parts} for name, parts in per_recording.items()]
    synthesized = _permuted_orders({"prologue": prologue, **classes}, per_recording)
    _coherent_default({"prologue": prologue, **classes}, synthesized)
    free_orders += synthesized
    lacks = _lacking(names, steps, constant, classes)
    return Template(names, prologue, classes, pool=pool, allocator=allocator, recordings=info,
                    not_exact=not_exact, positions=positions, free_orders=free_orders, lacks=lacks)


def learn_files(paths: Sequence[str | Path], *, max_degree: int = MAX_DEGREE) -> Template:
    """:func:`learn` from recording files (``ms-memopt record`` JSONL, or any trace format)."""
    from ms_memopt.io.traces import load_trace

    _refuse_repeats([str(Path(p).resolve()) for p in paths], shown=[str(p) for p in paths])
    recordings, pools = [], set()
    for path in paths:
        trace = load_trace(path)
        recordings.append((str(path), trace.events))
        pools.add(trace.meta.get("pool"))
    if len(pools) > 1:
        raise InputError(f"the recordings come from different pools: {sorted(map(str, pools))}")
    template = learn(recordings, pool=next(iter(pools)) if pools else None, max_degree=max_degree)
    template.purposes = _purposes_of(recordings)
    return template


def _purposes_of(recordings: Sequence[tuple[str, Sequence[Event]]]) -> dict:
    """The purposes of the recording with the most steps (persistent state does not add up
    across processes), and which one it was."""
    from ms_memopt.analysis.purposes import learn_purposes

    name, events = max(recordings, key=lambda r: sum(1 for e in r[1] if e.action == "step"))
    return {**learn_purposes(events).to_dict(), "recording": name}


def _refuse_repeats(names: Sequence[str], shown: Sequence[str] | None = None) -> None:
    """A recording named twice would merge its steps and free orders into one process's."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        j = first.setdefault(name, i)
        if j != i:
            label = shown or names
            raise InputError(f"recording given twice (as {label[j]} and {label[i]}): each calibration process "
                             "counts once", source=label[i])


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
            raise InputError(f"schedule step {number} ({_show(dims)}) is a {novelty} step and the template has none: "
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
    want = _free_sequence(_first_step(list(recorded)))
    best: tuple[float, int, int | None] | None = None
    flat = flat_template(template, schedule[:1]) if schedule else template
    for rank, k in enumerate([None, *range(len(flat.free_orders))]):
        got = _free_sequence(_first_step(generate(flat, list(schedule[:1]), free_order=k, keep_runtime_leak=True))
                             ) if schedule else []
        match = sum(1 for a, b in zip(want, got) if a == b) / len(want) if want else 1.0
        if best is None or match > best[0]:
            best = (match, rank, k)
    return best[2], best[0]


def _first_step(events: list[Event]) -> list[Event]:
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
    keys = [_key(s) for s in seen]
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


# --- schedules ----------------------------------------------------------------------------
def read_schedule(path: str | Path, dims: Sequence[str] | None = None) -> list[dict[str, int]]:
    """A schedule CSV: a header of dim names, then one row of integers per step.

    Raises:
        InputError: names the file, line and column of a bad cell; a header that is not the
            template's dims (when ``dims`` is given).
    """
    import csv

    from ms_memopt.core.lines import open_input

    source = str(path)
    with open_input(path, expected="a schedule CSV (a header of dim names, one row of integers per step)") as handle:
        try:
            return _schedule_rows(csv.reader(handle), source, dims)
        except csv.Error as exc:    # a bare CR, a cell over csv.field_size_limit()
            raise InputError(f"not a CSV row ({exc})", source=source, line=handle.line) from None


#: steps a schedule may list (read row by row; 10**6 steps is about 250 MB of rows)
MAX_SCHEDULE_ROWS = 1_000_000


def _schedule_rows(reader, source: str, dims: Sequence[str] | None) -> list[dict[str, int]]:
    lines = ((n, row) for n, row in enumerate(reader, 1) if any(cell.strip() for cell in row))
    first = next(lines, None)
    if first is None:
        raise InputError("empty schedule; expected a header of dim names (seq,batch) and one row per step",
                         source=source, line=1)
    header_line, header = first
    header = [h.strip() for h in header]
    for column, name in enumerate(header, 1):
        if not name.isidentifier():
            raise InputError(f"column {column}: header {name!r} is not a dim name", source=source, line=header_line)
    if len(set(header)) != len(header):
        raise InputError("a dim is named twice in the header", source=source, line=header_line)
    if dims is not None and set(header) != set(dims):
        raise InputError(f"the header names {header}; the template's dims are {list(dims)}", source=source,
                         line=header_line)
    out = []
    for number, row in lines:
        if len(row) != len(header):
            raise InputError(f"{len(row)} cells, the header has {len(header)}", source=source, line=number)
        if len(out) >= MAX_SCHEDULE_ROWS:
            raise InputError(f"more than {MAX_SCHEDULE_ROWS:,} steps; expected a schedule of at most that many",
                             source=source, line=number)
        step = {}
        for column, (name, cell) in enumerate(zip(header, row), 1):
            text = cell.strip()
            value = int(text) if len(text) <= 12 and text.lstrip("-").isdigit() else None
            if value is None or not -_DIM_LIMIT < value < _DIM_LIMIT:
                raise InputError(f"column {column} ({name}): expected an integer, got {text[:40]!r} (dims are "
                                 "within int32)", source=source, line=number)
            step[name] = value
        out.append(step)
    if not out:
        raise InputError("no step rows after the header", source=source, line=header_line)
    return out


# --- JSON ---------------------------------------------------------------------------------
def save_template(template: Template, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(template.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")


def _need(cond: bool, where: str, message: str, source: str) -> None:
    if not cond:
        raise InputError(f"{where}: {message}", source=source)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: a template's numbers are checked when it is loaded, so evaluating it stays cheap: coefficients
#: (integers, or "p/q" of two integers) within int64, exponents within MAX_TEMPLATE_DEGREE, dims
#: within int32 (a coefficient "1e9" is not "p/q"; exponents of 1e9 took minutes and gigabytes to
#: evaluate; a coefficient of 10**5 digits failed converting to text)
MAX_TEMPLATE_DEGREE = 8
_COEF_LIMIT = 2**63
_DIM_LIMIT = 2**31
_FRACTION = re.compile(r"-?\d{1,19}(?:/\d{1,19})?")


def _check_coef(c, where: str, source: str) -> None:
    if _is_int(c):
        _need(-_COEF_LIMIT < c < _COEF_LIMIT, where, f"a coefficient is within int64, got {short_repr(c)}", source)
        return
    _need(isinstance(c, str) and _FRACTION.fullmatch(c) is not None, where,
          f"a coefficient is an integer or a \"p/q\" string of two integers within int64, got {short_repr(c)}",
          source)
    try:
        value = Fraction(c)
    except (ValueError, ZeroDivisionError):
        raise InputError(f"{where}: bad coefficient {c!r}", source=source) from None
    _need(abs(value.numerator) < _COEF_LIMIT and value.denominator < _COEF_LIMIT, where,
          f"a coefficient is within int64, got {c!r}", source)


def _check_part(part, where: str, dims: list[str], classes: set[str], source: str) -> None:
    _need(isinstance(part, dict), where, "expected an object", source)
    for key in ("samples", "seen", "basis", "ops"):
        _need(key in part, f"{where}", f"missing key {key!r}", source)
    _need(_is_int(part["samples"]) and part["samples"] >= 1, f"{where}.samples", "expected a positive integer", source)
    _need(isinstance(part["seen"], list) and all(isinstance(s, dict) and set(s) == set(dims) and
                                                 all(_is_int(v) and -_DIM_LIMIT < v < _DIM_LIMIT for v in s.values())
                                                 for s in part["seen"]),
          f"{where}.seen", f"expected a list of {{dim: int}} objects over {dims}, each value within int32", source)
    basis = part["basis"]
    _need(isinstance(basis, list) and len(basis) >= 1 and all(
        isinstance(b, list) and len(b) == len(dims) and all(_is_int(e) and e >= 0 for e in b)
        and sum(b) <= MAX_TEMPLATE_DEGREE for b in basis),
        f"{where}.basis", f"expected a list of exponent lists, {len(dims)} non-negative integers each, of total "
        f"degree at most {MAX_TEMPLATE_DEGREE}", source)
    _check_ops(part["ops"], f"{where}.ops", basis, classes, source)
    after = part.get("ops_after", {})
    _need(isinstance(after, dict), f"{where}.ops_after", "expected an object {class: ops}", source)
    for prev, ops in after.items():
        _need(prev in classes, f"{where}.ops_after.{prev}", f"unknown class; expected one of {sorted(classes)}", source)
        _check_ops(ops, f"{where}.ops_after.{prev}", basis, classes, source)


def _check_ops(ops, where: str, basis: list, classes: set[str], source: str) -> None:
    _need(isinstance(ops, list), where, "expected a list", source)
    allocs = 0
    for i, op in enumerate(ops):
        at = f"{where}[{i}]"
        _need(isinstance(op, list) and op and op[0] in ("a", "f", "e"), at, "expected [\"a\", ...], [\"f\", ...] or "
              "[\"e\"]", source)
        if op[0] == "a":
            _need(len(op) == 6 or (len(op) == 7 and op[6] == "runtime"), at,
                  "an allocation is [\"a\", coefs, pool, stream, tag, exact] (then \"runtime\": MindSpore's own, never "
                  "freed)", source)
            _need(isinstance(op[1], list) and 1 <= len(op[1]) <= len(basis), f"{at}[1]",
                  f"expected 1..{len(basis)} coefficients", source)
            for j, c in enumerate(op[1]):
                _check_coef(c, f"{at}[1][{j}]", source)
            _need(op[2] is None or isinstance(op[2], str), f"{at}[2]", "pool is a string or null", source)
            _need(_is_int(op[3]), f"{at}[3]", "stream is an integer", source)
            _need(op[4] is None or isinstance(op[4], str), f"{at}[4]", "tag is a string or null", source)
            _need(isinstance(op[5], bool), f"{at}[5]", "exact is true or false", source)
            allocs += 1
        elif op[0] == "f":
            _need(len(op) >= 3 and op[1] in ("same", "prologue", "back"), at,
                  "a free is [\"f\", \"same\"|\"prologue\", i] or [\"f\", \"back\", k, {class: i}]", source)
            if op[1] == "back":
                _need(len(op) == 4 and _is_int(op[2]) and op[2] >= 1 and isinstance(op[3], dict) and op[3] and
                      all(k in classes and _is_int(v) and v >= 0 for k, v in op[3].items()), at,
                      f"expected [\"f\", \"back\", k >= 1, {{class: i}}] with classes from {sorted(classes)}", source)
            else:
                _need(len(op) == 3 and _is_int(op[2]) and op[2] >= 0, at, "expected a non-negative allocation index",
                      source)
                if op[1] == "same":
                    _need(op[2] < allocs, f"{at}[2]", f"frees allocation #{op[2]} before it is made", source)


def template_from_dict(data, source: str = "template") -> Template:
    """Validate a template's JSON object; errors name the key path (``classes.repeat.ops[3][1]``)."""
    _need(isinstance(data, dict), "(top)", "expected a JSON object", source)
    _need(data.get("format") == FORMAT, "format", f"expected {FORMAT!r}, got {data.get('format')!r}", source)
    _need(data.get("version") in (VERSION, LAYERED_VERSION), "version", f"unsupported version "
          f"{data.get('version')!r}; expected {VERSION} (or {LAYERED_VERSION}: over a repeated block count)", source)
    layered = data.get("layered")
    _need((layered is None) == (data.get("version") == VERSION), "version",
          f"version {LAYERED_VERSION} is a template over a repeated block count (with \"layered\"), version "
          f"{VERSION} one without; got version {data.get('version')!r}" + (" with" if layered else " without"),
          source)
    if layered is not None:
        _need(isinstance(layered, dict) and layered.get("dim") in (data.get("dims") or []) and
              _is_int(layered.get("base")) and isinstance(layered.get("counts"), dict) and layered["counts"],
              "layered", "expected {\"dim\": a dim, \"base\": int, \"counts\": {count: template}}", source)
        for count, sub in layered["counts"].items():
            _need(count.lstrip("-").isdigit(), f"layered.counts.{count}", "expected an integer count", source)
            template_from_dict(sub, f"{source}: layered.counts.{count}")
    for key in ("dims", "prologue", "classes"):
        _need(key in data, "(top)", f"missing key {key!r}", source)
    dims = data["dims"]
    _need(isinstance(dims, list) and all(isinstance(d, str) and d.isidentifier() for d in dims)
          and len(set(dims)) == len(dims), "dims", "expected a list of distinct dim names", source)
    classes = data["classes"]
    _need(isinstance(classes, dict) and classes, "classes", "expected an object {class: part}", source)
    for name in classes:
        _need(is_class_name(name), f"classes.{name}", "unknown class; expected first, repeat, new_shape or "
              "new:FEATURE+... (ms_memopt/templates/classes.py)", source)
    names = set(CLASSES) | set(classes)
    _check_part(data["prologue"], "prologue", dims, names, source)
    for name, part in classes.items():
        _check_part(part, f"classes.{name}", dims, names, source)
        covers = part.get("covers", [])
        _need(isinstance(covers, list) and all(is_class_name(c) and is_new(c) for c in covers) and
              (not covers or is_new(name)),
              f"classes.{name}.covers", "expected a list of novelty classes (new:...)", source)
    free_orders = data.get("free_orders") or []
    _need(isinstance(free_orders, list), "free_orders", "expected a list", source)
    parts = {"prologue": data["prologue"], **classes}
    for k, variant in enumerate(free_orders):
        at = f"free_orders[{k}]"
        _need(isinstance(variant, dict) and (variant.get("recording") is None or isinstance(variant["recording"], str))
              and isinstance(variant.get("parts"), dict), at,
              "expected {\"recording\": path or null, \"parts\": {...}}", source)
        for name, order in variant["parts"].items():
            _need(name in parts and isinstance(order, dict) and "ops" in order, f"{at}.parts.{name}",
                  f"expected {{\"ops\": [...]}} for one of {sorted(parts)}", source)
            _check_ops(order["ops"], f"{at}.parts.{name}.ops", parts[name]["basis"], names, source)
            for prev, ops in (order.get("ops_after") or {}).items():
                _need(prev in names, f"{at}.parts.{name}.ops_after.{prev}", "unknown class", source)
                _check_ops(ops, f"{at}.parts.{name}.ops_after.{prev}", parts[name]["basis"], names, source)
    allocator = data.get("allocator") or "mindspore-bestfit"
    from ms_memopt.allocators import MODELS

    # pool mode's model needs region sizes from a recipe, which a template does not carry
    _need(isinstance(allocator, str) and allocator in MODELS and allocator != "pool", "allocator",
          f"expected the model that recorded it, one of {', '.join(m for m in sorted(MODELS) if m != 'pool')}, "
          f"got {short_repr(allocator)}", source)
    fit = data.get("fit") or {}
    _need(isinstance(fit, dict), "fit", "expected an object", source)
    return Template(dims=list(dims), prologue=data["prologue"], classes=dict(classes), pool=data.get("pool"),
                    allocator=allocator, recordings=list(data.get("recordings") or []),
                    not_exact=list(fit.get("not_exact") or []), positions=int(fit.get("positions") or 0),
                    free_orders=list(free_orders), layered=layered, lacks=list(data.get("lacks") or []),
                    purposes=_checked_purposes(data.get("purposes"), source))


def _checked_purposes(purposes, source: str) -> dict | None:
    """A template's ``purposes`` (written by learn): each purpose's figures are counts and bytes."""
    if purposes is None:
        return None
    from ms_memopt.analysis.purposes import PURPOSES

    _need(isinstance(purposes, dict) and isinstance(purposes.get("purposes"), dict), "purposes",
          "expected {\"purposes\": {purpose: {count, bytes, ...}}}", source)
    for name, figures in purposes["purposes"].items():
        _need(name in PURPOSES and isinstance(figures, dict)
              and all(_is_int(figures.get(k)) and figures[k] >= 0 for k in ("count", "bytes", "peak")),
              f"purposes.purposes.{name}", f"expected one of {', '.join(PURPOSES)} with integer count, bytes, peak",
              source)
    return purposes


def load_template(path: str | Path) -> Template:
    """Read and validate a ``.template.json`` file.

    Raises:
        InputError: not JSON, not our format, or a bad key (the message names its key path).
    """
    from ms_memopt.core.jsontext import parse_json
    from ms_memopt.core.lines import open_text

    source = str(path)
    # save_template writes one line: a template of a large model is tens of MiB on it
    with open_text(path, expected="an ms-memopt template (.template.json)", max_line=_MAX_TEMPLATE_BYTES) as handle:
        text = handle.read()
    return template_from_dict(parse_json(text, source=source, line=1), source)


# --- fidelity -----------------------------------------------------------------------------
def _block_offsets(events: Iterable[Event]) -> list[tuple]:
    """Per allocation in order: ``(size, block number, offset in block, step)`` (blocks
    numbered by creation, from the ``segment_alloc`` events; ``step`` counts the ``step``
    events before it); ``None`` block and offset when not inside a block."""
    blocks: list[tuple[int, int]] = []
    out = []
    step = 0
    for event in events:
        if event.action == "step":
            step += 1
        elif event.action == "segment_alloc":
            blocks.append((event.addr, event.size))
        elif event.action == "alloc":
            where = None
            if event.addr is not None:
                for number, (base, size) in enumerate(blocks):
                    if base <= event.addr < base + size:
                        where = (number, event.addr - base)
                        break
            out.append((event.size,) + (where or (None, None)) + (step,))
    return out


def fidelity(recorded: Iterable[Event], simulated: Iterable[Event], *, until_last_step: bool = True) -> dict:
    """Compare a recording with simulated events, allocation by allocation in order:
    ``size_match`` (same size at the same position) and ``offset_match`` (same block number
    and offset inside it), as fractions of the recording's allocations.

    ``layout_match``: step by step, the fraction of allocations whose place (block, offset,
    aligned size) the other side also fills in that step, as multisets: two equal buffers that
    swapped places (frees in another order) still match, a different layout does not.

    ``until_last_step``: only the recording's allocations before its last ``step`` event (the
    process's exit is not a step).
    """
    recorded = list(recorded)
    if until_last_step:
        last = max((i for i, e in enumerate(recorded) if e.action == "step"), default=len(recorded) - 1)
        recorded = recorded[:last + 1]
    rec = _block_offsets(recorded)
    sim = _block_offsets(simulated)
    n = len(rec)
    same_size = sum(1 for a, b in zip(rec, sim) if a[0] == b[0])
    same_place = sum(1 for a, b in zip(rec, sim) if a[1] is not None and a[1:3] == b[1:3])
    # the same places as sets, step by step: which of two equal buffers sits where aside
    from collections import Counter

    def per_step(rows: list[tuple]) -> dict[int, Counter]:
        out: dict[int, Counter] = {}
        for size, block, offset, step in rows:
            if block is not None:
                out.setdefault(step, Counter())[(block, offset, max(512, (size + 511) // 512 * 512))] += 1
        return out
    rec_steps, sim_steps = per_step(rec), per_step(sim)
    # the recording's prologue is ended by a setup mark the simulation does not write
    shift = 1 if recorded and any(e.action == "step" and e.tag is None for e in recorded) else 0
    # (the prologue and the first step are one "step" of the simulation: compared together)
    merged: dict[int, Counter] = {}
    for step, counter in rec_steps.items():
        merged.setdefault(max(0, step - shift), Counter()).update(counter)
    same_layout = sum(sum((counter & sim_steps.get(step, Counter())).values()) for step, counter in merged.items())
    return {"allocs_recorded": n, "allocs_simulated": len(sim),
            "size_match": same_size / n if n else None, "offset_match": same_place / n if n else None,
            "layout_match": same_layout / n if n else None}


# --- placing ------------------------------------------------------------------------------

