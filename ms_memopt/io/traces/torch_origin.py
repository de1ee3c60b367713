"""Which allocator wrote a PyTorch-format memory snapshot, and how it was set.

torch_npu writes its snapshots (``torch_npu.npu.memory._snapshot()``) in PyTorch's format, so
the file alone does not say whether PyTorch's CUDA caching allocator or torch_npu's
``NPUCachingAllocator`` recorded it, nor (without ``allocator_settings``, which torch_npu does
not write) whether ``expandable_segments`` was on. The recording says it in other ways, read
here as facts with the evidence behind them; replay turns them into a model:

* **torch_npu**: a frame names the package (a path component ``torch_npu``, e.g.
  ``torch_npu/utils/_module.py``, or the allocator's source ``NPUCachingAllocator.cpp``);
  without frames, the blocks: torch_npu pads every request by 32 bytes before rounding to
  512 (``round_size``), so a small-pool block holding ``requested`` bytes is
  ``round_up(requested + 32, 512)`` where PyTorch's is ``round_up(requested, 512)`` (small-pool
  blocks are always split to the rounded size, so their sizes show the rule; the sizes where
  both rules agree say nothing and are not counted); without live blocks (all freed before the
  dump), the trace: a small request followed by one placed right after it shows its block's size
  as the distance between their addresses;
* **expandable segments**: a segment with ``is_expandable``, ``segment_map`` /
  ``segment_unmap`` entries in the trace (only expandable segments map pages), or
  ``allocator_settings["expandable_segments"]`` (PyTorch's newer files).

Example:
    >>> frames = [{"filename": "/env/site-packages/torch_npu/utils/_module.py", "name": "f", "line": 1}]
    >>> origin = snapshot_origin({"segments": []}, [{"action": "alloc", "frames": frames}])
    >>> origin.framework, origin.framework_evidence
    ('torch_npu', 'a frame names torch_npu (torch_npu/utils/_module.py)')
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from itertools import repeat

__all__ = ["SnapshotOrigin", "snapshot_origin", "NPU_PAD"]

#: torch_npu's ``round_size`` pads each request by this many bytes (``kPadSize``)
NPU_PAD = 32
_BLOCK = 512
_SMALL_SEGMENT = 2 << 20
_PATH_PARTS = re.compile(r"[\\/]")


@dataclass(frozen=True)
class SnapshotOrigin:
    """What recorded a snapshot: ``framework`` is ``"torch_npu"`` or ``"torch"``; ``expandable``
    whether expandable segments were on; each with the evidence, in words."""

    framework: str
    framework_evidence: str
    expandable: bool
    expandable_evidence: str

    def to_meta(self) -> dict:
        return {"framework": self.framework, "framework_evidence": self.framework_evidence,
                "expandable_segments": self.expandable, "expandable_evidence": self.expandable_evidence}


def snapshot_origin(data: dict, trace: list) -> SnapshotOrigin:
    """Read who recorded the snapshot ``data`` (its loaded dict) and ``trace`` (one device's
    trace entries); see the module docstring for the rules."""
    segments = [s for s in data.get("segments", ()) if isinstance(s, dict)]
    framework, framework_evidence = _framework(segments, trace)
    expandable, expandable_evidence = _expandable(data, segments, trace)
    return SnapshotOrigin(framework, framework_evidence, expandable, expandable_evidence)


def _framework(segments: list[dict], trace: list) -> tuple[str, str]:
    named = _npu_frame(segments, trace)
    if named is not None:
        return "torch_npu", f"a frame names torch_npu ({named})"
    # the trace's rule is read only when the blocks' says nothing (a pass over every allocation)
    for rules, what in ((lambda: _block_rules(segments), "small-pool blocks"),
                        (lambda: _trace_rules(trace), "small requests followed by one right after them")):
        padded, plain = rules()
        if padded > plain:
            return "torch_npu", (f"{padded} of {padded + plain} {what} take round_up(requested + 32, 512) bytes "
                                 "(torch_npu's round_size), no frame names a package")
        if plain:
            return "torch", f"{plain} of {padded + plain} {what} take round_up(requested, 512) bytes"
    return "torch", "nothing names torch_npu (no torch_npu frame, no block sizes that tell)"


def _npu_frame(segments: list[dict], trace: list) -> str | None:
    """The first frame file naming torch_npu, from ``torch_npu/`` on; ``None``: none does.
    Frame lists shared through the pickle's memo are looked at once."""
    for frames in _frame_lists(segments, trace):
        for frame in frames:
            name = frame.get("filename") if isinstance(frame, dict) else None
            if not isinstance(name, str):
                continue
            parts = _PATH_PARTS.split(name)
            if "torch_npu" in parts:
                return "/".join(parts[parts.index("torch_npu"):])
            if parts[-1].startswith("NPUCachingAllocator"):
                return parts[-1]
    return None


def _frame_lists(segments: list[dict], trace: list) -> list[list]:
    """Each distinct frame list object (``frames`` of a segment, a block, a trace entry), in the
    order first met. The trace's are gathered at C speed when every entry is a dict (a snapshot
    holds 1.2M entries sharing a few lists); all objects stay alive meanwhile, so ids are distinct."""
    if _all_dicts(trace):
        every = [entry.get("frames") for entry in _with_frames(segments, ())]
        every += map(dict.get, trace, repeat("frames"))
        lists = dict(zip(map(id, every), every))
    else:
        lists = {}
        for entry in _with_frames(segments, trace):
            frames = entry.get("frames")
            lists.setdefault(id(frames), frames)
    return [frames for frames in lists.values() if isinstance(frames, list)]


def _all_dicts(trace: list) -> bool:
    """Every entry a dict (at C speed)."""
    return not set(map(type, trace)) - {dict}


def _with_frames(segments: list[dict], trace: list):
    for segment in segments:
        yield segment
        blocks = segment.get("blocks")
        if isinstance(blocks, list):
            yield from (b for b in blocks if isinstance(b, dict))
    yield from (e for e in trace if isinstance(e, dict))


def _block_rules(segments: list[dict]) -> tuple[int, int]:
    """(blocks only torch_npu's rounding explains, blocks only PyTorch's explains) among the
    live small-pool blocks."""
    padded = plain = 0
    for segment in segments:
        small = segment.get("segment_type") == "small" or (
            "segment_type" not in segment and segment.get("total_size") == _SMALL_SEGMENT)
        blocks = segment.get("blocks")
        if not small or not isinstance(blocks, list):
            continue
        for block in blocks:
            if not isinstance(block, dict) or block.get("state") != "active_allocated":
                continue
            size, requested = block.get("size"), block.get("requested_size")
            if not isinstance(size, int) or not isinstance(requested, int) or requested <= 0:
                continue
            npu, cuda = _round(requested + NPU_PAD), _round(requested)
            if npu != cuda:
                padded += size == npu
                plain += size == cuda
    return padded, plain


def _trace_rules(trace: list) -> tuple[int, int]:
    """(pairs only torch_npu's rounding explains, pairs only PyTorch's explains) among
    consecutive small allocations of one stream whose second lands right after the first."""
    padded = plain = 0
    before = None
    for entry in trace:
        if not isinstance(entry, dict) or entry.get("action") != "alloc":
            continue
        addr, size, stream = entry.get("addr"), entry.get("size"), entry.get("stream")
        if not isinstance(addr, int) or not isinstance(size, int) or size <= 0:
            before = None
            continue
        if before is not None and before[2] == stream and 0 < addr - before[0] <= _SMALL_SEGMENT // 2:
            npu, cuda = _round(before[1] + NPU_PAD), _round(before[1])
            if npu != cuda:
                padded += addr - before[0] == npu
                plain += addr - before[0] == cuda
        before = (addr, size, stream) if size + NPU_PAD <= _SMALL_SEGMENT // 2 else None
    return padded, plain


def _round(size: int) -> int:
    return max(_BLOCK, (size + _BLOCK - 1) // _BLOCK * _BLOCK)


def _expandable(data: dict, segments: list[dict], trace: list) -> tuple[bool, str]:
    flagged = sum(1 for s in segments if s.get("is_expandable") is True)
    if flagged:
        return True, f"{flagged} of {len(segments)} segments are is_expandable"
    try:
        if not _all_dicts(trace):
            raise TypeError
        actions = Counter(map(dict.get, trace, repeat("action")))     # at C speed: 1.2M entries
        maps = sum(count for action, count in actions.items() if action in ("segment_map", "segment_unmap"))
    except TypeError:   # an entry that is not a dict, an action that cannot be hashed
        maps = sum(1 for e in trace if isinstance(e, dict) and e.get("action") in ("segment_map", "segment_unmap"))
    if maps:
        return True, f"the trace maps and unmaps pages ({maps} segment_map/segment_unmap entries)"
    settings = data.get("allocator_settings")
    if isinstance(settings, dict) and settings.get("expandable_segments") is True:
        return True, "allocator_settings: expandable_segments is True"
    if segments:
        return False, f"none of {len(segments)} segments is_expandable, no segment_map entries"
    return False, "no segment_map entries"
