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

__all__ = ["MAX_DEPTH", "MAX_ALIASES", "MAX_EXPANDED_NODES", "parse_yaml", "nesting_depth"]

#: deepest nesting accepted; real recipes and MindFormers configs stay under 10
MAX_DEPTH = 64
#: alias uses (``*name``) accepted in one document; MindFormers configs use a handful
MAX_ALIASES = 1000
#: nodes the document may hold once every alias is expanded (a "billion laughs" bomb of 9
#: levels of 10 expands to 10**9); a large MindFormers config has about a thousand
MAX_EXPANDED_NODES = 100_000

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
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_aliases(node, source)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except InputError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"invalid YAML: {problem}", source=source, line=line) from None
    except RecursionError:   # a shape the pre-check under-counted
        raise InputError("invalid YAML: nested too deeply", source=source) from None
    except (ValueError, OverflowError) as exc:   # constructors: a 5000-digit int, a bad date
        raise InputError(f"invalid YAML value: {str(exc)[:200]}", source=source) from None


def _children(node: yaml.Node) -> list[tuple[str, yaml.Node]]:
    """``(key path step, child)`` of a composed node, keys before values."""
    if isinstance(node, yaml.SequenceNode):
        return [(f"[{i}]", child) for i, child in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        out = []
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            out.append((f".{name}", key))
            out.append((f".{name}", value))
        return out
    return []


def _check_aliases(root: yaml.Node, source: str | None) -> None:
    """Refuse a document whose aliases are too many or expand too far, naming the key path.

    PyYAML builds an alias as a shared reference, so the document itself stays small; it is
    whoever walks it next (validation, a deep copy, a JSON dump) that pays the expansion. The
    expanded size is counted on the composed nodes, each node once (sizes memoized), so a
    9-level bomb is measured in microseconds; a node reached again while still open is a
    recursive alias and refused too.
    """
    size: dict[int, int] = {}
    seen: set[int] = set()
    open_nodes: set[int] = set()
    aliases = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:           # iterative post-order: alias chains can be deeper than the recursion limit
        node, done = stack.pop()
        key = id(node)
        if done:
            open_nodes.discard(key)
            size[key] = min(MAX_EXPANDED_NODES + 1, 1 + sum(size[id(c)] for _, c in _children(node)))
            continue
        if key in seen:
            aliases += 1
            if key in open_nodes:
                raise InputError("invalid YAML: a recursive alias (an anchor used inside itself)", source=source,
                                 line=node.start_mark.line + 1)
            if aliases > MAX_ALIASES:
                raise InputError(f"invalid YAML: more than {MAX_ALIASES} alias uses (*name)", source=source,
                                 line=node.start_mark.line + 1)
            continue
        seen.add(key)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for _, child in reversed(_children(node)))
    if size[id(root)] <= MAX_EXPANDED_NODES:
        return
    path, node = "", root
    while isinstance(node, yaml.MappingNode):   # down to the first key whose value is over the budget
        over = [(step, child) for step, child in _children(node) if size[id(child)] > MAX_EXPANDED_NODES]
        if not over:
            break
        step, node = over[0]
        path += step
    raise InputError(f"aliases expand this document to more than {MAX_EXPANDED_NODES} nodes (an alias bomb?); "
                     "expected a recipe or config written out", source=source, key=path.lstrip(".") or None)
