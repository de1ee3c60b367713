"""Allocator models: faithful re-implementations of real device-memory allocators.

==================  ==========================================================================
``mindspore``        MindSpore's dynamic memory pool (best fit, blocks grown by doubling)
``mindspore-bestfit`` MindSpore's older pool ``DynamicMemPoolBestFit`` (the CPU pool): same
                     rules, equal sizes taken in the order they became idle
``mindspore-vmm``    MindSpore's VMM pool (virtual range, 2 MB physical chunks on demand)
``torch``            PyTorch's CUDA caching allocator
``torch-expandable`` PyTorch with ``expandable_segments:True``
``torch-npu``        torch_npu's NPUCachingAllocator (Ascend): PyTorch's rules, requests padded
                     by 32 B (:mod:`~ms_memopt.allocators.torch_npu`)
``torch-npu-expandable`` torch_npu with ``expandable_segments:True`` (16 KiB-aligned large blocks)
``pool``             ms-memopt pool mode: fixed regions by purpose, activation ring
==================  ==========================================================================

Models with a compiled fast path (:mod:`ms_memopt.allocators.fast`) are created as such when
it is built; ``create(..., fast=False)`` or ``MS_MEMOPT_PURE_PYTHON=1`` gives the pure-Python
reference.

Example:
    >>> model = create("mindspore", capacity=2**30)   # doctest: +SKIP
    >>> addr = model.malloc(4096)                      # doctest: +SKIP
"""
from __future__ import annotations

import importlib
import inspect

from ms_memopt.allocators.base import AllocatorModel, OOMRecord, oom_kind
from ms_memopt.core.errors import InputError

__all__ = ["AllocatorModel", "OOMRecord", "MODELS", "create", "model_class", "oom_kind"]

# name -> (module, class); imported on first use so one model's cost is not every model's
MODELS: dict[str, tuple[str, str]] = {
    "mindspore": ("ms_memopt.allocators.mindspore", "MindSporePool"),
    "mindspore-bestfit": ("ms_memopt.allocators.mindspore", "MindSporeBestFitPool"),
    "mindspore-vmm": ("ms_memopt.allocators.mindspore_vmm", "MindSporeVMMPool"),
    "torch": ("ms_memopt.allocators.torch", "TorchCachingAllocator"),
    "torch-expandable": ("ms_memopt.allocators.torch_expandable", "TorchExpandableAllocator"),
    "torch-npu": ("ms_memopt.allocators.torch_npu", "TorchNpuCachingAllocator"),
    "torch-npu-expandable": ("ms_memopt.allocators.torch_npu", "TorchNpuExpandableAllocator"),
    "pool": ("ms_memopt.allocators.pool", "PoolModeAllocator"),
}


def create(name: str, capacity: int | None = None, *, fast: bool | None = None, **options) -> AllocatorModel:
    """Create the allocator model called ``name`` with a device ``capacity`` in bytes.

    ``fast``: ``None`` (default) takes the compiled fast path when the model has one for these
    options and it is built; ``False`` the pure-Python reference; ``True`` insists on the fast path.

    Raises:
        InputError: unknown model name; an option the model does not take; ``fast=True`` and
            no fast path.
    """
    cls = model_class(name, fast=fast, options=options)
    _check_options(name, options)
    return cls(capacity=capacity, **options)


def _check_options(name: str, options: dict) -> None:
    """An unknown option names the model's own (its reference class's keyword arguments)."""
    module_name, class_name = MODELS[name]
    accepted = [p for p in inspect.signature(getattr(importlib.import_module(module_name), class_name)).parameters
                if p not in ("self", "capacity")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InputError(f"allocator {name!r} takes no option {unknown[0]!r}; its options: "
                         f"{', '.join(accepted) or 'none'}", key="--allocator-option")


def model_class(name: str, *, fast: bool | None = None, options: dict | None = None) -> type[AllocatorModel]:
    """The class :func:`create` instantiates for ``name`` (see its ``fast``)."""
    if name not in MODELS:
        raise InputError(f"unknown allocator {name!r}; expected one of {', '.join(MODELS)}", key="--allocator")
    if fast or fast is None:
        from ms_memopt.allocators.fast import AVAILABLE, FAST_MODELS
        if name in FAST_MODELS and (AVAILABLE or fast) and FAST_MODELS[name].supports(options or {}):
            return FAST_MODELS[name]
        if fast:
            raise InputError(f"allocator {name!r} has no compiled fast path here for these options "
                             f"(built: {', '.join(FAST_MODELS) or 'none'})", key="--allocator")
    module_name, class_name = MODELS[name]
    return getattr(importlib.import_module(module_name), class_name)
