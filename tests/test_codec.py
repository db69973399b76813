"""The header codec contract, on both implementations.

Every test taking ``impl`` runs on the Cython and on the msgpack codec; the
differential tests feed the same bytes to both and require the same outcome:
the same result, or ProtocolError with the same ``rid``.
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections import namedtuple
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit.protocol import PRIORITY_MAX, PRIORITY_MIN, ProtocolError, block_hashes
from tests.support import codec_extras as py_codec_extras
from tests.support.peers import (
    HANDOFF,
    PARTIAL,
    REPLY,
    REPLY_BATCH,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
)

SETTINGS = settings(max_examples=300, deadline=None)
DIFFERENTIAL = settings(SETTINGS, max_examples=1000)

INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
# Every edge of msgpack's int forms, and of int64.
EDGES = sorted(
    {
        s * (e + d)
        for e in (0, 1 << 5, 1 << 7, 1 << 8, 1 << 15, 1 << 16, 1 << 31, 1 << 32, 1 << 63)
        for d in (-1, 0, 1)
        for s in (1, -1)
        if INT64_MIN <= s * (e + d) <= INT64_MAX
    }
    | {UINT64_MAX, UINT64_MAX - 1}
)
MAX_NESTING = 512

int64s = st.sampled_from([e for e in EDGES if e <= INT64_MAX]) | st.integers(INT64_MIN, INT64_MAX)
ints = st.sampled_from(EDGES) | st.integers(INT64_MIN, UINT64_MAX)
# What encode and decode support; tuples are arrays too, decoded as lists.
supported = st.recursive(
    st.none() | st.booleans() | ints,
    lambda children: st.lists(children, max_size=20) | st.lists(children).map(tuple),
    max_leaves=40,
)
# Anything msgpack may carry after a SUBMIT's request id.
anything = st.recursive(
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
    lambda children: (
        st.lists(children, max_size=20)
        | st.dictionaries(st.text(max_size=5) | int64s, children, max_size=5)
    ),
    max_leaves=20,
)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def submit_frame(header: int, rid: int, rest: list) -> bytes:
    return packb([header, rid, *rest])


submits = st.builds(
    submit_frame, int64s, int64s, st.lists(anything, max_size=4) | st.lists(st.none(), max_size=20)
)
replies = st.builds(
    lambda entries: packb([REPLY, [[rid, flag] for rid, flag in entries]]),
    st.lists(st.tuples(int64s, st.booleans()), max_size=20),
) | st.builds(lambda rids: packb([PARTIAL, rids]), st.lists(int64s, max_size=20))
submit_batches = st.builds(
    lambda entries, hashed: packb(
        [
            SUBMIT_BATCH,
            [[rid, params, flag] if hashed else [rid, params] for rid, params, flag in entries],
        ]
    ),
    st.lists(st.tuples(int64s, anything, st.booleans()), max_size=8),
    st.booleans(),
) | st.builds(  # a client's with QoS: entries of 3, and of 5 with the QoS after the rid
    lambda entries: packb([SUBMIT_BATCH, [list(e) for e in entries]]),
    st.lists(
        st.tuples(int64s, anything, st.booleans())
        | st.tuples(int64s, ints, ints, anything, st.booleans()),
        max_size=6,
    ),
)
qos_submits = st.builds(
    lambda header, rid, prio, deadline, rest: packb([header, rid, prio, deadline, *rest]),
    st.sampled_from([SUBMIT, SUBMIT_KV]),
    int64s,
    ints,
    ints,
    st.lists(anything, max_size=2),
)
reply_batches = st.builds(
    lambda entries: packb([REPLY_BATCH, [list(e) for e in entries]]),
    st.lists(st.tuples(int64s, st.booleans()), max_size=20),
)
header_ints = st.builds(lambda h, v: packb([h, v]), int64s, int64s)
valid_frames = (
    submits
    | qos_submits
    | replies
    | submit_batches
    | reply_batches
    | header_ints
    | supported.map(packb)
)

# Megatron-Core's single frames: [20, rid, prompt, params] (0.19's), with multi_modal_data
# last (main's), [24, rid, prompt, params, kv_meta, src_block_ids] (main's), and
# [21, [map, ...]] (main's [22, [map, ...]] too).
UINT32_MAX = (1 << 32) - 1
TOKEN_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 1 << 31, UINT32_MAX - 1, UINT32_MAX]
tokens = st.lists(st.sampled_from(TOKEN_EDGES) | st.integers(0, UINT32_MAX), max_size=70)
prompts = st.text(max_size=40) | tokens | st.lists(anything, max_size=6)
params_maps = st.dictionaries(st.text(max_size=8) | int64s, anything, max_size=6)
request_ids = (
    int64s
    | st.sampled_from([INT64_MAX + 1, UINT64_MAX, True, False, None, 1.5, "7", b"7", [7]])
    | st.just(...)  # no "request_id" at all
)


@st.composite
def reply_entries(draw: st.DrawFn) -> Any:
    """A finished request as Megatron's engine sends it, or something that is not one."""
    if draw(st.integers(0, 9)) == 0:
        return draw(anything)  # not a map, mostly
    entry = draw(st.dictionaries(st.text(max_size=12) | int64s, anything, max_size=6))
    rid = draw(request_ids)
    if rid is not ...:
        # anywhere among the keys, not only first
        items = list(entry.items())
        items.insert(draw(st.integers(0, len(items))), ("request_id", rid))
        entry = dict(items)
    return entry


single_submits = st.builds(
    lambda header, rid, prompt, params, more: packb([header, rid, prompt, params, *more]),
    st.sampled_from([SUBMIT, SUBMIT_KV]) | int64s,
    int64s,
    prompts,
    params_maps,
    st.lists(anything, max_size=2),  # main's multi_modal_data; kv_meta, src_block_ids
)
single_replies = st.builds(
    lambda header, entries: packb([header, entries]),
    st.sampled_from([REPLY, PARTIAL]),
    st.lists(reply_entries(), max_size=12),
)
single_frames = single_submits | single_replies | prompts.map(packb) | params_maps.map(packb)


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes] = valid_frames) -> bytes:
    """A valid frame with a few bytes flipped, cut, inserted or appended."""
    frame = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(frame)))
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "extend"]))
        if kind == "flip" and at < len(frame):
            frame[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del frame[at:]
        elif kind == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del frame[at : at + 1]
        else:
            frame += draw(st.binary(min_size=1, max_size=4))
    return bytes(frame)


def as_lists(obj: Any) -> Any:
    return [as_lists(x) for x in obj] if isinstance(obj, (list, tuple)) else obj


def supported_value(obj: Any, level: int = 0) -> bool:
    if obj is None or isinstance(obj, int):
        return True
    if type(obj) is list:
        return level < MAX_NESTING and all(supported_value(x, level + 1) for x in obj)
    return False


def outcome(fn, *args) -> tuple[str, Any]:
    """The result, or the rid of the ProtocolError; any other exception fails the test."""
    try:
        # repr keeps True and 1 apart
        return "ok", repr(fn(*args))
    except ProtocolError as exc:
        return "error", exc.rid


# -- encode / decode -----------------------------------------------------------


@SETTINGS
@given(obj=supported)
def test_encode_is_packb(codec_extras, obj):
    assert codec_extras.encode(obj) == packb(obj)


@SETTINGS
@given(obj=supported)
def test_decode_round_trip(codec_extras, obj):
    assert repr(codec_extras.decode(packb(obj))) == repr(as_lists(obj))


@SETTINGS
@given(data=st.binary(max_size=40) | mutated())
def test_decode_agrees_with_msgpack(codec_extras, data):
    try:
        expected = msgpack.unpackb(data)
    except Exception:
        ok = False
    else:
        ok = supported_value(expected)
    if ok:
        assert repr(codec_extras.decode(data)) == repr(expected)
    else:
        with pytest.raises(ProtocolError):
            codec_extras.decode(data)


class Color(enum.IntEnum):
    RED = 7


@pytest.mark.parametrize(
    "obj",
    [Color.RED, [Color.RED, (1, 2)], namedtuple("P", "x y")(1, [None]), [[]] * 16, [0] * 70000],
)
def test_encode_subclasses_and_long_arrays(codec_extras, obj):
    assert codec_extras.encode(obj) == packb(obj)
    assert codec_extras.decode(packb(obj)) == as_lists(obj)


@pytest.mark.parametrize(
    "obj", ["a", b"a", 1.5, {}, object(), [1, "a"], (None, [{}]), UINT64_MAX + 1, INT64_MIN - 1]
)
def test_encode_unsupported(codec_extras, obj):
    with pytest.raises(ProtocolError):
        codec_extras.encode(obj)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\x01\x02",  # trailing
        b"\x92\x01",  # truncated
        b"\xdd\xff\xff\xff\xff",  # claims 2**32-1 elements: refused before allocating
        b"\xcf\xff",
        packb("a"),
        b"\xa1\xff",  # invalid UTF-8
        packb(b"a"),
        packb({}),
        packb(1.5),
        packb(msgpack.ExtType(1, b"")),
        packb([1, [2, "x"]]),
    ],
)
def test_decode_unsupported(codec_extras, frame):
    with pytest.raises(ProtocolError):
        codec_extras.decode(frame)


def nested(depth: int) -> list:
    obj: list = []
    for _ in range(depth - 1):
        obj = [obj]
    return obj


def test_nesting_limit(codec_extras):
    assert codec_extras.MAX_NESTING == MAX_NESTING
    assert codec_extras.encode(nested(MAX_NESTING)) == packb(nested(MAX_NESTING))
    assert codec_extras.decode(packb(nested(MAX_NESTING))) == nested(MAX_NESTING)
    with pytest.raises(ProtocolError, match="deep"):
        codec_extras.encode(nested(MAX_NESTING + 1))
    with pytest.raises(ProtocolError, match="deep"):
        codec_extras.decode(packb(nested(MAX_NESTING + 1)))
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ProtocolError, match="deep"):
        codec_extras.encode(cycle)


# -- read_header / read_submit / rewrite_submit ----------------------------------


@SETTINGS
@given(header=int64s, rid=int64s, rest=st.lists(anything, max_size=4), new_rid=int64s)
def test_submit(impl, codec_extras, header, rid, rest, new_rid):
    frame = submit_frame(header, rid, rest)
    offset = len(frame) - sum(len(packb(x)) for x in rest)
    assert impl.codec.read_header(frame) == (header, len(rest) + 2, offset - len(packb(rid)))
    assert impl.codec.read_submit(frame) == (header, len(rest) + 2, rid, offset)
    assert codec_extras.rewrite_submit(frame, new_rid) == submit_frame(header, new_rid, rest)


def test_submit_array16_and_large_remainder(impl, codec_extras):
    rest = [None] * 20 + [b"\0" * (1 << 20)]
    frame = submit_frame(SUBMIT, 5, rest)
    assert impl.codec.read_submit(frame) == (SUBMIT, 23, 5, 5)
    assert codec_extras.rewrite_submit(frame, 1 << 40) == submit_frame(SUBMIT, 1 << 40, rest)


def test_header_ignores_what_follows(impl):
    assert impl.codec.read_header(b"\x93\x14\xc1\xc1") == (20, 3, 2)
    assert impl.codec.read_header(b"\xdd\xff\xff\xff\xff\xd0\x80") == (-128, 2**32 - 1, 7)
    assert impl.codec.read_header(b"\xdc\x00\x01\xcf" + INT64_MAX.to_bytes(8, "big")) == (
        INT64_MAX,
        1,
        12,
    )


def test_remainder_is_checked_for_structure_only(impl, codec_extras):
    # a str with invalid UTF-8, an ext -1 (timestamp) of a bad length, floats, any map keys
    rest = b"\xa2\xff\xfe" + b"\xc7\x03\xffxyz" + packb({1: 1.5, b"k": [{}]})
    frame = b"\x95\x14\x05" + rest
    assert impl.codec.read_submit(frame) == (20, 5, 5, 3)
    assert codec_extras.rewrite_submit(frame, 300) == b"\x95\x14\xcd\x01\x2c" + rest


@pytest.mark.parametrize(
    ("frame", "rid"),
    [
        (b"", None),
        (b"\x14", None),  # not an array
        (b"\x91\x14", None),  # too short
        (b"\x92\x14", None),  # truncated before the rid
        (b"\x92\xc3\x05", None),  # header is a bool
        (b"\x92\xcf" + UINT64_MAX.to_bytes(8, "big") + b"\x05", None),  # header out of range
        (b"\x92\x14\xa1a", None),  # rid is a str
        (b"\x92\x14\xcf" + (INT64_MAX + 1).to_bytes(8, "big"), None),  # rid out of range
        (b"\x92\x14\x05\x00", 5),  # trailing bytes
        (b"\x93\x14\x05", 5),  # truncated remainder
        (b"\x93\x14\x05\xc1", 5),  # reserved byte
        (b"\x93\x14\x05\xa5abc", 5),  # str longer than the frame
        (b"\x93\x14\x05\xc9\xff\xff\xff\xff\x01", 5),  # ext32 longer than the frame
        (b"\x93\x14\xd0\xfe\xdf\xff\xff\xff\xff", -2),  # map claiming 2**32-1 pairs
        (b"\xdd\xff\xff\xff\xff\x14\x05", 5),  # array claiming 2**32-1 elements
    ],
)
def test_submit_errors(impl, codec_extras, frame, rid):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit(frame)
    assert info.value.rid == rid
    with pytest.raises(ProtocolError) as info:
        codec_extras.rewrite_submit(frame, 1)
    assert info.value.rid == rid


def test_submit_rid_out_of_range_message(impl):
    with pytest.raises(ProtocolError, match="request id out of range"):
        impl.codec.read_submit(b"\x92\x14\xcf" + (INT64_MAX + 1).to_bytes(8, "big"))


@pytest.mark.parametrize(
    ("depth", "last", "ok"),
    [(1024, b"\x00", True), (1023, b"\x90", True), (1024, b"\x90", False), (1025, b"\x00", False)],
)
def test_submit_remainder_depth_is_msgpacks(impl, depth, last, ok):
    # as deep as msgpack's own unpacker goes, and no deeper
    frame = b"\x93\x14\x05" + b"\x91" * depth + last
    if ok:
        assert impl.codec.read_submit(frame) == (20, 3, 5, 3)
    else:
        with pytest.raises(ProtocolError) as info:
            impl.codec.read_submit(frame)
        assert info.value.rid == 5


# -- read_reply ------------------------------------------------------------------


@SETTINGS
@given(entries=st.lists(st.tuples(int64s, st.booleans()), max_size=100))
def test_reply(impl, entries):
    frame = packb([REPLY, [list(e) for e in entries]])
    assert impl.codec.read_reply(frame) == (REPLY, entries)
    partial = packb([PARTIAL, [rid for rid, _ in entries]])
    assert impl.codec.read_reply(partial) == (PARTIAL, [(rid, False) for rid, _ in entries])


def test_reply_larger_than_the_local_buffer(impl):
    entries = [(i, i % 3 == 0) for i in range(5000)]
    assert impl.codec.read_reply(packb([REPLY, [list(e) for e in entries]])) == (REPLY, entries)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        packb([REPLY]),
        packb([REPLY, [], 1]),
        packb([SUBMIT, []]),  # not a reply header
        packb([True, []]),
        packb([REPLY, {}]),
        packb([REPLY, [[1, True]]]) + b"\x00",  # trailing
        packb([REPLY, [[1, True]]])[:-1],  # truncated
        packb([REPLY, [[1, b"\xc1"]]]).replace(b"\xc4\x01\xc1", b"\xc1\xc1\xc1"),  # reserved byte
        b"\x92\x15\xdd\xff\xff\xff\xff",  # claims 2**32-1 entries
    ],
)
def test_reply_errors(impl, frame):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_reply(frame)
    assert info.value.rid is None


# -- read_header_int / read_submit_batch / read_reply_batch -------------------------


@SETTINGS
@given(header=int64s, value=int64s)
def test_header_int(impl, header, value):
    assert impl.codec.read_header_int(packb([header, value])) == (header, value)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        packb([REPLY]),
        packb([REPLY, 1, 2]),
        packb([REPLY, None]),
        packb([REPLY, True]),
        packb([True, 1]),
        packb([REPLY, 1.0]),
        packb([REPLY, INT64_MAX + 1]),
        packb([REPLY, 1]) + b"\x00",
        packb([REPLY, 1])[:-1],
    ],
)
def test_header_int_errors(impl, frame):
    with pytest.raises(ProtocolError):
        impl.codec.read_header_int(frame)


@SETTINGS
@given(header=int64s, rids=st.lists(int64s, min_size=1, max_size=40))
def test_rids(impl, header, rids):
    """[header, rid, ...]: a coordkit engine's RELEASE_KV and KV_READ_DONE."""
    assert impl.codec.read_rids(packb([header, *rids])) == (header, rids)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        packb([REPLY]),
        packb([REPLY, 1, None]),
        packb([REPLY, 1, 2.0]),
        packb([REPLY, 1, INT64_MAX + 1]),
        packb([True, 1]),
        packb([REPLY, 1, 2]) + b"\x00",
        packb([REPLY, 1, 2])[:-1],
        b"\xdd\xff\xff\xff\xff\x15\x01",  # claims 2**32-1 elements
    ],
)
def test_rids_errors(impl, frame):
    with pytest.raises(ProtocolError):
        impl.codec.read_rids(frame)


@SETTINGS
@given(entries=st.lists(st.tuples(int64s, anything, st.booleans()), max_size=20))
def test_submit_batch(impl, entries):
    for width in (2, 3):
        wire = [[rid, p, flag] if width == 3 else [rid, p] for rid, p, flag in entries]
        frame = packb([SUBMIT_BATCH, wire])
        read = impl.codec.read_submit_batch(frame, width)
        assert [(rid, flag) for rid, _, _, flag in read] == [
            (rid, flag and width == 3) for rid, _, flag in entries
        ]
        # the params are found in place, byte for byte as msgpack wrote them
        assert [frame[o : o + n] for _, o, n, _ in read] == [packb(p) for _, p, _ in entries]


def test_submit_batch_larger_than_the_local_buffer(impl):
    entries = [[i, {"n": i}, i % 2 == 0] for i in range(5000)]
    read = impl.codec.read_submit_batch(packb([SUBMIT_BATCH, entries]))
    assert [(rid, flag) for rid, _, _, flag in read] == [(e[0], e[2]) for e in entries]


@pytest.mark.parametrize(
    ("frame", "width", "rids"),
    [
        (b"", 3, ()),
        (packb([SUBMIT_BATCH]), 3, ()),
        (packb([SUBMIT_BATCH, [], 1]), 3, ()),
        (packb([REPLY_BATCH, []]), 3, ()),  # another header
        (packb([SUBMIT_BATCH, {}]), 3, ()),
        (packb([SUBMIT_BATCH, [[1, {}, True]]]), 2, ()),  # a client's entry where an engine's goes
        (packb([SUBMIT_BATCH, [[1, {}]]]), 3, ()),  # and the other way round
        (packb([SUBMIT_BATCH, [[1, {}, 1]]]), 3, (1,)),  # hashed is an int
        (packb([SUBMIT_BATCH, [["1", {}, True]]]), 3, ()),
        (packb([SUBMIT_BATCH, [[INT64_MAX + 1, {}, True]]]), 3, ()),
        (packb([SUBMIT_BATCH, [[1, {}, True]]]) + b"\x00", 3, (1,)),
        (packb([SUBMIT_BATCH, [[1, {}, True]]])[:-1], 3, (1,)),
        (b"\x92\x5f\x91\x93\x01\xc1\xc3", 3, (1,)),  # reserved byte in the params
        (b"\x92\x5f\xdd\xff\xff\xff\xff", 3, ()),  # claims 2**32-1 entries
        (packb([SUBMIT_BATCH, [[7, {}, True], [8, {}], [9, {}, True]]]), 3, (7,)),
        (packb([SUBMIT_BATCH, [[7, {}, True], [8, {}, None]]]), 3, (7, 8)),
    ],
)
def test_submit_batch_errors(impl, frame, width, rids):
    """The error names the entries whose ids could be read, so that they can be answered."""
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit_batch(frame, width)
    assert info.value.rid is None
    assert info.value.rids == rids


@SETTINGS
@given(
    entries=st.lists(st.tuples(int64s, anything, st.booleans()), min_size=1, max_size=15),
    data=st.data(),
)
def test_a_cut_submit_batch_names_every_id_before_the_cut(impl, entries, data):
    frame = packb([SUBMIT_BATCH, [list(e) for e in entries]])
    ends, end = [], 3  # [95, [ then each entry's fixarray, rid and the rest
    for rid, params, hashed in entries:
        ends.append(end + 1 + len(packb(rid)))
        end += len(packb([rid, params, hashed]))
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit_batch(frame[:cut])
    named = [rid for (rid, _, _), at in zip(entries, ends, strict=True) if at <= cut]
    assert info.value.rids == tuple(named)


def test_a_long_batch_with_a_fault_at_its_end_names_every_entry(impl):
    entries = [[i, {"n": i}, False] for i in range(5000)]
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit_batch(packb([SUBMIT_BATCH, entries]) + b"\x00")
    assert info.value.rids == tuple(range(5000))
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_reply_batch(packb([REPLY_BATCH, [[i, True] for i in range(5000)]])[:-1])
    assert info.value.rids == tuple(range(5000))


@SETTINGS
@given(entries=st.lists(st.tuples(int64s, anything), max_size=20))
def test_handoff(impl, entries):
    """A coordkit prefill's HANDOFF: each kv_meta found in place, as it came."""
    frame = packb([HANDOFF, [list(e) for e in entries]])
    read = impl.codec.read_handoff(frame)
    assert [rid for rid, _, _ in read] == [rid for rid, _ in entries]
    assert [frame[o : o + n] for _, o, n in read] == [packb(kv) for _, kv in entries]


def test_a_handoffs_kv_meta_is_read_as_it_came(impl):
    """Bytes msgpack would not write (a map16 of one key, a float32) are kept, not
    re-encoded: the decode gets what the prefill sent."""
    kv_meta = b"\xde\x00\x01\xa1k\xca\x3f\x80\x00\x00"  # {"k": 1.0}: map16, float32
    frame = packb([HANDOFF, []])[:-1] + b"\x91\x92\x07" + kv_meta
    assert impl.codec.read_handoff(frame) == [(7, 5, len(kv_meta))]


@pytest.mark.parametrize(
    ("frame", "rids"),
    [
        (b"", ()),
        (packb([HANDOFF]), ()),
        (packb([SUBMIT_BATCH, [[1, {}]]]), ()),  # another header
        (packb([HANDOFF, [[1, {}, True]]]), ()),  # an entry of three
        (packb([HANDOFF, [["1", {}]]]), ()),
        (packb([HANDOFF, [[1, {}]]]) + b"\x00", (1,)),
        (packb([HANDOFF, [[1, {}], [2, {}]]])[:-1], (1, 2)),
        (b"\x92\x68\x91\x92\x01\xc1", (1,)),  # the reserved byte as kv_meta
    ],
)
def test_handoff_errors(impl, frame, rids):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_handoff(frame)
    assert info.value.rids == rids


def test_submit_batch_width(impl):
    with pytest.raises(ValueError):
        impl.codec.read_submit_batch(packb([SUBMIT_BATCH, []]), 4)


# -- the QoS fields: read_qos, read_submit_batch of width 5 ---------------------------

priorities = st.integers(PRIORITY_MIN, PRIORITY_MAX)
deadlines = st.sampled_from([0, 1, 127, 128, 65535, 1 << 32, INT64_MAX]) | st.integers(0, INT64_MAX)


@SETTINGS
@given(
    header=st.sampled_from([SUBMIT, SUBMIT_KV]),
    rid=int64s,
    priority=priorities,
    deadline=deadlines,
    rest=st.lists(anything, min_size=1, max_size=2),
)
def test_qos(impl, codec_extras, header, rid, priority, deadline, rest):
    """The QoS right after the rid; what follows them is the params span, verbatim: what
    an engine is sent has no QoS in it."""
    frame = submit_frame(header, rid, [priority, deadline, *rest])
    _, length, got, offset = impl.codec.read_submit(frame)
    assert (length, got) == (4 + len(rest), rid)
    got_priority, got_deadline, end = impl.codec.read_qos(frame, offset)
    assert (got_priority, got_deadline) == (priority, deadline)
    assert frame[end:] == b"".join(packb(x) for x in rest)


@pytest.mark.parametrize(
    "qos",
    [
        [PRIORITY_MIN - 1, 0],
        [PRIORITY_MAX + 1, 0],
        [0, -1],
        [0, UINT64_MAX],
        [UINT64_MAX, 0],
        [True, 0],
        [0, None],
        [0.5, 0],
        ["0", 0],
        [0],
    ],
)
def test_qos_errors(impl, qos):
    frame = submit_frame(SUBMIT, 7, qos)
    with pytest.raises(ProtocolError):
        impl.codec.read_qos(frame, impl.codec.read_submit(frame)[3])


def test_qos_offset_outside_the_frame(impl):
    with pytest.raises(ValueError):
        impl.codec.read_qos(submit_frame(SUBMIT, 7, [0, 0, {}]), 99)


@SETTINGS
@given(
    entries=st.lists(
        st.tuples(int64s, anything, st.booleans(), st.none() | st.tuples(priorities, deadlines)),
        max_size=12,
    )
)
def test_submit_batch_qos(impl, entries):
    """Width 5: each entry with its QoS after the rid, or without (0, 0); the params span
    starts after them."""
    wire = [[rid, *(qos or ()), p, flag] for rid, p, flag, qos in entries]
    frame = packb([SUBMIT_BATCH, wire])
    read = impl.codec.read_submit_batch(frame, 5)
    assert [(rid, flag, prio, deadline) for rid, _, _, flag, prio, deadline in read] == [
        (rid, flag, *(qos or (0, 0))) for rid, _, flag, qos in entries
    ]
    assert [frame[o : o + n] for _, o, n, *_ in read] == [packb(p) for _, p, _, _ in entries]
    if any(qos is not None for *_, qos in entries):
        with pytest.raises(ProtocolError):  # not granted: an entry of 5 is malformed
            impl.codec.read_submit_batch(frame, 3)


@pytest.mark.parametrize(
    ("entries", "rids"),
    [
        ([[1, 0, 0, {}, True], [2, PRIORITY_MAX + 1, 0, {}, True]], (1, 2)),
        ([[1, -1, -5, {}, False]], (1,)),
        ([[1, 0, {}, True]], ()),  # 4 fields: neither layout
        ([[1, 0, 0, {}, True, 9]], ()),
    ],
)
def test_submit_batch_qos_errors(impl, entries, rids):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit_batch(packb([SUBMIT_BATCH, entries]), 5)
    assert info.value.rids == rids


@SETTINGS
@given(entries=st.lists(st.tuples(int64s, st.booleans()), max_size=100))
def test_reply_batch(impl, entries):
    frame = packb([REPLY_BATCH, [list(e) for e in entries]])
    assert impl.codec.read_reply_batch(frame) == entries


@pytest.mark.parametrize(
    ("frame", "rids"),
    [
        (b"", ()),
        (packb([REPLY_BATCH]), ()),
        (packb([REPLY, [[1, True]]]), ()),  # an engine's reply header
        (packb([REPLY_BATCH, [[1]]]), ()),
        (packb([REPLY_BATCH, [[1, True, 2]]]), ()),
        (packb([REPLY_BATCH, [[1, 1]]]), (1,)),
        (packb([REPLY_BATCH, [1]]), ()),
        (packb([REPLY_BATCH, [[INT64_MAX + 1, True]]]), ()),
        (packb([REPLY_BATCH, [[1, True]]]) + b"\x00", (1,)),
        (packb([REPLY_BATCH, [[1, True]]])[:-1], (1,)),
    ],
)
def test_reply_batch_errors(impl, frame, rids):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_reply_batch(frame)
    assert info.value.rid is None
    assert info.value.rids == rids


@pytest.mark.parametrize(
    ("frame", "entries"),
    [
        (packb([REPLY, [[1]]]), [None]),
        (packb([REPLY, [[1, True, 2]]]), [None]),
        (packb([REPLY, [[1, 1]]]), [None]),  # flag is an int
        (packb([REPLY, [[True, True]]]), [None]),
        (packb([REPLY, [[INT64_MAX + 1, True]]]), [None]),
        (packb([REPLY, [1]]), [None]),  # a PARTIAL entry under ENGINE_REPLY
        (packb([PARTIAL, [[1, True]]]), [None]),  # and the other way round
        (packb([PARTIAL, [None]]), [None]),
        # the good entries of a batch survive the bad ones around them
        (packb([REPLY, [[7, False], [INT64_MAX + 1, False], {"a": [1]}, [8, True]]]),
         [(7, False), None, None, (8, True)]),
        (packb([PARTIAL, [5, "x", -(2**63), 2**64 - 1]]),
         [(5, False), None, (INT64_MIN, False), None]),
    ],
)  # fmt: skip
def test_reply_salvages_good_entries(impl, frame, entries):
    header = msgpack.unpackb(frame)[0]
    assert impl.codec.read_reply(frame) == (header, entries)


# -- writers -----------------------------------------------------------------------


@SETTINGS
@given(header=int64s, value=int64s)
def test_writers(impl, codec_extras, header, value):
    assert codec_extras.write_header(header) == packb([header])
    assert impl.codec.write_header_int(header, value) == packb([header, value])


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (True, TypeError),
        (1.0, TypeError),
        ("1", TypeError),
        (None, TypeError),
        (INT64_MAX + 1, OverflowError),
        (INT64_MIN - 1, OverflowError),
    ],
)
def test_int_arguments(impl, codec_extras, value, error):
    with pytest.raises(error):
        codec_extras.write_header(value)
    with pytest.raises(error):
        impl.codec.write_header_int(REPLY, value)
    with pytest.raises(error):
        codec_extras.rewrite_submit(packb([SUBMIT, 1]), value)


def test_int_enum_arguments(impl):
    assert impl.codec.write_header_int(Color.RED, Color.RED) == packb([7, 7])


# -- Megatron-Core's single frames -------------------------------------------------
#
# The oracle: msgpack.unpackb. A frame it decodes to the right shape must be
# read, spans and all; one it decodes to another shape must be refused. A frame
# it refuses must be refused too, unless msgpack's own Unpacker.skip accepts its
# structure: the codec checks structure only (a str's UTF-8, an ext's payload
# and the hashability of map keys are the reader's business), as read_submit does.


def decoded(data: bytes) -> tuple[bool, Any]:
    try:
        return True, msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        return False, None


def skippable(data: bytes) -> bool:
    """msgpack's Unpacker.skip takes ``data`` as exactly one object."""
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(data) or 1)
    unpacker.feed(data)
    try:
        unpacker.skip()
    except Exception:
        return False
    return unpacker.tell() == len(data)


def is_int64(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def same(a: Any, b: Any) -> bool:
    # repr keeps True and 1 apart, and a NaN equal to itself
    return repr(a) == repr(b)


def unpacked(data: bytes) -> list[Any]:
    """Every object of ``data``, in order (msgpack.unpackb takes only one)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return list(unpacker)


def check_single_submit(impl, data: bytes) -> None:
    ok, obj = decoded(data)
    shaped = (
        ok
        and type(obj) is list
        and 4 <= len(obj) <= 6
        and is_int64(obj[0])
        and is_int64(obj[1])
        and type(obj[2]) in (str, list)
        and type(obj[3]) is dict
    )
    if not shaped and (ok or not skippable(data)):
        with pytest.raises(ProtocolError):
            impl.codec.read_single_submit(data)
        return
    try:
        header, rid, length, prompt, params, extra = impl.codec.read_single_submit(data)
    except ProtocolError:
        assert not shaped
        return
    assert 0 < prompt < params < extra <= len(data)
    assert (extra == len(data)) == (length == 4)
    if shaped:
        assert (header, rid, length) == (obj[0], obj[1], len(obj))
        assert same(msgpack.unpackb(data[prompt:params], strict_map_key=False), obj[2])
        # the params (and kv_meta) up to the last field, then the last field
        assert same(unpacked(data[params:extra]), obj[3 : max(4, len(obj) - 1)])
        assert same(unpacked(data[extra:]), obj[4:][-1:])
    else:  # a structural read of what msgpack refuses to decode
        assert skippable(data[prompt:params]) and skippable(data[extra:]) == (length > 4)
        middle = data[params:extra]  # the params, and kv_meta of six fields
        assert skippable(middle) if length < 6 else not skippable(middle)


def expected_entry(entry: Any) -> tuple[int | None, str | None]:
    if type(entry) is not dict:
        return None, "reply entry is not a map"
    if "request_id" not in entry:
        return None, "reply entry has no request_id"
    rid = entry["request_id"]
    if not is_int64(rid):
        return None, "request_id is not an int64"
    return rid, None


def check_single_reply(impl, data: bytes) -> None:
    ok, obj = decoded(data)
    shaped = (
        ok
        and type(obj) is list
        and len(obj) == 2
        and (same(obj[0], REPLY) or same(obj[0], PARTIAL))
        and type(obj[1]) is list
    )
    if not shaped and (ok or not skippable(data)):
        with pytest.raises(ProtocolError):
            impl.codec.read_single_reply(data)
        return
    try:
        header, entries = impl.codec.read_single_reply(data)
    except ProtocolError:
        assert not shaped
        return
    assert header in (REPLY, PARTIAL) and (not shaped or header == obj[0])
    # the spans tile the batch, in order, up to the end of the frame
    assert [end for _, end, _, _ in entries[:-1]] == [start for start, _, _, _ in entries[1:]]
    assert not entries or entries[-1][1] == len(data)
    if shaped:
        assert len(entries) == len(obj[1])
        for (start, end, rid, error), entry in zip(entries, obj[1], strict=True):
            assert same(msgpack.unpackb(data[start:end], strict_map_key=False), entry)
            assert (rid, error) == expected_entry(entry)
    else:
        assert all(skippable(data[start:end]) for start, end, _, _ in entries)


def check_whole(impl, name: str, data: bytes, types: tuple[type, ...]) -> None:
    ok, obj = decoded(data)
    if ok and type(obj) in types:
        getattr(impl.codec, name)(data)
    elif ok or not skippable(data):
        with pytest.raises(ProtocolError):
            getattr(impl.codec, name)(data)


def check_prompt_hashes(impl, data: bytes, block_size: int) -> None:
    ok, obj = decoded(data)
    if ok and type(obj) is list and all(type(t) is int and 0 <= t <= UINT32_MAX for t in obj):
        assert impl.codec.prompt_hashes(data, block_size) == block_hashes(obj, block_size)
    else:  # nothing msgpack refuses is an array of ints
        with pytest.raises(ProtocolError):
            impl.codec.prompt_hashes(data, block_size)


@SETTINGS
@given(header=st.sampled_from([SUBMIT]) | int64s, rid=int64s, prompt=prompts, params=params_maps)
def test_single_submit(impl, header, rid, prompt, params):
    frame = packb([header, rid, prompt, params])
    start = len(packb([header, rid, []])) - 1
    end = start + len(packb(prompt))
    assert impl.codec.read_single_submit(frame) == (header, rid, 4, start, end, len(frame))
    assert frame[start:end] == packb(prompt) and frame[end:] == packb(params)
    # and back: a multipart client's prompt and params, spliced into one frame for 0.19's engine
    assert impl.codec.write_single_submit(header, rid, packb(prompt), packb(params)) == frame


@SETTINGS
@given(
    rid=int64s,
    prompt=prompts,
    params=params_maps,
    multi_modal_data=anything,
    kv_meta=anything,
    blocks=anything,
)
def test_single_submit_of_megatron_main(
    impl, rid, prompt, params, multi_modal_data, kv_meta, blocks
):
    start = len(packb([SUBMIT, rid, []])) - 1
    end = start + len(packb(prompt))
    # [20, rid, prompt, sampling_params, multi_modal_data]
    frame = packb([SUBMIT, rid, prompt, params, multi_modal_data])
    extra = end + len(packb(params))
    assert impl.codec.read_single_submit(frame) == (SUBMIT, rid, 5, start, end, extra)
    assert impl.codec.read_single_head(frame) == (SUBMIT, rid, 5, start)
    assert frame[extra:] == packb(multi_modal_data)
    # [24, rid, prompt, sampling_params, kv_meta, src_block_ids]: kv_meta stays with the params
    frame = packb([SUBMIT_KV, rid, prompt, params, kv_meta, blocks])
    extra = end + len(packb(params)) + len(packb(kv_meta))
    assert impl.codec.read_single_submit(frame) == (SUBMIT_KV, rid, 6, start, end, extra)
    assert frame[end:extra] == packb(params) + packb(kv_meta) and frame[extra:] == packb(blocks)


@SETTINGS
@given(data=st.binary(max_size=40) | mutated(single_frames) | single_frames)
def test_single_submit_agrees_with_msgpack(impl, data):
    check_single_submit(impl, data)


@SETTINGS
@given(data=st.binary(max_size=40) | mutated(single_frames) | single_frames)
def test_single_head_is_the_head_of_single_submit(impl, data):
    # what read_single_submit reads first, and all of what read_single_head reads
    try:
        header, rid, length, prompt, *_ = impl.codec.read_single_submit(data)
    except ProtocolError as exc:
        if exc.rid is None:  # the fault is in the head
            with pytest.raises(ProtocolError):
                impl.codec.read_single_head(data)
        else:
            assert impl.codec.read_single_head(data)[1] == exc.rid
    else:
        assert impl.codec.read_single_head(data) == (header, rid, length, prompt)


def test_single_head_reads_nothing_after_the_rid(impl):
    # O(1): a prompt claiming 2**32-1 tokens, or garbage, is not looked at
    for rest in (b"\xdd\xff\xff\xff\xff", b"\xc1\xc1", b""):
        assert impl.codec.read_single_head(b"\x94\x14\xcd\x01\x00" + rest) == (20, 256, 4, 5)
        assert impl.codec.read_single_head(b"\x95\x14\x05" + rest) == (20, 5, 5, 3)
        assert impl.codec.read_single_head(b"\x96\x18\x05" + rest) == (24, 5, 6, 3)
    bad = (b"", b"\x93\x14\x05", b"\x97\x14\x05", b"\x94\x14", b"\x94\x14\xa1x", b"\x94\xc0\x05")
    for frame in bad:
        with pytest.raises(ProtocolError) as info:
            impl.codec.read_single_head(frame)
        assert info.value.rid is None


def test_single_submit_structure_only(impl):
    # a str prompt with invalid UTF-8, params holding an ext -1 (timestamp) of a bad length
    prompt, params = b"\xa2\xff\xfe", b"\x81\xa1k\xc7\x03\xffxyz"
    frame = b"\x94\x14\x05" + prompt + params
    assert impl.codec.read_single_submit(frame) == (20, 5, 4, 3, 6, len(frame))
    # and multi_modal_data holding a str with invalid UTF-8: its bytes are not looked at
    frame = b"\x95\x14\x05" + prompt + params + b"\x81\xa5image\xa1\xff"
    assert impl.codec.read_single_submit(frame) == (20, 5, 5, 3, 6, 6 + len(params))


@pytest.mark.parametrize(
    ("frame", "rid"),
    [
        (b"", None),
        (b"\x14", None),  # not an array
        (packb([SUBMIT, 7, [1], {}, 1, 2, 3]), None),  # seven fields: checked first
        (packb([SUBMIT, 7, {}]), None),  # the multipart layout
        (packb([True, 7, [1], {}]), None),  # header is a bool
        (packb([SUBMIT, "7", [1], {}]), None),  # rid is a str
        (packb([SUBMIT, True, [1], {}]), None),  # rid is a bool
        (packb([SUBMIT, UINT64_MAX, [1], {}]), None),  # rid out of range
        (b"\x94\x14", None),  # truncated before the rid
        (b"\x94\x14\x07", 7),  # truncated before the prompt
        (packb([SUBMIT, 7, b"bin", {}]), 7),  # a prompt is a str or an array
        (packb([SUBMIT, 7, 12, {}]), 7),
        (packb([SUBMIT, 7, None, {}]), 7),
        (packb([SUBMIT, 7, {"a": 1}, {}]), 7),
        (packb([SUBMIT, 7, "p", [1]]), 7),  # params are a map
        (packb([SUBMIT, 7, "p", None]), 7),
        (packb([SUBMIT, 7, "p", "x"]), 7),
        (packb([SUBMIT, 7, "p", {}]) + b"\x00", 7),  # trailing
        (packb([SUBMIT, 7, "p", {"a": 1}])[:-1], 7),  # truncated params
        (packb([SUBMIT, 7, "pp", {}])[:5], 7),  # truncated prompt
        (b"\x94\x14\x07\xdd\xff\xff\xff\xff\x80", 7),  # prompt claims 2**32-1 tokens
        (b"\x94\x14\x07\x91\xc1\x80", 7),  # reserved byte in the prompt
        (packb([SUBMIT, 7, "p", {}, None]) + b"\x00", 7),  # five fields, trailing
        (packb([SUBMIT, 7, "p", {}, {"image": b"x"}])[:-1], 7),  # multi_modal_data cut short
        (packb([SUBMIT, 7, "p", [1], None]), 7),  # five fields, params not a map
        (b"\x95\x14\x07\xa1p\x80\xc1", 7),  # a reserved byte as multi_modal_data
        (packb([SUBMIT_KV, 7, "p", {}, {}, [1]])[:-1], 7),  # src_block_ids cut short
        (b"\x96\x18\x07\xa1p\x80\x80", 7),  # no src_block_ids
    ],
)
def test_single_submit_errors(impl, frame, rid):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_single_submit(frame)
    assert info.value.rid == rid


@pytest.mark.parametrize(
    ("depth", "last", "ok"),
    [(1024, b"\x00", True), (1023, b"\x90", True), (1024, b"\x90", False), (1025, b"\x00", False)],
)
def test_single_submit_prompt_depth_is_msgpacks(impl, depth, last, ok):
    frame = b"\x94\x14\x05" + b"\x91" * depth + last + b"\x80"
    if ok:
        assert impl.codec.read_single_submit(frame) == (20, 5, 4, 3, len(frame) - 1, len(frame))
    else:
        with pytest.raises(ProtocolError) as info:
            impl.codec.read_single_submit(frame)
        assert info.value.rid == 5


# Fewer examples: lists of up to 20 entries are slow to draw (1.5 minutes at 300 on py).
@settings(SETTINGS, max_examples=100)
@given(header=st.sampled_from([REPLY, PARTIAL]), entries=st.lists(reply_entries(), max_size=20))
def test_single_reply(impl, header, entries):
    frame = packb([header, entries])  # finished requests, or main's partial replies
    read, got = impl.codec.read_single_reply(frame)
    assert read == header
    start = len(frame) - sum(len(packb(e)) for e in entries)
    for (begin, end, rid, error), entry in zip(got, entries, strict=True):
        assert (begin, end) == (start, start + len(packb(entry)))
        assert frame[begin:end] == packb(entry)  # each entry forwarded as its bytes
        assert (rid, error) == expected_entry(entry)
        start = end


@SETTINGS
@given(data=st.binary(max_size=40) | mutated(single_frames) | single_frames)
def test_single_reply_agrees_with_msgpack(impl, data):
    check_single_reply(impl, data)


def str_forms(text: bytes) -> list[bytes]:
    """``text`` as a msgpack str in each of its four forms."""
    n = len(text)
    return [
        bytes([0xA0 | n]) + text,
        b"\xd9" + n.to_bytes(1, "big") + text,
        b"\xda" + n.to_bytes(2, "big") + text,
        b"\xdb" + n.to_bytes(4, "big") + text,
    ]


@pytest.mark.parametrize("key", str_forms(b"request_id"))
def test_single_reply_request_id_in_any_str_form(impl, key):
    entry = b"\x83\xa1a\x01" + key + b"\xcd\x01\x00" + b"\xa1b\x90"
    frame = b"\x92\x15\x91" + entry
    assert impl.codec.read_single_reply(frame) == (REPLY, [(3, len(frame), 256, None)])


@pytest.mark.parametrize(
    ("entry", "rid", "error"),
    [
        ({"request_id": -1}, -1, None),
        ({"request_id": INT64_MAX}, INT64_MAX, None),
        ({"request_id": INT64_MIN}, INT64_MIN, None),
        ({"request_id": 1, "x": {"request_id": 2}}, 1, None),  # top-level keys only
        ({"x": {"request_id": 2}}, None, "reply entry has no request_id"),
        ({b"request_id": 2}, None, "reply entry has no request_id"),  # a bin key is not a str
        ({"request_i": 2, "request_idx": 3}, None, "reply entry has no request_id"),
        ({}, None, "reply entry has no request_id"),
        ({"request_id": INT64_MAX + 1}, None, "request_id is not an int64"),
        ({"request_id": True}, None, "request_id is not an int64"),
        ({"request_id": None}, None, "request_id is not an int64"),
        ({"request_id": 1.0}, None, "request_id is not an int64"),
        ({"request_id": "1"}, None, "request_id is not an int64"),
        ({"request_id": [1]}, None, "request_id is not an int64"),
        ([1, 2], None, "reply entry is not a map"),
        ("request_id", None, "reply entry is not a map"),
        (None, None, "reply entry is not a map"),
    ],
)
def test_single_reply_entries(impl, entry, rid, error):
    frame = packb([REPLY, [{"request_id": 9}, entry, {"request_id": 10}]])
    _, entries = impl.codec.read_single_reply(frame)
    assert [(r, e) for _, _, r, e in entries] == [(9, None), (rid, error), (10, None)]
    assert frame[entries[1][0] : entries[1][1]] == packb(entry)


@pytest.mark.parametrize(
    ("first", "last", "expected"),
    [(b"\x01", b"\x02", (2, None)), (b"\x01", b"\xc0", (None, "request_id is not an int64"))],
)
def test_single_reply_last_request_id_wins(impl, first, last, expected):
    # as in the dict msgpack decodes
    entry = b"\x82\xaarequest_id" + first + b"\xaarequest_id" + last
    frame = b"\x92\x15\x91" + entry
    assert expected_entry(msgpack.unpackb(entry)) == expected
    assert impl.codec.read_single_reply(frame) == (REPLY, [(3, len(frame), *expected)])


def test_single_reply_larger_than_the_local_buffer(impl):
    entries = [{"request_id": i, "generated_tokens": [i] * (i % 7)} for i in range(3000)]
    frame = packb([REPLY, entries])
    _, got = impl.codec.read_single_reply(frame)
    assert [rid for _, _, rid, _ in got] == list(range(3000))
    assert b"".join(frame[start:end] for start, end, _, _ in got) == packb(entries)[3:]


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        packb([REPLY]),
        packb([REPLY, [], 1]),
        packb([PARTIAL, [], 1]),
        packb([SUBMIT, []]),
        packb([True, []]),
        packb([UINT64_MAX, []]),
        packb([REPLY, {}]),
        packb([REPLY, None]),
        packb([REPLY, [{"request_id": 1}]]) + b"\x00",  # trailing
        packb([REPLY, [{"request_id": 1}]])[:-1],  # truncated
        b"\x92\x15\xdd\xff\xff\xff\xff",  # claims 2**32-1 entries
        b"\x92\x15\x91\xdf\xff\xff\xff\xff",  # an entry claiming 2**32-1 pairs
        b"\x92\x15\x92\x80\xc1",  # a reserved byte as an entry
        b"\x92\x15\x91\x81\xaarequest_id\xc1",  # ... as the request_id
        b"\x92\x15\x91\x81\xaarequest_id\xcd\x01",  # a request_id cut short
        b"\x92\x15\x91\x81\xaarequest_i",  # a key cut short
        b"\x92\x15\x91\x81\xc1\x01",  # a reserved byte as a key
    ],
)
def test_single_reply_errors(impl, frame):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_single_reply(frame)
    assert info.value.rid is None


# -- single frames: checks and the splice writer ----------------------------------


@SETTINGS
@given(data=st.binary(max_size=40) | mutated(single_frames) | single_frames)
def test_check_prompt_and_map_agree_with_msgpack(impl, data):
    check_whole(impl, "check_prompt", data, (str, list))
    check_whole(impl, "check_map", data, (dict,))


@pytest.mark.parametrize(
    ("frame", "prompt", "map_"),
    [
        (packb("text"), True, False),
        (packb([1, 2]), True, False),
        (packb([]), True, False),
        (packb({"a": [1]}), False, True),
        (packb({}), False, True),
        (b"", False, False),
        (packb(b"bytes"), False, False),
        (packb(3), False, False),
        (packb("a") + packb("b"), False, False),  # two objects
        (packb({}) + b"\x00", False, False),
        (packb([1, 2])[:-1], False, False),
        (b"\xa2\xff\xfe", True, False),  # structure only: UTF-8 is the reader's business
    ],
)
def test_check_prompt_and_map(impl, frame, prompt, map_):
    for check, ok in ((impl.codec.check_prompt, prompt), (impl.codec.check_map, map_)):
        if ok:
            check(frame)
        else:
            with pytest.raises(ProtocolError):
                check(frame)


@SETTINGS
@given(header=int64s, rid=int64s, prompt=st.binary(max_size=30), params=st.binary(max_size=30))
def test_write_single_submit_splices_the_bytes(impl, header, rid, prompt, params):
    out = impl.codec.write_single_submit(header, rid, prompt, params)
    # a fixarray of 4, then the header and the rid in their smallest forms, then the spans
    assert out == b"\x94" + packb([header, rid])[1:] + prompt + params


def test_write_single_submit_large_spans(impl):
    prompt, params = packb(list(range(100_000))), packb({"k": "v" * 70_000})
    out = impl.codec.write_single_submit(SUBMIT, 1 << 40, memoryview(prompt), bytearray(params))
    assert out == packb([SUBMIT, 1 << 40, list(range(100_000)), {"k": "v" * 70_000}])


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), (1.0, TypeError), (None, TypeError), (INT64_MAX + 1, OverflowError)],
)
def test_write_single_submit_int_arguments(impl, value, error):
    with pytest.raises(error):
        impl.codec.write_single_submit(value, 1, b"\x90", b"\x80")
    with pytest.raises(error):
        impl.codec.write_single_submit(SUBMIT, value, b"\x90", b"\x80")


# -- block hashes from a prompt --------------------------------------------------------


def pack_tokens(tokens: list[int], form: str) -> bytes:
    """A token array in msgpack's smallest forms, or in one of the larger ones it also
    decodes: every reader must take them all (an array16/32 header, uint32/64, int64)."""
    if form == "packb":
        return packb(tokens)
    if form == "array16":
        return b"\xdc" + len(tokens).to_bytes(2, "big") + b"".join(packb(t) for t in tokens)
    prefix, size = {"uint32": (b"\xce", 4), "uint64": (b"\xcf", 8), "int64": (b"\xd3", 8)}[form]
    header = b"\xdd" + len(tokens).to_bytes(4, "big")
    return header + b"".join(prefix + t.to_bytes(size, "big") for t in tokens)


TOKEN_FORMS = ["packb", "array16", "uint32", "uint64", "int64"]


@SETTINGS
@given(tokens=tokens, block_size=st.integers(1, 20), form=st.sampled_from(TOKEN_FORMS))
def test_prompt_hashes_are_block_hashes(impl, tokens, block_size, form):
    prompt = pack_tokens(tokens, form)
    assert msgpack.unpackb(prompt) == tokens
    assert impl.codec.prompt_hashes(prompt, block_size) == block_hashes(tokens, block_size)


@pytest.mark.parametrize("block_size", [1, 2, 15, 16, 17, 31, 32, 33, 64, 1000])
def test_prompt_hashes_at_block_boundaries(impl, block_size):
    rng = random.Random(block_size)
    for n in sorted({0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size, 1500}):
        tokens = [rng.randrange(1 << 32) for _ in range(n)]
        expected = block_hashes(tokens, block_size)
        assert len(expected) == 8 * (n // block_size)
        assert impl.codec.prompt_hashes(packb(tokens), block_size) == expected


def test_prompt_hashes_of_a_long_prompt(impl):
    tokens = [(i * 7919) % 150_000 for i in range(32_000)]
    prompt = zmq.Frame(packb(tokens)).buffer  # read in place, from any buffer
    assert impl.codec.prompt_hashes(prompt, 16) == block_hashes(tokens, 16)


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        (packb("a str prompt"), "the prompt is a str"),
        (b"\xd9\x01a", "the prompt is a str"),
        (packb([1, -1]), "a token is not an int"),
        (packb([1, 1 << 32]), "a token is not an int"),
        (packb([1, UINT64_MAX]), "a token is not an int"),
        (packb([1, True]), "a token is not an int"),
        (packb([1, None]), "a token is not an int"),
        (packb([1, 1.0]), "a token is not an int"),
        (packb([1, [2]]), "a token is not an int"),
        (packb([1, "2"]), "a token is not an int"),
        (packb(list(range(64)) + [-5]), "a token is not an int"),  # after the last full block
        (packb({"a": 1}), "unexpected type"),
        (packb(b"bytes"), "unexpected type"),
        (packb(5), "unexpected type"),
        (b"", "truncated"),
        (packb([1, 2, 3])[:-1], "truncated"),
        (b"\xdd\xff\xff\xff\xff\x01", "truncated"),  # claims 2**32-1 tokens
        (packb([1, 2]) + b"\x00", "trailing bytes"),
    ],
)
def test_prompt_hashes_none_and_why(impl, prompt, why):
    with pytest.raises(ProtocolError, match=why.replace("*", r"\*")):
        impl.codec.prompt_hashes(prompt, 2)


@pytest.mark.parametrize(
    ("block_size", "error"),
    [(0, ValueError), (-1, ValueError), (1 << 32, ValueError), (True, TypeError), (2.0, TypeError)],
)
def test_prompt_hashes_block_size(impl, block_size, error):
    with pytest.raises(error):
        impl.codec.prompt_hashes(packb([1, 2]), block_size)


@SETTINGS
@given(data=st.binary(max_size=40) | mutated(tokens.map(packb)), block_size=st.integers(1, 4))
def test_prompt_hashes_agree_with_msgpack(impl, data, block_size):
    check_prompt_hashes(impl, data, block_size)


# BLAKE2b (RFC 7693), the C twin's own, against hashlib: every length up to a few
# blocks (128 bytes each), around each block boundary, and every digest size.
LENGTHS = sorted(set(range(0, 300)) | {b * 128 + d for b in range(2, 9) for d in (-1, 0, 1)})


@pytest.mark.parametrize("digest_size", [8, 1, 16, 32, 63, 64])
def test_blake2b_is_hashlibs(codec_extras, digest_size):
    rng = random.Random(digest_size)
    for n in LENGTHS:
        data = rng.randbytes(n)
        expected = hashlib.blake2b(data, digest_size=digest_size).digest()
        assert codec_extras.blake2b(data, digest_size) == expected, n


@SETTINGS
@given(data=st.binary(max_size=2000))
def test_blake2b_random_inputs(codec_extras, data):
    assert codec_extras.blake2b(data) == hashlib.blake2b(data, digest_size=8).digest()


def test_blake2b_large_input_and_buffers(codec_extras):
    data = random.Random(0).randbytes(1 << 20)
    expected = hashlib.blake2b(data, digest_size=8).digest()
    assert codec_extras.blake2b(memoryview(b"x" + data)[1:]) == expected
    assert codec_extras.blake2b(bytearray(data)) == expected


@pytest.mark.parametrize("digest_size", [0, 65, -1])
def test_blake2b_digest_size(codec_extras, digest_size):
    with pytest.raises(ValueError):
        codec_extras.blake2b(b"x", digest_size)


# -- any bytes-like frame ----------------------------------------------------------


def test_buffers(impl, codec_extras):
    frame = submit_frame(SUBMIT, 5, [{"n": 1}])
    padded = b"xx" + frame
    views = [
        frame,
        bytearray(frame),
        memoryview(frame),
        memoryview(padded)[2:],
        zmq.Frame(frame).buffer,
    ]
    for view in views:
        assert impl.codec.read_header(view) == (SUBMIT, 3, 2)
        assert impl.codec.read_submit(view) == (SUBMIT, 3, 5, 3)
        assert codec_extras.rewrite_submit(view, 6) == submit_frame(SUBMIT, 6, [{"n": 1}])
    reply = packb([REPLY, [[1, True]]])
    assert impl.codec.read_reply(memoryview(b"x" + reply)[1:]) == (REPLY, [(1, True)])
    batch = packb([REPLY_BATCH, [[1, True]]])
    assert impl.codec.read_reply_batch(memoryview(b"x" + batch)[1:]) == [(1, True)]
    submit = packb([SUBMIT_BATCH, [[1, None, False]]])
    assert impl.codec.read_submit_batch(bytearray(submit)) == [(1, 5, 1, False)]
    assert codec_extras.decode(bytearray(packb([1, None]))) == [1, None]


@pytest.mark.parametrize(
    "name",
    [
        "read_header",
        "read_submit",
        "read_reply",
        "read_header_int",
        "read_reply_batch",
        "decode",
        "read_single_head",
        "read_single_submit",
        "read_single_reply",
        "check_prompt",
        "check_map",
        "blake2b",
    ],
)
def test_not_a_buffer(impl, codec_extras, name):
    with pytest.raises(TypeError):
        function(impl, codec_extras, name)(12)


# -- C against Python, on any bytes ---------------------------------------------------


def function(impl, codec_extras, name: str):
    """A function of impl's codec, or one of its test-only ones."""
    return getattr(impl.codec, name, None) or getattr(codec_extras, name)


def same_everywhere(c_impl, c_codec_extras, py_impl, data: bytes) -> None:
    for name, args in [
        ("read_header", ()),
        ("read_submit", ()),
        ("rewrite_submit", (7,)),
        ("read_reply", ()),
        ("read_header_int", ()),
        ("read_submit_batch", (3,)),
        ("read_submit_batch", (2,)),
        ("read_submit_batch", (5,)),
        ("read_qos", (min(3, len(data)),)),
        ("read_reply_batch", ()),
        ("decode", ()),
        ("read_single_head", ()),
        ("read_single_submit", ()),
        ("read_single_reply", ()),
        ("check_prompt", ()),
        ("check_map", ()),
        ("prompt_hashes", (1,)),
        ("prompt_hashes", (3,)),
    ]:
        c = outcome(function(c_impl, c_codec_extras, name), data, *args)
        py = outcome(function(py_impl, py_codec_extras, name), data, *args)
        assert c == py, name


@pytest.mark.c_extension
@DIFFERENTIAL
@given(data=st.binary(max_size=64))
def test_differential_any_bytes(c_impl, c_codec_extras, py_impl, data):
    same_everywhere(c_impl, c_codec_extras, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(data=mutated())
def test_differential_mutated_frames(c_impl, c_codec_extras, py_impl, data):
    same_everywhere(c_impl, c_codec_extras, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(
    data=st.builds(
        lambda head, tail: b"\x94\x14\x05" + head + tail,
        st.binary(max_size=3),
        st.binary(max_size=40),
    )
)
def test_differential_submit_remainders(c_impl, c_codec_extras, py_impl, data):
    # random bytes after a valid header and rid: the skip of the remainder
    same_everywhere(c_impl, c_codec_extras, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(data=mutated(single_frames))
def test_differential_mutated_single_frames(c_impl, c_codec_extras, py_impl, data):
    same_everywhere(c_impl, c_codec_extras, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(
    data=st.builds(
        lambda head, tail: b"\x92\x15\x91" + head + tail,
        st.sampled_from([b"\x81", b"\x82", b"\x83\xaarequest_id", b"\x81\xaarequest_id"]),
        st.binary(max_size=30),
    )
    | st.builds(
        lambda head, tail: b"\x94\x14\x05" + head + tail,
        st.sampled_from([b"", b"\x91", b"\xa1a", b"\x92\x01"]),
        st.binary(max_size=30),
    )
)
def test_differential_single_remainders(c_impl, c_codec_extras, py_impl, data):
    # random bytes where a reply map's keys, or a SUBMIT's prompt and params, are read
    same_everywhere(c_impl, c_codec_extras, py_impl, data)


# Every fixed-size form the skip takes by table, in runs, and cut short at every byte.
FIXED_FORMS = [
    b"\x05", b"\xff", b"\xc0", b"\xc2", b"\xc3", b"\xcc\x80", b"\xcd\x01\x00",
    b"\xce\x00\x01\x00\x00", b"\xcf" + bytes(8), b"\xd0\x80", b"\xd1\x80\x00",
    b"\xd2" + bytes(4), b"\xd3" + bytes(8), b"\xca" + bytes(4), b"\xcb" + bytes(8),
    b"\xa3abc", b"\xa0", b"\xd4\x01\x00", b"\xd5\x01" + bytes(2), b"\xd6\x01" + bytes(4),
    b"\xd7\x01" + bytes(8), b"\xd8\x01" + bytes(16),
]  # fmt: skip


@pytest.mark.parametrize("form", FIXED_FORMS, ids=lambda f: f[:1].hex())
def test_skip_runs_of_fixed_size_objects(impl, form):
    run = form * 40
    frame = b"\x94\x14\x05\xdc\x00\x28" + run + b"\x80"
    assert impl.codec.read_single_submit(frame) == (20, 5, 4, 3, len(frame) - 1, len(frame))
    assert impl.codec.read_submit(b"\x93\x14\x05\xdc\x00\x28" + run) == (20, 3, 5, 3)
    for cut in range(1, len(form)):
        with pytest.raises(ProtocolError) as info:
            impl.codec.read_single_submit(frame[: 6 + len(run) - cut])
        assert info.value.rid == 5
