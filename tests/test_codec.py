"""The header codec contract, on both implementations.

Every test taking ``impl`` runs on the Cython and on the msgpack codec; the
differential tests feed the same bytes to both and require the same outcome:
the same result, or ProtocolError with the same ``rid``.
"""

from __future__ import annotations

import enum
from collections import namedtuple
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit.protocol import ProtocolError
from tests.support.peers import PARTIAL, REPLY, REPLY_BATCH, SUBMIT, SUBMIT_BATCH

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
)
reply_batches = st.builds(
    lambda entries: packb([REPLY_BATCH, [list(e) for e in entries]]),
    st.lists(st.tuples(int64s, st.booleans()), max_size=20),
)
header_ints = st.builds(lambda h, v: packb([h, v]), int64s, int64s)
valid_frames = (
    submits | replies | submit_batches | reply_batches | header_ints | supported.map(packb)
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid frame with a few bytes flipped, cut, inserted or appended."""
    frame = bytearray(draw(valid_frames))
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
def test_encode_is_packb(impl, obj):
    assert impl.codec.encode(obj) == packb(obj)


@SETTINGS
@given(obj=supported)
def test_decode_round_trip(impl, obj):
    assert repr(impl.codec.decode(packb(obj))) == repr(as_lists(obj))


@SETTINGS
@given(data=st.binary(max_size=40) | mutated())
def test_decode_agrees_with_msgpack(impl, data):
    try:
        expected = msgpack.unpackb(data)
    except Exception:
        ok = False
    else:
        ok = supported_value(expected)
    if ok:
        assert repr(impl.codec.decode(data)) == repr(expected)
    else:
        with pytest.raises(ProtocolError):
            impl.codec.decode(data)


class Color(enum.IntEnum):
    RED = 7


@pytest.mark.parametrize(
    "obj",
    [Color.RED, [Color.RED, (1, 2)], namedtuple("P", "x y")(1, [None]), [[]] * 16, [0] * 70000],
)
def test_encode_subclasses_and_long_arrays(impl, obj):
    assert impl.codec.encode(obj) == packb(obj)
    assert impl.codec.decode(packb(obj)) == as_lists(obj)


@pytest.mark.parametrize(
    "obj", ["a", b"a", 1.5, {}, object(), [1, "a"], (None, [{}]), UINT64_MAX + 1, INT64_MIN - 1]
)
def test_encode_unsupported(impl, obj):
    with pytest.raises(ProtocolError):
        impl.codec.encode(obj)


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
def test_decode_unsupported(impl, frame):
    with pytest.raises(ProtocolError):
        impl.codec.decode(frame)


def nested(depth: int) -> list:
    obj: list = []
    for _ in range(depth - 1):
        obj = [obj]
    return obj


def test_nesting_limit(impl):
    assert impl.codec.MAX_NESTING == MAX_NESTING
    assert impl.codec.encode(nested(MAX_NESTING)) == packb(nested(MAX_NESTING))
    assert impl.codec.decode(packb(nested(MAX_NESTING))) == nested(MAX_NESTING)
    with pytest.raises(ProtocolError, match="deep"):
        impl.codec.encode(nested(MAX_NESTING + 1))
    with pytest.raises(ProtocolError, match="deep"):
        impl.codec.decode(packb(nested(MAX_NESTING + 1)))
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ProtocolError, match="deep"):
        impl.codec.encode(cycle)


# -- read_header / read_submit / rewrite_submit ----------------------------------


@SETTINGS
@given(header=int64s, rid=int64s, rest=st.lists(anything, max_size=4), new_rid=int64s)
def test_submit(impl, header, rid, rest, new_rid):
    frame = submit_frame(header, rid, rest)
    offset = len(frame) - sum(len(packb(x)) for x in rest)
    assert impl.codec.read_header(frame) == (header, len(rest) + 2, offset - len(packb(rid)))
    assert impl.codec.read_submit(frame) == (header, len(rest) + 2, rid, offset)
    assert impl.codec.rewrite_submit(frame, new_rid) == submit_frame(header, new_rid, rest)


def test_submit_array16_and_large_remainder(impl):
    rest = [None] * 20 + [b"\0" * (1 << 20)]
    frame = submit_frame(SUBMIT, 5, rest)
    assert impl.codec.read_submit(frame) == (SUBMIT, 23, 5, 5)
    assert impl.codec.rewrite_submit(frame, 1 << 40) == submit_frame(SUBMIT, 1 << 40, rest)


def test_header_ignores_what_follows(impl):
    assert impl.codec.read_header(b"\x93\x14\xc1\xc1") == (20, 3, 2)
    assert impl.codec.read_header(b"\xdd\xff\xff\xff\xff\xd0\x80") == (-128, 2**32 - 1, 7)
    assert impl.codec.read_header(b"\xdc\x00\x01\xcf" + INT64_MAX.to_bytes(8, "big")) == (
        INT64_MAX,
        1,
        12,
    )


def test_remainder_is_checked_for_structure_only(impl):
    # a str with invalid UTF-8, an ext -1 (timestamp) of a bad length, floats, any map keys
    rest = b"\xa2\xff\xfe" + b"\xc7\x03\xffxyz" + packb({1: 1.5, b"k": [{}]})
    frame = b"\x95\x14\x05" + rest
    assert impl.codec.read_submit(frame) == (20, 5, 5, 3)
    assert impl.codec.rewrite_submit(frame, 300) == b"\x95\x14\xcd\x01\x2c" + rest


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
def test_submit_errors(impl, frame, rid):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit(frame)
    assert info.value.rid == rid
    with pytest.raises(ProtocolError) as info:
        impl.codec.rewrite_submit(frame, 1)
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
        packb([REPLY, [[1]]]),
        packb([REPLY, [[1, True, 2]]]),
        packb([REPLY, [[1, 1]]]),  # flag is an int
        packb([REPLY, [[True, True]]]),
        packb([REPLY, [[INT64_MAX + 1, True]]]),
        packb([REPLY, [1]]),  # a PARTIAL entry under ENGINE_REPLY
        packb([PARTIAL, [[1, True]]]),  # and the other way round
        packb([PARTIAL, [None]]),
        packb([REPLY, [[1, True]]]) + b"\x00",  # trailing
        packb([REPLY, [[1, True]]])[:-1],  # truncated
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
    ("frame", "width"),
    [
        (b"", 3),
        (packb([SUBMIT_BATCH]), 3),
        (packb([SUBMIT_BATCH, [], 1]), 3),
        (packb([REPLY_BATCH, []]), 3),  # another header
        (packb([SUBMIT_BATCH, {}]), 3),
        (packb([SUBMIT_BATCH, [[1, {}, True]]]), 2),  # a client's entry where an engine's goes
        (packb([SUBMIT_BATCH, [[1, {}]]]), 3),  # and the other way round
        (packb([SUBMIT_BATCH, [[1, {}, 1]]]), 3),  # hashed is an int
        (packb([SUBMIT_BATCH, [["1", {}, True]]]), 3),
        (packb([SUBMIT_BATCH, [[INT64_MAX + 1, {}, True]]]), 3),
        (packb([SUBMIT_BATCH, [[1, {}, True]]]) + b"\x00", 3),
        (packb([SUBMIT_BATCH, [[1, {}, True]]])[:-1], 3),
        (b"\x92\x5f\x91\x93\x01\xc1\xc3", 3),  # reserved byte in the params
        (b"\x92\x5f\xdd\xff\xff\xff\xff", 3),  # claims 2**32-1 entries
    ],
)
def test_submit_batch_errors(impl, frame, width):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_submit_batch(frame, width)
    assert info.value.rid is None


def test_submit_batch_width(impl):
    with pytest.raises(ValueError):
        impl.codec.read_submit_batch(packb([SUBMIT_BATCH, []]), 4)


@SETTINGS
@given(entries=st.lists(st.tuples(int64s, st.booleans()), max_size=100))
def test_reply_batch(impl, entries):
    frame = packb([REPLY_BATCH, [list(e) for e in entries]])
    assert impl.codec.read_reply_batch(frame) == entries


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        packb([REPLY_BATCH]),
        packb([REPLY, [[1, True]]]),  # an engine's reply header
        packb([REPLY_BATCH, [[1]]]),
        packb([REPLY_BATCH, [[1, True, 2]]]),
        packb([REPLY_BATCH, [[1, 1]]]),
        packb([REPLY_BATCH, [1]]),
        packb([REPLY_BATCH, [[INT64_MAX + 1, True]]]),
        packb([REPLY_BATCH, [[1, True]]]) + b"\x00",
        packb([REPLY_BATCH, [[1, True]]])[:-1],
    ],
)
def test_reply_batch_errors(impl, frame):
    with pytest.raises(ProtocolError) as info:
        impl.codec.read_reply_batch(frame)
    assert info.value.rid is None


# -- writers -----------------------------------------------------------------------


@SETTINGS
@given(header=int64s, value=int64s)
def test_writers(impl, header, value):
    assert impl.codec.write_header(header) == packb([header])
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
def test_int_arguments(impl, value, error):
    with pytest.raises(error):
        impl.codec.write_header(value)
    with pytest.raises(error):
        impl.codec.write_header_int(REPLY, value)
    with pytest.raises(error):
        impl.codec.rewrite_submit(packb([SUBMIT, 1]), value)


def test_int_enum_arguments(impl):
    assert impl.codec.write_header_int(Color.RED, Color.RED) == packb([7, 7])


# -- any bytes-like frame ----------------------------------------------------------


def test_buffers(impl):
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
        assert impl.codec.rewrite_submit(view, 6) == submit_frame(SUBMIT, 6, [{"n": 1}])
    reply = packb([REPLY, [[1, True]]])
    assert impl.codec.read_reply(memoryview(b"x" + reply)[1:]) == (REPLY, [(1, True)])
    batch = packb([REPLY_BATCH, [[1, True]]])
    assert impl.codec.read_reply_batch(memoryview(b"x" + batch)[1:]) == [(1, True)]
    submit = packb([SUBMIT_BATCH, [[1, None, False]]])
    assert impl.codec.read_submit_batch(bytearray(submit)) == [(1, 5, 1, False)]
    assert impl.codec.decode(bytearray(packb([1, None]))) == [1, None]


@pytest.mark.parametrize(
    "name",
    ["read_header", "read_submit", "read_reply", "read_header_int", "read_reply_batch", "decode"],
)
def test_not_a_buffer(impl, name):
    with pytest.raises(TypeError):
        getattr(impl.codec, name)(12)


# -- C against Python, on any bytes ---------------------------------------------------


def same_everywhere(c_impl, py_impl, data: bytes) -> None:
    for name, args in [
        ("read_header", ()),
        ("read_submit", ()),
        ("rewrite_submit", (7,)),
        ("read_reply", ()),
        ("read_header_int", ()),
        ("read_submit_batch", (3,)),
        ("read_submit_batch", (2,)),
        ("read_reply_batch", ()),
        ("decode", ()),
    ]:
        c = outcome(getattr(c_impl.codec, name), data, *args)
        py = outcome(getattr(py_impl.codec, name), data, *args)
        assert c == py, name


@pytest.mark.c_extension
@DIFFERENTIAL
@given(data=st.binary(max_size=64))
def test_differential_any_bytes(c_impl, py_impl, data):
    same_everywhere(c_impl, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(data=mutated())
def test_differential_mutated_frames(c_impl, py_impl, data):
    same_everywhere(c_impl, py_impl, data)


@pytest.mark.c_extension
@DIFFERENTIAL
@given(
    data=st.builds(
        lambda head, tail: b"\x94\x14\x05" + head + tail,
        st.binary(max_size=3),
        st.binary(max_size=40),
    )
)
def test_differential_submit_remainders(c_impl, py_impl, data):
    # random bytes after a valid header and rid: the skip of the remainder
    same_everywhere(c_impl, py_impl, data)
