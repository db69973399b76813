"""coordkit's public Cython surface (``coordkit/__init__.pxd``), used as a host's code uses it.

``zmqutil`` (tests/support/_zmqutil_c.pyx) cimports that .pxd and nothing else
of coordkit. Through it, frames written with the header codec and the frame
helpers must be what coordkit's own message specs write, frames the specs
write must read back, and an engine written on it must serve a real
Coordinator and Client of either implementation.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import zmq

from coordkit import Client, ProtocolError, protocol
from coordkit.protocol import Header, packb
from tests.support.scripted import TIMEOUT, run

PARAMS = {"temperature": 0.5, "max_tokens": 16}
SMALL, LARGE = packb([1, 2, 3]), os.urandom(1 << 16)  # LARGE is pinned, not copied


@pytest.fixture
def pair(tmp_path):
    context = zmq.Context()
    bound = context.socket(zmq.PAIR)
    bound.bind(f"ipc://{tmp_path}/pair")
    connected = context.socket(zmq.PAIR)
    connected.connect(f"ipc://{tmp_path}/pair")
    yield bound, connected
    context.destroy(linger=0)


@pytest.mark.parametrize("prompt", [SMALL, LARGE, bytearray(LARGE), memoryview(LARGE)[1:]])
@pytest.mark.parametrize("rid", [0, 7, 1 << 40, -5])
def test_a_submit_written_on_the_pxd_is_the_specs(zmqutil, pair, prompt, rid):
    sender, receiver = pair
    zmqutil.send_submit(sender, rid, packb(PARAMS), prompt)
    assert receiver.recv_multipart() == protocol.SUBMIT_REQUEST.pack(rid, PARAMS, bytes(prompt))


@pytest.mark.parametrize("rid", [0, 300, (1 << 63) - 1])
def test_a_submit_the_specs_write_reads_on_the_pxd(zmqutil, pair, rid):
    sender, receiver = pair
    sender.send_multipart(protocol.SUBMIT_REQUEST.pack(rid, PARAMS, LARGE))
    assert zmqutil.recv_submit(receiver) == (Header.SUBMIT_REQUEST, rid, packb(PARAMS), [LARGE])
    sender.send_multipart([packb([Header.SUBMIT_REQUEST, rid, None])[:-1] + b"\xc1"])
    with pytest.raises(ProtocolError, match="reserved byte"):
        zmqutil.recv_submit(receiver)


@pytest.mark.parametrize("final", [True, False])
def test_replies_written_on_the_pxd_are_the_specs(zmqutil, pair, final):
    sender, receiver = pair
    replies = [(1, b"a"), (70_000, LARGE), (2**33, b"")]
    zmqutil.send_replies(sender, replies, final)
    bodies = [body for _, body in replies]
    if final:
        expected = protocol.ENGINE_REPLY.pack([(rid, False) for rid, _ in replies], bodies)
    else:
        expected = protocol.ENGINE_REPLY_PARTIAL.pack([rid for rid, _ in replies], bodies)
    assert receiver.recv_multipart() == expected


def test_a_reply_batch_reads_on_the_pxd(zmqutil, pair):
    sender, receiver = pair
    entries = [(rid, rid % 3 == 0) for rid in range(100)]  # grows the entries' array
    bodies = [packb({"n": rid}) for rid, _ in entries]
    sender.send_multipart(protocol.REPLY_BATCH.pack(entries, bodies))
    assert zmqutil.recv_reply_batch(receiver) == [
        (rid, final, body) for (rid, final), body in zip(entries, bodies, strict=True)
    ]
    sender.send_multipart(protocol.REPLY_BATCH.pack(entries[:2], bodies[:1] * 2)[:2])
    with pytest.raises(ProtocolError, match="2 entries, 1 bodies"):
        zmqutil.recv_reply_batch(receiver)


def test_an_engine_on_the_pxd_serves_a_coordinator(zmqutil, make_coordinator, impl):
    """A host's engine loop in Cython: registered with the empty frame, it answers each
    SUBMIT the coordinator routes to it with one reply batch."""
    stop = threading.Event()

    def serve(address: str) -> None:
        context = zmq.Context()
        engine = context.socket(zmq.DEALER)
        engine.setsockopt(zmq.IDENTITY, b"engine-0")
        engine.connect(address)
        zmqutil.send(engine, [b""])  # the registration
        try:
            while not stop.is_set():
                try:
                    _, rid, _, (prompt,) = zmqutil.recv_submit(engine, 50)
                except zmq.Again:
                    continue
                zmqutil.send_replies(engine, [(rid, packb({"echo": prompt}))])
        finally:
            context.destroy(linger=1000)

    async def body(address: str) -> list:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            return await asyncio.gather(*(client.submit(p) for p in ([1, 2], "text", LARGE)))

    with make_coordinator() as coord:
        thread = threading.Thread(target=serve, args=(coord.address,), daemon=True)
        thread.start()
        try:
            replies = run(body(coord.address))
        finally:
            stop.set()
            thread.join(TIMEOUT)
    assert replies == [{"echo": packb([1, 2])}, {"echo": packb("text")}, {"echo": LARGE}]
