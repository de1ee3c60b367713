"""ms-memopt: sight, first aid and prevention for fragmented device memory in MindSpore training.

The core (this package outside :mod:`ms_memopt.mindspore`) is framework-free: layouts and
metrics, the event model and trace readers, allocator models, replay, the planner, the
estimator and the simulator. :mod:`ms_memopt.mindspore` is the only adapter to MindSpore.
"""
from __future__ import annotations

from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.core.metrics import LayoutMetrics, frag_ratio, measure
from ms_memopt.core.units import format_size, parse_count, parse_size

__version__ = "0.1.0"

__all__ = ["Arena", "Handle", "InputError", "Block", "Layout", "Segment", "LayoutMetrics", "frag_ratio", "measure",
           "format_size", "parse_count", "parse_size", "__version__"]


#: exported lazily: Arena imports numpy (a tenth of a second), loaded when first asked for, not by every command
_EXPORTS = ("Arena", "Handle")


def __getattr__(name: str):
    if name in _EXPORTS:
        from ms_memopt.analysis import arena

        return getattr(arena, name)
    raise AttributeError(f"module 'ms_memopt' has no attribute {name!r}")
