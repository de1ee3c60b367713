"""An import-only stand-in for ``hyper_parallel``, written for ms-memopt's tests.

Why it exists: mindformers 2.0.0 (the release for MindSpore 2.10) lists ``hyper-parallel~=1.0.0``
as a requirement, but that package is not on PyPI, so mindformers is installed with
``pip install --no-deps`` (see the Makefile). ``import mindformers`` still imports its new
PyNative stack (``mindformers.pynative``), whose modules import names from ``hyper_parallel``
at module level. The classic path ms-memopt is used with — ``mindformers.Trainer`` and
``run_mindformer.py`` in graph or PyNative mode — never calls them.

What it is: exactly the module-level names mindformers 2.0.0 imports (``_NAMES`` below, read
from its source): classes as inert placeholders (mindformers builds tables like
``{"weight": (Replicate(),)}`` at import), functions as placeholders that raise when called.
Modules mindformers imports inside ``try/except ImportError`` (``distributed_checkpoint``,
``custom_ops``) are deliberately absent, so mindformers sees them missing and takes its
fallbacks. Nothing here computes anything; a code path that needs the real package fails
with :class:`NotImplementedError` naming the function.

Put the folder holding this package (``tests/mindformers_support``) on ``sys.path`` only when
the real package is absent (``tests/conftest.py`` does; ``ms_memopt`` itself never imports it).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# module -> names mindformers 2.0.0 imports from it at module level
_NAMES: dict[str, tuple[str, ...]] = {
    "hyper_parallel": ("DFunction", "DTensor", "DeviceMesh", "PipelineStage", "SkipDTensorDispatch",
                       "init_device_mesh", "shard_module"),
    "hyper_parallel.core.activation_checkpoint": ("CheckpointPolicy", "SwapManager", "checkpoint_wrapper",
                                                  "swap_wrapper"),
    "hyper_parallel.core.context_parallel.async_context_parallel": ("AsyncContextParallel",),
    "hyper_parallel.core.context_parallel.context_parallel": ("ContextParallel",),
    "hyper_parallel.core.dtensor.dtensor": ("DTensor", "distribute_tensor"),
    "hyper_parallel.core.dtensor.layout": ("_infer_slice_area_by_rank",),
    "hyper_parallel.core.dtensor.placement_types": ("Placement", "Replicate", "Shard"),
    "hyper_parallel.core.dtensor.redistribute_infer": ("RedistributionOperatorInfer",),
    "hyper_parallel.core.fully_shard.api": ("HSDPModule", "MixedPrecisionPolicy", "fully_shard"),
    "hyper_parallel.core.fully_shard.utils": ("CPUOffloadPolicy", "OffloadPolicy"),
    "hyper_parallel.core.pipeline_parallel.hook_coordinator": ("HookCoordinator",),
    "hyper_parallel.core.shard.sharding_plan": ("ShardingPlan",),
    "hyper_parallel.platform": ("get_platform",),
    "hyper_parallel.platform.mindspore.autograd_compat": ("enable_mindspore_backward_compat",),
}
# every prefix of a listed module is a package
_PACKAGES = {name.rsplit(".", i)[0] for name in _NAMES for i in range(name.count(".") + 1)}


class _Unavailable:
    """A class of the real hyper_parallel: importable, subclassable, instantiable (mindformers
    builds placement tables such as ``Replicate()`` at module level), with no behaviour."""

    def __init__(self, *args, **kwargs) -> None:
        pass


def _unavailable_function(module: str, name: str):
    def function(*args, **kwargs):
        raise NotImplementedError(f"{module}.{name} is an import-only stand-in "
                                  "(tests/mindformers_support); this code path needs the real package")
    function.__name__ = function.__qualname__ = name
    function.__module__ = module
    return function


class _UnavailablePlatform:
    """What ``get_platform()`` returns: mindformers calls it at module level (``muon.py``,
    ``ep_overlap.py``) and uses the result only inside the new PyNative stack."""

    def __getattr__(self, name: str):
        raise NotImplementedError(f"hyper_parallel platform.{name}: import-only stand-in "
                                  "(tests/mindformers_support); this code path needs the real package")


def get_platform() -> _UnavailablePlatform:
    return _UnavailablePlatform()


def _placeholder(module: str, name: str):
    if name == "get_platform":
        return get_platform
    if name.lstrip("_")[:1].islower():
        return _unavailable_function(module, name)
    return type(name, (_Unavailable,), {"__module__": module})


def _fill(module: types.ModuleType) -> None:
    for name in _NAMES.get(module.__name__, ()):
        setattr(module, name, _placeholder(module.__name__, name))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _PACKAGES and fullname != __name__:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__path__ = []
        _fill(module)


_fill(sys.modules[__name__])
sys.meta_path.append(_Finder())
