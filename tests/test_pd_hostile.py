"""Hostile P/D engines: a seeded storm of P/D messages (HANDOFF, KV_READ_DONE,
KV_TRANSFER_READY, REQUEST_ERROR, REQUEST_ABORTED, REGISTER_ROLE, replies), well-formed
and garbled, naming live requests and none, from engines seated as prefills and
decodes, while a client submits. The loop serves on, every request ends (nothing in
flight once the timeouts passed), and nothing the room holds leaks: no seat reserved,
nothing queued, no pin or orphan once the leases ended. Both loop cores."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.support.peers import RawClient, RawEngine, m, um, wait_for

pytestmark = pytest.mark.timeout(60)

STORM_SECONDS = 3.0
RID_HEADERS = (25, 28, 30, 31)  # RELEASE_KV, KV_READ_DONE, KV_TRANSFER_READY, REQUEST_ABORTED


def junk(r: random.Random, depth: int = 0) -> Any:
    """A random msgpack value, nested at most three deep."""
    kind = r.randrange(10 if depth < 3 else 8)
    if kind == 8:
        return [junk(r, depth + 1) for _ in range(r.randrange(3))]
    if kind == 9:
        return {junk(r, 3) if r.random() < 0.3 else "k": junk(r, depth + 1) for _ in range(2)}
    return [None, True, r.randrange(-5, 2**40), -(2**63), 2**64 - 1, 1.5, "x", b"\x01"][kind]


def rogue_message(r: random.Random, rid: Any) -> list[bytes]:
    header = r.choice([104, 104, 29, 27, 21, 22, 26, 100, 103, r.randrange(256), *RID_HEADERS])
    if r.random() < 0.1:
        return [r.randbytes(r.randrange(1, 12))]
    if header == 104:  # HANDOFF: entries, one block frame each (or one too many, too few)
        entries = [[rid, {"a": 1} if r.random() < 0.5 else junk(r)] for _ in range(r.randrange(3))]
        n_blocks = max(len(entries) + r.choice([0, 0, 0, 1, -1]), 0)
        return [m([104, entries])] + [m([1, 2]) for _ in range(n_blocks)]
    if header in RID_HEADERS:
        return [m([header, rid] + ([junk(r)] if r.random() < 0.2 else []))]
    if header == 29:
        return [m([29, rid, junk(r) if r.random() < 0.2 else "boom", r.random() < 0.5])]
    if header in (21, 22):
        return [m([header, [[rid, True]] if r.random() < 0.7 else junk(r)]), m({"x": 1})]
    if header == 27:
        if r.random() < 0.3:  # msgpack, but a map keyed by an array: a TypeError
            return [b"\x92\x1b\x81\x91\x01\x02"]
        return [m([27, r.choice(["prefill", "decode", junk(r)]), "nixl", junk(r)])]
    return [m([header] + [junk(r) for _ in range(r.randrange(3))])]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_storm_of_pd_messages_stops_nothing_and_leaks_nothing(make_cluster, seed):
    r = random.Random(seed)
    with make_cluster(pd_mode="always", request_timeout=1.0, pd_lease=0.5) as c:
        engines = []
        for n, role in enumerate(("prefill", "decode", "prefill", "decode")):
            engine = RawEngine(c.ctx, c.coord.address, f"{role}-{n}".encode())
            c.peers.append(engine)
            engine.register().hello(role=role, capacity=4, transfer={"t": 1})
            engines.append(engine)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(coordkit=True)
        c.peers.append(client)
        rids: list[int] = []  # the server ids the engines were sent
        submitted = 0
        end = time.monotonic() + STORM_SECONDS
        while time.monotonic() < end:
            submitted += 1
            client.send(m([20, submitted, {"max_tokens": 2}]), m(list(range(r.randrange(1, 40)))))
            for engine in engines:
                while engine.sock.poll(0):
                    meta = engine.sock.recv_multipart()[0]
                    try:
                        message = um(meta)
                    except ValueError:
                        continue
                    if isinstance(message, list) and len(message) > 1:
                        rids.append(message[1])
            for _ in range(3):
                rid = r.choice(rids) if rids and r.random() < 0.8 else junk(r)
                r.choice(engines).send(*rogue_message(r, rid))
            time.sleep(0.001)

        def settled() -> bool:
            stats = c.coord.stats()
            pd = stats["pd"]
            return (
                stats["inflight"] == 0
                and pd["queued"] == {"prefill": 0, "decode": 0}
                and pd["orphans"] == 0
                and all(e["reserved"] == 0 and e["pinned"] == 0 for e in pd["engines"].values())
            )

        wait_for(settled, timeout=10)
        assert submitted > 100 and c.coord.stats()["counters"]["malformed"] > 0
