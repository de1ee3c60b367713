"""The pool-mode memory plan: device memory cut into regions by purpose, fixed at start-up.

A :class:`PoolPlan` is what pool mode reserves before the first step: one contiguous range
per purpose (parameters by dtype, gradients, optimizer state, activations, communication
buffers, workspace), laid out back to back in a fixed order, each region starting on an
``alignment`` boundary. Because the regions never move and nothing else is allocated
between them, the free space inside the reservation cannot be cut up by interleaved
lifetimes, which is the fragmentation pool mode exists to prevent.

The same object is used by the MindSpore side (``ms_memopt.mindspore.enable_pool_mode``
returns one) and by the simulator's ``pool`` policy, so it is framework-free: sizes in bytes,
offsets in bytes from the start of the reservation.

Region names are ``purpose`` or ``purpose.detail`` (``parameters.float16``, ``optimizer.m``);
the purpose decides the place in the layout, regions of one purpose keep the order given.

Example:
    >>> plan = PoolPlan.build({"parameters.float16": 1000, "gradients": 2000,
    ...                        "optimizer": 6000, "activations": 4096}, alignment=512,
    ...                       rings=("activations",))
    >>> [(r.name, r.offset, r.size) for r in plan.regions]
    [('parameters.float16', 0, 1000), ('gradients', 1024, 2000), ('optimizer', 3072, 6000), ('activations', 9216, 4096)]
    >>> plan.total, plan.region("activations").ring
    (13312, True)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from ms_memopt.core.errors import InputError

__all__ = ["PURPOSES", "Region", "PoolPlan", "share_capacity"]

#: Purposes in layout order. Long-lived, fixed-size regions come first so that the ones whose
#: size may be tuned later (activations, communication, workspace) sit at the high end.
PURPOSES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations",
                             "communication", "workspace")


@dataclass(frozen=True)
class Region:
    """One contiguous range of the pool.

    Args:
        name: unique name, ``purpose`` or ``purpose.detail`` (e.g. ``parameters.bfloat16``).
        offset: start, in bytes from the start of the reservation (a multiple of the alignment).
        size: bytes the region holds (not rounded; the gap to the next region is padding).
        purpose: one of :data:`PURPOSES`.
        dtype: element type stored there, when the region holds one type (``"float16"``).
        ring: the region is reused as a ring (activations freed in FIFO order each step).
    """

    name: str
    offset: int
    size: int
    purpose: str
    dtype: str | None = None
    ring: bool = False

    @property
    def end(self) -> int:
        """One past the last byte of the region."""
        return self.offset + self.size


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _purpose_of(name: str) -> str:
    return name.split(".", 1)[0]


@dataclass(frozen=True)
class PoolPlan:
    """Regions of one reservation, in address order.

    Args:
        regions: the regions, sorted by offset, non-overlapping.
        alignment: every region offset is a multiple of it (MindSpore aligns to 512 B).
        total: bytes to reserve: the aligned end of the last region.
    """

    regions: tuple[Region, ...]
    alignment: int = 512
    total: int = 0
    notes: Mapping[str, object] = field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, sizes: Mapping[str, int], alignment: int = 512, *,
              dtypes: Mapping[str, str] | None = None, rings: Iterable[str] = (),
              notes: Mapping[str, object] | None = None) -> "PoolPlan":
        """Lay regions out back to back in purpose order (see :data:`PURPOSES`).

        Args:
            sizes: bytes per region name; zero-size regions are kept (offset still defined).
            alignment: region start alignment in bytes (positive).
            dtypes: element type per region name; for ``purpose.<dtype>`` names without an
                entry here the suffix is taken as the dtype of parameter regions.
            rings: names of regions reused as rings.
            notes: free-form facts kept with the plan (e.g. the checkpoint interval).

        Raises:
            InputError: unknown purpose, negative or non-integer size, bad alignment, a ring
                name that is not a region.

        Example:
            >>> PoolPlan.build({"workspace": 10, "parameters.float32": 4}, alignment=8).to_dict()["regions"][1]["offset"]
            8
        """
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise InputError(f"alignment must be a positive integer number of bytes, got {alignment!r}",
                             key="alignment")
        dtypes = dict(dtypes or {})
        rings = set(rings)
        unknown_rings = rings - set(sizes)
        if unknown_rings:
            raise InputError(f"ring regions {sorted(unknown_rings)} are not among the region names "
                             f"{sorted(sizes)}", key="rings")
        for name, size in sizes.items():
            purpose = _purpose_of(name)
            if purpose not in PURPOSES:
                raise InputError(f"region {name!r} has unknown purpose {purpose!r}; expected one of "
                                 f"{', '.join(PURPOSES)} (optionally followed by '.detail')",
                                 key=f"sizes.{name}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InputError(f"region size must be a non-negative integer of bytes, got {size!r}",
                                 key=f"sizes.{name}")
        # Stable sort: regions of one purpose keep the caller's order.
        ordered = sorted(sizes, key=lambda n: PURPOSES.index(_purpose_of(n)))
        regions = []
        cursor = 0
        for name in ordered:
            purpose = _purpose_of(name)
            dtype = dtypes.get(name)
            if dtype is None and purpose == "parameters" and "." in name:
                dtype = name.split(".", 1)[1]
            offset = _align_up(cursor, alignment)
            regions.append(Region(name, offset, int(sizes[name]), purpose, dtype, name in rings))
            cursor = offset + int(sizes[name])
        return cls(tuple(regions), alignment, _align_up(cursor, alignment), dict(notes or {}))

    def region(self, name: str) -> Region:
        """The region called ``name``; ``KeyError`` naming the known regions otherwise."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r}; regions are {[r.name for r in self.regions]}")

    def by_purpose(self, purpose: str) -> tuple[Region, ...]:
        """All regions of one purpose, in address order."""
        return tuple(r for r in self.regions if r.purpose == purpose)

    def size_of(self, purpose: str) -> int:
        """Bytes held by all regions of one purpose (padding excluded)."""
        return sum(r.size for r in self.by_purpose(purpose))

    def to_dict(self) -> dict:
        """Plain JSON-ready form: ``{"alignment", "total", "regions": [...], "notes"}``."""
        return {"alignment": self.alignment, "total": self.total,
                "regions": [asdict(r) for r in self.regions], "notes": dict(self.notes)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "PoolPlan":
        """Inverse of :meth:`to_dict` (offsets are taken as given, then checked)."""
        try:
            regions = tuple(Region(**r) for r in data["regions"])
            plan = cls(regions, int(data["alignment"]), int(data["total"]), dict(data.get("notes", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"not a pool plan: {exc}") from None
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ``InputError`` when regions overlap, are misaligned or exceed ``total``."""
        cursor = 0
        for r in sorted(self.regions, key=lambda r: r.offset):
            if r.offset % self.alignment:
                raise InputError(f"region {r.name!r} offset {r.offset} is not a multiple of "
                                 f"{self.alignment}", key=f"regions.{r.name}.offset")
            if r.offset < cursor:
                raise InputError(f"region {r.name!r} at {r.offset} overlaps the previous region "
                                 f"ending at {cursor}", key=f"regions.{r.name}.offset")
            cursor = r.end
        if cursor > self.total:
            raise InputError(f"regions end at {cursor}, beyond total {self.total}", key="total")


def share_capacity(needs: Mapping[str, int], capacity: int | None, *, fixed: Iterable[str] = ("parameters", "optimizer"),
                   alignment: int = 512) -> dict[str, int]:
    """Region sizes from each region's need (bytes): a ``fixed`` region (never freed) gets its
    need; what ``capacity`` leaves after every need is shared among
    the others in proportion to their needs, or, short of the needs, what the fixed ones leave
    is (the pool then fails where a region runs out). Without a capacity the others get twice
    their need. Every size is a multiple of ``alignment``.

    Example:
        >>> share_capacity({"parameters": 1000, "activations": 3000, "workspace": 1000}, 10240)
        {'parameters': 1024, 'activations': 6656, 'workspace': 2560}
    """
    fixed = set(fixed)
    sizes = {name: max(alignment, _align_up(n, alignment)) for name, n in needs.items()}
    varying = [name for name in sizes if name not in fixed]
    if not varying:
        return sizes
    if capacity is None:
        return {name: 2 * size if name in varying else size for name, size in sizes.items()}
    spare = capacity - sum(sizes.values())
    weight = sum(sizes[name] for name in varying)
    room = capacity - sum(size for name, size in sizes.items() if name in fixed)
    for name in varying:
        share = sizes[name] + spare * sizes[name] // weight if spare > 0 else room * sizes[name] // weight
        sizes[name] = max(alignment, share // alignment * alignment)
    leftover = capacity - sum(sizes.values())       # what rounding down left: the last region's
    if leftover >= alignment:
        sizes[varying[-1]] += leftover // alignment * alignment
    return sizes
