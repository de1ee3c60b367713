"""torch_npu's ``NPUCachingAllocator``: PyTorch's caching allocator as Ascend's port runs it.

torch_npu (``torch_npu/csrc/core/npu/NPUCachingAllocator.cpp``, read at the tags
``v7.2.0-pytorch2.6.0`` and ``v7.3.0-pytorch2.6.0`` of Ascend/pytorch) keeps PyTorch's pools,
best fit, splitting, merging, segment sizes and retries: the rules of
:class:`~ms_memopt.allocators.torch.TorchCachingAllocator` and, with
``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``, of
:class:`~ms_memopt.allocators.torch_expandable.TorchExpandableAllocator`. The models here are
those two with torch_npu's differences, each named by where the source has it:

* every request is padded by 32 bytes before rounding (``round_size``: ``size += kPadSize``
  (32), then ``kMinBlockSize`` (512) multiples): 256 B takes 512 B, 512 B takes 1024 B and
  4096 B takes 4608 B. ``roundup_power2_divisions`` (7.3) rounds the padded size;
* ``page_size:1g`` (``IsMallocPage1GMem``, when the CANN and driver support 1 GB pages): a
  large-pool segment is the request rounded up to 1 GiB (``kExtraLargeBuffer``, in ``malloc``)
  and an expandable large-pool range maps 1 GiB pages (``find_expandable_block``);
* expandable segments only: ``base_addr_aligned_kb`` (default 16, ``kAlignRoundLarge``;
  ``malloc`` after the block is found): a request of 2 MiB or more (``kRoundLarge``) starts on
  the next 16 KiB boundary of its block when the block does not start on one and the rest
  still holds it; the bytes before it stay a free block;
* expandable segments only: ``segment_size_mb`` (7.3, 20-512): the large pool's page
  (``find_expandable_block``), 20 MiB (``kLargeBuffer``) by default; the small pool's is 2 MiB;
* the options' limits are ``CachingAllocatorConfig::parseArgs``'s: ``max_split_size_mb`` > 20,
  ``garbage_collection_threshold`` in (0, 1), ``base_addr_aligned_kb`` 0-16,
  ``segment_size_mb`` 20-512; ``max_split_size_mb`` or ``garbage_collection_threshold`` with
  ``expandable_segments:True`` is refused (so the expandable model takes neither).

What is the same, in the source's words: ``kMinBlockSize`` 512, ``kSmallSize`` 1 MiB,
``kSmallBuffer`` 2 MiB, ``kLargeBuffer`` 20 MiB, ``kMinLargeAlloc`` 10 MiB, ``kRoundLarge``
2 MiB (``get_allocation_size``); ``should_split`` (remainder >= 512 B in the small pool and with
expandable segments, > 1 MiB in the large pool below ``max_split_size``); ``get_free_block``
(best fit by (stream, size, address), the oversize rules, expandable blocks ranked by the size
they can grow to); ``free_block``/``try_merge_blocks``; ``alloc_block`` then
``release_available_cached_blocks`` then ``release_cached_blocks`` and one retry;
``garbage_collect_cached_blocks``; ``release_blocks`` (``empty_cache``: idle unsplit segments
freed, the whole pages of free expandable blocks unmapped, a range left empty released); the
expandable range of 1 1/8 x device memory per (stream, pool).

Not modelled: ``roundup_power2_divisions`` given per size interval (``[256:1,>:4]``; one value
for every size is); ``emptyVirtAddrCache`` keeping unmapped physical pages for reuse
(``free_physical_handles_``: it changes what the device holds, not an address);
``AclrtMallocAlign32``'s own placement (replay takes segment addresses from the recording);
graph pools; HCCL's zero-copy ranges.

Example:
    >>> m = TorchNpuCachingAllocator()
    >>> a = m.malloc(256); b = m.malloc(512)
    >>> b - a, m.malloc(4096) - b           # 256 + 32 takes 512 B; 512 + 32 takes 1024 B
    (512, 1024)
"""
from __future__ import annotations

from ms_memopt.allocators.torch import ROUND_LARGE, TorchCachingAllocator, allocation_size, round_size
from ms_memopt.allocators.torch_expandable import TorchExpandableAllocator, page_size
from ms_memopt.core.errors import InputError

__all__ = ["TorchNpuCachingAllocator", "TorchNpuExpandableAllocator", "PAD", "EXTRA_LARGE_BUFFER",
           "ALIGN_ROUND_LARGE", "npu_round_size", "npu_page_size"]

MiB = 1 << 20
PAD = 32                        # round_size: kPadSize
EXTRA_LARGE_BUFFER = 1 << 30    # kExtraLargeBuffer: page_size:1g segments and pages
ALIGN_ROUND_LARGE = 16 << 10    # kAlignRoundLarge: base_addr_aligned_kb's default and largest value
_SEGMENT_SIZE_MB = (20, 512)    # parseSegmentSizeMb: k20MB, k512MB


def npu_round_size(size: int, divisions: int = 0) -> int:
    """torch_npu's ``round_size``: ``size + 32`` rounded as PyTorch rounds (bytes).

    Example:
        >>> npu_round_size(1), npu_round_size(480), npu_round_size(481), npu_round_size(37632)
        (512, 512, 1024, 37888)
    """
    return round_size(size + PAD, divisions)


def npu_page_size(small: bool, large_page: int | None) -> int:
    """torch_npu's expandable page (``find_expandable_block``): PyTorch's, or ``large_page``
    (``segment_size_mb``, ``page_size:1g``) in the large pool (bytes)."""
    return page_size(small) if small or large_page is None else large_page


def _check_bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"must be true or false, got {value!r}", key=key)
    return value


class TorchNpuCachingAllocator(TorchCachingAllocator):
    """torch_npu's caching allocator (default settings); see the module docstring.

    Args:
        capacity: device memory in bytes (``None``: unbounded).
        max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold: as
            ``PYTORCH_NPU_ALLOC_CONF`` sets them (see :class:`TorchCachingAllocator`).
        page_size_1g: ``page_size:1g``: large-pool segments in whole GiB.
    """

    name = "torch-npu"
    pad = PAD

    def __init__(self, capacity: int | None = None, max_split_size_mb: int | None = None,
                 roundup_power2_divisions: int | None = None,
                 garbage_collection_threshold: float | None = None, page_size_1g: bool = False) -> None:
        self.page_size_1g = _check_bool(page_size_1g, "page_size_1g")
        super().__init__(capacity, max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold)

    def _segment_size(self, rsize: int, small: bool) -> int:
        # malloc: IsMallocPage1GMem(pool.is_small) ? kExtraLargeBuffer * ceil(size / 1 GiB) : get_allocation_size
        if self.page_size_1g and not small:
            return (rsize + EXTRA_LARGE_BUFFER - 1) // EXTRA_LARGE_BUFFER * EXTRA_LARGE_BUFFER
        return allocation_size(rsize)


class TorchNpuExpandableAllocator(TorchExpandableAllocator):
    """torch_npu's caching allocator with ``expandable_segments:True``; see the module docstring.

    Args:
        capacity: device memory in bytes (``None``: unbounded); bounds the mapped bytes.
        roundup_power2_divisions: as for ``torch-npu``.
        base_addr_aligned_kb: ``base_addr_aligned_kb:K`` (0-16; 0 turns the alignment off).
        segment_size_mb: ``segment_size_mb:N`` (20-512): the large pool's page; ``None``: 20 MiB.
        page_size_1g: ``page_size:1g``: 1 GiB pages in the large pool.

    Example:
        >>> m = TorchNpuExpandableAllocator()
        >>> a = m.malloc(1536 * 1024)             # 1.5 MiB: large pool, at the range's start
        >>> (m.malloc(4 * MiB) - a) % (16 << 10)  # the next 2 MiB+ request starts 16 KiB-aligned
        0
    """

    name = "torch-npu-expandable"
    pad = PAD

    def __init__(self, capacity: int | None = None, roundup_power2_divisions: int | None = None,
                 base_addr_aligned_kb: int = ALIGN_ROUND_LARGE >> 10, segment_size_mb: int | None = None,
                 page_size_1g: bool = False) -> None:
        kb = base_addr_aligned_kb
        if isinstance(kb, bool) or not isinstance(kb, int) or not 0 <= kb <= ALIGN_ROUND_LARGE >> 10:
            raise InputError(f"must be an integer from 0 to {ALIGN_ROUND_LARGE >> 10} (KiB), got {kb!r}",
                             key="base_addr_aligned_kb")
        low, high = _SEGMENT_SIZE_MB
        mb = segment_size_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or not low <= mb <= high):
            raise InputError(f"must be an integer from {low} to {high} (MiB), got {mb!r}", key="segment_size_mb")
        self.align = kb << 10
        self.large_page = EXTRA_LARGE_BUFFER if _check_bool(page_size_1g, "page_size_1g") else \
            (mb * MiB if mb is not None else None)
        self.page_size_1g = page_size_1g
        self.segment_size_mb = segment_size_mb
        super().__init__(capacity, roundup_power2_divisions)

    def _page_size(self, small: bool) -> int:
        # find_expandable_block: kSmallBuffer | segment_size_mb | kLargeBuffer; 1 GiB with page_size:1g
        return npu_page_size(small, self.large_page)

    def _place(self, addr: int, rsize: int) -> int:
        """malloc's ``base_addr_aligned_size`` step: a request of ``kRoundLarge`` (2 MiB) or more
        starts on the next ``align`` boundary of its block if it still fits there; the bytes
        before it become a free block (not merged: its neighbour before is not free)."""
        align = self.align
        if rsize < ROUND_LARGE or not align or addr % align == 0:
            return addr
        offset = align - addr % align          # (ptr + align) - (ptr % align) - ptr
        if offset + rsize > self.block_size(addr):
            return addr
        return self._split_front(addr, offset)
