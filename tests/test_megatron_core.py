"""Megatron-Core 0.19's single frames: ``Coordinator(dialect="megatron-core")``.

Up to release 0.19, Megatron-Core's client and engines send every coordinator
message as one msgpack frame (``m(x)`` is ``msgpack.packb(x, use_bin_type=True)``):

    CONNECT / CONNECT_ACK   client <-> coord     m([0]) / m([1])
    SUBMIT_REQUEST          client -> coord      m([20, client_rid, prompt, sampling_params])
                            coord -> engine      m([20, server_rid, prompt, sampling_params])
    ENGINE_REPLY            engine -> coord      m([21, [finished_request, ...]]), each a map
                                                 whose "request_id" is the server id
                            coord -> client      m([21, client_rid, finished_request])
    control 40-47           client -> coord -> every engine: m([h]), m([44, epoch])
    DISCONNECT / SHUTDOWN   engine -> coord / client -> coord: m([60]) / m([61])
    registration            engine -> coord      one empty frame

The single-frame peers know only these layouts (``tests/support/peers.py``).
In the same dialect coordkit's own peers keep speaking multipart: a client
that connects with ``m([0, {"coordkit": 1}])``, an engine that follows its
registration with ``m([94, {"coordkit": 1}])`` (ENGINE_HELLO); the mixed
tests put one on each side.

Held throughout: a prompt, its sampling params and a finished request reach
the other side byte for byte (in encodings ``msgpack.packb`` would not choose,
so that a coordinator that decoded and re-encoded them would be caught); a
Megatron client never gets a frame it cannot parse (no ERROR: a refused or
malformed message is counted and dropped); a 0.19 engine never gets a message
0.19 does not have (no ABORT, no RELEASE_KV); every request ends with exactly
one terminal outcome. A SUBMIT is read as far as its request id: one whose
body is bad reaches a single-frame engine as it came, and is caught only when
the coordinator must walk it (to split it for a multipart engine).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

import pytest
import zmq

from coordkit.protocol import ErrorCode, block_hashes
from tests.support.cluster import Cluster
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    DISCONNECT,
    ERROR,
    PAUSE,
    REPLY,
    REPLY_BATCH,
    RESUME,
    SET_GENERATION_EPOCH,
    SHUTDOWN,
    START_CUDA_PROFILER,
    STOP,
    STOP_CUDA_PROFILER,
    SUBMIT,
    SUBMIT_BATCH,
    SUSPEND,
    UNPAUSE,
    Raw,
    SingleFrameClient,
    SingleFrameEngine,
    finished_request,
    m,
    splice,
    submit_parts,
    um,
    wait_for,
)
from tests.support.processes import single_frame_engine_process

SP = {"temperature": 0.7, "num_tokens_to_generate": 8}

# Encodings msgpack.packb would not choose: bytes a re-encoding would change.
#   {"temperature": 0.7, "n": 8} as a map16, a str8 key, a float64, an int16
PARAMS = b"\xde\x00\x02\xd9\x0btemperature\xcb?\xe6ffffff\xa1n\xd1\x00\x08"
#   [1, 256, 5] as an array16, a uint16 and a uint32
TOKENS = b"\xdc\x00\x03\x01\xcd\x01\x00\xce\x00\x00\x00\x05"
#   "hello" as a str8
TEXT = b"\xd9\x05hello"


def finished(server_rid: int, tag: str = "done") -> bytes:
    """A finished request's bytes, as no re-encoding would keep them: a map16 with
    the "request_id" among its keys, not first, under a str8 key, as an int64."""
    return (
        b"\xde\x00\x03"
        + m("status")
        + m("COMPLETED")
        + b"\xd9\x0arequest_id\xd3"
        + server_rid.to_bytes(8, "big", signed=True)
        + m("tag")
        + m(tag)
    )


def reply_to(client_rid: int, body: bytes) -> bytes:
    """What a 0.19 client gets for a finished request: ``[21, client_rid, <body as it came>]``."""
    return splice(REPLY, client_rid, Raw(body))


@pytest.fixture
def megatron(make_cluster):
    """``megatron(**options)``: a running Cluster in the megatron-core dialect, no engine yet."""
    return lambda **options: make_cluster(dialect="megatron-core", **options)


def round_trip(client: SingleFrameClient, engine: SingleFrameEngine, rid: int) -> None:
    """A request that must still go through: the loop is alive and routing."""
    client.submit(rid, [1, 2, 3], SP)
    server_rid, _, _ = engine.recv_submit()
    engine.reply(finished(server_rid))
    assert client.recv_frame() == reply_to(rid, finished(server_rid))


def counters(cluster: Cluster) -> dict[str, int]:
    return cluster.coord.stats()["counters"]


def recv_any(engines: list[Any], timeout: float = 5.0) -> tuple[int, list[bytes]]:
    """The next message any of ``engines`` gets: (its index, its frames)."""
    poller = zmq.Poller()
    for engine in engines:
        poller.register(engine.sock, zmq.POLLIN)
    ready = dict(poller.poll(int(timeout * 1000)))
    assert ready, "no engine got anything"
    index = next(i for i, e in enumerate(engines) if e.sock in ready)
    return index, engines[index].sock.recv_multipart()


# -- the layouts --------------------------------------------------------------------


def test_connect_ack_is_one_frame(megatron):
    with megatron() as c:
        client = SingleFrameClient(c.ctx, c.coord.address)
        c.peers.append(client)
        client.send(m([CONNECT]))
        assert client.recv_frame() == m([CONNECT_ACK])
        client.assert_silent()


@pytest.mark.parametrize(
    "prompt",
    [TOKENS, TEXT, m([101, 2009, 2003]), m("Hello"), m([]), m(list(range(5000)))],
    ids=["tokens", "text", "token-list", "str", "empty", "long"],
)
def test_submit_reaches_the_engine_as_one_frame(megatron, prompt):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        sent = client.submit(7, Raw(prompt), Raw(PARAMS))
        assert sent == b"\x94\x14\x07" + prompt + PARAMS
        # read as far as the request id; the rest copied behind the rewritten head
        assert engine.recv_frame() == b"\x94\x14\x00" + prompt + PARAMS
        engine.assert_silent()


def test_finished_request_reaches_its_client_byte_for_byte(megatron):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(7, Raw(TOKENS), Raw(PARAMS))
        server_rid, prompt, params = engine.recv_submit()
        assert (prompt, params) == (TOKENS, PARAMS)
        engine.reply(finished(server_rid))
        assert client.recv_frame() == reply_to(7, finished(server_rid))
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0
        assert counters(c)["replies"] == 1


def test_batched_reply_split_across_clients_byte_for_byte(megatron):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        clients = [c.single_frame_client() for _ in range(3)]
        for k, client in enumerate(clients):
            client.submit(5, [k], SP)  # the same request id from every client
        received = [engine.recv_submit() for _ in clients]
        server_rids = {um(prompt)[0]: rid for rid, prompt, _ in received}  # client -> server id
        # one engine step finished all three, in another order
        bodies = {k: finished(server_rids[k], tag=f"client {k}") for k in (2, 0, 1)}
        engine.reply(*(Raw(body) for body in bodies.values()))
        for k, client in enumerate(clients):
            assert client.recv_frame() == reply_to(5, bodies[k])
            client.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def test_many_clients_overlapping_ids_two_engines(megatron):
    n_per_client = 200
    with megatron(policy="round_robin") as c:
        engines = [c.add_single_frame_engine() for _ in range(2)]
        clients = [c.single_frame_client() for _ in range(3)]
        for i in range(n_per_client):
            for k, client in enumerate(clients):
                # overlapping request ids; the prompt says who sent it
                client.submit(i, [k, i] if i % 2 else f"client {k} request {i}", SP)
        held: list[list[tuple[int, bytes]]] = [[], []]
        for _ in range(3 * n_per_client):
            index, frames = recv_any(engines)
            assert len(frames) == 1
            server_rid, prompt, params = submit_parts(frames[0])
            assert params == m(SP)
            held[index].append((server_rid, prompt))
        assert [len(h) for h in held] == [300, 300]
        expected: dict[tuple[int, int], bytes] = {}
        rng = random.Random(7)
        for engine, items in zip(engines, held, strict=True):
            rng.shuffle(items)
            for start in range(0, len(items), 7):
                batch = items[start : start + 7]
                bodies = [m(finished_request(rid, um(prompt))) for rid, prompt in batch]
                for (_, prompt), body in zip(batch, bodies, strict=True):
                    expected[_owner(um(prompt))] = body
                engine.reply(*(Raw(b) for b in bodies))
        for k, client in enumerate(clients):
            got: dict[int, bytes] = {}
            for _ in range(n_per_client):
                rid, body = client.recv_reply()
                assert rid not in got  # one terminal reply per request
                got[rid] = body
            assert got == {i: expected[(k, i)] for i in range(n_per_client)}
            client.assert_silent(0.05)
        assert c.coord.stats()["inflight"] == 0


def _owner(prompt: Any) -> tuple[int, int]:
    if isinstance(prompt, list):
        return prompt[0], prompt[1]
    _, k, _, i = prompt.split()
    return int(k), int(i)


def test_large_prompt_and_reply(megatron):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        prompt = m([random.Random(1).randrange(150_000) for _ in range(200_000)])
        client.submit(1, Raw(prompt), SP)
        server_rid, got, params = engine.recv_submit()
        assert got == prompt and params == m(SP)
        body = m(finished_request(server_rid, generated_tokens=list(range(100_000))))
        engine.reply(Raw(body))
        assert client.recv_frame() == reply_to(1, body)


# -- control and lifecycle -------------------------------------------------------------


def test_control_signals_broadcast_as_sent(megatron):
    with megatron() as c:
        # both kinds of engine get the signal as the client sent it: one frame
        engines = [c.add_single_frame_engine(), c.add_coordkit_engine()]
        client = c.single_frame_client()

        def signal(*meta: Any, allowed: bool) -> None:
            client.signal(*meta)
            for engine in engines:
                if allowed:
                    assert engine.recv() == [m(list(meta))]
                else:
                    engine.assert_silent(0.1)
            client.assert_silent(0.05)  # refused or not, a Megatron client hears nothing

        signal(UNPAUSE, allowed=False)  # while running
        signal(PAUSE, allowed=True)
        signal(PAUSE, allowed=False)  # again: 0.19 ignores it too
        signal(SET_GENERATION_EPOCH, 3, allowed=True)  # in any state
        signal(SUSPEND, allowed=True)
        signal(RESUME, allowed=True)
        signal(STOP, allowed=True)  # from paused, then running
        signal(START_CUDA_PROFILER, allowed=True)
        signal(STOP_CUDA_PROFILER, allowed=True)
        signal(PAUSE, allowed=True)
        signal(UNPAUSE, allowed=True)
        stats = c.coord.stats()
        assert stats["control_state"] == "running"
        assert stats["counters"]["invalid_control"] == 2
        assert stats["counters"]["control"] == 9


def test_late_engine_gets_traffic_and_signals(megatron):
    with megatron(policy="least_loaded") as c:
        first = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(0, "x", SP)
        first.recv_submit()
        late = c.add_single_frame_engine(b"mp-coord-1")
        client.submit(1, "y", SP)  # rank 0 holds one, the late rank none
        assert late.recv_frame() == m([SUBMIT, 1, "y", SP])
        client.signal(PAUSE)
        for engine in (first, late):
            assert engine.recv_frame() == m([PAUSE])


def test_no_engine_yet_drops_and_counts_the_request(megatron):
    with megatron() as c:
        client = c.single_frame_client()
        client.submit(0, "early", SP)
        wait_for(lambda: counters(c)["no_engines"] == 1)
        client.assert_silent()  # 0.19's client cannot parse ERROR(NO_ENGINES)
        engine = c.add_single_frame_engine()
        round_trip(client, engine, 1)


def test_disconnect_drains_the_engine(megatron):
    with megatron(policy="round_robin") as c:
        leaving, staying = c.add_single_frame_engine(), c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(0, "a", SP)
        server_rid, _, _ = leaving.recv_submit()
        leaving.disconnect()
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "draining")
        for rid in range(1, 4):  # no new work for the leaving engine
            client.submit(rid, "b", SP)
            staying.recv_submit()
        leaving.assert_silent()
        leaving.reply(finished(server_rid))  # its finals still go through
        assert client.recv_frame() == reply_to(0, finished(server_rid))
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "gone")


def test_shutdown_ends_the_coordinator_without_a_word_to_megatron(make_coordinator):
    coord = make_coordinator(dialect="megatron-core")
    thread = threading.Thread(target=coord.serve_forever)
    thread.start()
    ctx = zmq.Context()
    try:
        engine = SingleFrameEngine(ctx, coord.address, b"mp-coord-0").register()
        wait_for(lambda: len(coord.stats()["engines"]) == 1)
        client = SingleFrameClient(ctx, coord.address).connect()
        client.submit(0, "in flight", SP)
        engine.recv_submit()
        client.shutdown()
        thread.join(5)
        assert not thread.is_alive()
        # the request in flight ends with ERROR(SHUTTING_DOWN) for a coordkit client;
        # a Megatron client could not parse it, and 0.19's coordinator says nothing either
        client.assert_silent()
        engine.assert_silent()  # SHUTDOWN is the coordinator's, not the engines'
        for peer in (client, engine):
            peer.close()
    finally:
        if thread.is_alive():
            coord.stop()
        ctx.term()


# -- malformed input -------------------------------------------------------------------

BAD_FROM_CLIENT = [
    # (frames, the counter that counts them); none is answered
    ([b"\xc1"], "malformed"),
    ([m([])], "malformed"),
    ([m("not an array")], "malformed"),
    ([m([SUBMIT])], "malformed"),
    ([m([SUBMIT, 7, "p"])], "malformed"),  # no params
    ([m([SUBMIT, "7", "p", SP])], "malformed"),
    ([m([SUBMIT, 2**64 - 1, "p", SP])], "malformed"),
    ([m([SUBMIT, 7, "p", SP]), b"extra"], "malformed"),  # one frame, not two
    ([m([PAUSE, 1])], "malformed"),
    ([m([SET_GENERATION_EPOCH])], "malformed"),
    ([m([SHUTDOWN, 1])], "malformed"),
    ([m([77])], "unknown_header"),
    ([m([REPLY, 7, {}])], "unknown_header"),  # a reply is not a client's to send
]

# SUBMITs whose head is right (an array of 4, int header and rid) but whose body is not.
BAD_BODIES = [
    m([SUBMIT, 7, b"bin", SP]),  # a prompt is a str or a list
    m([SUBMIT, 7, 3, SP]),
    m([SUBMIT, 7, None, SP]),
    m([SUBMIT, 7, "p", [1]]),  # params are a map
    m([SUBMIT, 7, "p", SP]) + b"\x00",
    m([SUBMIT, 7, "p", SP])[:-1],
]


@pytest.mark.parametrize(("frames", "counter"), BAD_FROM_CLIENT)
def test_malformed_from_megatron_client_counted_never_answered(megatron, frames, counter):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        before = c.coord.stats()
        client.send(*frames)
        wait_for(lambda: c.coord.stats()["messages"] > before["messages"])
        wait_for(lambda: counters(c) != before["counters"])
        moved = {k: n - before["counters"][k] for k, n in counters(c).items()}
        assert {k: n for k, n in moved.items() if n} == {counter: 1}
        client.assert_silent(0.05)  # 0.19's client cannot parse ERROR
        engine.assert_silent(0.05)
        round_trip(client, engine, 1000)
        assert c.coord.stats()["inflight"] == 0


@pytest.mark.parametrize("frame", BAD_BODIES)
def test_a_body_bound_for_a_single_frame_engine_goes_unread(megatron, frame):
    """A SUBMIT is read as far as its request id: between single-frame peers the
    rest goes on as it came (what keeps its cost flat in the prompt's length)."""
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.send(frame)
        assert engine.recv_frame() == b"\x94\x14\x00" + frame[3:]
        wait_for(lambda: counters(c)["submitted"] == 1)  # counted once sent
        assert counters(c)["malformed"] == 0


@pytest.mark.parametrize("frame", BAD_BODIES)
def test_a_body_that_must_be_split_is_checked(megatron, frame):
    """With a multipart engine to choose, the frame is walked (to split it at the
    prompt's end): a bad one is malformed, counted and dropped, never answered."""
    with megatron() as c:
        single, multi = c.add_single_frame_engine(), c.add_coordkit_engine()
        client = c.single_frame_client()
        before = counters(c)
        client.send(frame)
        wait_for(lambda: counters(c)["malformed"] == before["malformed"] + 1)
        client.assert_silent(0.05)
        single.assert_silent(0.05)
        multi.assert_silent(0.05)
        assert c.coord.stats()["inflight"] == 0


BAD_FROM_ENGINE = [
    # (frames, the counter that counts them)
    ([b"\xc1"], "malformed"),
    ([m([REPLY])], "malformed"),
    ([m([REPLY, {}])], "malformed"),
    ([m([REPLY, [{"request_id": 0}], 1])], "malformed"),
    ([m([REPLY, [{"request_id": 0}]]) + b"\x00"], "malformed"),  # refused whole:
    ([m([REPLY, [{"request_id": 0}]])[:-1]], "malformed"),  # request 0 is still there
    ([m([REPLY, [{"request_id": 0}]]), b"extra"], "malformed"),  # one frame, not two
    ([m([REPLY, [[0, False]]]), b"body"], "malformed"),  # the multipart layout
    # a readable batch with an entry that cannot be delivered: that entry is skipped
    ([m([REPLY, [[0, False]]])], "malformed_entries"),  # not a map
    ([m([REPLY, [{"rid": 0}]])], "malformed_entries"),  # no request_id
    ([m([REPLY, [{"request_id": "0"}]])], "malformed_entries"),  # not an int
    ([m([REPLY, [{"request_id": 2**64 - 1}]])], "malformed_entries"),  # not an int64
    ([m([REPLY, [{"request_id": 12345}]])], "unknown_request"),
    ([m([REPLY, [{"request_id": -1}]])], "unknown_request"),
    ([m([DISCONNECT, 1])], "malformed"),
    ([m([SUBMIT, 0, "p", {}])], "unknown_header"),
]


@pytest.mark.parametrize(("frames", "counter"), BAD_FROM_ENGINE)
def test_malformed_from_single_frame_engine_counted(megatron, frames, counter):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(0, "p", SP)
        server_rid, _, _ = engine.recv_submit()
        assert server_rid == 0
        # the loop counts a SUBMIT after forwarding it: the snapshot waits for that count
        wait_for(lambda: counters(c)["submitted"] == 1)
        before = c.coord.stats()
        engine.send(*frames)
        wait_for(lambda: c.coord.stats()["messages"] > before["messages"])
        wait_for(lambda: counters(c) != before["counters"])
        moved = {k: n - before["counters"][k] for k, n in counters(c).items()}
        assert {k: n for k, n in moved.items() if n} == {counter: 1}
        client.assert_silent(0.05)
        engine.reply(finished(0))  # the request is still there, untouched
        assert client.recv_frame() == reply_to(0, finished(0))
        round_trip(client, engine, 1)
        assert c.coord.stats()["engines"][0]["state"] == "alive"


def test_bad_entries_counted_good_ones_forwarded(megatron):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        for rid in (10, 11):
            client.submit(rid, "p", SP)
        first, second = engine.recv_submit()[0], engine.recv_submit()[0]
        engine.reply(
            Raw(finished(first)),
            [1, 2],  # not a map
            {"status": "COMPLETED"},  # no request_id
            {"request_id": "1"},  # not an int
            Raw(finished(second)),
        )
        assert client.recv_frame() == reply_to(10, finished(first))
        assert client.recv_frame() == reply_to(11, finished(second))
        client.assert_silent()
        wait_for(lambda: counters(c)["malformed_entries"] == 3)
        assert (counters(c)["replies"], counters(c)["malformed"]) == (2, 0)
        engine.assert_silent()  # 0.19's engine cannot be told which entries were skipped
        assert c.coord.stats()["inflight"] == 0


def test_reply_from_an_engine_not_owning_the_request_is_dropped(megatron):
    with megatron(policy="round_robin") as c:
        owner, impostor = c.add_single_frame_engine(), c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(0, "p", SP)
        server_rid, _, _ = owner.recv_submit()
        impostor.reply(finished(server_rid, tag="impostor"))
        wait_for(lambda: counters(c)["unknown_request"] == 1)
        client.assert_silent()
        owner.reply(finished(server_rid))
        assert client.recv_frame() == reply_to(0, finished(server_rid))
        # and never twice: a second final is dropped
        owner.reply(finished(server_rid, tag="again"))
        wait_for(lambda: counters(c)["unknown_request"] == 2)
        client.assert_silent()


# -- a killed engine -------------------------------------------------------------------


def test_sigkilled_engine_requests_resent_byte_identical(megatron):
    """0.19's engines send no heartbeat: a dead one is found when a send to it fails.

    Its requests never produced anything the client saw (0.19 has no partial
    replies), so each is re-sent to another engine, as it was sent the first
    time, and ends with exactly one reply.
    """
    n_requests = 40
    with (
        megatron(policy="round_robin") as c,
        single_frame_engine_process(c.coord.address, b"mp-coord-0", hold=True) as victim,
    ):
        wait_for(lambda: len(c.coord.stats()["engines"]) == 1, timeout=30)
        survivor = c.add_single_frame_engine(b"mp-coord-1")
        client = c.single_frame_client()
        sent: dict[int, bytes] = {}  # client rid -> prompt and params, as sent

        def submit(rid: int) -> None:
            prompt = m(list(range(rid, rid + 30))) if rid % 2 else m(f"prompt {rid}")
            params = m({**SP, "seed": rid})
            client.submit(rid, Raw(prompt), Raw(params))
            sent[rid] = prompt + params

        for rid in range(n_requests):
            submit(rid)  # round robin: every other one held by the victim
        replies: dict[int, list[bytes]] = {}
        answered: dict[int, bytes] = {}  # server rid -> the body the survivor sent
        killed = False
        probe = 1000
        deadline = time.monotonic() + 60
        poller = zmq.Poller()
        poller.register(client.sock, zmq.POLLIN)
        poller.register(survivor.sock, zmq.POLLIN)
        while len(replies) < len(sent):
            assert time.monotonic() < deadline, f"{sorted(set(sent) - set(replies))} lost"
            ready = dict(poller.poll(100))
            if survivor.sock in ready:
                server_rid, prompt, params = survivor.recv_submit()
                # the survivor echoes what it got, for the client to hold against what it sent
                body = m({"request_id": server_rid, "got": prompt + params})
                answered[server_rid] = body
                survivor.reply(Raw(body))
            if client.sock in ready:
                rid, body = client.recv_reply()
                replies.setdefault(rid, []).append(body)
            if not killed and len(replies) == n_requests // 2:
                victim.send_signal(signal.SIGKILL)  # holding the other half
                victim.wait()
                killed = True
            elif killed and not ready:
                submit(probe)  # a send the dead engine's turn will make fail
                probe += 1
        client.assert_silent(0.3)
        assert all(len(bodies) == 1 for bodies in replies.values())
        for rid, (body,) in replies.items():
            reply = um(body)
            assert reply["got"] == sent[rid]  # prompt and params byte for byte
            assert body == answered[reply["request_id"]]  # the map byte for byte
        stats = c.coord.stats()
        assert stats["inflight"] == 0
        assert stats["counters"]["rerouted"] >= n_requests // 2
        states = {e["identity"]: e["state"] for e in stats["engines"]}
        assert states == {"mp-coord-0": "gone", "mp-coord-1": "alive"}


# -- mixed peers: coordkit's multipart on one side ----------------------------------------


@pytest.mark.parametrize("hashed", [False, True], ids=["prompt", "prompt+hashes"])
def test_coordkit_client_to_single_frame_engine(megatron, hashed):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.client(coordkit=True)
        meta = b"\x93\x14\x05" + PARAMS  # [20, 5, params], the params as the client wrote them
        extra = [block_hashes(um(TOKENS), 2)] if hashed else []
        client.send(meta, TOKENS, *extra)
        # one frame: the prompt frame and the params' bytes spliced behind a new head
        assert engine.recv_frame() == b"\x94\x14\x00" + TOKENS + PARAMS
        engine.reply(Raw(finished(0)))
        # the finished request, split out of the batch, is the body frame
        assert client.recv() == [m([REPLY, 5]), finished(0)]
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def long_prompt(seed: int) -> bytes:
    """A token prompt of 40-60 KB (large frames are copied into reused buffers)."""
    return m(list(range(70_000 + seed, 70_000 + seed + 8_000 + 97 * seed)))


def test_long_frames_stay_intact_through_reused_buffers(megatron):
    with megatron(policy="round_robin") as c:
        single, multi = c.add_single_frame_engine(), c.add_coordkit_engine()
        client = c.single_frame_client()
        for rid in range(24):  # sizes vary, buffers come back and go out again
            prompt = long_prompt(rid)
            client.submit(rid, Raw(prompt), Raw(PARAMS))
            server_rid = rid  # server ids count from 0, one request at a time
            if rid % 2 == 0:  # the single-frame engine: the whole frame, copied
                head = m([SUBMIT, server_rid])[1:]
                assert single.recv_frame() == b"\x94" + head + prompt + PARAMS
            else:  # the coordkit engine: the prompt span, copied into a frame of its own
                assert multi.recv() == [b"\x93" + m([SUBMIT, server_rid])[1:] + PARAMS, prompt]


def test_stopping_with_long_frames_unsent_loses_nothing_else(megatron):
    """Buffers libzmq still holds when the loop goes are freed when it lets go."""
    with megatron() as c:
        engine = c.add_single_frame_engine()  # never reads until the end
        client = c.single_frame_client()
        for rid in range(50):
            client.submit(rid, Raw(long_prompt(rid)), Raw(PARAMS))
        wait_for(lambda: c.coord.stats()["inflight"] == 50)
        c.coord.stop()
        assert len(engine.recv_frames()) == 50  # every one went out before the stop
    with megatron() as c:  # and the next coordinator in this process works
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(1, Raw(long_prompt(1)), Raw(PARAMS))
        assert engine.recv_frame().endswith(long_prompt(1) + PARAMS)


def test_single_frame_client_to_coordkit_engine(megatron):
    with megatron() as c:
        engine = c.add_coordkit_engine()
        client = c.single_frame_client()
        client.submit(7, Raw(TOKENS), Raw(PARAMS))
        # split at the field boundary: [20, rid, params] and the prompt as its own frame
        assert engine.recv() == [b"\x93\x14\x00" + PARAMS, TOKENS]
        engine.send(m([REPLY, [[0, False]]]), finished(0))
        # the body frame becomes the map inside the client's one frame
        assert client.recv_frame() == reply_to(7, finished(0))
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def test_both_kinds_of_engine_behind_one_coordinator(megatron):
    with megatron(policy="round_robin") as c:
        engines = [c.add_single_frame_engine(), c.add_coordkit_engine()]
        megatron_client, coordkit_client = c.single_frame_client(), c.client(coordkit=True)
        single, multi = engines
        # one at a time: two clients' messages reach the coordinator in no set order
        megatron_client.submit(1, Raw(TEXT), Raw(PARAMS))  # round robin: the single-frame engine
        assert single.recv_frame() == b"\x94\x14\x00" + TEXT + PARAMS
        coordkit_client.send(b"\x93\x14\x02" + PARAMS, TEXT)  # the coordkit engine
        assert multi.recv() == [b"\x93\x14\x01" + PARAMS, TEXT]
        megatron_client.submit(3, Raw(TOKENS), Raw(PARAMS))
        assert single.recv_frame() == b"\x94\x14\x02" + TOKENS + PARAMS
        coordkit_client.send(b"\x93\x14\x04" + PARAMS, TOKENS)
        assert multi.recv() == [b"\x93\x14\x03" + PARAMS, TOKENS]
        single.reply(Raw(finished(2)), Raw(finished(0)))
        multi.send(m([REPLY, [[3, False], [1, False]]]), finished(3), finished(1))
        got = sorted(megatron_client.recv_frame() for _ in range(2))
        assert got == sorted([reply_to(1, finished(0)), reply_to(3, finished(2))])
        assert sorted(tuple(coordkit_client.recv()) for _ in range(2)) == sorted(
            [(m([REPLY, 2]), finished(1)), (m([REPLY, 4]), finished(3))]
        )
        for peer in (megatron_client, coordkit_client, *engines):
            peer.assert_silent(0.05)


def test_a_batched_client_behind_both_kinds_of_engine(megatron):
    with megatron(policy="round_robin") as c:
        single = c.add_single_frame_engine()
        batched = c.add_coordkit_engine(batch=True)
        client = c.client(batch=True)
        # [95, [[5, params, False], [6, ...], [7, ...]]], the params as the client wrote them
        entries = b"".join(b"\x93" + bytes([rid]) + PARAMS + b"\xc2" for rid in (5, 6, 7))
        client.send(b"\x92" + m(SUBMIT_BATCH) + b"\x93" + entries, TOKENS, TEXT, b"\x90")
        # Round robin: 5 and 7 to the single-frame engine, each spliced into one
        # frame at once; 6 to the batched engine, as a batch of one.
        assert single.recv_frame() == b"\x94\x14\x00" + TOKENS + PARAMS
        assert single.recv_frame() == b"\x94\x14\x02\x90" + PARAMS
        assert batched.recv() == [b"\x92" + m(SUBMIT_BATCH) + b"\x91\x92\x01" + PARAMS, TEXT]
        # A single-frame engine's finished requests for a batched client: one REPLY_BATCH.
        single.reply(Raw(finished(2)), Raw(finished(0)))
        assert client.recv() == [m([REPLY_BATCH, [[7, True], [5, True]]]), finished(2), finished(0)]
        batched.send(m([REPLY, [[1, False]]]), finished(1))
        assert client.recv() == [m([REPLY_BATCH, [[6, True]]]), finished(1)]
        for peer in (client, single, batched):
            peer.assert_silent(0.05)
        assert c.coord.stats()["inflight"] == 0


@pytest.mark.parametrize(
    ("meta", "prompt"),
    [
        (m([SUBMIT, 5, SP]), b"\xc1 not msgpack"),  # fine for a multipart engine, not here
        (m([SUBMIT, 5, SP]), m(b"bin")),  # msgpack, but neither a str nor an array
        (m([SUBMIT, 5, SP]), m("a") + m("b")),  # two objects
        (m([SUBMIT, 5, [1, 2]]), m([1])),  # params that are not a map
    ],
    ids=["not-msgpack", "bin", "two-objects", "params-not-a-map"],
)
def test_coordkit_request_a_single_frame_engine_cannot_take(megatron, meta, prompt):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.client(coordkit=True)
        client.send(meta, prompt)
        header, rid, code, _ = um(client.recv()[0])
        assert (header, rid, code) == (ERROR, 5, ErrorCode.MALFORMED)
        client.assert_silent()  # that one ERROR is the request's one terminal outcome
        engine.assert_silent()  # no frame 0.19's engine could not parse
        assert c.coord.stats()["inflight"] == 0


def test_abort_never_reaches_a_single_frame_engine(megatron):
    with megatron() as c:
        engine = c.add_single_frame_engine()
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 5, SP]), m([1, 2, 3]))
        server_rid, _, _ = engine.recv_submit()
        client.send(m([ABORT, 5]))
        # 0.19's engine has no ABORT: it would raise on the header
        engine.assert_silent()
        # the engine finishes the request as it would have, and that is its one terminal reply
        engine.reply(Raw(finished(server_rid)))
        assert client.recv() == [m([REPLY, 5]), finished(server_rid)]
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def test_abort_still_reaches_a_coordkit_engine(megatron):
    with megatron() as c:
        engine = c.add_coordkit_engine()
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 5, SP]), m([1, 2, 3]))
        meta, _ = engine.recv()
        server_rid = um(meta)[1]
        client.send(m([ABORT, 5]))
        assert engine.recv() == [m([ABORT, server_rid])]
        engine.send(m([REPLY, [[server_rid, False]]]), b"aborted")
        assert client.recv() == [m([REPLY, 5]), b"aborted"]


def test_a_coordkit_engine_is_told_apart_by_its_hello(megatron):
    """Registration alone is 0.19's: an engine that says ENGINE_HELLO gets multipart."""
    with megatron(policy="round_robin") as c:
        plain = c.add_engine()  # a RawEngine that never says hello: taken for 0.19's
        hello = c.add_coordkit_engine()
        client = c.single_frame_client()
        client.submit(0, "p", SP)
        client.submit(1, "q", SP)
        assert plain.recv() == [m([SUBMIT, 0, "p", SP])]
        assert hello.recv() == [m([SUBMIT, 1, SP]), m("q")]


# -- prefix routing from token prompts ---------------------------------------------------


def test_prefix_routing_from_token_prompts(megatron):
    """The client sends no hashes: the coordinator hashes a token-id prompt itself."""
    with megatron(policy="prefix", block_size=4) as c:
        engines = [c.add_single_frame_engine(), c.add_single_frame_engine()]
        client = c.single_frame_client()
        shared = list(range(100, 164))  # 16 full blocks
        client.submit(0, shared + [1], SP)
        first, _ = recv_any(engines)
        # the same 16 leading blocks: it follows them, though that engine is the busier
        # (prefilling them elsewhere costs more than the work queued there)
        client.submit(1, shared + [2, 3], SP)
        assert recv_any(engines)[0] == first
        # a str prompt has no token ids: routed by load, to the idle engine
        client.submit(2, "the same words", SP)
        assert recv_any(engines)[0] == 1 - first
        # another prefix: by load too (2 pending against 1)
        client.submit(3, [9, 9, 9, 9, 9], SP)
        assert recv_any(engines)[0] == 1 - first


def test_coordinator_hashes_are_a_coordkit_clients(megatron):
    """A coordkit client sends the hashes of its prompt; a Megatron client's are computed
    from its prompt: the same function, so both follow the same prefix."""
    with megatron(policy="prefix", block_size=4) as c:
        engines = [c.add_single_frame_engine(), c.add_single_frame_engine()]
        megatron_client, coordkit_client = c.single_frame_client(), c.client(coordkit=True)
        tokens = list(range(200, 296))  # 24 blocks
        megatron_client.submit(0, tokens, SP)
        first, _ = recv_any(engines)
        prompt = tokens[:64] + [1, 2]  # the first 16 blocks
        coordkit_client.send(m([SUBMIT, 0, SP]), m(prompt), block_hashes(prompt, 4))
        index, frames = recv_any(engines)
        assert index == first
        assert frames == [m([SUBMIT, 1, prompt, SP])]


# -- detokenization, as 0.19's coordinator does it --------------------------------------------


def test_detokenizer_fills_generated_text_of_every_finished_request(megatron):
    """0.19's engine leaves generated_text to its coordinator (it does not detokenize
    when it serves one), and 0.19's coordinator detokenizes every finished request:
    with a detokenizer, so does this one; without one the map goes untouched (above)."""
    with megatron(detokenizer=lambda tokens: " ".join(f"t{t}" for t in tokens)) as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        client.submit(1, [5, 6], SP)
        server_rid, _, _ = engine.recv_submit()
        engine.reply(finished_request(server_rid, [5, 6], generated_tokens=[7, 8]))
        rid, body = client.recv_reply()
        assert rid == 1
        assert um(body) == finished_request(server_rid, [5, 6], generated_tokens=[7, 8]) | {
            "generated_text": "t7 t8"
        }
        assert counters(c)["detokenized"] == 1


def test_detokenized_replies_coalesced_for_a_batched_client(megatron):
    """One 0.19 reply finishing requests of a batched and of an unbatched coordkit
    client: the batched one gets one REPLY_BATCH, both get detokenized bodies."""
    with megatron(detokenizer=lambda tokens: " ".join(f"t{t}" for t in tokens)) as c:
        engine = c.add_single_frame_engine()
        batched = c.client(batch=True)
        plain = c.client(coordkit=True)
        entries = [[rid, SP, False] for rid in (3, 4)]
        batched.send(m([SUBMIT_BATCH, entries]), m([1, 2]), m([3]))
        plain.send(m([SUBMIT, 9, SP]), m([4, 5]))
        sid = {}  # the server id of each prompt
        for _ in range(3):
            server_rid, prompt, _ = engine.recv_submit()
            sid[tuple(um(prompt))] = server_rid
        # the plain client's request finishes between the batched client's two
        order = [sid[(1, 2)], sid[(4, 5)], sid[(3,)]]
        engine.reply(*[finished_request(s, None, generated_tokens=[s, 50]) for s in order])

        def text(frame: bytes) -> str:
            return str(um(frame)["generated_text"])

        frames = batched.recv()
        assert um(frames[0]) == [REPLY_BATCH, [[3, True], [4, True]]]
        assert [text(f) for f in frames[1:]] == [f"t{sid[k]} t50" for k in ((1, 2), (3,))]
        meta, body = plain.recv()
        assert um(meta) == [REPLY, 9] and text(body) == f"t{sid[(4, 5)]} t50"
        for peer in (batched, plain, engine):
            peer.assert_silent(0.05)
        assert counters(c)["detokenized"] == 3 and c.coord.stats()["inflight"] == 0
