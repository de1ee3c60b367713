"""Old module paths of the flat layout, kept importable with a deprecation warning.

Until 0.2 the package was flat (``ms_memopt.recipe``, ``ms_memopt.replay``, ...). Its modules now
live in layers (``core``, ``io``, ``config``, ``engine``, ``analysis``, ``report``; see
docs/architecture.md). Importing an old path still works: it warns with a
:class:`DeprecationWarning` that names the new path, and gives the very same module object,
so ``isinstance`` checks and monkeypatching see one module, not a copy.

Example:
    >>> import ms_memopt.recipe as old          # doctest: +SKIP
    DeprecationWarning: ms_memopt.recipe moved to ms_memopt.config.recipe; import it from there ...
    >>> import ms_memopt.config.recipe as new
    >>> new_name("ms_memopt.recipe") == new.__name__
    True
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

#: old dotted path -> new dotted path (a moved package covers its submodules)
MOVED: dict[str, str] = {
    "ms_memopt.units": "ms_memopt.core.units",
    "ms_memopt.errors": "ms_memopt.core.errors",
    "ms_memopt.layout": "ms_memopt.core.layout",
    "ms_memopt.metrics": "ms_memopt.core.metrics",
    "ms_memopt.events": "ms_memopt.core.events",
    "ms_memopt.poolplan": "ms_memopt.core.poolplan",
    "ms_memopt.jsontext": "ms_memopt.core.jsontext",
    "ms_memopt.yamltext": "ms_memopt.io.yamltext",
    "ms_memopt.traces": "ms_memopt.io.traces",
    "ms_memopt.recipe": "ms_memopt.config.recipe",
    "ms_memopt.mfconfig": "ms_memopt.config.mfconfig",
    "ms_memopt.replay": "ms_memopt.engine.replay",
    "ms_memopt.whatif": "ms_memopt.engine.whatif",
    "ms_memopt.simulate": "ms_memopt.engine.simulate",
    "ms_memopt.workload": "ms_memopt.engine.workload",
    "ms_memopt.job": "ms_memopt.engine.job",
    "ms_memopt.sweep": "ms_memopt.engine.sweep",
    "ms_memopt.executors": "ms_memopt.engine.executors",
    "ms_memopt.template": "ms_memopt.engine.template",
    "ms_memopt.timing": "ms_memopt.engine.timing",
    "ms_memopt.estimate": "ms_memopt.analysis.estimate",
    "ms_memopt.forecast": "ms_memopt.analysis.forecast",
    "ms_memopt.scan": "ms_memopt.analysis.scan",
    "ms_memopt.planner": "ms_memopt.analysis.planner",
    "ms_memopt.compaction": "ms_memopt.analysis.compaction",
    "ms_memopt.arena": "ms_memopt.analysis.arena",
    "ms_memopt.doctor": "ms_memopt.engine.doctor",
    "ms_memopt.report_merge": "ms_memopt.report.merge",
    "ms_memopt.plots": "ms_memopt.report.plots",
    "ms_memopt.memory_map": "ms_memopt.report.memory_map",
    "ms_memopt.poolcapture": "ms_memopt.mindspore.poolcapture",
}


def new_name(old: str) -> str | None:
    """Where the module ``old`` lives now, or None when it did not move.

    >>> new_name("ms_memopt.traces.ms_pool_log"), new_name("ms_memopt.cli")
    ('ms_memopt.io.traces.ms_pool_log', None)
    """
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        is_package = importlib.util.find_spec(target_name).submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        target_name = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {target_name}; import it from there (the old path goes in 0.2)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(target_name)

    def exec_module(self, module):
        # the module is the one at the new path, already executed; keep its own __spec__ and __name__
        pass


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finders: an old file left behind must not win
