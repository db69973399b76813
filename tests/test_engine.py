"""coordkit.Engine and FakeEngine against a bare ROUTER playing the coordinator.

The ROUTER checks the exact frames an engine puts on the wire; the fake
engine is driven step by step from the test, so what it batches is exact.
Every test runs on both engine cores (``impl``).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import msgpack
import pytest
import zmq

from coordkit.engine import Abort, Control, Engine, ReleaseKV, Request
from coordkit.protocol import Header, packb, unpackb
from coordkit.tools.fake_engine import FakeEngine
from tests.support.cluster import bind_address
from tests.support.peers import (
    ABORT,
    DISCONNECT,
    ENGINE_ACK,
    HEARTBEAT,
    HELD,
    PARTIAL,
    PAUSE,
    REBUILD_HELLO,
    RELEASE_KV,
    REPLY,
    RESUME,
    SET_GENERATION_EPOCH,
    STOP,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    SUSPEND,
    UNPAUSE,
    engine_hello,
)
from tests.support.processes import engine_processes

TIMEOUT_MS = 5000


@pytest.fixture(params=["ipc", "tcp"])
def router(request, tmp_path):
    """A ROUTER bound on ipc (in tmp_path) or tcp://127.0.0.1; yields (socket, address)."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)  # a missing message fails, never hangs
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address(request.param, tmp_path))
    yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close()


def registered(router, impl, engine_cls=Engine, **kwargs):
    """An engine of ``impl`` connected to ``router``, its registration and its
    ENGINE_HELLO (asking for batches, or not with ``batch=False``) already received."""
    socket, address = router
    engine = engine_cls(address, implementation=impl.name, **kwargs)
    assert engine.implementation == impl.name
    assert socket.recv_multipart() == [engine.identity, b""]
    hello = (
        {"coordkit": 1, "ack": 1, "batch": 1}
        if kwargs.get("batch", True)
        else {"coordkit": 1, "ack": 1}
    )
    if kwargs.get("rebuild", True):
        hello.update(REBUILD_HELLO)
    capacity = kwargs.get("capacity", kwargs.get("max_batch"))
    if capacity:  # declared (FakeEngine: its max_batch, when given)
        hello["capacity"] = capacity
    identity, frame = socket.recv_multipart()
    assert identity == engine.identity and engine_hello(frame) == hello
    return engine


def drive(engine: FakeEngine, socket, count: int = 1) -> list[list[bytes]]:
    """Step ``engine`` until ``socket`` has received ``count`` messages; return them."""
    messages = []
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(messages) < count:
        assert time.monotonic() < deadline, f"got {len(messages)} of {count} messages"
        engine.step()
        while socket.poll(0):
            messages.append(socket.recv_multipart()[1:])
    return messages


def collect(engine: Engine, count: int) -> list:
    """Poll ``engine`` until it has produced ``count`` events."""
    events: list = []
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(events) < count and time.monotonic() < deadline:
        events += engine.poll(0.1)
    assert len(events) == count
    return events


def final(engine: FakeEngine, socket) -> list[bytes]:
    """Step ``engine`` until an ENGINE_REPLY arrives (skipping partials); return it."""
    while True:
        for message in drive(engine, socket):
            if unpackb(message[0])[0] == Header.ENGINE_REPLY:
                return message


def step_until(engine: FakeEngine, condition) -> None:
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not condition():
        assert time.monotonic() < deadline
        engine.step()


def submit(socket, engine, rid, prompt=(1, 2, 3), params=None):
    meta = packb([SUBMIT, rid, params or {}])
    socket.send_multipart([engine.identity, meta, packb(list(prompt))])


def queue_paused(engine: FakeEngine, socket, requests) -> None:
    """Queue ``requests`` (rid, prompt[, params]) while paused, so one step sees them all."""
    socket.send_multipart([engine.identity, packb([PAUSE])])
    for request in requests:
        submit(socket, engine, *request)
    step_until(engine, lambda: engine.pending == len(requests))
    assert engine.state == "paused"
    socket.send_multipart([engine.identity, packb([UNPAUSE])])


def test_registers_with_its_identity(router, impl):
    with registered(router, impl, rank=3) as engine:
        assert engine.identity == b"engine-3"
    with registered(router, impl, identity="mp-coord-0") as engine:
        assert engine.identity == b"mp-coord-0"


def test_poll_gives_events(router, impl):
    socket, _ = router
    with registered(router, impl) as engine:
        identity = engine.identity
        socket.send_multipart([identity, packb([SUBMIT, 7, {"max_tokens": 2}]), packb([1, 2, 3])])
        with_kv = packb([SUBMIT_KV, 8, {}, {"k": 1}])
        socket.send_multipart([identity, with_kv, packb("hi"), b"\x01\x02"])
        socket.send_multipart([identity, packb([ABORT, 7])])
        socket.send_multipart([identity, packb([RELEASE_KV, 4])])
        socket.send_multipart([identity, packb([PAUSE])])
        socket.send_multipart([identity, packb([SET_GENERATION_EPOCH, 5])])
        submit_, with_kv, abort, release, pause, epoch = collect(engine, 6)
    assert isinstance(submit_, Request)
    assert (submit_.server_rid, submit_.sampling_params) == (7, {"max_tokens": 2})
    assert isinstance(submit_.prompt, zmq.Frame)  # the received frame, not a copy
    assert submit_.prompt_tokens() == [1, 2, 3]
    assert (with_kv.server_rid, with_kv.kv_meta, with_kv.prompt_tokens()) == (8, {"k": 1}, "hi")
    assert with_kv.src_block_ids.bytes == b"\x01\x02"
    assert abort == Abort(7)
    assert release == ReleaseKV(4)
    assert pause == Control(Header.PAUSE)
    assert epoch == Control(Header.SET_GENERATION_EPOCH, 5)
    assert engine.pending == 2


def test_malformed_message_is_dropped(router, impl):
    socket, _ = router
    with registered(router, impl) as engine:
        socket.send_multipart([engine.identity, b"\xc1"])  # not msgpack
        socket.send_multipart([engine.identity, packb([SUBMIT, "x", {}]), b""])  # rid not an int
        socket.send_multipart([engine.identity, packb([UNPAUSE])])
        assert collect(engine, 1) == [Control(Header.UNPAUSE)]


def test_reply_is_one_batched_message(router, impl):
    socket, _ = router
    with registered(router, impl) as engine:
        engine.reply([(1, b"raw body"), (2, {"x": 1}, True), (3, [4, 5])])
        engine.reply([])  # nothing to send: no message
        engine.reply_partial([(4, {"p": 1}), (5, b"part")])
        engine.disconnect()
        identity = engine.identity
        assert socket.recv_multipart() == [
            identity,
            packb([REPLY, [[1, False], [2, True], [3, False]]]),
            b"raw body",
            packb({"x": 1}),
            packb([4, 5]),
        ]
        partial = [packb([PARTIAL, [4, 5]]), packb({"p": 1}), b"part"]
        assert socket.recv_multipart() == [identity, *partial]
        assert socket.recv_multipart() == [identity, packb([DISCONNECT])]


def test_without_hello_it_registers_as_megatron_engines_do(router, impl):
    """hello=False: the empty frame and nothing else, for a coordinator that knows
    no coordkit header; the engine works as ever, unbatched."""
    socket, address = router
    with Engine(address, implementation=impl.name, hello=False) as engine:
        assert not engine.batch
        assert socket.recv_multipart() == [engine.identity, b""]
        assert not socket.poll(200), socket.recv_multipart()  # no ENGINE_HELLO
        submit(socket, engine, 7)
        [request] = collect(engine, 1)
        assert isinstance(request, Request) and request.server_rid == 7
        engine.reply([(7, b"done")])
        assert socket.recv_multipart() == [engine.identity, packb([REPLY, [[7, False]]]), b"done"]


def test_a_fake_engine_declares_the_batch_it_was_given(router, impl):
    """FakeEngine's ``max_batch`` (``--batch``), when given, is its declared capacity (the
    registered helper checks the hello); its cost model's own bound is not declared."""
    with fake(router, impl, max_batch=3) as engine:
        assert engine.capacity == 3
    # another identity: the router may not have seen the first one's connection end yet
    with fake(router, impl, identity="undeclared") as engine:
        assert engine.capacity == 0


def test_heartbeat_reports_pending_and_capacity(router, impl):
    socket, _ = router
    with registered(router, impl, heartbeat_interval=0.05, capacity=9) as engine:
        engine.poll(0)  # the first heartbeat is due at once
        assert socket.recv_multipart()[1:] == [packb([HEARTBEAT, 0, 9])]
        submit(socket, engine, 1)
        collect(engine, 1)
        engine.poll(0.1)  # waits out the interval, sending the next heartbeat
        # Heartbeats sent while the request was on its way still say 0.
        while (heartbeat := socket.recv_multipart()[1:]) == [packb([HEARTBEAT, 0, 9])]:
            pass
        assert heartbeat == [packb([HEARTBEAT, 1, 9])]
        engine.reply([(1, b"")])
        assert engine.pending == 0


# -- FakeEngine -------------------------------------------------------------------------


def fake(router, impl, **kwargs) -> FakeEngine:
    return registered(router, impl, FakeEngine, heartbeat_interval=None, **kwargs)


def test_fake_engine_is_deterministic(router, impl):
    socket, _ = router
    prompt = [5, 6, 7, 8]
    bodies = []
    for rank in (0, 1):
        with fake(router, impl, rank=rank, output_tokens=5) as engine:
            submit(socket, engine, 10 + rank, prompt)
            [[meta, body]] = drive(engine, socket)
            assert unpackb(meta) == [REPLY, [[10 + rank, False]]]
            bodies.append(unpackb(body))
    expected = FakeEngine.generate(prompt, 5)
    context, length = sum(prompt), len(prompt)  # each token a function of its context
    for token in expected:
        assert token == (context * 31 + length) % 32000
        context, length = context + token, length + 1
    assert FakeEngine.generate([*prompt, *expected[:2]], 3) == expected[2:]
    for rank, body in enumerate(bodies):
        assert body["request_id"] == 10 + rank
        assert body["rank"] == rank
        assert body["status"] == "finished"
        assert body["generated_tokens"] == expected
        assert len(body["logprobs"]) == 5 and all(isinstance(p, float) for p in body["logprobs"])
        assert body["generated_text"] is None
    assert bodies[0]["logprobs"] == bodies[1]["logprobs"]


def test_fake_engine_text_and_raw_prompts(router, impl):
    socket, _ = router
    # Ids outside u32 have no block hashes either: the prefix cache skips all three.
    prompts = {packb("héllo"): "héllo", b"\xc1\xc1raw": b"\xc1\xc1raw", packb([2**40]): [2**40]}
    with fake(router, impl, output_tokens=2, prefix_block_size=1) as engine:
        for rid, (frame, prompt) in enumerate(prompts.items()):
            socket.send_multipart([engine.identity, packb([SUBMIT, rid, {}]), frame])
            [[_, body]] = drive(engine, socket)
            reply = unpackb(body)
            assert reply["generated_tokens"] == FakeEngine.generate(prompt, 2)
            assert "cached_blocks" not in reply and "prompt_blocks" not in reply


def prefix_cache_hits(engine: FakeEngine, socket, prompt: list[int]) -> tuple[int, int]:
    """(cached_blocks, prompt_blocks) of ``prompt``, run on ``engine`` on its own."""
    submit(socket, engine, 1, prompt)
    [[_, body]] = drive(engine, socket)
    reply = unpackb(body)
    return reply["cached_blocks"], reply["prompt_blocks"]


def test_fake_engine_prefix_cache_counts_leading_blocks(router, impl):
    socket, _ = router
    prompt = list(range(10))  # two full blocks of 4, and a partial one that is not cached
    with fake(router, impl, output_tokens=1, prefix_block_size=4) as engine:
        assert prefix_cache_hits(engine, socket, prompt) == (0, 2)
        assert prefix_cache_hits(engine, socket, prompt) == (2, 2)
        assert prefix_cache_hits(engine, socket, prompt[:4] + [99] * 6) == (1, 2)
        # Hashes are chained: the same second block after another first one is a miss.
        assert prefix_cache_hits(engine, socket, [99] + prompt[1:]) == (0, 2)
        assert prefix_cache_hits(engine, socket, prompt[:3]) == (0, 0)


def test_fake_engine_prefix_cache_evicts_least_recently_used(router, impl):
    socket, _ = router
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]
    with fake(router, impl, output_tokens=1, prefix_block_size=2, cache_blocks=4) as engine:
        assert prefix_cache_hits(engine, socket, a) == (0, 2)
        assert prefix_cache_hits(engine, socket, b) == (0, 2)
        assert prefix_cache_hits(engine, socket, a) == (2, 2)  # a's blocks are now the newest
        assert prefix_cache_hits(engine, socket, c) == (0, 1)  # evicts b's first block
        # b's second block is still cached, but a prefix cache stops at the first miss.
        assert prefix_cache_hits(engine, socket, b) == (0, 2)
        assert prefix_cache_hits(engine, socket, c) == (1, 1)


def test_fake_engine_batches_a_step_into_one_reply(router, impl):
    socket, _ = router
    with fake(router, impl, max_batch=4, output_tokens=3) as engine:
        queue_paused(engine, socket, [(rid, [rid]) for rid in range(5)])
        first, second = drive(engine, socket, 2)  # the first step admits four of the five
    meta = unpackb(first[0])
    assert meta == [REPLY, [[0, False], [1, False], [2, False], [3, False]]]
    assert [unpackb(b)["generated_tokens"] for b in first[1:]] == [
        FakeEngine.generate([rid], 3) for rid in range(4)
    ]
    assert unpackb(second[0]) == [REPLY, [[4, False]]]


def test_fake_engine_streams_partials_then_final(router, impl):
    socket, _ = router
    with fake(router, impl, output_tokens=3) as engine:
        queue_paused(engine, socket, [(1, [9], {"stream": True, "detokenize": True}), (2, [9])])
        messages = drive(engine, socket, 3)
    tokens = FakeEngine.generate([9], 3)
    for n, (meta, body) in enumerate(messages[:2], start=1):
        assert unpackb(meta) == [PARTIAL, [1]]  # the non-streaming request gets no partials
        assert unpackb(body)["generated_tokens"] == tokens[:n]
        assert unpackb(body)["status"] == "generating"
    assert unpackb(messages[2][0]) == [REPLY, [[1, True], [2, False]]]


def test_fake_engine_honours_abort(router, impl):
    socket, _ = router
    with fake(router, impl, output_tokens=1000) as engine:
        submit(socket, engine, 1, [3], {"stream": True})
        drive(engine, socket, 2)  # two steps: two partials
        socket.send_multipart([engine.identity, packb([ABORT, 1])])
        socket.send_multipart([engine.identity, packb([ABORT, 99])])  # unknown: ignored
        meta, body = final(engine, socket)
        assert unpackb(meta) == [REPLY, [[1, False]]]
        reply = unpackb(body)
        assert reply["status"] == "aborted"
        tokens = reply["generated_tokens"]
        assert 2 <= len(tokens) < 1000
        assert tokens == FakeEngine.generate([3], len(tokens))
        assert engine.pending == 0


def test_fake_engine_control_states(router, impl):
    socket, _ = router
    with fake(router, impl) as engine:
        for header, state in [
            (PAUSE, "paused"),
            (SUSPEND, "suspended"),
            (RESUME, "paused"),
            (UNPAUSE, "running"),
        ]:
            socket.send_multipart([engine.identity, packb([header])])
            step_until(engine, lambda state=state: engine.state == state)
        socket.send_multipart([engine.identity, packb([SET_GENERATION_EPOCH, 7])])
        step_until(engine, lambda: engine.epoch == 7)
        # STOP: the queued request is answered as aborted, then DISCONNECT.
        socket.send_multipart([engine.identity, packb([PAUSE])])
        submit(socket, engine, 5)
        socket.send_multipart([engine.identity, packb([STOP])])
        engine.run()
        assert engine.state == "stopped"
        meta, body = socket.recv_multipart()[1:]
        assert unpackb(meta) == [REPLY, [[5, False]]]
        assert unpackb(body)["status"] == "aborted"
        assert socket.recv_multipart()[1:] == [packb([DISCONNECT])]


def test_fake_engine_run_ends_on_stop_event(router, impl):
    socket, _ = router
    stop = threading.Event()
    with fake(router, impl) as engine:
        thread = threading.Thread(target=engine.run, args=(stop,))
        thread.start()
        submit(socket, engine, 1)
        assert unpackb(socket.recv_multipart()[2])["status"] == "finished"
        stop.set()
        thread.join(TIMEOUT_MS / 1000)
        assert not thread.is_alive()
        assert socket.recv_multipart()[1:] == [packb([DISCONNECT])]


def test_engine_process(router):
    socket, address = router
    options = ["--output-tokens", "3", "--heartbeat", "0"]
    options += ["--prefix-block-size", "1", "--cache-blocks", "1"]
    with engine_processes(address, [2], *options, stderr=subprocess.PIPE, text=True) as [process]:
        assert socket.recv_multipart() == [b"engine-2", b""]
        identity, hello = socket.recv_multipart()
        assert identity == b"engine-2"
        assert engine_hello(hello) == {"coordkit": 1, "ack": 1, "batch": 1, **REBUILD_HELLO}
        for rid in (1, 2):
            socket.send_multipart([b"engine-2", packb([SUBMIT, rid, {}]), packb([1, 2])])
            identity, meta, body = socket.recv_multipart()
            assert unpackb(meta) == [REPLY, [[rid, False]]]
            reply = msgpack.unpackb(body)
            assert reply["generated_tokens"] == FakeEngine.generate([1, 2], 3)
            # Blocks of 1 token; a cache of 1 block keeps only the second: never a hit.
            assert (reply["cached_blocks"], reply["prompt_blocks"]) == (0, 2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT_MS / 1000) == 0
        assert socket.recv_multipart() == [b"engine-2", packb([DISCONNECT])]
        assert "found in sys.modules" not in process.stderr.read()  # no runpy double import


def test_held_reports_the_block_hashes_it_was_sent_lately(router, impl):
    """HELD's block-hash frame: each hash the engine was sent lately, once, in the
    order of its latest request, at most ``held_hashes`` of them in all."""
    socket, _ = router
    engine = registered(router, impl, held_hashes=6)

    def ack() -> list[bytes]:
        socket.send_multipart([engine.identity, packb([ENGINE_ACK, {"rebuild": 1, "epoch": 1}])])
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not socket.poll(0):
            assert time.monotonic() < deadline
            engine.poll(0.05)
        meta, hashes = socket.recv_multipart()[1:]
        assert unpackb(meta)[0] == HELD
        return [int.from_bytes(hashes[i : i + 8], "little") for i in range(0, len(hashes), 8)]

    def frame(*ids: int) -> bytes:
        return b"".join(i.to_bytes(8, "little") for i in ids)

    def trailer(rid: int, hashed: bool) -> bytes:
        return packb([rid, b"ck", hashed])

    assert ack() == []  # nothing sent yet: the frame is empty
    prompt = packb([1, 2])
    socket.send_multipart(
        [engine.identity, packb([SUBMIT, 1, {}]), prompt, trailer(1, True), frame(1, 2, 3)]
    )
    batch = packb([SUBMIT_BATCH, [[2, {}], [3, {}], [4, {}]]])
    socket.send_multipart(
        [
            engine.identity,
            batch,
            prompt,
            trailer(2, True),
            frame(1, 2, 4),
            prompt,
            trailer(3, False),
            prompt,
            trailer(4, True),
            frame(5),
        ]
    )
    assert len(collect(engine, 4)) == 4
    assert ack() == [1, 2, 4, 5]  # 7 hashes: request 1's went; 1 and 2 as of request 2
    socket.send_multipart(
        [engine.identity, packb([SUBMIT, 5, {}]), prompt, trailer(5, True), frame(6, 7, 8)]
    )
    collect(engine, 1)
    assert ack() == [5, 6, 7, 8]  # at most 6 hashes kept: request 2's went too
    # A trailer that says hashed without them, or hashes that are not whole: dropped.
    socket.send_multipart([engine.identity, packb([SUBMIT, 6, {}]), prompt, trailer(6, True)])
    socket.send_multipart(
        [engine.identity, packb([SUBMIT, 7, {}]), prompt, trailer(7, True), b"123"]
    )
    assert engine.poll(0.2) == []
    assert ack() == [5, 6, 7, 8]
    engine.close()


def test_held_hashes_below_zero_is_refused(router, impl):
    _, address = router
    with pytest.raises(ValueError, match="held_hashes must be at least 0, not -1"):
        Engine(address, implementation=impl.name, held_hashes=-1)
