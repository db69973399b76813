"""Thousands of peers through a real coordinator: a fleet of 4 096 engine ranks
registering and taking requests, and thousands of clients with requests in flight.

Each side is one ROUTER socket that connects once per peer it plays, each
connection with its own routing id (``ZMQ_ROUTING_ID`` before the connect) and a
local name to send on (``ZMQ_CONNECT_ROUTING_ID``): to the coordinator, as many
peers as there are connections.
"""

from __future__ import annotations

import resource
from collections import Counter

import pytest
import zmq

from tests.support.peers import CONNECT, CONNECT_ACK, REPLY, SUBMIT, WAIT, m, um, wait_for

ENGINES = 4096
CLIENTS = 2000


def descriptors(needed: int) -> None:
    """Lift the open-file limit to the hard one; skip when even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"{needed} descriptors needed, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, needed * 2), hard))


def peers(ctx: zmq.Context, address: str, prefix: bytes, n: int) -> tuple[zmq.Socket, list[bytes]]:
    """One ROUTER, ``n`` connections to ``address`` as peers ``prefix + i``; the names to
    send on, by peer."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    routes = []
    for i in range(n):
        route = i.to_bytes(4, "big")
        sock.setsockopt(zmq.ROUTING_ID, prefix + b"%d" % i)
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, route)
        sock.connect(address)
        routes.append(route)
    return sock, routes


def recv(sock: zmq.Socket, timeout: float = 10 * WAIT) -> list[bytes]:
    if not sock.poll(int(timeout * 1000)):
        raise TimeoutError("no message")
    return sock.recv_multipart()


def test_4096_engines_register_and_share_the_load(make_coordinator):
    descriptors(2 * ENGINES + 512)  # both ends of every connection are in this process
    coord = make_coordinator()  # max_engines: the default
    coord.start()
    ctx = zmq.Context()
    try:
        engines, routes = peers(ctx, coord.address, b"rank-", ENGINES + 1)
        for route in routes[:ENGINES]:
            engines.send_multipart([route, b""])
        wait_for(lambda: len(coord.stats()["engines"]) == ENGINES, timeout=120)
        engines.send_multipart([routes[ENGINES], b""])  # one more than the table holds
        wait_for(lambda: coord.stats()["counters"]["table_full"] == 1, timeout=60)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(coord.address)
        client.send(m([CONNECT]))
        assert um(recv(client)[0]) == [CONNECT_ACK]
        # least_loaded, with nothing released: every rank once, then every rank again.
        for rid in range(2 * ENGINES):
            client.send_multipart([m([SUBMIT, rid, {}]), b"p%d" % rid])
        held = [recv(engines) for _ in range(2 * ENGINES)]  # replied to once all came
        per_rank = Counter(route for route, _, _ in held)
        assert set(per_rank) == set(routes[:ENGINES]) and set(per_rank.values()) == {2}
        for route, meta, prompt in held:
            engines.send_multipart([route, m([REPLY, [[um(meta)[1], False]]]), prompt])
        replies = {um(meta)[1]: body for meta, body in (recv(client) for _ in range(2 * ENGINES))}
        assert replies == {rid: b"p%d" % rid for rid in range(2 * ENGINES)}
        stats = coord.stats()
        assert stats["inflight"] == 0 and all(e["pending"] == 0 for e in stats["engines"])
    finally:
        coord.stop()
        ctx.destroy(linger=0)


def test_thousands_of_clients_each_with_requests_in_flight(make_coordinator):
    descriptors(2 * CLIENTS + 512)
    coord = make_coordinator()
    coord.start()
    ctx = zmq.Context()
    try:
        engine = ctx.socket(zmq.DEALER)
        engine.setsockopt(zmq.LINGER, 0)
        engine.connect(coord.address)
        engine.send(b"")
        wait_for(lambda: len(coord.stats()["engines"]) == 1)
        clients, routes = peers(ctx, coord.address, b"client-", CLIENTS)
        for route in routes:
            clients.send_multipart([route, m([CONNECT])])
        acks = {recv(clients)[0] for _ in range(CLIENTS)}
        assert acks == set(routes) and coord.stats()["clients"] == CLIENTS
        for rid in range(3):  # three each, the same client rids for every client
            for i, route in enumerate(routes):
                clients.send_multipart([route, m([SUBMIT, rid, {}]), b"%d/%d" % (i, rid)])
        sent: dict[int, tuple[bytes, int]] = {}  # server rid -> (client, client rid)
        for _ in range(3 * CLIENTS):
            meta, prompt = recv(engine)
            i, rid = map(int, prompt.split(b"/"))
            sent[um(meta)[1]] = (routes[i], rid)
        assert coord.stats()["inflight"] == 3 * CLIENTS
        for server_rid in sorted(sent, reverse=True):  # answered in another order than sent
            engine.send_multipart([m([REPLY, [[server_rid, False]]]), b"r%d" % server_rid])
        got: dict[tuple[bytes, int], bytes] = {}
        for _ in range(3 * CLIENTS):
            route, meta, body = recv(clients)
            got[(route, um(meta)[1])] = body
        # Each reply reached the client that sent its request, under that client's rid.
        assert got == {peer: b"r%d" % server_rid for server_rid, peer in sent.items()}
        assert coord.stats()["inflight"] == 0
    finally:
        coord.stop()
        ctx.destroy(linger=0)
