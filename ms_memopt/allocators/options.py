"""``--allocator-option KEY=VALUE``: each model option parsed as what it is.

One table, :data:`OPTION_TYPES`, says what every option of every model takes: a size
(``512MiB``, plain bytes), a boolean, an integer, a fraction, or one of a few names. The
command line of ``replay``, ``simulate`` and ``doctor`` reads options through
:func:`parse_allocator_options`, so ``grow=add`` is a name, ``pregrow=true`` a boolean and
``increase_size=2GB`` a size; a bad value is an :class:`~ms_memopt.core.errors.InputError` naming
the option and what it allows (exit 2).

Example:
    >>> parse_allocator_options("mindspore", ["grow=add", "increase_size=2GiB", "pregrow=true"])
    {'grow': 'add', 'increase_size': 2147483648, 'pregrow': True}
    >>> parse_allocator_options("torch", ["max_split_size_mb=128"])
    {'max_split_size_mb': 128}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ms_memopt.core.errors import InputError
from ms_memopt.core.units import parse_size

__all__ = ["OptionType", "OPTION_TYPES", "parse_allocator_options"]

_KEY = "--allocator-option"


@dataclass(frozen=True)
class OptionType:
    """What one option takes: ``kind`` is ``size``, ``bool``, ``int``, ``fraction`` or
    ``choice`` (then ``choices`` lists the names)."""

    kind: str
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        return {"size": "a size (e.g. 512MiB, 2GB, plain bytes)", "bool": "true or false",
                "int": "an integer", "fraction": "a number in (0, 1)"}.get(
            self.kind, "one of " + ", ".join(self.choices))

    def accepts(self, value) -> bool:
        """True when ``value``, as a recording stores it (JSON or a pickle: an int, a bool, a
        float, a name), is of this type: what a recording's options are checked with before use."""
        if self.kind == "bool":
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.kind == "size":
            return isinstance(value, int) and 0 <= value < 1 << 63
        if self.kind == "int":
            return isinstance(value, int) and -(1 << 63) <= value < 1 << 63
        if self.kind == "fraction":
            return isinstance(value, (int, float)) and 0.0 < value < 1.0
        return isinstance(value, str) and value in self.choices

    def parse(self, name: str, text: str):
        value = text.strip()
        if self.kind == "size":
            return parse_size(value, key=f"{_KEY} {name}")
        if self.kind == "bool":
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        elif self.kind == "int":
            try:
                return int(value)
            except ValueError:
                pass
        elif self.kind == "fraction":
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if 0.0 < number < 1.0:
                return number
        elif value in self.choices:
            return value
        raise InputError(f"option {name!r} expects {self.describe()}, got {value!r}", key=_KEY)


_SIZE, _BOOL, _INT, _FRACTION = OptionType("size"), OptionType("bool"), OptionType("int"), OptionType("fraction")
_MINDSPORE = {"increase_size": _SIZE, "init_size": _SIZE, "pregrow": _BOOL, "small_pool": _BOOL,
              "grow": OptionType("choice", ("double", "add")), "tie": OptionType("choice", ("address", "idle_order"))}
_TORCH = {"max_split_size_mb": _INT, "roundup_power2_divisions": _INT, "garbage_collection_threshold": _FRACTION}

#: every model's options and their types (a model missing here takes none)
OPTION_TYPES: dict[str, dict[str, OptionType]] = {
    "mindspore": _MINDSPORE,
    "mindspore-bestfit": _MINDSPORE,
    "mindspore-vmm": {},
    "torch": _TORCH,
    "torch-expandable": {"roundup_power2_divisions": _INT},
    # torch_npu's PYTORCH_NPU_ALLOC_CONF (CachingAllocatorConfig::parseArgs); page_size:1g is page_size_1g=true
    "torch-npu": {**_TORCH, "page_size_1g": _BOOL},
    "torch-npu-expandable": {"roundup_power2_divisions": _INT, "base_addr_aligned_kb": _INT,
                             "segment_size_mb": _INT, "page_size_1g": _BOOL},
    "pool": {"chunked": _BOOL},
}


def parse_allocator_options(allocator: str, items: Iterable[str]) -> dict:
    """``KEY=VALUE`` strings as the keyword arguments of model ``allocator``.

    Raises:
        InputError: not ``KEY=VALUE``, an option the model does not take (the message lists
            the ones it does), or a value of the wrong type (the message says what it expects).
    """
    types = OPTION_TYPES.get(allocator, {})
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"expected KEY=VALUE, got {item!r}", key=_KEY)
        if key not in types:
            known = ", ".join(f"{k} ({t.describe()})" for k, t in types.items()) or "none"
            raise InputError(f"allocator {allocator!r} takes no option {key!r}; its options: {known}", key=_KEY)
        out[key] = types[key].parse(key, value)
    return out
