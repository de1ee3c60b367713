"""Learning a step template from recordings (:func:`learn`, :func:`learn_files`): the steps split
at their marks, lined up per class, each allocation's size fitted as a polynomial in the dims.
See :mod:`ms_memopt.templates.template` for the whole account.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.templates.alignment import inserted_runs
from ms_memopt.templates.classes import (FEATURE_NAMES, FIRST, REPEAT, features, is_new, novelty_name,
                                         playable_classes, possible_novelties)
from ms_memopt.templates.format import Template, dims_key, parse_dims_tag, show_dims, template_from_dict
from ms_memopt.templates.layers import learn_layered
from ms_memopt.templates.polynomial import MAX_DEGREE, coef_value, evaluate, fit_sizes

__all__ = ["learn", "learn_files"]


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
        return f"{self.recording}: step {self.number} ({self.kind}, {show_dims(self.dims)})"


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
           f"{show_dims(dict(key))})")
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
        other = at.setdefault(dims_key(step.dims), step)
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
    taken = set()
    for pos, at in candidate.items():
        if at is None or not d_allocs[at][5]:
            continue
        theirs = d_allocs[at][1]
        if all(evaluate(theirs, d_basis, point) == step.sizes[pos] for step, point in zip(samples, points)):
            coefs[pos], exact[pos] = list(theirs), True
            taken.add(pos)
    # a size this class alone makes (a tensor the first step creates at its first use): on the
    # few shapes the class was seen at, a polynomial exact on them need not be the size's
    # (2*seq + 16*batch - 32 is seq*batch at 16x2, 16x3, 16x4, 32x2), so where the class's own fit
    # uses a dim, the polynomial of a repeat step's allocation that reproduces every sample is
    # taken (the one most repeat allocations have: the repeat steps are fitted on the whole grid)
    zero = [0] * len(names)
    at_samples: dict[tuple, list] = {}
    for theirs, _ in Counter(tuple(op[1]) for op in d_allocs if op[5]).most_common():
        values = tuple(evaluate(list(theirs), d_basis, point) for point in points)
        at_samples.setdefault(values, list(theirs))
    for pos in range(len(coefs)):
        constant = all(coef_value(c) == 0 for c, e in zip(coefs[pos], d_basis) if e != zero)
        if pos in taken or (exact[pos] and constant):
            continue
        theirs = at_samples.get(tuple(step.sizes[pos] for step in samples))
        if theirs is not None and not all(coef_value(c) == 0 for c, e in zip(theirs, d_basis) if e != zero):
            coefs[pos], exact[pos] = list(theirs), True
    return d_basis, coefs, exact


def _lacking(names: list[str], steps: list[_Step], constant: dict[str, set[str]], classes: dict) -> list[dict]:
    """What the calibration still lacks and a plan over the values recorded can fill
    (ms_memopt.templates.classes.calibration_plan): each class a step over those values can fall
    in (``playable_classes``: a class that needs a token count two shapes share is playable only
    where they do) that no recorded step did, and each class recorded at one value only of a dim
    the recordings vary where the values recorded let it fall at another."""
    fixed = set().union(*constant.values()) if constant else set()
    varying = [n for n in names if n not in fixed and len({s.dims[n] for s in steps}) > 1]
    covered = {c for name, part in classes.items() for c in part.get("covers", [name])}
    out = []
    playable: dict[str, list[dict[str, int]]] = {}
    if varying:
        playable = playable_classes(_plan_values(varying, steps))
        for kind in possible_novelties(varying, marked=len(names)):
            if kind not in covered and kind in playable:
                out.append({"class": kind, "why": "never recorded: no calibration step was new in exactly these"})
    # a class seen at one value of a dim takes the repeat steps' sizes where its allocations are
    # theirs (_borrowed); only without repeat steps varying that dim are its sizes a guess
    spans = {dim for dim in varying if len({s[dim] for s in classes.get(REPEAT, {}).get("seen", [])}) > 1}
    for name, part in classes.items():
        # where a plan can play the class (a merged class: any of the novelties it covers)
        shapes = [shape for kind in part.get("covers", [name]) for shape in playable.get(kind, [])]
        for dim in varying:
            values = sorted({s[dim] for s in part["seen"]})
            if len(values) == 1 and dim not in spans and len({shape[dim] for shape in shapes}) > 1:
                out.append({"class": name, "dim": dim, "why": f"recorded at {dim}={values[0]} only"})
    return out


def _plan_values(varying: list[str], steps: list[_Step]) -> dict[str, list[int]]:
    """The values of each varying dim a plan is made over: those recorded, 3 spread ones where
    more (as ``ms-memopt learn`` prints the plan)."""
    out = {}
    for name in varying:
        values = sorted({s.dims[name] for s in steps})
        out[name] = values if len(values) <= 3 else [values[0], values[len(values) // 2], values[-1]]
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


def learn_files(paths: Sequence[str | Path], *, max_degree: int = MAX_DEGREE,
                dims_csv: Sequence[str | Path] = ()) -> Template:
    """:func:`learn` from recording files (``ms-memopt record`` JSONL, or any trace format) or
    Ascend profiler captures (a rank's folder, ``ASCEND_PROFILER_OUTPUT/``, the ``.db``: cut at
    the profiler's step markers, the tensors held before the capture as the prologue;
    :mod:`ms_memopt.templates.capture`).

    ``dims_csv``: one CSV per capture, in the order the captures are given: a header of dim
    names and one row per captured step (none: no dims, every step alike).

    The template's ``recordings`` entry of a capture carries ``capture``: where its steps were
    marked, how many, what it held before the capture and its recorded figures (bytes).

    Raises:
        InputError: recordings that do not line up (see :func:`learn`), captures mixed with
            recordings, another number of ``dims_csv`` files than captures, or a ``dims_csv``
            whose rows are not the capture's steps (names the CSV).
    """
    from ms_memopt.io.traces import load_trace
    from ms_memopt.templates.capture import capture_recording, is_capture
    from ms_memopt.templates.format import read_schedule

    _refuse_repeats([str(Path(p).resolve()) for p in paths], shown=[str(p) for p in paths])
    recordings, pools, captures = [], set(), []
    for path in paths:
        if is_capture(path):
            csv_path = dims_csv[len(captures)] if len(captures) < len(dims_csv) else None
            dims = read_schedule(csv_path) if csv_path is not None else None
            captured = capture_recording(path, dims, dims_source=str(csv_path))
            captures.append(captured)
            recordings.append((str(path), captured.events))
        else:
            trace = load_trace(path)
            recordings.append((str(path), trace.events))
            pools.add(trace.meta.get("pool"))
    if dims_csv and len(dims_csv) != len(captures):
        raise InputError(f"{len(dims_csv)} dims CSV file(s) for {len(captures)} profiler capture(s): give one per "
                         "capture, in the captures' order", key="--dims-csv")
    if captures and len(captures) != len(recordings):
        raise InputError("profiler captures and ms-memopt recordings mixed: their pools differ (a device pool "
                         "captured by the profiler, a recorded MindSpore pool); learn each kind on its own",
                         source=str(paths[len(captures)] if not is_capture(paths[0]) else paths[0]))
    if len(pools) > 1:
        raise InputError(f"the recordings come from different pools: {sorted(map(str, pools))}")
    template = learn(recordings, pool=next(iter(pools)) if pools else None, max_degree=max_degree)
    if captures:
        allocators = {c.allocator for c in captures}
        if len(allocators) > 1:
            raise InputError(f"the captures come from different allocators: {sorted(allocators)}")
        template.allocator = captures[0].allocator
        for entry, captured in zip(template.recordings, captures):
            entry["capture"] = {"marks": captured.marks, "steps": captured.steps,
                                "held_before": captured.held_before, "recorded": captured.recorded,
                                "notes": captured.notes}
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
