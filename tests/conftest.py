"""Suite-wide settings.

Hypothesis' default 200 ms deadline per example fails a property when a busy neighbour
process slows this one down; no test of ours may depend on the machine's speed, so the
deadline is off for every property (explicit ``@settings`` inherit this profile).
"""
import importlib.util
import sys
from pathlib import Path

from hypothesis import settings

# mindformers 2.0.0 imports hyper_parallel, which is not on PyPI: when it is absent the tests use
# the import-only stand-in in tests/mindformers_support (see its docstring and docs/mindformers.md)
if importlib.util.find_spec("hyper_parallel") is None:
    sys.path.append(str(Path(__file__).parent / "mindformers_support"))

settings.register_profile("ms_memopt", deadline=None)
settings.load_profile("ms_memopt")
