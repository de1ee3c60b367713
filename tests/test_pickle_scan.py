"""The compiled pickle nesting guard (ms_memopt/io/traces/_pickle_scan.c) against its pure-Python
reference (``nesting_reference``): the same depth, or the same exception with the same message, on
honest pickles of every protocol, their truncations and damaged bytes, hand-made opcode streams
(memo tricks, text PUT/GET, globals of every kind) and the million-deep bomb.
"""
from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.io.traces import torch_snapshot
from ms_memopt.io.traces.torch_snapshot import MAX_NESTING, nesting_reference, pickle_nesting

compiled = torch_snapshot._NESTING
pytestmark = pytest.mark.skipif(compiled is None, reason="the compiled scan is not built (or switched off)")


def _outcome(scan, data: bytes, limit: int):
    """What ``scan`` gives: ("depth", n) or (exception type, message)."""
    try:
        return "depth", scan(data, limit)
    except (ValueError, pickle.UnpicklingError) as exc:
        return type(exc), str(exc)


def _same(data: bytes, limit: int = MAX_NESTING) -> None:
    assert _outcome(compiled, data, limit) == _outcome(lambda d, n: nesting_reference(d, limit=n), data, limit)


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.tuples(inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4) | st.frozensets(st.integers(), max_size=3),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_values, st.integers(0, 5), st.integers(0, 8))
def test_every_protocol_gives_the_reference_depth(value, protocol, limit):
    data = pickle.dumps(value, protocol=protocol)
    _same(data, 10**6)
    _same(data, limit)


@settings(max_examples=200, deadline=None)
@given(_values, st.integers(0, 5), st.data())
def test_truncated_and_damaged_pickles_give_the_reference_error(value, protocol, data):
    raw = pickle.dumps([value, value, {"k": (value,)}], protocol=protocol)
    _same(raw[:data.draw(st.integers(0, len(raw)))])
    damaged = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _same(bytes(damaged))


def test_random_bytes_after_a_protocol_header_give_the_reference_outcome():
    rng = random.Random(0)
    for _ in range(3000):
        _same(b"\x80\x04" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))


@pytest.mark.parametrize("data", [
    b"(lp0\nI1\nag0\nag0\na.",                   # protocol 0: text PUT and GET
    b"(lp-5\nI1\nag-5\n.",                       # a negative memo index
    b"(lp99999999999999999999999\ng99999999999999999999999\n.",   # beyond int64
    b"(lp\nI1\na.",                              # PUT with no index: -1
    b"(lpx\n.",                                  # an index int() refuses
    b"\x80\x02]r\xff\xff\xff\x7f]h\x00a.",       # a far LONG_BINPUT, then a near BINGET
    b"\x80\x04]\x94]r\x01\x00\x00\x00\x94h\x01a.",  # MEMOIZE after a PUT at the next index
    b"\x80\x04]]\x94\x94h\x00h\x01\x00.",        # an unknown opcode (0x00)
    b"cos\nsystem\n.",                            # GLOBAL
    b"\x80\x04\x8c\x02os\x8c\x06system\x93.",    # STACK_GLOBAL
    b"\x80\x04\x8c\x02o\xff\x8c\x01 \x93.",      # STACK_GLOBAL of undecodable bytes
    b"\x80\x02\x82\x05.",                         # EXT1
    b"\x80\x02\x84\x01\x02\x03\x04.",             # EXT4
    b"(i  some.module \n Name\n.",               # INST, with spaces to strip
    b"\x80\x02cno newline",                      # GLOBAL without its newlines
    b"\x80\x02\ncx",                              # GLOBAL whose second newline comes before it
    b"Pid\n.", b"\x80\x02K\x01Q.",                 # PERSID, BINPERSID
    b"\x80\x04T\xff\xff\xff\xff.",                 # BINSTRING with a negative length
    b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\xff.",  # BINBYTES8 claiming 2^64 - 1 bytes
    b"\x80\x04\x8c", b"\x80\x04K", b"\x80\x04q", b"\x80\x04X\x01\x00",   # cut inside an argument
    b"\x80\x04)\x85\x85\x85\x85R0t.",             # TUPLE1s, REDUCE, POP_MARK
    b"\x80\x04}(K\x01]u2u.",                      # DUP after a fill
])
def test_hand_made_opcode_streams_give_the_reference_outcome(data):
    _same(data)
    _same(data, 10**6)


def test_a_million_deep_tuple_is_measured_in_c_without_recursion():
    data = b"\x80\x04}K\x01" + b"\x85" * 1_000_000 + b"K\x01s."     # {(((...1,),),): 1}
    assert pickle_nesting(data, limit=10**7) == 1_000_001
    assert pickle_nesting(data) == MAX_NESTING + 1


def test_pickle_nesting_takes_the_compiled_scan():
    assert pickle_nesting is not nesting_reference and torch_snapshot._NESTING is compiled
