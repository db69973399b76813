"""One scripted conversation through both coordinators: the same frames at every peer.

The script is random but seeded, and its moves depend on what the peers
have seen (an engine replies to the requests it was given), so any
difference between the two implementations — a routing decision, a server
id, an error text, a dropped frame — shows up as a different frame log.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import zmq

from tests.support.cluster import Cluster
from tests.support.peers import (
    ABORT,
    DISCONNECT,
    PARTIAL,
    PAUSE,
    RELEASE_KV,
    REPLY,
    REPLY_BATCH,
    RESUME,
    START_CUDA_PROFILER,
    STOP,
    SUBMIT,
    SUBMIT_BATCH,
    SUSPEND,
    UNPAUSE,
    m,
    um,
    wait_for,
)

QUIET = 0.02  # seconds without a frame that end a step's delivery
SIGNALS = [PAUSE, UNPAUSE, SUSPEND, RESUME, STOP, START_CUDA_PROFILER]


def _collect(cluster: Cluster, names: dict[zmq.Socket, str], log: dict) -> None:
    poller = zmq.Poller()
    for sock in names:
        poller.register(sock, zmq.POLLIN)
    while ready := dict(poller.poll(QUIET * 1000)):
        for sock in ready:
            log[names[sock]].append(sock.recv_multipart())


def _server_ids_in(frames: list[bytes]) -> list[int]:
    """The server ids an engine was given in one message: a SUBMIT's, or a batch's."""
    header, *fields = um(frames[0])
    if header == SUBMIT:
        return [fields[0]]
    return [entry[0] for entry in fields[0]] if header == SUBMIT_BATCH else []


def _conversation(impl, address: str, policy: str, seed: int, steps: int) -> dict:
    rng = random.Random(seed)
    log: dict[str, list[list[bytes]]] = defaultdict(list)
    with Cluster(impl, address, policy=policy, seed=3, max_inflight=64, prefix_ttl=3600) as c:
        for rank in range(3):
            c.add_engine(f"e{rank}".encode())
        c.add_coordkit_engine(b"e3", batch=True)
        clients = [
            c.client(coordkit=True, identity=b"ck"),
            c.client(identity=b"mg"),
            c.client(batch=True, identity=b"bk"),
        ]
        peers = [*c.engines, *clients]
        names = dict(
            zip([p.sock for p in peers], ["e0", "e1", "e2", "e3", "ck", "mg", "bk"], strict=True)
        )
        next_rid = [0, 0, 0]
        handled = c.coord.stats()["messages"]
        prefixes = [[rng.randrange(1 << 64) for _ in range(4)] for _ in range(3)]

        def send(peer, *frames):
            nonlocal handled
            peer.send(*frames)
            handled += 1
            wait_for(lambda: c.coord.stats()["messages"] >= handled)
            _collect(c, names, log)

        for _ in range(steps):
            move = rng.random()
            k = rng.randrange(3)
            client = clients[k]
            if move < 0.35 and k == 2:
                # A batch of one to four, some entries hashed, now and then a rid
                # again (a duplicate) or a frame missing (every entry named fails).
                entries, frames = [], []
                for _ in range(rng.randrange(1, 5)):
                    rid = next_rid[k] - (rng.random() < 0.1)
                    next_rid[k] = max(next_rid[k], rid + 1)
                    chain = prefixes[rng.randrange(3)][: rng.randrange(1, 5)]
                    hashed = rng.random() < 0.5
                    entries.append([rid, {"n": rid}, hashed])
                    frames.append(m([rng.randrange(1000)] * 8))
                    if hashed:
                        frames.append(b"".join(h.to_bytes(8, "little") for h in chain))
                if rng.random() < 0.1:
                    frames.pop()
                send(client, m([SUBMIT_BATCH, entries]), *frames)
            elif move < 0.35:
                rid = next_rid[k]
                next_rid[k] += 1
                frames = [m([SUBMIT, rid, {"n": rid}]), m([rng.randrange(1000)] * 8)]
                if rng.random() < 0.5:
                    chain = prefixes[rng.randrange(3)][: rng.randrange(1, 5)]
                    frames.append(b"".join(h.to_bytes(8, "little") for h in chain))
                send(client, *frames)
            elif move < 0.6:
                # An engine finishes (or streams) some of what it was given.
                rank = rng.randrange(4)
                given = [sid for f in log[f"e{rank}"] for sid in _server_ids_in(f)]
                if not given:
                    continue
                batch = rng.sample(given, min(len(given), rng.randrange(1, 4)))
                if rng.random() < 0.3:
                    send(c.engines[rank], m([PARTIAL, batch]), *[b"partial"] * len(batch))
                else:
                    entries = [[rid, False] for rid in batch]
                    send(c.engines[rank], m([REPLY, entries]), *[m(rid) for rid in batch])
            elif move < 0.68:
                send(client, m([ABORT, rng.randrange(max(1, next_rid[k]))]))
            elif move < 0.74:
                send(client, m([rng.choice(SIGNALS)]))
            elif move < 0.78:
                send(client, m([RELEASE_KV, rng.randrange(100)]))
            elif move < 0.82:
                send(client, m([SUBMIT, max(0, next_rid[k] - 1), {}]), b"dup")  # maybe in flight
            elif move < 0.86:
                rank = rng.randrange(4)
                send(c.engines[rank], m([DISCONNECT]))
            elif move < 0.9:
                send(c.engines[rng.randrange(4)], b"")  # register again, or come back
            else:
                junk = rng.choice(
                    [
                        b"\xc1",
                        m([]),
                        m([SUBMIT, "x", {}]),
                        m([77]),
                        m([SUBMIT, 1]),
                        m([SUBMIT_BATCH, [[0, {}]]]),
                        m([SUBMIT_BATCH, [[next_rid[k], {}, False]]]),
                    ]
                )
                send(client, junk, b"p")
        stats = c.coord.stats()
        metrics = c.coord.metrics()
    return {
        "log": dict(log),
        "counters": stats["counters"],
        "inflight": stats["inflight"],
        "metrics": metrics,
    }


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "prefix"])
def test_same_frames_at_every_peer(c_impl, py_impl, tmp_path, policy):
    runs = [
        _conversation(impl, f"ipc://{tmp_path}/{impl.name}.sock", policy, seed=11, steps=120)
        for impl in (c_impl, py_impl)
    ]
    c_run, py_run = runs
    assert sum(len(frames) for frames in c_run["log"].values()) > 50
    headers = {peer: {um(f[0])[0] for f in frames} for peer, frames in c_run["log"].items()}
    assert SUBMIT_BATCH in headers["e3"] and REPLY_BATCH in headers["bk"]  # batches went by
    for peer in sorted(set(c_run["log"]) | set(py_run["log"])):
        assert c_run["log"].get(peer) == py_run["log"].get(peer), peer
    assert c_run["counters"] == py_run["counters"]
    assert c_run["inflight"] == py_run["inflight"]
    assert c_run["metrics"] == py_run["metrics"]


def _server_ids(impl, address: str, waves: list[int]) -> list[int]:
    """The server ids an engine sees for waves of requests held, then answered."""
    seen: list[int] = []
    with Cluster(impl, address, n_engines=1) as c:
        client, engine = c.client(), c.engines[0]
        rid = 0
        for held in waves:
            for _ in range(held):
                client.sock.send_multipart([m([SUBMIT, rid, {}]), b"p"])
                rid += 1
            ids = [um(engine.recv()[0])[1] for _ in range(held)]
            entries = [[sid, False] for sid in ids]
            engine.send(m([REPLY, entries]), *[b"r"] * held)
            for _ in range(held):
                client.recv()
            seen += ids
    return seen


@pytest.mark.c_extension
def test_server_ids_are_drawn_alike(c_impl, py_impl, tmp_path):
    # Few in flight, then many (the window grows), then few again (it shrinks
    # at the next lap): ids advance, jump to a new lap of the index at the
    # window's end, and are the same in both implementations.
    waves = [64] * 80 + [3000, 3000, 5000] + [64] * 200
    c_ids, py_ids = (
        _server_ids(impl, f"ipc://{tmp_path}/{impl.name}.sock", waves) for impl in (c_impl, py_impl)
    )
    assert c_ids == py_ids
    assert all(a < b for a, b in zip(c_ids, c_ids[1:], strict=False))  # increasing
    assert len({sid & ((1 << 20) - 1) for sid in c_ids}) < 20_000  # positions reused
    assert c_ids[-1] > 1 << 20  # and laps taken
