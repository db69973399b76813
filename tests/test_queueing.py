"""The queue in the loop: requests that find no engine with room wait at the
coordinator instead of being refused BUSY, and leave it in the queue's order, on
both cores, against raw peers (the room itself alone: test_queue.py).

An engine's room is the capacity it declared in ENGINE_HELLO (or
``max_inflight_per_engine``); a client granted ``"qos"`` may give a request a
priority and a deadline, which the coordinator reads and strips: engines see
``[20, server_rid, params]`` as ever.
"""

from __future__ import annotations

import time

from coordkit.protocol import ErrorCode
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    ERROR,
    REPLY,
    REPLY_BATCH,
    SUBMIT,
    SUBMIT_BATCH,
    RawClient,
    m,
    um,
    wait_for,
)

SP = {"num_tokens_to_generate": 4}


def qos_client(cluster, tenant: str | None = None, batch: bool = False) -> RawClient:
    """A client that asks for QoS (and names ``tenant``), granted it."""
    client = RawClient(cluster.ctx, cluster.coord.address)
    cluster.peers.append(client)
    hello: dict = {"coordkit": 1, "qos": 1}
    granted = {"qos": 1}
    if tenant is not None:
        hello["tenant"] = tenant
    if batch:
        hello["batch"] = granted["batch"] = 1
    client.send(m([CONNECT, hello]))
    assert um(client.recv()[0]) == [CONNECT_ACK, granted]
    return client


def engine_with(cluster, capacity: int, batch: bool = False):
    """A coordkit engine that takes ``capacity`` requests at once."""
    engine = cluster.add_engine()
    messages = cluster.coord.stats()["messages"]
    engine.hello(capacity=capacity, **({"batch": 1} if batch else {}))
    wait_for(lambda: cluster.coord.stats()["messages"] > messages)
    return engine


def depth(cluster) -> int:
    return cluster.coord.stats()["queue"]["depth"]


def finish(engine, server_rid: int, body: bytes = b"done") -> None:
    engine.send(m([REPLY, [[server_rid, False]]]), body)


def test_a_request_past_capacity_waits_and_goes_when_room_frees(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=1)
        client = c.client()  # a Megatron client, which says nothing of QoS: it waits too
        client.send(m([SUBMIT, 7, SP]), m([1]))
        client.send(m([SUBMIT, 8, SP]), m([2]))
        assert engine.recv() == [m([SUBMIT, 0, SP]), m([1])]
        wait_for(lambda: depth(c) == 1)
        engine.assert_silent()
        finish(engine, 0)
        assert client.recv() == [m([REPLY, 7]), b"done"]
        assert engine.recv() == [m([SUBMIT, 1, SP]), m([2])]  # its server id from arrival
        finish(engine, 1)
        assert client.recv() == [m([REPLY, 8]), b"done"]
        stats = c.coord.stats()
        assert stats["counters"]["queued"] == 1
        assert stats["counters"]["busy"] == 0
        assert stats["queue"]["depth"] == 0
        outcomes = stats["queue"]["by_priority"][0]["outcomes"]
        assert outcomes == {"dispatched": 1, "timed_out": 0, "refused": 0, "abandoned": 0}


def test_qos_is_granted_and_never_reaches_an_engine(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=4)
        client = qos_client(c, tenant="a")
        client.send(m([SUBMIT, 5, -3, 60000, SP]), m([1]))
        assert engine.recv() == [m([SUBMIT, 0, SP]), m([1])]
        # Only a client granted it may send them: from another, the layout is wrong.
        plain = c.client(coordkit=True)
        plain.send(m([SUBMIT, 6, -3, 0, SP]), m([1]))
        code, text = um(plain.recv()[0])[2:]
        assert code == ErrorCode.MALFORMED and text == "SUBMIT_REQUEST: malformed message"
        client.send(m([SUBMIT, 9, 500, 0, SP]), m([1]))  # out of range
        assert um(client.recv()[0])[1:3] == [9, ErrorCode.MALFORMED]
        engine.assert_silent()


def test_priorities_are_strict_and_none_overtakes(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=1)
        client = qos_client(c)
        client.send(m([SUBMIT, 0, SP]), m([0]))
        assert engine.recv()[1] == m([0])
        for rid, priority in ((1, 5), (2, 0), (3, -1), (4, 5), (5, -1)):
            client.send(m([SUBMIT, rid, priority, 0, SP]), m([rid]))
        wait_for(lambda: depth(c) == 5)
        order, running = [], 0
        for _ in range(5):
            finish(engine, running)
            meta, prompt = engine.recv()
            running = um(meta)[1]
            order.append(um(prompt)[0])
        assert order == [3, 5, 2, 1, 4]


def test_tenants_share_by_weight(make_cluster):
    with make_cluster(tenant_weights={"gold": 3}) as c:
        engine = engine_with(c, capacity=1)
        gold, free = qos_client(c, "gold"), qos_client(c, "free")
        gold.send(m([SUBMIT, 99, SP]), m(["first"]))
        assert engine.recv()[1] == m(["first"])
        for rid in range(8):
            gold.send(m([SUBMIT, rid, SP]), m(["gold"]))
        for rid in range(8):
            free.send(m([SUBMIT, rid, SP]), m(["free"]))
        wait_for(lambda: depth(c) == 16)
        served = []
        server_rid = 0
        for _ in range(8):
            finish(engine, server_rid)
            meta, prompt = engine.recv()
            server_rid = um(meta)[1]
            served.append(um(prompt)[0])
        # gold's weight 3 to free's 1: three of every four dispatches while both wait.
        assert served.count("gold") == 6 and served.count("free") == 2
        by_tenant = c.coord.stats()["queue"]["by_tenant"]
        assert by_tenant["gold"]["outcomes"]["dispatched"] == 6
        assert by_tenant["free"]["depth"] == 6


def test_a_deadline_ends_the_wait_and_never_reaches_an_engine(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=1)
        client = qos_client(c)
        client.send(m([SUBMIT, 1, SP]), m([1]))
        engine.recv()
        start = time.monotonic()
        client.send(m([SUBMIT, 2, 0, 150, SP]), m([2]))
        reply = um(client.recv()[0])
        assert reply[:3] == [ERROR, 2, ErrorCode.TIMED_OUT]
        assert 0.14 < time.monotonic() - start < 2
        finish(engine, 0)
        assert client.recv() == [m([REPLY, 1]), b"done"]
        engine.assert_silent()
        stats = c.coord.stats()
        assert stats["queue"]["by_priority"][0]["outcomes"]["timed_out"] == 1
        assert stats["counters"]["timed_out"] == 1


def test_the_limit_refuses_busy(make_cluster):
    with make_cluster(queue_limit=2) as c:
        engine = engine_with(c, capacity=1)
        client = c.client(coordkit=True)
        for rid in range(4):
            client.send(m([SUBMIT, rid, SP]), m([rid]))
        assert um(client.recv()[0])[:3] == [ERROR, 3, ErrorCode.BUSY]
        assert engine.recv()[1] == m([0])
        assert depth(c) == 2
        assert c.coord.stats()["queue"]["by_priority"][0]["outcomes"]["refused"] == 1


def test_without_a_queue_a_full_engine_is_busy(make_cluster):
    with make_cluster(queue_limit=0) as c:
        engine = engine_with(c, capacity=1)
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, SP]), m([0]))
        client.send(m([SUBMIT, 1, SP]), m([1]))
        assert um(client.recv()[0])[:3] == [ERROR, 1, ErrorCode.BUSY]
        assert engine.recv()[1] == m([0])


def test_an_abort_or_a_departure_ends_waiting_requests_at_the_coordinator(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=1)
        client = c.client(coordkit=True)
        for rid in range(3):
            client.send(m([SUBMIT, rid, SP]), m([rid]))
        assert engine.recv()[1] == m([0])
        wait_for(lambda: depth(c) == 2)
        client.send(m([ABORT, 1]))
        code, text = um(client.recv()[0])[2:]
        assert code == ErrorCode.ABORTED
        assert text == "request 1 was aborted before any engine ran it"
        other = c.client(coordkit=True)
        other.send(m([SUBMIT, 0, SP]), m(["other"]))
        wait_for(lambda: depth(c) == 2)
        client.close()  # its connection ends: its waiting request leaves, unannounced
        # The one the engine ran is aborted there, its room another's: the other client's.
        assert engine.recv() == [m([ABORT, 0])]
        assert engine.recv()[1] == m(["other"])
        engine.assert_silent()
        assert depth(c) == 0
        outcomes = c.coord.stats()["queue"]["by_priority"][0]["outcomes"]
        assert outcomes["abandoned"] == 2 and outcomes["dispatched"] == 1


def test_an_engine_death_requeues_its_unstarted_requests_at_the_head(make_cluster):
    with make_cluster() as c:
        first, second = engine_with(c, capacity=1), engine_with(c, capacity=1)
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, SP]), m([0]))
        client.send(m([SUBMIT, 1, SP]), m([1]))
        client.send(m([SUBMIT, 2, SP]), m([2]))
        got = {bytes(e.recv()[1]): e for e in (first, second)}
        wait_for(lambda: depth(c) == 1)
        dying = got[m([0])]
        survivor = got[m([1])]
        dying.close()  # ipc: gone at once; request 0 produced nothing
        wait_for(lambda: c.coord.stats()["counters"]["queued"] == 2)
        finish(survivor, 1)
        assert client.recv() == [m([REPLY, 1]), b"done"]
        meta, prompt = survivor.recv()
        assert prompt == m([0])  # the re-queued one first, then the one that waited
        finish(survivor, um(meta)[1])
        assert client.recv() == [m([REPLY, 0]), b"done"]
        assert survivor.recv()[1] == m([2])


def test_a_freed_batched_engine_gets_one_batch(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=2, batch=True)
        client = qos_client(c, batch=True)
        client.send(m([SUBMIT, 0, SP]), m([0]))
        client.send(m([SUBMIT, 1, SP]), m([1]))
        assert engine.recv()[1] == m([0])
        assert engine.recv()[1] == m([1])
        for rid in (2, 3, 4):
            client.send(m([SUBMIT, rid, SP]), m([rid]))
        wait_for(lambda: depth(c) == 3)
        engine.send(m([REPLY, [[0, False], [1, False]]]), b"a", b"b")
        frames = engine.recv()
        assert um(frames[0]) == [SUBMIT_BATCH, [[2, SP], [3, SP]]]
        assert frames[1:] == [m([2]), m([3])]
        assert um(client.recv()[0])[0] == REPLY_BATCH


def test_no_engine_left_ends_the_waiting_requests(make_cluster):
    with make_cluster() as c:
        engine = engine_with(c, capacity=1)
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, SP]), m([0]))
        client.send(m([SUBMIT, 1, SP]), m([1]))
        engine.recv()
        wait_for(lambda: depth(c) == 1)
        engine.close()  # request 0 finds no engine to go on to, and request 1 none to wait for
        errors = sorted(um(client.recv()[0])[1:3] for _ in range(2))
        assert errors == [[0, ErrorCode.NO_ENGINES], [1, ErrorCode.NO_ENGINES]]
        assert depth(c) == 0
        assert c.coord.stats()["queue"]["by_priority"][0]["outcomes"]["refused"] == 1
