"""A step template's data and its JSON file: :class:`Template`, the ``dims:`` step tags, the
schedule CSV, and the checks a template file passes when it is read.

The learning is in :mod:`ms_memopt.templates.learning`, the events a template makes in
:mod:`ms_memopt.templates.generating`, the comparison with a recording in
:mod:`ms_memopt.templates.fidelity`; :mod:`ms_memopt.templates.template` names them all.
The format (version 1; version 2 over a repeated block count) is described in
docs/simulation.md, "Templates learned from recordings".

Example:
    >>> dims_tag({"seq": 32, "batch": 4}), parse_dims_tag("dims:seq=32")
    ('dims:seq=32,batch=4', {'seq': 32})
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Sequence

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import short_repr
from ms_memopt.templates.classes import CLASSES, is_class_name, is_new

__all__ = ["FORMAT", "VERSION", "LAYERED_VERSION", "MAX_TEMPLATE_DEGREE", "MAX_SCHEDULE_ROWS", "STEP_COLUMN", "Template",
           "dims_key", "dims_tag", "load_template", "parse_dims_tag", "read_schedule", "save_template",
           "show_dims", "template_from_dict"]

FORMAT = "ms-memopt-template"
VERSION = 1
LAYERED_VERSION = 2         # a template over a repeated block count (``layered``); version 1 still reads
_DIMS_PREFIX = "dims:"
_MAX_TEMPLATE_BYTES = 1 << 30      # a template's one JSON line (the 1 MiB line bound of other inputs is too small)



# --- dims in step tags ----------------------------------------------------------------------
def parse_dims_tag(tag: str | None) -> dict[str, int] | None:
    """``"dims:seq=32,batch=4"`` -> ``{"seq": 32, "batch": 4}``; ``None`` for any other tag.

    Example:
        >>> parse_dims_tag("dims:seq=32,batch=4"), parse_dims_tag("dims:"), parse_dims_tag(None)
        ({'seq': 32, 'batch': 4}, {}, None)
    """
    if not tag or not tag.startswith(_DIMS_PREFIX):
        return None
    out: dict[str, int] = {}
    if tag == _DIMS_PREFIX:         # a step with no dims: every step of the run alike (a profiler capture's)
        return out
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


def dims_key(dims: dict[str, int]) -> tuple:
    """``dims`` as a hashable key, whatever their order."""
    return tuple(sorted(dims.items()))


def show_dims(dims: dict[str, int]) -> str:
    """``dims`` as people read them (``seq=32,batch=4``; ``no dims``)."""
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


# --- schedules ----------------------------------------------------------------------------
def read_schedule(path: str | Path, dims: Sequence[str] | None = None) -> list[dict[str, int]]:
    """A schedule CSV: a header of dim names, then one row of integers per step. A ``step``
    column (:data:`STEP_COLUMN`) may number the rows; it is not a dim (unless the template has
    one of that name), so a template without dims reads a schedule of that column alone.

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


#: a schedule's column that numbers its steps (the profiler's ``ProfilerStep#N`` in a capture's
#: dims CSV) and is not a dim: a template without dims has a schedule of it alone
STEP_COLUMN = "step"
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
    if dims is not None and set(header) - {STEP_COLUMN} != set(dims):
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
            if name != STEP_COLUMN or STEP_COLUMN in (dims or ()):
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
