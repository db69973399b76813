"""Batched messages at the coordinator, frame by frame, with raw peers.

A coordkit client that asks in CONNECT is granted batches (CONNECT_ACK
``[1, {"batch": 1}]``) and may send SUBMIT_BATCH; its replies come coalesced,
one REPLY_BATCH per engine message. An engine that asks in ENGINE_HELLO gets
the entries of one SUBMIT_BATCH bound for it as one ENGINE_SUBMIT_BATCH. Every
other peer sees the frames it always saw. Every test runs on both cores.
"""

from __future__ import annotations

import time

import pytest

from coordkit.protocol import ErrorCode
from tests.support.peers import (
    CONNECT,
    CONNECT_ACK,
    ERROR,
    PARTIAL,
    REPLY,
    REPLY_BATCH,
    SUBMIT,
    SUBMIT_BATCH,
    RawClient,
    m,
    um,
    wait_for,
)


def batch(*entries: tuple[int, dict, bytes] | tuple[int, dict, bytes, bytes]) -> list[bytes]:
    """A client's SUBMIT_BATCH: ``(rid, params, prompt[, hashes])`` per entry."""
    frames = [m([SUBMIT_BATCH, [[e[0], e[1], len(e) == 4] for e in entries]])]
    for entry in entries:
        frames += entry[2:]
    return frames


def server_ids(frames: list[bytes]) -> list[int]:
    """The server ids of an ENGINE_SUBMIT_BATCH an engine received."""
    header, entries = um(frames[0])
    assert header == SUBMIT_BATCH
    return [entry[0] for entry in entries]


def errors(client: RawClient) -> list[tuple[int | None, int]]:
    """The (rid, code) of every ERROR that arrives now (and nothing else)."""
    out = []
    for frames in client.recv_all():
        header, rid, code, message = um(frames[0])
        assert header == ERROR and message
        out.append((rid, code))
    return out


# -- the grant -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hello, ack",
    [
        ({"coordkit": 1, "batch": 1}, [CONNECT_ACK, {"batch": 1}]),
        ({"coordkit": 2, "batch": 3}, [CONNECT_ACK, {"batch": 1}]),
        ({"coordkit": 1}, [CONNECT_ACK]),
        ({"coordkit": 1, "batch": 0}, [CONNECT_ACK]),
        ({"coordkit": 1, "batch": True}, [CONNECT_ACK]),  # a bool is no version
        ({"batch": 1}, [CONNECT_ACK]),  # not a coordkit client
        (None, [CONNECT_ACK]),  # Megatron's [0]
    ],
)
def test_batches_granted_only_to_a_coordkit_client_that_asks(cluster, hello, ack):
    client = RawClient(cluster.ctx, cluster.coord.address)
    cluster.peers.append(client)
    client.send(m([CONNECT] if hello is None else [CONNECT, hello]))
    assert client.recv() == [m(ack)]


def test_a_client_that_did_not_ask_may_not_send_a_batch(make_cluster):
    with make_cluster(n_engines=1) as c:
        plain = c.client(coordkit=True)
        plain.send(*batch((0, {}, b"p")))
        assert errors(plain) == [(None, ErrorCode.MALFORMED)]
        megatron = c.client()
        megatron.send(*batch((0, {}, b"p")))
        megatron.assert_silent()  # it cannot parse an ERROR: counted only
        # Asked, then connected again without asking: the grant is withdrawn.
        again = c.client(batch=True)
        again.send(m([CONNECT, {"coordkit": 1}]))
        assert again.recv() == [m([CONNECT_ACK])]
        again.send(*batch((0, {}, b"p")))
        assert errors(again) == [(None, ErrorCode.MALFORMED)]
        c.engines[0].assert_silent()
        stats = c.coord.stats()
        assert stats["counters"]["malformed"] == 3 and stats["inflight"] == 0


# -- a batch in and out ----------------------------------------------------------------


def test_a_batch_in_and_out(make_cluster):
    with make_cluster() as c:
        engine = c.add_coordkit_engine(batch=True)
        client = c.client(batch=True)
        hashes = (7).to_bytes(8, "little") * 2
        client.send(
            *batch((10, {"a": 1}, b"p0"), (11, {}, b"p1", hashes), (12, {"stop": ["\n"]}, b"p2"))
        )
        frames = engine.recv()
        ids = server_ids(frames)
        params = [{"a": 1}, {}, {"stop": ["\n"]}]
        # One message: the params as they came, the prompts as themselves, no hashes.
        assert frames == [
            m([SUBMIT_BATCH, [list(e) for e in zip(ids, params, strict=True)]]),
            b"p0",
            b"p1",
            b"p2",
        ]
        engine.assert_silent()
        engine.send(m([PARTIAL, ids[:2]]), b"a", b"b")
        assert client.recv() == [m([REPLY_BATCH, [[10, False], [11, False]]]), b"a", b"b"]
        engine.send(m([REPLY, [[sid, False] for sid in reversed(ids)]]), b"z", b"y", b"x")
        expected = [m([REPLY_BATCH, [[12, True], [11, True], [10, True]]]), b"z", b"y", b"x"]
        assert client.recv() == expected
        client.assert_silent()
        stats = c.coord.stats()
        assert stats["inflight"] == 0
        counters = stats["counters"]
        assert (counters["submitted"], counters["replies"], counters["partials"]) == (3, 3, 2)
        traffic = {
            (t["direction"], t["header"]): t["messages"] for t in c.coord.metrics()["traffic"]
        }
        assert traffic[("in", SUBMIT_BATCH)] == 1 and traffic[("out", SUBMIT_BATCH)] == 1
        assert traffic[("out", REPLY_BATCH)] == 2


def test_mixed_batched_and_unbatched_peers(make_cluster):
    with make_cluster(policy="round_robin") as c:
        batched = c.add_coordkit_engine(b"batched", batch=True)
        megatron = c.add_engine(b"megatron")
        coordkit = c.add_coordkit_engine(b"coordkit")
        other_batched = c.add_coordkit_engine(b"other", batch=True)
        asking = c.client(batch=True)
        plain = c.client(coordkit=True)
        # Round robin over the four: each batched engine gets its entries as one
        # message, each other engine one SUBMIT_REQUEST per entry.
        asking.send(*batch(*[(rid, {"n": rid}, f"p{rid}".encode()) for rid in range(8)]))
        to_batched, to_other = batched.recv(), other_batched.recv()
        assert to_batched[1:] == [b"p0", b"p4"] and to_other[1:] == [b"p3", b"p7"]
        for engine, rids in ((megatron, (1, 5)), (coordkit, (2, 6))):
            messages = engine.recv_all()
            assert [frames[1] for frames in messages] == [f"p{rid}".encode() for rid in rids]
            assert [um(frames[0])[2] for frames in messages] == [{"n": rid} for rid in rids]
            assert all(um(frames[0])[0] == SUBMIT for frames in messages)
        # A SUBMIT_REQUEST goes as one, also to a batched engine.
        plain.send(m([SUBMIT, 0, {}]), b"q0")
        single = batched.recv()
        assert single == [m([SUBMIT, um(single[0])[1], {}]), b"q0"]
        # One engine message for both clients: coalesced for the one that asked only.
        ids = server_ids(to_batched) + [um(single[0])[1]]
        batched.send(m([REPLY, [[sid, False] for sid in ids]]), b"r0", b"r4", b"rq")
        assert asking.recv() == [m([REPLY_BATCH, [[0, True], [4, True]]]), b"r0", b"r4"]
        assert plain.recv() == [m([REPLY, 0]), b"rq"]
        asking.assert_silent()
        plain.assert_silent()
        assert c.coord.stats()["inflight"] == 6


# -- malformed batches: an ERROR per request named, nothing lost -------------------------


@pytest.mark.parametrize(
    ("frames", "named"),
    [
        ([m([SUBMIT_BATCH, [[0, {}, "yes"]]]), b"p"], [0]),  # hashed not a bool
        ([m([SUBMIT_BATCH, [[0, {}]]]), b"p"], [None]),  # an entry of two
        ([m([SUBMIT_BATCH, 5]), b"p"], [None]),  # no entries
        ([m([SUBMIT_BATCH, [[0, {}, False]], 1]), b"p"], [None]),  # an array of three
        ([m([SUBMIT_BATCH, [[(1 << 64) - 1, {}, False]]]), b"p"], [None]),  # a rid beyond int64
        ([m([SUBMIT_BATCH, [[0, {}, False]]])[:-2], b"p"], [0]),  # truncated in the params
        ([m([SUBMIT_BATCH, [[0, {}, False]]]) + b"\xc0", b"p"], [0]),  # trailing bytes
        (  # the third entry's hashed is not a bool: the first three are named
            [m([SUBMIT_BATCH, [[0, {}, False], [1, {}, False], [2, {}, 1]]]), b"a", b"b", b"c"],
            [0, 1, 2],
        ),
        (  # the third entry is too short: its id is not read as one
            [m([SUBMIT_BATCH, [[0, {}, False], [1, {}, False], [2, {}]]]), b"a", b"b", b"c"],
            [0, 1],
        ),
        (  # a long batch, faulty at its very end
            [m([SUBMIT_BATCH, [[i, {}, False] for i in range(3000)]]) + b"\xc0"] + [b"p"] * 3000,
            list(range(3000)),
        ),
    ],
    ids=[
        "hashed",
        "width",
        "entries",
        "length",
        "rid",
        "truncated",
        "trailing",
        "third-hashed",
        "third-width",
        "long",
    ],
)
def test_a_batch_that_does_not_read_whole_ends_every_request_named(make_cluster, frames, named):
    """No prompt can be told from another, so none goes on; each request whose id
    could be read gets its ERROR, and a batch that names none gets one without an id."""
    with make_cluster() as c:
        engine = c.add_coordkit_engine(batch=True)
        client = c.client(batch=True)
        client.send(*frames)
        received: list[tuple[int | None, int]] = []
        deadline = time.monotonic() + 10
        while len(received) < len(named) and time.monotonic() < deadline:
            received += errors(client)
        assert received == [(rid, ErrorCode.MALFORMED) for rid in named]
        engine.assert_silent()
        stats = c.coord.stats()
        assert stats["counters"]["malformed"] == len(named) and stats["inflight"] == 0
        client.send(*batch((7, {}, b"after")))  # the client is served as before
        assert engine.recv()[1:] == [b"after"]


@pytest.mark.parametrize(
    "prompts",
    [[b"p0", b"p1"], [b"p0", b"p1", b"h" * 8, b"extra"], [b"p0"]],
    ids=["hashes-missing", "one-too-many", "one-too-few"],
)
def test_entries_and_frames_that_disagree_end_every_request_named(make_cluster, prompts):
    with make_cluster() as c:
        engine = c.add_coordkit_engine(batch=True)
        client = c.client(batch=True)
        client.send(m([SUBMIT_BATCH, [[0, {}, False], [1, {}, True]]]), *prompts)
        assert errors(client) == [(0, ErrorCode.MALFORMED), (1, ErrorCode.MALFORMED)]
        engine.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def test_a_bad_entry_ends_alone_and_the_others_go_on(make_cluster):
    with make_cluster(max_inflight=3) as c:
        engine = c.add_coordkit_engine(batch=True)
        client = c.client(batch=True)
        client.send(m([SUBMIT, 5, {}]), b"before")  # one in flight already
        first = engine.recv()
        client.send(
            *batch(
                (0, {}, b"p0", b"short"),  # block hashes not a multiple of 8 bytes
                (1, {}, b"p1"),
                (1, {}, b"again"),  # a duplicate within the batch
                (5, {}, b"dup"),  # a duplicate of one in flight
                (2, {}, b"p2"),
                (3, {}, b"p3"),  # beyond max_inflight
            )
        )
        assert errors(client) == [
            (0, ErrorCode.MALFORMED),
            (1, ErrorCode.DUPLICATE_REQUEST),
            (5, ErrorCode.DUPLICATE_REQUEST),
            (3, ErrorCode.BUSY),
        ]
        frames = engine.recv()
        assert frames[1:] == [b"p1", b"p2"]
        ids = server_ids(frames) + [um(first[0])[1]]
        engine.send(m([REPLY, [[sid, False] for sid in ids]]), b"r1", b"r2", b"r5")
        assert client.recv() == [
            m([REPLY_BATCH, [[1, True], [2, True], [5, True]]]),
            *[b"r1", b"r2", b"r5"],
        ]
        stats = c.coord.stats()
        assert stats["inflight"] == 0
        assert stats["counters"]["malformed"] == 1 and stats["counters"]["busy"] == 1


def test_a_batch_with_no_engine_ends_every_request(make_cluster):
    with make_cluster() as c:
        client = c.client(batch=True)
        client.send(*batch((0, {}, b"p0"), (1, {}, b"p1")))
        assert errors(client) == [(0, ErrorCode.NO_ENGINES), (1, ErrorCode.NO_ENGINES)]
        assert c.coord.stats()["inflight"] == 0


# -- an engine death with a batch in flight ---------------------------------------------


@pytest.mark.parametrize("keep_prompts", [True, False])
def test_engine_death_with_a_batch_in_flight(make_cluster, keep_prompts):
    with make_cluster(policy="round_robin", keep_prompts=keep_prompts) as c:
        doomed = c.add_coordkit_engine(b"doomed", batch=True)
        survivor = c.add_coordkit_engine(b"survivor", batch=True)
        client = c.client(batch=True)
        client.send(*batch(*[(rid, {"n": rid}, f"p{rid}".encode()) for rid in range(4)]))
        held = server_ids(doomed.recv())
        survivor_ids = server_ids(survivor.recv())
        doomed.send(m([PARTIAL, [held[0]]]), b"started")  # rid 0 produced output
        assert client.recv() == [m([REPLY_BATCH, [[0, False]]]), b"started"]
        doomed.close()  # dies without a word: its connection's end says so at once (ipc)
        c.peers.remove(doomed)
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "gone")
        # rid 2 produced nothing: sent again, alone; rid 0 streamed a body without
        # tokens: it cannot go on elsewhere.
        resent = survivor.recv_all() if keep_prompts else []
        assert [(um(f[0])[0], um(f[0])[2], f[1]) for f in resent] == (
            [(SUBMIT, {"n": 2}, b"p2")] if keep_prompts else []
        )
        survivor_ids += [um(f[0])[1] for f in resent]
        client.send(*batch((4, {"n": 4}, b"p4"), (5, {"n": 5}, b"p5")))
        to_survivor = survivor.recv_all()
        assert [frames[1:] for frames in to_survivor] == [[b"p4", b"p5"]]  # one batch
        failed = [0] if keep_prompts else [0, 2]
        assert errors(client) == [(rid, ErrorCode.ENGINE_FAILED) for rid in failed]
        assert c.coord.stats()["counters"]["rerouted"] == (1 if keep_prompts else 0)
        survivor_ids += server_ids(to_survivor[0])
        n = len(survivor_ids)
        survivor.send(m([REPLY, [[sid, False] for sid in survivor_ids]]), *[b"r"] * n)
        reply = client.recv()
        assert um(reply[0])[0] == REPLY_BATCH and len(reply) == n + 1
        finished = sorted(entry[0] for entry in um(reply[0])[1])
        assert finished == ([1, 2, 3, 4, 5] if keep_prompts else [1, 3, 4, 5])
        client.assert_silent()
        stats = c.coord.stats()
        assert stats["inflight"] == 0 and stats["engines"][0]["state"] == "gone"
