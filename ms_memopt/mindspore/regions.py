"""Tensors that live inside a contiguous region the project formed, and must stay there.

``FusedAdamW`` and pool mode move parameters (and graph-mode optimizer state) into regions with
``combine_tensor_list_contiguous``. Such a region is formed once for the life of the process
(its memory never returns to MindSpore's pool), and its members are views into it. Relocating
one member on its own (live compaction: ``untyped_storage().resize_(0)``, then ``set_data``)
would resize the storage the whole region shares and would pull the member out of the one
place where it cannot fragment. So live compaction leaves pinned tensors where they are.

The registry holds weak references: a tensor nobody else holds drops out.

Example:
    >>> from mindspore import Parameter, Tensor                          # doctest: +SKIP
    >>> p = Parameter(Tensor([1.0]), name="w"); pin(p); is_pinned(p)     # doctest: +SKIP
    True
"""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["pin", "unpin", "is_pinned"]

_PINNED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def pin(*tensors: Any) -> None:
    """Mark ``tensors`` as members of a project-formed region (never relocated one by one)."""
    for tensor in tensors:
        _PINNED[id(tensor)] = tensor


def unpin(*tensors: Any) -> None:
    for tensor in tensors:
        _PINNED.pop(id(tensor), None)


def is_pinned(tensor: Any) -> bool:
    """Whether ``tensor`` lives in a region formed by ``FusedAdamW`` or pool mode."""
    return _PINNED.get(id(tensor)) is tensor
