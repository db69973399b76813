"""Message declarations: pack and parse derive from one spec, and parse validates.

The layouts are checked against the published table byte for byte, and against
both codecs: what ``pack`` writes, the coordinator's codec reads the same way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest

from coordkit import protocol
from coordkit.protocol import Header, ProtocolError
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    DISCONNECT,
    ERROR,
    HEARTBEAT,
    PARTIAL,
    RELEASE_KV,
    REPLY,
    SET_GENERATION_EPOCH,
    SHUTDOWN,
    STATS,
    STATS_REPLY,
    SUBMIT,
    SUBMIT_KV,
)


def m(obj):
    return msgpack.packb(obj, use_bin_type=True)


SP = {"temperature": 0.5}

LAYOUTS = [
    (protocol.CONNECT, (), [m([CONNECT])]),
    (protocol.CONNECT_COORDKIT, ({"coordkit": 1},), [m([CONNECT, {"coordkit": 1}])]),
    (protocol.CONNECT_ACK, (), [m([CONNECT_ACK])]),
    (protocol.SUBMIT_REQUEST, (7, SP, b"p"), [m([SUBMIT, 7, SP]), b"p"]),
    (protocol.SUBMIT_REQUEST, (7, SP, b"p", b"h" * 8), [m([SUBMIT, 7, SP]), b"p", b"h" * 8]),
    (
        protocol.SUBMIT_REQUEST_WITH_KV,
        (7, SP, {"k": 1}, b"p", b"s"),
        [m([SUBMIT_KV, 7, SP, {"k": 1}]), b"p", b"s"],
    ),
    (protocol.SUBMIT_REQUEST_QOS, (7, -1, 250, SP, b"p"), [m([SUBMIT, 7, -1, 250, SP]), b"p"]),
    (
        protocol.SUBMIT_REQUEST_WITH_KV_QOS,
        (7, 3, 0, SP, {"k": 1}, b"p", b"s"),
        [m([SUBMIT_KV, 7, 3, 0, SP, {"k": 1}]), b"p", b"s"],
    ),
    (protocol.CLIENT_REPLY, (7, b"body"), [m([REPLY, 7]), b"body"]),
    (protocol.CLIENT_REPLY_PARTIAL, (7, b"body"), [m([PARTIAL, 7]), b"body"]),
    (protocol.ABORT_REQUEST, (7,), [m([ABORT, 7])]),
    (protocol.RELEASE_KV, (7,), [m([RELEASE_KV, 7])]),
    (protocol.SET_GENERATION_EPOCH, (3,), [m([SET_GENERATION_EPOCH, 3])]),
    (protocol.DISCONNECT, (), [m([DISCONNECT])]),
    (protocol.SHUTDOWN, (), [m([SHUTDOWN])]),
    (protocol.ERROR, (None, 4, "busy"), [m([ERROR, None, 4, "busy"])]),
    (protocol.HEARTBEAT, (2, 8), [m([HEARTBEAT, 2, 8])]),
    (protocol.STATS, (), [m([STATS])]),
    (protocol.STATS_REPLY, (m({"a": 1}),), [m([STATS_REPLY]), m({"a": 1})]),
]


@pytest.mark.parametrize(("spec", "values", "frames"), LAYOUTS)
def test_pack_gives_the_published_layout_and_parse_inverts_it(spec, values, frames):
    assert spec.pack(*values) == frames
    # The whole message, not a prefix of it (empty for CONNECT, STATS, ...): every field,
    # and None for an optional frame that was left out.
    assert spec.parse(frames) == spec.message_type(*values)


def test_every_control_signal_is_declared():
    assert set(protocol.CONTROL) == set(range(40, 48))
    for header, spec in protocol.CONTROL.items():
        if header != Header.SET_GENERATION_EPOCH:
            assert spec.pack() == [m([header])]


def test_batched_replies():
    frames = protocol.ENGINE_REPLY.pack([(1, True), (2, False)], [b"a", b"b"])
    assert frames == [m([REPLY, [[1, True], [2, False]]]), b"a", b"b"]
    assert protocol.ENGINE_REPLY.parse(frames) == ([[1, True], [2, False]], [b"a", b"b"])
    frames = protocol.ENGINE_REPLY_PARTIAL.pack([1, 2], [b"a", b"b"])
    assert frames == [m([PARTIAL, [1, 2]]), b"a", b"b"]


BAD = [
    (protocol.SUBMIT_REQUEST, [m([SUBMIT, 7, SP])], "expected 2-3 frames"),
    (protocol.SUBMIT_REQUEST, [m([SUBMIT, 7, SP]), b"p", b"h", b"x"], "expected 2-3 frames"),
    (protocol.SUBMIT_REQUEST, [m([SUBMIT, 7]), b"p"], "expected 2 metadata fields"),
    (protocol.SUBMIT_REQUEST, [m([SUBMIT, True, SP]), b"p"], "'rid' must be int"),
    (protocol.SUBMIT_REQUEST, [m([SUBMIT, "7", SP]), b"p"], "'rid' must be int"),
    (protocol.SUBMIT_REQUEST, [m([REPLY, 7, SP]), b"p"], "header must be 20"),
    (protocol.SUBMIT_REQUEST, [b"\xc1", b"p"], "not msgpack"),
    (protocol.SUBMIT_REQUEST, [m({"a": 1}), b"p"], "non-empty array"),
    (protocol.ERROR, [m([ERROR, 1, "4", "x"])], "'code' must be int"),
    (protocol.ENGINE_REPLY, [m([REPLY, [[1, True], [2, False]]]), b"a"], "2 entries but 1"),
    (protocol.ENGINE_REPLY, [m([REPLY, [[1, 1]]]), b"a"], "'needs_detokenize' must be bool"),
    (protocol.ENGINE_REPLY, [m([REPLY, [1]]), b"a"], "each entry must be an array of 2"),
    (protocol.ENGINE_REPLY_PARTIAL, [m([PARTIAL, [[1, True]]]), b"a"], "'rid' must be int"),
    (protocol.ENGINE_REPLY, [], "empty message"),
]


@pytest.mark.parametrize(("spec", "frames", "reason"), BAD)
def test_parse_names_the_message_and_the_fault(spec, frames, reason):
    with pytest.raises(ProtocolError) as error:
        spec.parse(frames)
    assert str(error.value).startswith(spec.name)
    assert reason in str(error.value)


def test_pack_refuses_what_parse_would():
    with pytest.raises(ProtocolError):
        protocol.SUBMIT_REQUEST.pack("7", SP, b"p")
    with pytest.raises(ProtocolError):
        protocol.ENGINE_REPLY.pack([(1, False)], [b"a", b"b"])


@pytest.mark.parametrize("rid", [0, 7, -1, 2**31, 2**63 - 1, -(2**63)])
def test_the_codec_reads_what_the_specs_write(impl, codec_extras, rid):
    meta = protocol.SUBMIT_REQUEST.pack(rid, SP, b"p")[0]
    header, length, got, offset = impl.codec.read_submit(meta)
    assert (header, length, got) == (SUBMIT, 3, rid)
    assert meta[offset:] == m(SP)
    assert codec_extras.rewrite_submit(meta, 5) == protocol.SUBMIT_REQUEST.pack(5, SP, b"p")[0]
    assert impl.codec.write_header_int(REPLY, rid) == protocol.CLIENT_REPLY.pack(rid, b"")[0]
    reply = protocol.ENGINE_REPLY.pack([(rid, True)], [b"a"])[0]
    assert impl.codec.read_reply(reply) == (REPLY, [(rid, True)])


def test_submit_batch_entries_with_and_without_qos():
    frames = protocol.SUBMIT_BATCH.pack([(1, SP, b"a", None), (2, SP, b"b", b"h" * 8, -3, 40)])
    assert frames == [
        m([protocol.Header.SUBMIT_BATCH, [[1, SP, False], [2, -3, 40, SP, True]]]),
        b"a",
        b"b",
        b"h" * 8,
    ]
    first, second = protocol.SUBMIT_BATCH.parse(frames)
    assert (first.priority, first.deadline_ms) == (0, 0)
    assert (second.rid, second.prompt, second.priority, second.deadline_ms) == (2, b"b", -3, 40)
    with pytest.raises(ProtocolError, match="a priority and a deadline_ms"):
        protocol.SUBMIT_BATCH.pack([(1, SP, b"a", None, 3)])
    with pytest.raises(ProtocolError, match="array of 3 or 5"):
        protocol.SUBMIT_BATCH.parse([m([protocol.Header.SUBMIT_BATCH, [[1, 2, SP, True]]]), b"a"])


@pytest.mark.parametrize("rid", [0, -1, 2**63 - 1])
def test_the_codec_reads_the_qos_the_specs_write(impl, rid):
    """What follows the QoS is the params span an engine is sent: the QoS stripped."""
    meta = protocol.SUBMIT_REQUEST_QOS.pack(rid, -128, 2**40, SP, b"p")[0]
    header, length, got, offset = impl.codec.read_submit(meta)
    assert (header, length, got) == (SUBMIT, 5, rid)
    priority, deadline_ms, end = impl.codec.read_qos(meta, offset)
    assert (priority, deadline_ms) == (-128, 2**40)
    assert meta[end:] == m(SP)


@pytest.mark.parametrize(
    ("hello", "expected"),
    [
        ({"coordkit": 1, "qos": 1, "tenant": "acme"}, (True, "acme")),
        ({"coordkit": 1, "tenant": "é" * 64}, (False, "é" * 64)),  # 128 bytes: the most
        ({"coordkit": 1, "tenant": "é" * 65}, (False, None)),
        ({"coordkit": 1, "tenant": ""}, (False, None)),
        ({"coordkit": 1, "tenant": b"acme"}, (False, None)),
        ({"coordkit": 1, "qos": True}, (False, None)),  # a feature is an int >= 1
        ({"qos": 1, "tenant": "acme"}, (False, None)),  # not a coordkit client
    ],
)
def test_a_connect_names_its_tenant_and_asks_for_qos(hello, expected):
    said = protocol.parse_connect(protocol.CONNECT_COORDKIT.pack(hello))
    assert (said.qos, said.tenant) == expected


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(8, 8), (protocol.MAX_CAPACITY, protocol.MAX_CAPACITY), (0, 0), (-1, 0), (True, 0), (1.5, 0)]
    + [(protocol.MAX_CAPACITY + 1, 0), ("8", 0)],
)
def test_an_engine_hello_declares_its_capacity(capacity, expected):
    hello = protocol.ENGINE_HELLO.pack({"coordkit": 1, "capacity": capacity})
    assert protocol.parse_engine_hello(hello).capacity == expected
    megatron = protocol.ENGINE_HELLO.pack({"capacity": 8})
    assert protocol.parse_engine_hello(megatron).capacity == 0


def test_packb_is_msgpack_packb_in_every_thread():
    """packb keeps a Packer per thread: threads packing at once do not mix their bytes."""
    values = [{"n": i, "text": "x" * (i % 50), "list": list(range(i % 20))} for i in range(2000)]
    expected = [msgpack.packb(value, use_bin_type=True) for value in values]
    with pytest.raises(TypeError):
        protocol.packb(object())  # a failed pack leaves nothing behind for the next
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: [protocol.packb(v) for v in values], range(8)))
    assert all(result == expected for result in results)
