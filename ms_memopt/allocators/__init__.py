"""Allocator models: faithful re-implementations of real device-memory allocators.

==================  ==========================================================================
``mindspore``        MindSpore's dynamic memory pool (best fit, blocks grown by doubling)
``mindspore-bestfit`` MindSpore's older pool ``DynamicMemPoolBestFit`` (the CPU pool): same
                     rules, equal sizes taken in the order they became idle
``mindspore-vmm``    MindSpore's VMM pool (virtual range, 2 MB physical chunks on demand)
``torch``            PyTorch's CUDA caching allocator (torch_npu's NPUCachingAllocator)
``torch-expandable`` PyTorch with ``expandable_segments:True``
``pool``             ms-memopt pool mode: fixed regions by purpose, activation ring
==================  ==========================================================================

Example:
    >>> model = create("mindspore", capacity=2**30)   # doctest: +SKIP
    >>> addr = model.malloc(4096)                      # doctest: +SKIP
"""
from __future__ import annotations

import importlib

from ..errors import InputError
from .base import AllocatorModel, OOMRecord

__all__ = ["AllocatorModel", "OOMRecord", "MODELS", "create"]

# name -> (module, class); imported on first use so one model's cost is not every model's
MODELS: dict[str, tuple[str, str]] = {
    "mindspore": ("ms_memopt.allocators.mindspore", "MindSporePool"),
    "mindspore-bestfit": ("ms_memopt.allocators.mindspore", "MindSporeBestFitPool"),
    "mindspore-vmm": ("ms_memopt.allocators.mindspore_vmm", "MindSporeVMMPool"),
    "torch": ("ms_memopt.allocators.torch", "TorchCachingAllocator"),
    "torch-expandable": ("ms_memopt.allocators.torch_expandable", "TorchExpandableAllocator"),
    "pool": ("ms_memopt.allocators.pool", "PoolModeAllocator"),
}


def create(name: str, capacity: int | None = None, **options) -> AllocatorModel:
    """Create the allocator model called ``name`` with a device ``capacity`` in bytes.

    Raises:
        InputError: unknown model name.
    """
    if name not in MODELS:
        raise InputError(f"unknown allocator {name!r}; expected one of {', '.join(MODELS)}", key="--allocator")
    module_name, class_name = MODELS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(capacity=capacity, **options)
