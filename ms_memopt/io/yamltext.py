"""One guarded YAML parse for every YAML input (recipes, MindFormers configs).

PyYAML's pure-Python scanner spends time proportional to the nesting depth on every token,
so a deeply nested document costs the square of its depth; with MindSpore imported the
recursion limit is 10000 instead of 1000, and a 5000-deep flow sequence then takes ~12 s
to be refused by a ``RecursionError``. :func:`parse_yaml` measures the nesting depth in one
linear pass first and refuses anything deeper than :data:`MAX_DEPTH` in milliseconds,
whatever the recursion limit; every other failure becomes an
:class:`~ms_memopt.core.errors.InputError` naming the file and line.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from ms_memopt.core.errors import InputError

__all__ = ["MAX_DEPTH", "parse_yaml", "nesting_depth"]

#: deepest nesting accepted; real recipes and MindFormers configs stay under 10
MAX_DEPTH = 64

# Tokens that matter for depth: quoted scalars and comments (skipped, so a bracket inside
# them does not count), flow brackets, and line starts with their indentation and sequence
# dashes (block nesting). A quote opened inside a plain scalar (``it's``) can only hide
# brackets, never add any: the pre-check may under-count but never refuses a valid file.
_TOKEN = re.compile(
    r"""(?P<skip>'(?:[^']|'')*'|"(?:[^"\\]|\\.)*"|(?:^|(?<=[ \t]))#[^\n]*)"""
    r"|(?P<open>[\[{])|(?P<close>[\]}])"
    r"|^(?P<indent>[ ]*)(?P<dashes>(?:-[ ]+)*)(?=[^ \n#])",
    re.MULTILINE,
)


def nesting_depth(text: str, *, limit: int = MAX_DEPTH) -> tuple[int, int]:
    """Deepest nesting of ``text`` seen before it passes ``limit``: ``(depth, line)``.

    Flow nesting (brackets) and block nesting (indentation and ``- `` markers) are counted
    together, a little generously (a sequence entry counts one level more than PyYAML
    nests it); the scan stops at the first line where the depth exceeds ``limit``. Runs in
    time linear in the text's length.

    Example:
        >>> nesting_depth("a:\\n  b: [[1, 2], {c: 3}]\\n")
        (4, 2)
    """
    deepest, deepest_line = 0, 1
    flow = 0
    block: list[int] = []   # columns of the open block nodes above the current line
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        if kind == "skip":
            continue
        if kind == "close":
            flow = max(0, flow - 1)
            continue
        if kind == "open":
            flow += 1
        elif not flow:   # a content line in block context (indentation means nothing in flow)
            column = len(match.group("indent"))
            while block and block[-1] >= column:
                block.pop()
            block.append(column)
            dashes = match.group("dashes")
            block.extend(column + dash.end() for dash in re.finditer(r"-[ ]+", dashes))
        depth = len(block) + flow
        if depth > deepest:
            deepest, deepest_line = depth, text.count("\n", 0, match.start()) + 1
            if deepest > limit:
                break
    return deepest, deepest_line


def parse_yaml(text: str, *, source: str | None = None) -> Any:
    """Parse one YAML document safely; every way it can fail is an :class:`InputError`.

    Raises:
        InputError: nested deeper than :data:`MAX_DEPTH` (refused before parsing), a syntax
            error (with its line), or a value PyYAML cannot construct (a 5000-digit integer,
            a bad date); the message names ``source``.

    Example:
        >>> parse_yaml("model:\\n  model_config: {num_layers: 2}\\n")
        {'model': {'model_config': {'num_layers': 2}}}
    """
    depth, line = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise InputError(f"invalid YAML: nested more than {MAX_DEPTH} levels deep",
                         source=source, line=line)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"invalid YAML: {problem}", source=source, line=line) from None
    except RecursionError:   # a shape the pre-check under-counted
        raise InputError("invalid YAML: nested too deeply", source=source) from None
    except (ValueError, OverflowError) as exc:   # constructors: a 5000-digit int, a bad date
        raise InputError(f"invalid YAML value: {str(exc)[:200]}", source=source) from None
