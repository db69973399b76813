"""One scripted conversation through both coordinators: the same frames at every peer.

The script is random but seeded, and its moves depend on what the peers
have seen (an engine replies to the requests it was given), so any
difference between the two implementations — a routing decision, a server
id, an error text, a dropped frame — shows up as a different frame log.
The megatron-core dialect has its own conversation: Megatron main's and 0.19's
clients and engines (single frames) beside coordkit's, batched and not. With every
request traced the frames are the same as without, and both cores trace alike.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
import zmq

from coordkit.protocol import block_hashes
from tests.support.cluster import Cluster
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    DISCONNECT,
    ENGINE_HELLO,
    PARTIAL,
    PAUSE,
    RELEASE_KV,
    REPLY,
    REPLY_BATCH,
    RESUME,
    SEND_KV,
    START_CUDA_PROFILER,
    STOP,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    SUSPEND,
    UNPAUSE,
    RawClient,
    finished_request,
    m,
    main_partial,
    parse_019_engine,
    parse_main_client,
    parse_main_engine,
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


def _sender(cluster: Cluster, names: dict[zmq.Socket, str], log: dict) -> Any:
    """``send(peer, *frames)``: one message, then what every peer received once the
    coordinator handled it."""
    handled = cluster.coord.stats()["messages"]

    def send(peer: Any, *frames: bytes) -> None:
        nonlocal handled
        peer.send(*frames)
        handled += 1
        wait_for(lambda: cluster.coord.stats()["messages"] >= handled)
        _collect(cluster, names, log)

    return send


def _outcome(cluster: Cluster, log: dict) -> dict:
    """What a conversation left: every peer's frames, the counters, the metrics."""
    stats = cluster.coord.stats()
    metrics = cluster.coord.metrics()
    # How long each waited is the clock's: how many waited, and how it ended, is not.
    metrics["queue"] = {
        key: {
            row: {outcome: sum(waited["buckets"]) for outcome, waited in outcomes.items()}
            for row, outcomes in rows.items()
        }
        for key, rows in metrics["queue"].items()
    }
    return {
        "log": dict(log),
        "counters": stats["counters"],
        "inflight": stats["inflight"],
        "queue": stats["queue"],
        "metrics": metrics,
    }


def _assert_same(c_run: dict, py_run: dict) -> None:
    for peer in sorted(set(c_run["log"]) | set(py_run["log"])):
        assert c_run["log"].get(peer) == py_run["log"].get(peer), peer
    for key in ("counters", "inflight", "queue", "metrics"):
        assert c_run[key] == py_run[key], key


def _server_ids_in(frames: list[bytes]) -> list[int]:
    """The server ids an engine was given in one message: a SUBMIT's, or a batch's."""
    header, *fields = um(frames[0])
    if header == SUBMIT:
        return [fields[0]]
    return [entry[0] for entry in fields[0]] if header == SUBMIT_BATCH else []


def qos_client(cluster: Cluster, identity: bytes, hello: dict) -> RawClient:
    """A coordkit client granted QoS (and what else ``hello`` asks for)."""
    client = RawClient(cluster.ctx, cluster.coord.address, identity)
    cluster.peers.append(client)
    client.send(m([CONNECT, {"coordkit": 1, "qos": 1, **hello}]))
    granted = {"qos": 1, **({"batch": 1} if "batch" in hello else {})}
    assert um(client.recv()[0]) == [CONNECT_ACK, granted]
    return client


def qos(rng: random.Random) -> list[int]:
    """A request's QoS fields, half the time: a priority, and a deadline none reaches."""
    return [rng.choice([-1, 0, 3]), rng.choice([0, 60_000])] if rng.random() < 0.5 else []


def _conversation(impl, address: str, policy: str, seed: int, steps: int, **options: Any) -> dict:
    rng = random.Random(seed)
    log: dict[str, list[list[bytes]]] = defaultdict(list)
    # Every engine takes 4 at once: past that, requests wait in the queue, and are
    # dispatched (to e3 in batches) as finals free room.
    options = {"max_inflight": 64, "prefix_ttl": 3600, "max_inflight_per_engine": 4, **options}
    with Cluster(impl, address, policy=policy, seed=3, **options) as c:
        for rank in range(3):
            c.add_engine(f"e{rank}".encode())
        c.add_coordkit_engine(b"e3", batch=True)
        clients = [
            qos_client(c, b"ck", {"tenant": "gold"}),
            c.client(identity=b"mg"),
            qos_client(c, b"bk", {"batch": 1}),
        ]
        peers = [*c.engines, *clients]
        names = dict(
            zip([p.sock for p in peers], ["e0", "e1", "e2", "e3", "ck", "mg", "bk"], strict=True)
        )
        next_rid = [0, 0, 0]
        send = _sender(c, names, log)
        prefixes = [[rng.randrange(1 << 64) for _ in range(4)] for _ in range(3)]

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
                    entries.append([rid, *qos(rng), {"n": rid}, hashed])
                    frames.append(m([rng.randrange(1000)] * 8))
                    if hashed:
                        frames.append(b"".join(h.to_bytes(8, "little") for h in chain))
                if rng.random() < 0.1:
                    frames.pop()
                send(client, m([SUBMIT_BATCH, entries]), *frames)
            elif move < 0.35:
                rid = next_rid[k]
                next_rid[k] += 1
                fields = qos(rng) if k != 1 else []
                frames = [m([SUBMIT, rid, *fields, {"n": rid}]), m([rng.randrange(1000)] * 8)]
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
        return _outcome(c, log)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "prefix"])
def test_same_frames_at_every_peer(c_impl, py_impl, tmp_path, policy):
    runs = [
        _conversation(impl, f"ipc://{tmp_path}/{impl.name}.sock", policy, seed=11, steps=120)
        for impl in (c_impl, py_impl)
    ]
    c_run, py_run = runs
    assert sum(len(frames) for frames in c_run["log"].values()) > 50
    headers = {peer: {um(f[0])[0] for f in frames} for peer, frames in c_run["log"].items()}
    assert REPLY_BATCH in headers["bk"]  # batches went by
    # (round robin deals a batch out one per engine: e3 gets its requests one by one)
    assert SUBMIT_BATCH in headers["e3"] or policy == "round_robin"
    _assert_same(c_run, py_run)


def test_tracing_changes_no_frame_and_both_cores_trace_alike(c_impl, py_impl, tmp_path):
    """Every request traced (trace_sample=1: duplicates and refusals, aborts, engines
    draining and back, a client's batches, what is left at shutdown): the frames at every
    peer, the counters and the metrics are those of the same conversation untraced, and
    the two cores record the same requests, routed to the same engines, ended alike."""
    in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    runs, traces = {}, {}
    for impl in (c_impl, py_impl):
        for traced in (False, True):
            exporter = in_memory.InMemorySpanExporter()
            options = {"trace_sample": 1.0, "trace_exporter": exporter} if traced else {}
            address = f"ipc://{tmp_path}/{impl.name}-{traced}.sock"
            runs[impl.name, traced] = _conversation(
                impl, address, "least_loaded", seed=11, steps=120, **options
            )
            traces[impl.name, traced] = sorted(
                (
                    span.attributes["coordkit.server_rid"],
                    span.attributes["coordkit.client_rid"],
                    span.attributes.get("coordkit.engine"),
                    span.status.description or "",
                    tuple(
                        sorted(
                            s.name
                            for s in exporter.get_finished_spans()
                            if s.parent is not None and s.parent.span_id == span.context.span_id
                        )
                    ),
                )
                for span in exporter.get_finished_spans()
                if span.name == "coordkit.coordinator"
            )
        _assert_same(runs[impl.name, False], runs[impl.name, True])
        assert not traces[impl.name, False]
    assert traces["c", True] == traces["py", True]
    ends = {status for *_, status, _ in traces["c", True]}
    assert {"", "SHUTTING_DOWN"} <= ends, ends  # finals, and what was left at the end
    assert len(traces["c", True]) > 30, len(traces["c", True])


def _given(frames: list[bytes]) -> list[int]:
    """The server ids an engine of either format was given in one message (a body
    forwarded unread may not decode: it gave none the script can answer)."""
    try:
        header, *fields = um(frames[0])
    except Exception:
        return []
    if header in (SUBMIT, SUBMIT_KV):
        return [fields[0]]
    return [entry[0] for entry in fields[0]] if header == SUBMIT_BATCH else []


def _megatron_conversation(
    impl, address: str, version: str, policy: str, seed: int, steps: int
) -> dict:
    rng = random.Random(seed)
    log: dict[str, list[list[bytes]]] = defaultdict(list)
    options = {"policy": policy, "seed": 3, "max_inflight": 64, "prefix_ttl": 3600}
    with Cluster(
        impl, address, dialect="megatron-core", megatron_version=version, block_size=4, **options
    ) as c:
        add_megatron = c.add_main_engine if version == "main" else c.add_single_frame_engine
        megatron = [add_megatron(b"mp-coord-0"), add_megatron(b"mp-coord-1")]
        coordkit = [c.add_coordkit_engine(b"ck-0"), c.add_coordkit_engine(b"ck-1", batch=True)]
        main, old = c.main_client(b"main"), c.single_frame_client(b"v019")
        ck, bk = c.client(coordkit=True, identity=b"ck"), c.client(batch=True, identity=b"bk")
        peers = {
            "mp-coord-0": megatron[0],
            "mp-coord-1": megatron[1],
            "ck-0": coordkit[0],
            "ck-1": coordkit[1],
            "main": main,
            "v019": old,
            "ck": ck,
            "bk": bk,
        }
        names = {peer.sock: name for name, peer in peers.items()}
        next_rid: defaultdict[str, int] = defaultdict(int)
        answered: set[int] = set()  # the server ids an engine sent a final for
        send = _sender(c, names, log)
        prefixes = [[rng.randrange(1 << 20) for _ in range(8)] for _ in range(3)]

        def rid(client: str) -> int:
            next_rid[client] += 1
            return next_rid[client] - 1

        def prompt() -> list[int] | str:
            if rng.random() < 0.2:
                return f"words {rng.randrange(100)}"
            return prefixes[rng.randrange(3)][: rng.randrange(1, 9)] + [rng.randrange(50)]

        for _ in range(steps):
            move = rng.random()
            if move < 0.14:  # main's client: five fields, streaming or not, an image now and then
                params = {"n": next_rid["main"], "streaming": rng.random() < 0.5}
                image = {"image": [bytes(rng.randrange(256) for _ in range(6))]}
                mm = image if rng.random() < 0.15 else None
                send(main, m([SUBMIT, rid("main"), prompt(), params, mm]))
            elif move < 0.18:  # main's KV handoff
                frame = [SUBMIT_KV, rid("main"), prompt(), {}, {"agent": "d"}, [1, 2]]
                send(main, m(frame))
            elif move < 0.26:
                send(old, m([SUBMIT, rid("v019"), prompt(), {"n": next_rid["v019"]}]))
            elif move < 0.32:
                tokens = prefixes[rng.randrange(3)][: rng.randrange(4, 9)]
                hashes = [block_hashes(tokens, 4)] if rng.random() < 0.5 else []
                send(ck, m([SUBMIT, rid("ck"), {"stream": True}]), m(tokens), *hashes)
            elif move < 0.36:
                entries = [[rid("bk"), {"k": k}, False] for k in range(rng.randrange(1, 4))]
                send(bk, m([SUBMIT_BATCH, entries]), *[m(prompt()) for _ in entries])
            elif move < 0.6:  # an engine finishes, or streams, some of what it was given
                k = rng.randrange(4)
                engine = (megatron + coordkit)[k]
                name = names[engine.sock]
                given = [sid for f in log[name] for sid in _given(f)]
                if rng.random() < 0.9:  # mostly what it still owes, now and then a late one
                    given = [sid for sid in given if sid not in answered]
                if not given:
                    continue
                batch = rng.sample(given, min(len(given), rng.randrange(1, 4)))
                # 0.19's engines have no partial replies
                streams = rng.random() < 0.35 and (k >= 2 or version == "main")
                if not streams:
                    answered.update(batch)
                if k < 2:
                    bodies = [
                        main_partial(sid, [sid % 7]) if streams else finished_request(sid)
                        for sid in batch
                    ]
                    send(engine, m([PARTIAL if streams else REPLY, bodies]))
                elif streams:
                    send(engine, m([PARTIAL, batch]), *[m(main_partial(s, [1])) for s in batch])
                else:
                    entries = [[sid, False] for sid in batch]
                    send(engine, m([REPLY, entries]), *[m(finished_request(s)) for s in batch])
            elif move < 0.68:
                client, name = rng.choice([(main, "main"), (ck, "ck"), (bk, "bk")])
                send(client, m([ABORT, rng.randrange(max(1, next_rid[name]))]))
            elif move < 0.7:
                send(main, m([RELEASE_KV, rng.randrange(100)]))
            elif move < 0.76:
                send(rng.choice([main, old, ck]), m([rng.choice(SIGNALS)]))
            elif move < 0.8:
                send(rng.choice(megatron + coordkit), m([DISCONNECT]))
            elif move < 0.84:  # register again, or come back (a coordkit engine says hello)
                k = rng.randrange(4)
                send((megatron + coordkit)[k], b"")
                if k >= 2:
                    send(coordkit[k - 2], m([ENGINE_HELLO, {"coordkit": 1, "batch": k - 2}]))
            elif move < 0.87:
                # a request id again, maybe in flight: a duplicate
                send(main, m([SUBMIT, max(0, next_rid["main"] - 1), "p", {}, None]))
            else:
                junk = rng.choice(
                    [
                        m([SUBMIT_KV, 1, "p", {}]),
                        m([SUBMIT, 1, "p", {}, None, 1]),
                        m([SUBMIT, 1]),
                        m([ABORT, "x"]),
                        m([SEND_KV, 1, []]),
                        m([PARTIAL, 1, {}]),
                        b"\xc1",
                    ]
                )
                send(rng.choice([main, old]), junk)
                # main's: a body that goes unread to a main engine, or is walked and refused
                send(main, m([SUBMIT, rid("main"), b"bin", {}, None]))
        return _outcome(c, log)


@pytest.mark.parametrize(
    ("version", "policy"),
    [("main", "least_loaded"), ("main", "prefix"), ("0.19", "round_robin"), ("0.19", "prefix")],
)
def test_same_frames_at_every_megatron_peer(c_impl, py_impl, tmp_path, version, policy):
    runs = [
        _megatron_conversation(
            impl, f"ipc://{tmp_path}/{impl.name}.sock", version, policy, seed=5, steps=150
        )
        for impl in (c_impl, py_impl)
    ]
    c_run, py_run = runs
    headers = {peer: {um(f[0])[0] for f in frames} for peer, frames in c_run["log"].items()}
    # no Megatron peer got a frame its release would raise on
    parse = parse_main_engine if version == "main" else parse_019_engine
    for name in ("mp-coord-0", "mp-coord-1"):
        for frames in c_run["log"].get(name, []):
            assert len(frames) == 1
            parse(frames[0])
    for frames in c_run["log"]["main"]:
        parse_main_client(frames[0])
    for frames in c_run["log"]["v019"]:  # 0.19's client: finals only, each a map
        header, _, body = um(frames[0])
        assert header == REPLY and isinstance(body, dict)
    # the conversation went where it should: partials to main's client, batches, KV
    assert PARTIAL in headers["main"] and REPLY in headers["v019"]
    assert REPLY_BATCH in headers["bk"] and SUBMIT_BATCH in headers["ck-1"]
    if version == "main":
        assert {SUBMIT_KV, ABORT, RELEASE_KV} <= headers["mp-coord-0"] | headers["mp-coord-1"]
    _assert_same(c_run, py_run)


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
