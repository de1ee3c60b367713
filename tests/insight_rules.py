"""The rules MindStudio Insight's snapshot converter (MemSnapDump, ``tools/dump2db.py`` in the
Ascend-msinsight repository) applies to a memory snapshot, restated as a check (written from its
documented behaviour, none of its code): the converter starts from the final segments and their
active blocks and undoes the trace from its newest entry to its oldest, rebuilding the pool as
torch_npu's allocator held it.

* undoing ``alloc``: an active block starts at the entry's address, in a segment of the entry's
  stream, at least as large as the entry's size; it goes;
* undoing ``free_completed`` (or ``free``): the block comes back at the entry's address with the
  size torch_npu's allocator gave the request (the entry's size plus 32 B, rounded up to 512 B),
  inside one segment of the entry's stream and over no other block; ``free_requested``: that
  block is pending;
* undoing ``segment_alloc``: a segment of exactly that address and size, with no active block, goes;
  ``segment_free``: it comes back;
* undoing ``segment_map``: the range lies inside one segment and holds no block; it is cut out;
  ``segment_unmap``: the range comes back (joining its neighbours).

:func:`violations` returns the broken rules, the newest first (empty: the converter accepts it).
"""
from __future__ import annotations

import bisect


def npu_block(size: int) -> int:
    """The block torch_npu's allocator gives a request of ``size`` bytes (what the converter rebuilds)."""
    return -(-(size + 32) // 512) * 512


class _Pool:
    def __init__(self, snapshot: dict, device: int) -> None:
        self.segs: list[list] = []          # [addr, end, stream, blocks]; blocks: sorted [addr, end, state]
        for seg in snapshot["segments"]:
            if seg.get("device", 0) != device:
                continue
            blocks = sorted([b["address"], b["address"] + b["size"], b["state"]] for b in seg["blocks"]
                            if b["state"] != "inactive")
            self.segs.append([seg["address"], seg["address"] + seg["total_size"], seg["stream"], blocks])
        self.segs.sort(key=lambda s: (s[0], s[2]))

    def seg_at(self, addr: int, stream: int):
        starts = [s[0] for s in self.segs]
        i = bisect.bisect_right(starts, addr) - 1
        while i >= 0 and self.segs[i][0] <= addr:
            s = self.segs[i]
            if addr < s[1] and s[2] == stream:
                return s
            i -= 1
        return None

    def add_segment(self, addr: int, size: int, stream: int, merge: bool) -> str | None:
        end = addr + size
        if any(s[0] < end and addr < s[1] and s[2] == stream for s in self.segs):
            return "the segment overlaps a segment"
        new = [addr, end, stream, []]
        if merge:
            for s in [s for s in self.segs if s[2] == stream and (s[1] == addr or s[0] == end)]:
                self.segs.remove(s)
                new = [min(new[0], s[0]), max(new[1], s[1]), stream, sorted(new[3] + s[3])]
        self.segs.append(new)
        self.segs.sort(key=lambda s: (s[0], s[2]))
        return None


def violations(snapshot: dict, device: int = 0, limit: int = 5) -> list[str]:
    """The converter's rules ``snapshot`` breaks (at most ``limit``), newest entry first."""
    pool = _Pool(snapshot, device)
    trace = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    out: list[str] = []
    for index in range(len(trace) - 1, -1, -1):
        e = trace[index]
        action, addr, size, stream = e["action"], e.get("addr", 0), e.get("size", 0), e.get("stream", 0)
        problem = None
        seg = pool.seg_at(addr, stream) if action not in ("segment_free", "segment_unmap") else None
        if action in ("alloc", "free_completed", "free", "free_requested", "segment_alloc", "segment_map") and seg is None:
            problem = "no segment holds the address"
        elif action == "alloc":
            starts = [b[0] for b in seg[3]]
            i = bisect.bisect_left(starts, addr)
            if i == len(starts) or starts[i] != addr:
                problem = "no active block at the address"
            elif seg[3][i][1] - addr < size:
                problem = "the block is smaller than the entry's size"
            else:
                del seg[3][i]
        elif action in ("free_completed", "free"):
            end = addr + npu_block(size)
            starts = [b[0] for b in seg[3]]
            i = bisect.bisect_right(starts, addr)
            if end > seg[1]:
                problem = "the rebuilt block runs past its segment"
            elif (i > 0 and seg[3][i - 1][1] > addr) or (i < len(starts) and starts[i] < end):
                problem = "the rebuilt block overlaps an active block"
            else:
                seg[3].insert(i, [addr, end, "pending" if action == "free_completed" else "active"])
        elif action == "free_requested":
            starts = [b[0] for b in seg[3]]
            i = bisect.bisect_left(starts, addr)
            if i == len(starts) or starts[i] != addr or seg[3][i][2] != "pending":
                problem = "no pending block at the address"
            else:
                seg[3][i][2] = "active"
        elif action == "segment_alloc":
            if seg[0] != addr or seg[1] != addr + size:
                problem = "no segment of that address and size"
            elif seg[3]:
                problem = "the segment still holds active blocks"
            else:
                pool.segs.remove(seg)
        elif action == "segment_map":
            end = addr + size
            if end > seg[1]:
                problem = "the mapped range runs past its segment"
            elif any(b[0] < end and addr < b[1] for b in seg[3]):
                problem = "the mapped range holds a block"
            else:
                pool.segs.remove(seg)
                for lo, hi in ((seg[0], addr), (end, seg[1])):
                    if lo < hi:
                        pool.segs.append([lo, hi, stream, [b for b in seg[3] if lo <= b[0] < hi]])
                pool.segs.sort(key=lambda s: (s[0], s[2]))
        elif action in ("segment_free", "segment_unmap"):
            problem = pool.add_segment(addr, size, stream, merge=action == "segment_unmap")
        if problem is not None:
            out.append(f"entry {index} ({action} at {addr:#x}, {size} B): {problem}")
            if len(out) >= limit:
                break
    return out
