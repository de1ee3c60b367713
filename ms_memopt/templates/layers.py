"""Templates over a repeated block count (``layers``): the step at a count never recorded.

Recordings at several values of a dim fixed per process (``layers``) make a different number
of allocations a step. :func:`learn_layered` learns one flat template per recorded count
(:func:`ms_memopt.templates.template.learn` on that count's recordings) and finds, per part
(prologue, each class), the structure the counts share: the sequence at count ``base + m`` is
``F0 X1^(c1+m) F1 X2^(c2+m) ... FK``, pieces ``F`` around stretches of copies of a block ``X``
(a layer's forward, its backward, its optimizer updates): the runs :mod:`difflib` finds
inserted from ``base`` to ``base + 1`` (allocations as their sizes at one point; a run slid left
as far as it goes, so that one block split around tokens equal to its end is one run again),
each widened to the whole periodic stretch it lies in, every count checked against that
expansion.

Every free and ``empty_cache`` belongs to the unit (a piece, or copy ``r`` of a block) of the
allocation before it, and is keyed there by how many of the unit's allocations precede it and
the size of what it frees. What it frees is a rule over the recorded counts: a piece position
(fixed), or copy ``r' = a*r + b*m + c`` of a block (``a`` in 1, -1, 0: the same layer, the
reversed order of a backward pass, a fixed one), the simplest rule that holds at every
recorded count, with the first or the last copy of a block allowed to free a piece instead
(what comes before or after the layers), the copies whose ``r'`` falls off the stretch freeing a
piece place per distance off it (layers that are not copies of the others, such as a first
layer that makes a few more tensors, sit in the pieces), and the last copy allowed another
offset (the other of two equal tensors). A tensor whose place in its unit moves between counts
(scalars MindSpore allocates in an order it draws per process) is taken at the largest count's
place. :func:`expand` builds the flat template at any count above the largest recorded from its op
lists (the first, a middle and the last copy of each block as there) and those rules.

Example (``recordings``: ``(name, events)`` pairs at 2, 3 and 4 layers, marked ``layers=N``)::

    template = learn(recordings)                  # template.layered["dim"] == "layers"
    events = generate(template, [{"seq": 16, "layers": 6}])

Three recorded counts determine a rule, a fourth checks it (each recorded count but the
smallest and the largest, where every stretch has 2 copies or more, is rebuilt and must free
what it freed). Every recorded count's per-process free orders (``free_orders``) are expanded
too, the largest count's first (a process draws one order for all its layers, so an order seen
at 3 layers holds at 6); the orders after another class (``ops_after``) are not kept at counts
never recorded.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass

from ms_memopt.core.errors import InputError
from ms_memopt.templates.alignment import inserted_runs
from ms_memopt.templates.polynomial import evaluate

__all__ = ["learn_layered", "expand"]


@dataclass
class _Layout:
    """Where each allocation of a part lies at ``m`` copies more than the base count: pieces
    ``F0..FK`` (allocations) around the repeated stretches, stretch ``k`` ``base_copies[k] + m``
    copies of a block of ``blocks[k]`` allocations."""
    pieces: list[int]
    blocks: list[int]
    base_copies: list[int]

    def copies(self, s: int, m: int) -> int:
        return self.base_copies[s] + m

    def units(self, m: int) -> list[tuple[str, int, int, int]]:
        """``(kind "F"/"X", index, copy, first allocation)`` in order; empty units included."""
        out, at = [], 0
        for s, n in enumerate(self.pieces):
            out.append(("F", s, 0, at))
            at += n
            if s < len(self.blocks):
                for r in range(self.copies(s, m)):
                    out.append(("X", s, r, at))
                    at += self.blocks[s]
        return out

    def locate(self, m: int, index: int, units: list | None = None) -> tuple[str, int, int, int]:
        """Allocation ``index`` -> ``(kind, unit index, copy, offset in the unit)``."""
        units = units or self.units(m)
        starts = [u[3] for u in units]
        # the last unit starting at or before index that is not empty
        i = bisect_right(starts, index) - 1
        while i > 0 and self._length(units[i]) == 0:
            i -= 1
        kind, s, r, start = units[i]
        return kind, s, r, index - start

    def index(self, m: int, kind: str, s: int, r: int, offset: int) -> int:
        for k, unit_s, unit_r, start in self.units(m):
            if (k, unit_s, unit_r) == (kind, s, r):
                return start + offset
        raise KeyError((kind, s, r))

    def _length(self, unit) -> int:
        return self.pieces[unit[1]] if unit[0] == "F" else self.blocks[unit[1]]


def _tokens(part: dict, point: list[int]) -> list[tuple]:
    """Each allocation as (size at ``point``, pool, stream, tag); scalars (<= 8 B, allocated
    in an order MindSpore draws per process) as one token."""
    out = []
    for op in part["ops"]:
        if op[0] == "a":
            size = evaluate(op[1], part["basis"], point)
            out.append((size if size > 8 else "scalar", op[2], op[3], op[4]))
    return out


def _layout(label: str, tokens: dict[int, list[tuple]], base: int) -> _Layout:
    """The pieces and blocks all counts share, or the error saying where they do not."""

    counts = sorted(tokens)
    runs = inserted_runs(tokens[base], tokens[counts[1]]) if len(counts) > 1 else []
    if runs is None:
        raise InputError(f"{label}: the step at {counts[1]} is not the step at {base} with allocations inserted")
    # each run inserted into a stretch of copies of one block: the stretch (in the sequence
    # with one copy more, where it has at least two) is what repeats; its copies start at its
    # left end, what is left of it over a whole copy belongs to the next piece
    longer, short = tokens[counts[1]], tokens[base]
    pieces, blocks, base_copies, block_tokens = [], [], [], []
    at, shift = 0, 0                  # in the base: where the current piece starts; runs before
    for p, n in runs:
        lo, hi = p + shift, p + shift + n
        while lo > 0 and lo - 1 + n < len(longer) and longer[lo - 1] == longer[lo - 1 + n]:
            lo -= 1
        while hi < len(longer) and longer[hi] == longer[hi - n]:
            hi += 1
        copies = (hi - lo) // n
        start = lo - shift            # the stretch's start in the base
        if start < at:
            raise InputError(f"{label}: two repeated stretches overlap")
        pieces.append(start - at)
        blocks.append(n)
        base_copies.append(copies - 1)
        block_tokens.append(longer[lo:lo + n])
        at = start + (copies - 1) * n
        shift += n
    pieces.append(len(short) - at)
    layout = _Layout(pieces, blocks, base_copies)
    starts = []
    cursor = 0
    for s_, n in enumerate(pieces):
        starts.append(cursor)
        cursor += n + (base_copies[s_] * blocks[s_] if s_ < len(blocks) else 0)
    for count in counts:
        m = count - base
        want = []
        for kind, s_, r, start in layout.units(m):
            want += short[starts[s_]:starts[s_] + pieces[s_]] if kind == "F" else block_tokens[s_]
        if want != tokens[count]:
            raise InputError(f"{label}: the step at {count} is not the step at {base} with the blocks one more "
                             f"count inserts ({', '.join(map(str, blocks))} allocations) {m} times")
    return layout


def _targets(op: list) -> list[tuple[str, str | None, int]]:
    """What a free frees: ``(part kind "same"/"prologue"/"back", class for back, position)``."""
    if op[1] == "back":
        return [("back", cls, pos) for cls, pos in sorted(op[3].items())]
    return [(op[1], None, op[2])]


def _target_part(label: str, target: tuple) -> str:
    """The part a free's target (``(kind, class, ...)``, :func:`_targets`) lies in."""
    kind, cls = target[0], target[1]
    return label if kind == "same" else ("prologue" if kind == "prologue" else cls)


def _described(part_label: str, ops: list, m: int, layouts: dict, tokens_at: dict) -> list[tuple]:
    """Per non-allocation op: ``(its unit, its key in the unit, target descriptors)``; a target
    descriptor is ``(kind, unit index, copy, offset)`` in its part's layout at ``m``."""
    layout = layouts[part_label]
    units = layout.units(m)
    out, allocs = [], 0
    seen: dict[tuple, int] = {}
    for op in ops:
        if op[0] == "a":
            allocs += 1
            continue
        unit = layout.locate(m, allocs - 1, units)[:3] if allocs else ("F", 0, 0)
        before = allocs - layout.index(m, *unit, 0) if allocs else 0
        if op[0] == "e":
            targets, what = [], ("e",)
        else:
            targets, what = [], []
            for kind, cls, pos in _targets(op):
                target_part = _target_part(part_label, (kind, cls))
                where = layouts[target_part].locate(m, pos)
                targets.append(where)
                what.append((kind, cls, tokens_at[target_part][pos]))
            what = (op[1], op[2] if op[1] == "back" else None, tuple(what))
        key = (before, what)
        n = seen.get((unit, key), 0)
        seen[(unit, key)] = n + 1
        out.append((unit, key + (n,), targets))
    return out


_RULES = [(a, b, c) for a in (1, -1, 0) for b in ((0, 1) if a != -1 else (1, 0)) for c in (0, -1, 1, -2, 2, -3, 3)]


def _rule(samples: list[tuple[int, int, tuple, int]], copies_of=None) -> dict | None:
    """The simplest rule reproducing every ``(copy, m, target, last copy)`` sample: a fixed
    piece, or copy ``a*r + b*m + c`` of a block at an offset (the first or the last copy may
    free a piece instead; or the copies whose ``a*r + b*m + c`` falls off the block's stretch,
    ``copies_of(block, m)`` copies long, free a piece place per distance off it: layers that
    are not periodic, such as a first layer that makes a few more tensors, sit in the pieces)."""
    fixed = {t for r, m, t, _ in samples if t[0] == "F"}
    blocks = [(r, m, t, last) for r, m, t, last in samples if t[0] == "X"]
    rule: dict | None = _piece_rule(samples, fixed, bool(blocks)) if fixed else {}
    if not blocks:
        return rule
    if len({t[1] for _, _, t, _ in blocks}) > 1:
        return None
    top = max(m for _, m, _, _ in blocks)
    at_top = [(r, t[3], last) for r, m, t, last in blocks if m == top]
    offsets = {offset for _, offset, _ in at_top}
    last_offset = None
    if len(offsets) > 1:
        # the last copy may free the other of two equal tensors (what follows the blocks differs)
        inner = {offset for r, offset, last in at_top if r != last}
        at_last = {offset for r, offset, last in at_top if r == last}
        if len(inner) != 1 or len(at_last) != 1:
            return None
        offsets, last_offset = inner, next(iter(at_last))
    offset = next(iter(offsets))
    block = blocks[0][2][1]
    for a, b, c in _RULES:
        if not all(a * r + b * m + c == t[2] for r, m, t, _ in blocks):
            continue
        found = dict(rule) if rule is not None else None
        if found is None:           # the pieces freed are not the first's or the last's
            beyond = _beyond([(r, m, t) for r, m, t, _ in samples if t[0] == "F"], (a, b, c), block, copies_of)
            if beyond is None:
                continue
            found = {"beyond": beyond}
        if any(t[3] != (last_offset if last_offset is not None and r == last else offset)
               for r, _, t, last in blocks):
            found["varies"] = True          # as for a piece: the largest count's place
        if last_offset is not None:
            found["last_offset"] = last_offset
        found["block"] = [block, offset, a, b, c]
        return found
    return None


def _piece_rule(samples: list[tuple[int, int, tuple, int]], fixed: set, blocks: bool) -> dict | None:
    """The piece part of :func:`_rule`: one piece place (the largest count's when a scalar's
    place varies) and, beside blocks, whether the first or the last copy frees it."""
    rule: dict = {}
    if len(fixed) > 1:
        # another place in a piece at another count: a tensor allocated in an order the
        # process draws (scalars); the largest count's, the one the expansion starts from
        if len({t[1] for t in fixed}) > 1:
            return None
        rule["varies"] = True
        fixed = {max(((m, r), t) for r, m, t, _ in samples if t[0] == "F")[1]}
    rule["piece"] = list(next(iter(fixed)))
    if blocks:       # then only the first copy frees the piece (what comes before), or the last (after)
        pieces = [(r, last) for r, m, t, last in samples if t[0] == "F"]
        in_blocks = [(r, last) for r, m, t, last in samples if t[0] == "X"]
        if all(r == 0 for r, _ in pieces) and not any(r == 0 for r, _ in in_blocks):
            rule["piece_copy"] = "first"
        elif all(r == last for r, last in pieces) and not any(r == last for r, last in in_blocks):
            rule["piece_copy"] = "last"
        else:
            return None
    return rule


def _beyond(pieces: list[tuple[int, int, tuple]], abc: tuple[int, int, int], block: int, copies_of) -> dict | None:
    """``{distance: piece place}`` when every piece freed is where copy ``a*r + b*m + c`` falls
    off the block's stretch (``"-1"``: one before its first copy, ``"+0"``: just after its last),
    one place per distance; else ``None``."""
    if copies_of is None:
        return None
    a, b, c = abc
    out: dict[str, list] = {}
    for r, m, t in pieces:
        key = _off_stretch(a * r + b * m + c, copies_of(block, m))
        if key is None or out.setdefault(key, list(t)) != list(t):
            return None
    return out


def _off_stretch(copy: int, copies: int) -> str | None:
    """How far ``copy`` lies off a stretch of ``copies`` copies (``None``: on it)."""
    if copy < 0:
        return str(copy)
    return f"+{copy - copies}" if copy >= copies else None


def learn_layered(dim: str, groups: dict[int, list], learn_one) -> dict:
    """``{"dim", "base", "counts": {count: template dict}, "rules": ...}`` from recordings
    grouped by their value of ``dim``; ``learn_one(recordings)`` learns one count's flat
    template. Raises the :class:`InputError` naming the part and what does not hold."""
    counts = sorted(groups)
    if len(counts) < 3 or counts != list(range(counts[0], counts[0] + len(counts))):
        raise InputError(f"a repeated block count ({dim}) is learned from at least 3 consecutive counts; the "
                         f"recordings have {dim} = {counts}")
    flats = {c: learn_one(groups[c]) for c in counts}
    learned = {c: t.to_dict() for c, t in flats.items()}
    _check_structure(dim, counts[0], learned)
    return {"dim": dim, "base": counts[0], "counts": {str(c): d for c, d in learned.items()},
            "classes": [k for k in learned[counts[0]]["classes"] if all(k in d["classes"] for d in learned.values())]}


def _parts(template: dict) -> dict[str, dict]:
    return {"prologue": template["prologue"], **template["classes"]}


def _analyse(dim: str, base: int, counts: dict[int, dict]):
    """Layouts per part and the rule of every free, from the flat templates per count."""
    first = _parts(counts[base])
    labels = [label for label in first if all(label in _parts(t) for t in counts.values())]
    ref = next((p["seen"][0] for p in first.values() if p["seen"]), None)
    names = counts[base]["dims"]
    point = [ref.get(n, 0) for n in names] if ref else [0] * len(names)
    tokens = {label: {c: _tokens(_parts(t)[label], point) for c, t in counts.items()} for label in labels}
    layouts = {label: _layout(label, tokens[label], base) for label in labels}
    samples: dict[tuple, list] = {}
    keyed: dict[int, dict[str, list]] = {}
    for c, t in counts.items():
        m = c - base
        tokens_at = {label: tokens[label][c] for label in labels}
        for label in labels:
            described = _described(label, _parts(t)[label]["ops"], m, layouts, tokens_at)
            keyed.setdefault(c, {})[label] = described
            if m == 0:
                continue        # the base: its layers are pieces; the rules are for inserted copies
            for unit, key, targets in described:
                last = layouts[label].copies(unit[1], m) - 1 if unit[0] == "X" else 0
                samples.setdefault((label, unit[0], unit[1], key), []).append((unit[2], m, targets, last))
    rules = {}
    for where, found in samples.items():
        label, kind, s, key = where
        per_target = []
        for j in range(max(len(t) for _, _, t, _ in found)):
            target_part = _target_part(label, key[1][2][j]) if key[1][0] != "e" else None
            got = _rule([(r, m, targets[j], last) for r, m, targets, last in found if j < len(targets)],
                        layouts[target_part].copies if target_part in layouts else None)
            if got is None:
                what = key[1][2][j][2][0] if key[1][0] != "e" else "?"
                raise InputError(f"{label}: a free in {'piece' if kind == 'F' else 'block'} {s} (after {key[0]} of its "
                                 f"allocations, of a {what} B tensor) frees, from one {dim} count to the next, "
                                 "allocations no rule follows "
                                 f"({[(r, m, t[j]) for r, m, t, _ in found if j < len(t)][:6]})")
            per_target.append(got)
        rules[where] = per_target
    return labels, layouts, rules, keyed, tokens


def _canonical(op: list) -> str:
    return repr(op[:3] + [sorted(op[3].items())]) if op[0] == "f" and op[1] == "back" else repr(op)


def _check_structure(dim: str, base: int, counts: dict[int, dict]) -> None:
    """Raise the :class:`InputError` saying what does not hold (see :func:`expand`), else nothing;
    also expands to each recorded count above the base's next and compares with the learned one."""
    analysed = _analyse(dim, base, counts)
    labels = analysed[0]
    largest = max(counts)
    layouts = analysed[1]
    for c in counts:
        if c in (base, largest) or any(layout.copies(s, c - base) < 2 for layout in layouts.values()
                                       for s in range(len(layout.blocks))):
            continue          # a single copy is both the first and the last: recorded, never built
        # a count rebuilt from the largest's op lists must free what the recorded one frees
        got = _expand_from(dim, base, counts, c, analysed, free_orders=False)
        for label in labels:
            mine = sorted(_canonical(op) for op in _parts(got)[label]["ops"] if op[0] != "a")
            theirs = sorted(_canonical(op) for op in _parts(counts[c])[label]["ops"] if op[0] != "a")
            if mine != theirs:
                raise InputError(f"{label}: the rules from the {dim} counts {sorted(counts)} do not rebuild the frees "
                                 f"of {dim}={c}")


def _expand_ops(label: str, source_ops: list, described: list, m: int, m_src: int, layouts: dict,
                rules: dict) -> list:
    """One part's op list at ``m`` copies more than the base, from its op list at ``m_src``
    (``described``: :func:`_described` of its frees there)."""
    layout = layouts[label]
    described = iter(described)
    # the source's op list cut into its units
    units: dict[tuple, list] = {}
    allocs = 0
    for op in source_ops:
        if op[0] == "a":
            unit = layout.locate(m_src, allocs)[:3]
            allocs += 1
            units.setdefault(unit, []).append(("a", op))
        else:
            unit, key, _ = next(described)
            units.setdefault(unit, []).append(("f", op, key))

    def made_like(kind: str, s: int, r: int) -> list:
        """A unit's ops: a piece as the source's; a block's first and last copies as the
        source's first and last (a layer that frees what comes before or after the blocks),
        the copies between as the source's second, or (two copies) as the first's ops that
        the last makes too."""
        if kind == "F":
            return units.get(("F", s, 0), [])
        c_src, c = layout.copies(s, m_src), layout.copies(s, m)
        if r == 0:
            return units.get(("X", s, 0), [])
        if r == c - 1:
            return units.get(("X", s, c_src - 1), [])
        if c_src >= 3:
            return units.get(("X", s, 1), [])
        last = {item[2] for item in units.get(("X", s, c_src - 1), []) if item[0] == "f"}
        return [item for item in units.get(("X", s, 0), []) if item[0] == "a" or item[2] in last]

    ops: list = []
    for kind, s, r, _start in layout.units(m):
        for item in made_like(kind, s, r):
            if item[0] == "a":
                ops.append(list(item[1]))
                continue
            op, key = item[1], item[2]
            if op[0] == "e":
                ops.append(["e"])
                continue
            made = []
            for j, (tkind, cls, _pos) in enumerate(_targets(op)):
                rule = rules[(label, kind, s, key)][j]
                target_part = _target_part(label, (tkind, cls))
                boundary = None if kind != "X" else \
                    {"first": 0, "last": layout.copies(s, m) - 1}.get(rule.get("piece_copy"))
                if "block" not in rule or (kind == "X" and r == boundary):
                    made.append(layouts[target_part].index(m, "F", rule["piece"][1], 0, rule["piece"][3]))
                    continue
                bs, off, a, b, c = rule["block"]
                if kind == "X" and r == layout.copies(s, m) - 1:
                    off = rule.get("last_offset", off)
                copy = a * r + b * m + c
                beyond = _off_stretch(copy, layouts[target_part].copies(bs, m))
                piece = rule.get("beyond", {}).get(beyond) if beyond is not None else None
                made.append(layouts[target_part].index(m, "X", bs, copy, off) if beyond is None else
                            layouts[target_part].index(m, "F", piece[1], 0, piece[3]) if piece else None)
            if any(x is None for x in made):
                continue        # a layer that does not exist at this count
            if op[1] == "back":
                ops.append(["f", "back", op[2], {cls: x for (_k, cls, _p), x in zip(_targets(op), made)}])
            else:
                ops.append(["f", op[1], made[0]])
    return ops


def _expand_from(dim: str, base: int, counts: dict[int, dict], count: int, analysed, *,
                 free_orders: bool = True) -> dict:
    """The flat template dict at ``count`` from the recorded counts (``free_orders``: with every
    recorded count's orders expanded too; the structure check compares default frees only)."""
    labels, layouts, rules, keyed, tokens = analysed
    largest = max(counts)
    source = counts[largest]
    m_src, m = largest - base, count - base
    out = {k: v for k, v in source.items() if k not in ("prologue", "classes", "free_orders", "layered")}
    out["classes"] = {}
    for label in labels:
        part = _parts(source)[label]
        new = {k: v for k, v in part.items() if k not in ("ops", "ops_after")}
        new["ops"] = _expand_ops(label, part["ops"], keyed[largest][label], m, m_src, layouts, rules)
        if label == "prologue":
            out["prologue"] = new
        else:
            out["classes"][label] = new
    # every recorded count's per-process free orders, each expanded the same way (a part whose
    # frees no rule covers keeps the default order): the largest count's first, then those the
    # others showed (one process draws one order for every layer, so an order seen at 3 layers
    # holds at 6 too); an order that adds nothing new is kept once
    out["free_orders"] = []
    kept = set()
    for k in sorted(counts, reverse=True) if free_orders else []:
        if k != largest and any(layout.copies(s_, k - base) < 2 for layout in layouts.values()
                                for s_ in range(len(layout.blocks))):
            continue        # a single copy is both the first and the last: nothing to expand from
        for variant in counts[k].get("free_orders") or []:
            parts = _expanded_order(variant, counts[k], keyed[k], labels, m, k - base, layouts, rules)
            parts = {label: order for label, order in parts.items() if order["ops"] != _parts(out)[label]["ops"]}
            seen = json.dumps(parts, sort_keys=True)
            if parts and seen not in kept:
                kept.add(seen)
                out["free_orders"].append({**{key: v for key, v in variant.items() if key != "parts"}, "parts": parts})
    return out


def _expanded_order(variant: dict, source: dict, keyed: dict, labels: list, m: int, m_src: int, layouts: dict,
                    rules: dict) -> dict:
    """One free order of ``source`` (at ``m_src`` copies more than the base) at ``m``: per part."""
    parts = {}
    for label, order in variant["parts"].items():
        if label not in labels:
            continue
        # each free named as the default's free of the same allocation (equal-size frees in
        # one unit are told apart by their order there, which is what the variant changes)
        default_ops = _parts(source)[label]["ops"]
        named = {_canonical(op): item for op, item in zip((op for op in default_ops if op[0] != "a"), keyed[label])}
        try:
            described = [named[_canonical(op)] for op in order["ops"] if op[0] != "a"]
            parts[label] = {"ops": _expand_ops(label, order["ops"], described, m, m_src, layouts, rules)}
        except (KeyError, IndexError, StopIteration):
            continue
    return parts


def expand(layered: dict, count: int) -> dict:
    """The flat template dict at ``count`` of the dim: a recorded count's own, else built from
    the largest recorded count's op lists (see the module docstring).

    Raises:
        InputError: a count below the smallest recorded one plus two, not recorded.
    """
    counts = {int(c): t for c, t in layered["counts"].items()}
    if count in counts:
        return counts[count]
    base = layered["base"]
    if count < base + 2:
        raise InputError(f"{layered['dim']}={count}: the template is built for {layered['dim']} >= {base + 2} "
                         f"(recorded {sorted(counts)})")
    return _expand_from(layered["dim"], base, counts, count, _analyse(layered["dim"], base, counts))
