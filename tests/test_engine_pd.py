"""coordkit.Engine in disaggregated prefill/decode, against a bare ROUTER playing the
coordinator: the role and capacity said in the hello and granted in the ACK, the
hops as events, the handoff and the decode's transfer messages, frame for frame, on
both engine cores (``impl``)."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from coordkit.engine import Engine, ReleaseKV, Request, SendKV
from coordkit.protocol import ProtocolError, packb, unpackb
from tests.support.cluster import bind_address
from tests.support.peers import (
    ENGINE_ACK,
    HANDOFF,
    HELD,
    KV_READ_DONE,
    KV_TRANSFER_READY,
    REBUILD_HELLO,
    RELEASE_KV,
    REQUEST_ERROR,
    SEND_KV,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    engine_hello,
)

TIMEOUT_MS = 5000


@pytest.fixture
def router(tmp_path):
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)  # a missing message fails, never hangs
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address("ipc", tmp_path))
    yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close()


def registered(router, impl, **kwargs) -> tuple[Engine, dict]:
    """An engine of ``impl`` connected to ``router``; its registration received, and
    its hello (without the rebuild's keys and its session)."""
    socket, address = router
    engine = Engine(address, implementation=impl.name, **kwargs)
    assert socket.recv_multipart() == [engine.identity, b""]
    identity, frame = socket.recv_multipart()
    hello = engine_hello(frame)
    for key in REBUILD_HELLO:
        hello.pop(key, None)
    return engine, hello


def ack(socket, engine: Engine, granted: dict) -> None:
    socket.send_multipart([engine.identity, packb([ENGINE_ACK, granted])])
    assert engine.wait_registered(TIMEOUT_MS / 1000)


def collect(engine: Engine, count: int) -> list:
    events: list = []
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(events) < count and time.monotonic() < deadline:
        events += engine.poll(0.1)
    assert len(events) == count, events
    return events


def test_the_hello_says_the_role_and_the_ack_grants_it(router, impl, caplog):
    socket, _ = router
    engine, hello = registered(router, impl, role="prefill", capacity=6)
    with engine:
        assert hello == {"coordkit": 1, "ack": 1, "batch": 1, "role": "prefill", "capacity": 6}
        ack(socket, engine, {"batch": 1, "role": "prefill"})
        assert engine.role_granted
    engine, hello = registered(
        router, impl, rank=1, role="decode", capacity=2, domain="rack-1", transfer={"rank": 9}
    )
    with engine, caplog.at_level(logging.WARNING, logger="coordkit"):
        assert hello["domain"] == "rack-1" and hello["transfer"] == {"rank": 9}
        ack(socket, engine, {"batch": 1})  # a coordinator that does not run P/D
        assert engine.registered and not engine.role_granted
    assert "did not take the role 'decode'" in caplog.text


def test_an_aggregated_engine_says_no_role(router, impl):
    engine, hello = registered(router, impl, capacity=3)
    with engine:
        assert "role" not in hello and hello["capacity"] == 3  # its capacity: for the queue
        assert not engine.role_granted


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"role": "router", "capacity": 1}, "role must be one of prefill, decode, both or None"),
        ({"role": "decode"}, "a decode engine declares its capacity"),
        ({"role": "both", "capacity": 1, "hello": False}, "said in its hello"),
    ],
)
def test_a_role_without_what_it_needs_is_refused(router, impl, kwargs, reason):
    _, address = router
    with pytest.raises(ValueError, match=reason):
        Engine(address, implementation=impl.name, **kwargs)


def test_the_hops_arrive_as_requests(router, impl):
    socket, _ = router
    engine, _ = registered(router, impl, role="both", capacity=4)
    with engine:
        ident = engine.identity
        hop = {"temperature": 0.5, "do_kv_handoff": True}
        socket.send_multipart([ident, packb([SUBMIT, 1, hop]), packb([1, 2, 3])])
        socket.send_multipart([ident, packb([SUBMIT, 2, {}]), packb([4])])
        batch = packb([SUBMIT_BATCH, [[3, hop], [4, {"do_kv_handoff": 1}]]])
        socket.send_multipart([ident, batch, packb([5]), packb([6])])
        kv_meta = {"source": "engine-7", "resume_tokens": [42]}
        decode = packb([SUBMIT_KV, 5, {"stream": True}, kv_meta])
        socket.send_multipart([ident, decode, packb([1, 2, 3]), packb([10, 11])])
        prefill, whole, batched, not_a_hop, handoff = collect(engine, 5)
    assert all(isinstance(e, Request) for e in (prefill, whole, batched, not_a_hop, handoff))
    assert prefill.prefill_hop() and batched.prefill_hop()
    assert not whole.prefill_hop() and not not_a_hop.prefill_hop()  # the key says True
    assert not any(r.decode_hop() for r in (prefill, whole, batched, not_a_hop))
    assert handoff.decode_hop() and not handoff.prefill_hop()
    assert (handoff.server_rid, handoff.kv_meta, handoff.src_blocks()) == (5, kv_meta, [10, 11])
    assert handoff.prompt_tokens() == [1, 2, 3] and whole.src_blocks() is None
    assert engine.pending == 5


def test_a_prefill_takes_send_kv_and_release_kv(router, impl):
    socket, _ = router
    engine, _ = registered(router, impl, role="prefill", capacity=4)
    with engine:
        ident = engine.identity
        decode_meta = [{"global_rank": 3, "request_capacity": 2}]
        socket.send_multipart([ident, packb([SEND_KV, 5, decode_meta, 2])])
        socket.send_multipart([ident, packb([SEND_KV, 6, decode_meta])])  # main's layout
        socket.send_multipart([ident, packb([SEND_KV, 7, decode_meta, "2"])])  # dropped
        socket.send_multipart([ident, packb([RELEASE_KV, 5])])
        socket.send_multipart([ident, packb([RELEASE_KV, 8, 9])])  # several, in order
        socket.send_multipart([ident, packb([RELEASE_KV])])  # dropped: no rid
        socket.send_multipart([ident, packb([RELEASE_KV, 10, "11"])])  # dropped whole
        assert collect(engine, 5) == [
            SendKV(5, decode_meta, 2),
            SendKV(6, decode_meta, 0),
            ReleaseKV(5),
            ReleaseKV(8),
            ReleaseKV(9),
        ]
        assert engine.poll(0.3) == []


def test_handoff_is_one_message_for_the_step(router, impl):
    socket, _ = router
    engine, _ = registered(router, impl, role="prefill", capacity=4)
    with engine:
        ident = engine.identity
        for rid in (1, 2):
            socket.send_multipart([ident, packb([SUBMIT, rid, {"do_kv_handoff": True}]), b"p"])
        collect(engine, 2)
        assert engine.pending == 2
        engine.handoff([(1, {"resume_tokens": [7]}, [3, 4]), (2, None, packb([5]))])
        engine.handoff([])  # nothing: no message
        assert engine.pending == 0
        assert socket.recv_multipart() == [
            ident,
            packb([HANDOFF, [[1, {"resume_tokens": [7]}], [2, None]]]),
            packb([3, 4]),
            packb([5]),
        ]
        assert not socket.poll(100)


def test_a_decode_says_ready_read_done_or_failed(router, impl):
    socket, _ = router
    engine, _ = registered(router, impl, role="decode", capacity=4)
    with engine:
        ident = engine.identity
        for rid in (5, 6):
            meta = packb([SUBMIT_KV, rid, {}, {"k": 1}])
            socket.send_multipart([ident, meta, packb([1]), packb([9])])
        collect(engine, 2)
        engine.kv_transfer_ready(5, 1)
        engine.kv_read_done(5)
        engine.kv_read_done(5, 6)  # the reads of one step: one message
        engine.kv_read_done()  # none: no message
        with pytest.raises(ProtocolError, match="KV_READ_DONE"):
            engine.kv_read_done(5, "6")
        engine.request_error(6, "transfer failed", source_safe=False)
        assert engine.pending == 1
        assert [socket.recv_multipart()[1:] for _ in range(4)] == [
            [packb([KV_TRANSFER_READY, 5, 1])],
            [packb([KV_READ_DONE, 5])],
            [packb([KV_READ_DONE, 5, 6])],
            [packb([REQUEST_ERROR, 6, "transfer failed", False])],
        ]


def test_a_handed_off_request_is_reported_pinned_until_released(router, impl):
    """The rebuild after a coordinator's loss: a prefill hop handed off runs at its
    decode, but its blocks stay pinned here; HELD lists it, naming no client, its final
    sent, until a RELEASE_KV names it (a new coordinator releases what it never knew)."""
    socket, _ = router
    engine, _ = registered(router, impl, role="prefill", capacity=4)

    def held() -> list:
        granted = {"rebuild": 1, "epoch": 1, "held_all": 1}  # as a coordinator asks
        socket.send_multipart([engine.identity, packb([ENGINE_ACK, granted])])
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not socket.poll(0):
            assert time.monotonic() < deadline
            engine.poll(0.05)
        meta, _ = socket.recv_multipart()[1:]
        header, entries = unpackb(meta)
        assert header == HELD
        return entries

    with engine:
        assert held() == []
        trailer = packb([3, b"client-1", False])  # a rebuild client's request 3
        for rid in (1, 2):
            meta = packb([SUBMIT, rid, {"do_kv_handoff": True}])
            socket.send_multipart([engine.identity, meta, packb([1]), trailer])
        collect(engine, 2)
        assert [entry[0] for entry in held()] == [1, 2]
        engine.handoff([(1, {}, [1])])
        socket.recv_multipart()  # the HANDOFF
        assert held() == [[1, 3, None, 0, True], [2, 3, b"client-1", 0, False]]
        socket.send_multipart([engine.identity, packb([RELEASE_KV, 1])])
        assert [event.rid for event in collect(engine, 1)] == [1]
        assert [entry[0] for entry in held()] == [2]
