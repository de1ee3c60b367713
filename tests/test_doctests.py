"""Every docstring example in the package runs (issue 25: they were written but never run)."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ms_memopt

# modules that only run as scripts or need a process of their own
_NOT_IMPORTED = {"ms_memopt.__main__", "ms_memopt.demo"}


def _python_module(finder, name: str) -> bool:
    spec = finder.find_spec(name)
    return spec is not None and str(spec.origin or "").endswith(".py")   # not a compiled library


MODULES = sorted(name for finder, name, _ in pkgutil.walk_packages(ms_memopt.__path__, "ms_memopt.")
                 if name not in _NOT_IMPORTED and ".mindformers_register" not in name
                 and _python_module(finder, name))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
