"""coordkit.Engine: batched SUBMITs in, batched replies out, on both cores.

A bare ROUTER plays a coordinator that granted batches: it sends
ENGINE_SUBMIT_BATCH ``[95, [[rid, sampling_params], ...]]`` with one prompt
frame per entry, mixed with single messages, and malformed batches, which are
dropped whole. A differential test sends the same random messages to an
engine of each core and compares every event they hand out.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit.engine import Abort, Control, Engine, ReleaseKV, Request
from coordkit.protocol import Header, ProtocolError, packb
from tests.support.peers import (
    ABORT,
    ERROR,
    PARTIAL,
    PAUSE,
    REBUILD_HELLO,
    RELEASE_KV,
    REPLY,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    UNPAUSE,
    engine_hello,
)

TIMEOUT = 5.0


@pytest.fixture
def router(tmp_path):
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(f"ipc://{tmp_path}/engine.sock")
    yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close()


def connected(router, impl, **kwargs) -> Engine:
    socket, address = router
    engine = Engine(address, implementation=impl.name, **kwargs)
    assert socket.recv_multipart() == [engine.identity, b""]
    hello = (
        {"coordkit": 1, "ack": 1, "batch": 1}
        if kwargs.get("batch", True)
        else {"coordkit": 1, "ack": 1}
    )
    hello.update(REBUILD_HELLO)
    identity, frame = socket.recv_multipart()
    assert identity == engine.identity and engine_hello(frame) == hello
    return engine


def until(engine: Engine, count: int) -> list:
    events: list = []
    deadline = time.monotonic() + TIMEOUT
    while len(events) < count:
        assert time.monotonic() < deadline, f"{len(events)} of {count} events"
        events += engine.poll(0.05)
    assert len(events) == count, events
    return events


def batch(entries, prompts) -> list[bytes]:
    return [packb([SUBMIT_BATCH, [list(e) for e in entries]]), *prompts]


def test_without_batch_the_hello_asks_for_none(router, impl):
    socket, _ = router
    with connected(router, impl, batch=False) as engine:  # [94, {"coordkit": 1, "ack": 1}]
        socket.send_multipart([engine.identity, packb([PAUSE])])
        assert until(engine, 1) == [Control(Header.PAUSE)]


def test_an_error_from_the_coordinator_is_logged(router, impl, caplog):
    socket, _ = router
    with connected(router, impl) as engine:
        message = "ENGINE_REPLY: malformed message"
        socket.send_multipart([engine.identity, packb([ERROR, 7, 1, message])])
        socket.send_multipart([engine.identity, packb([UNPAUSE])])
        assert until(engine, 1) == [Control(Header.UNPAUSE)]
    assert "refused the reply to request 7: ENGINE_REPLY: malformed message" in caplog.text


def test_a_batch_is_one_request_per_entry(router, impl):
    socket, _ = router
    with connected(router, impl) as engine:
        identity = engine.identity
        params = [{}, {"max_tokens": 8, "stream": True}, None, [1, "x"]]
        prompts = [packb([1, 2]), packb("text"), b"raw \xc1", b""]
        socket.send_multipart([identity, *batch(zip(range(10, 14), params, strict=True), prompts)])
        socket.send_multipart([identity, packb([SUBMIT, 20, {"n": 1}]), packb([3])])
        socket.send_multipart([identity, packb([ABORT, 11])])
        socket.send_multipart([identity, packb([RELEASE_KV, 5])])
        socket.send_multipart([identity, packb([SUBMIT_KV, 21, {}, {"k": 1}]), b"p", b"s"])
        events = until(engine, 8)
        requests = events[:4]
        assert [type(e) for e in requests] == [Request] * 4
        assert [(r.server_rid, r.sampling_params) for r in requests] == list(
            zip(range(10, 14), params, strict=True)
        )
        assert all(isinstance(r.prompt, zmq.Frame) for r in requests)
        assert [r.prompt.bytes for r in requests] == prompts
        assert [bytes(r.prompt.buffer) for r in requests] == prompts
        assert requests[0].prompt_tokens() == [1, 2]
        assert (requests[0].kv_meta, requests[0].src_block_ids) == (None, None)
        assert (events[4].server_rid, events[4].sampling_params) == (20, {"n": 1})
        assert events[5:7] == [Abort(11), ReleaseKV(5)]
        assert (events[7].server_rid, events[7].kv_meta, events[7].src_block_ids.bytes) == (
            21,
            {"k": 1},
            b"s",
        )
        assert engine.pending == 6
        with pytest.raises(dataclasses.FrozenInstanceError):
            requests[0].server_rid = 1
        # the fast path builds the same objects as __init__ does
        assert requests[0] == Request(10, {}, requests[0].prompt)
        assert repr(requests[0]) == repr(Request(10, {}, requests[0].prompt))


def test_each_request_has_its_own_params(router, impl):
    socket, _ = router
    with connected(router, impl) as engine:
        flat = {"temperature": 0.5, "max_tokens": 3, "stop": "x"}
        nested = {"temperature": 0.5, "stop": [1, 2]}
        entries = [(rid, flat) for rid in range(3)] + [(rid, nested) for rid in range(3, 6)]
        socket.send_multipart([engine.identity, *batch(entries, [b"p"] * 6)])
        socket.send_multipart([engine.identity, packb([SUBMIT, 6, flat]), b"p"])
        events = until(engine, 7)
        assert [e.sampling_params for e in events] == [flat] * 3 + [nested] * 3 + [flat]
        events[0].sampling_params["temperature"] = 9.0
        events[3].sampling_params["stop"].append(3)
        others = events[1:3] + events[4:]
        assert [e.sampling_params for e in others] == [flat] * 2 + [nested] * 2 + [flat]
        assert len({id(e.sampling_params) for e in events}) == 7


def test_large_batches_and_prompts(router, impl):
    socket, _ = router
    with connected(router, impl) as engine:
        big = bytes(range(256)) * 1024  # 256 KiB: above pyzmq's copy threshold
        n = 300  # more entries than the first buffer holds
        prompts = [packb([i]) for i in range(n - 1)] + [big]
        socket.send_multipart([engine.identity, *batch([(i, {}) for i in range(n)], prompts)])
        events = until(engine, n)
        assert [e.server_rid for e in events] == list(range(n))
        assert events[-1].prompt.bytes == big
        assert bytes(events[-1].prompt.buffer) == big
        assert [e.prompt_tokens() for e in events[:-1]] == [[i] for i in range(n - 1)]


@pytest.mark.parametrize(
    "frames",
    [
        [packb([SUBMIT_BATCH, [[1, {}], [2, {}]]]), b"one prompt"],  # fewer prompts than entries
        [packb([SUBMIT_BATCH, [[1, {}]]]), b"p", b"extra"],
        [packb([SUBMIT_BATCH, [[1, {}, True]]]), b"p"],  # a client's entry
        [packb([SUBMIT_BATCH, [["1", {}]]]), b"p"],
        [packb([SUBMIT_BATCH, {}])],
        [b"\x92\x5f\x92\x92\x01\xa1\xff\x92\x02\x80", b"p", b"q"],  # params with bad UTF-8
        [packb([SUBMIT, 1, {}])],  # no prompt
        [packb([SUBMIT, 1, {}, 2]), b"p"],
        [packb([ABORT, "x"])],
        [packb([ABORT, 1]), b"extra"],
        [packb([77])],
        [b"\xc1"],
    ],
)
def test_malformed_messages_are_dropped_whole(router, impl, frames):
    socket, _ = router
    with connected(router, impl) as engine:
        socket.send_multipart([engine.identity, *frames])
        socket.send_multipart([engine.identity, packb([UNPAUSE])])
        assert until(engine, 1) == [Control(Header.UNPAUSE)]
        assert engine.pending == 0


def test_replies(router, impl):
    socket, _ = router
    with connected(router, impl) as engine:
        identity = engine.identity
        big = bytearray(b"b" * 20000)  # above COPY_BELOW: held until sent
        entries = [(i, {"i": i}, i % 3 == 0) for i in range(100)]
        engine.reply(entries + [(100, big), [101, b"raw", True, "ignored"], (102, zmq.Frame(b"f"))])
        frames = socket.recv_multipart()
        assert frames[0] == identity
        flags = [[i, i % 3 == 0] for i in range(100)] + [[100, False], [101, True], [102, False]]
        assert frames[1] == packb([REPLY, flags])
        assert frames[2:] == [packb({"i": i}) for i in range(100)] + [bytes(big), b"raw", b"f"]
        engine.reply(e for e in [(7, b"gen")])  # any iterable
        assert socket.recv_multipart()[1:] == [packb([REPLY, [[7, False]]]), b"gen"]
        engine.reply_partial([(1, {"p": 1}), (2, b"part")])
        assert socket.recv_multipart()[1:] == [packb([PARTIAL, [1, 2]]), packb({"p": 1}), b"part"]
        engine.reply([])
        engine.reply_partial(iter([]))
        socket.send_multipart([identity, packb([PAUSE])])
        until(engine, 1)  # nothing else was sent meanwhile
        assert not socket.poll(100)


@pytest.mark.parametrize(
    ("call", "entries", "match"),
    [
        ("reply", [("1", b"x")], "field 'rid' must be int, got str"),
        ("reply", [(True, b"x")], "field 'rid' must be int, got bool"),
        ("reply", [(2**63, b"x")], "does not fit int64"),
        ("reply_partial", [(None, b"x")], "field 'rid' must be int, got NoneType"),
    ],
)
def test_bad_reply_entries(router, impl, call, entries, match):
    socket, _ = router
    with connected(router, impl) as engine:
        with pytest.raises(ProtocolError, match=match):
            getattr(engine, call)([(0, b"fine"), *entries])
        assert not socket.poll(100)  # nothing of it was sent
        engine.reply([(3, b"after")])
        assert socket.recv_multipart()[1:] == [packb([REPLY, [[3, False]]]), b"after"]


def test_replies_release_large_bodies(router, impl):
    socket, _ = router
    with connected(router, impl) as engine:
        body = bytearray(100_000)
        engine.reply([(1, body)])
        assert socket.recv_multipart()[2] == bytes(body)
        deadline = time.monotonic() + TIMEOUT
        while True:  # held until libzmq sent it, released by a later call
            engine.poll(0)
            try:
                body.append(0)
                break
            except BufferError:
                assert time.monotonic() < deadline, "the body's buffer was never released"
                time.sleep(0.01)


# -- C against Python: the same messages, the same events ----------------------------------

anything = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)
rids = st.integers(-(2**63), 2**63 - 1)
messages = st.one_of(
    st.builds(
        lambda entries: batch([(r, p) for r, p, _ in entries], [b for _, _, b in entries]),
        st.lists(st.tuples(rids, anything, st.binary(max_size=8)), max_size=5),
    ),
    st.builds(lambda r, p, b: [packb([SUBMIT, r, p]), b], rids, anything, st.binary(max_size=8)),
    st.builds(lambda r: [packb([ABORT, r])], rids),
    st.builds(lambda r: [packb([RELEASE_KV, r])], rids),
    st.builds(lambda h: [packb([h])], st.sampled_from([40, 41, 42, 43, 45, 46, 47, 60, 99])),
    st.lists(st.binary(max_size=12), min_size=1, max_size=3),  # junk
)


@st.composite
def mutated(draw) -> list[bytes]:
    frames = draw(messages)
    if draw(st.booleans()):
        at = draw(st.integers(0, len(frames[0])))
        frames[0] = frames[0][:at] + draw(st.binary(max_size=2)) + frames[0][at + 1 :]
    return frames


def normalized(event) -> tuple:
    values = [getattr(event, f.name) for f in dataclasses.fields(event)]
    return (type(event).__name__, *[v.bytes if isinstance(v, zmq.Frame) else v for v in values])


@pytest.mark.c_extension
@settings(max_examples=60, deadline=None)
@given(sent=st.lists(messages | mutated(), max_size=8))
def test_differential_events(c_impl, py_impl, tmp_path_factory, sent):
    context = zmq.Context.instance()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path_factory.mktemp('d')}/e.sock"
    socket.bind(address)
    engines = [
        Engine(address, identity=f"e-{impl.name}", implementation=impl.name)
        for impl in (c_impl, py_impl)
    ]
    try:
        for _ in range(4):  # the registrations and the hellos
            socket.recv_multipart()
        seen = []
        for engine in engines:
            for frames in sent:
                socket.send_multipart([engine.identity, *frames])
            socket.send_multipart([engine.identity, packb([UNPAUSE])])  # the end
            events: list = []
            deadline = time.monotonic() + TIMEOUT
            # Until the end has come and nothing follows it: a generated UNPAUSE may
            # close a poll's events before the rest arrived.
            while True:
                assert time.monotonic() < deadline
                ended = bool(events) and events[-1] == Control(Header.UNPAUSE)
                more = engine.poll(0.3 if ended else 0.05)
                if ended and not more:
                    break
                events += more
            seen.append(([normalized(e) for e in events], engine.pending))
        assert seen[0] == seen[1]
    finally:
        for engine in engines:
            engine.close()
        socket.close()
