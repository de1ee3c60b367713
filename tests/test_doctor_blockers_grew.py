"""Blockers at a fragmentation verdict where the pool grew instead of failing (no capacity given).

The free memory lies in segments that never merge, so no window of one segment holds the
request; the blockers are then the live blocks pinning the segment whose release would have made
room on a card with nothing beyond what was reserved.
"""
from __future__ import annotations

from ms_memopt.core.events import Event, Trace
from ms_memopt.doctor.diagnose import diagnose

MiB = 2**20


def _two_cut_segments() -> Trace:
    events = []
    for base, (a, b) in ((100, (1, 2)), (200, (3, 4))):
        events += [Event("alloc", id=base, size=60 * MiB), Event("free", id=base)]     # a 60 MiB segment, cached
        events += [Event("alloc", id=a, size=30 * MiB, tag="activation"),
                   Event("alloc", id=b, size=30 * MiB, tag="kv_cache")]
    events += [Event("free", id=1), Event("free", id=3)]              # 30 MiB holes, one per cut segment
    events += [Event("alloc", id=9, size=50 * MiB, tag="allreduce")]  # no hole holds it: the pool grows
    return Trace(events, format="torch-snapshot")


def test_blockers_named_where_the_pool_grew_without_a_capacity():
    d = diagnose(_two_cut_segments())
    assert d.verdict.kind == "fragmentation" and not d.verdict.failed
    assert d.blockers, "the blocks a card without that room would have had to move"
    assert [b.size for b in d.blockers] == [30 * MiB] and d.blockers[0].tag == "kv_cache"
