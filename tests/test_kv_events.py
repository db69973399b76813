"""The prefix index from the engines' own KV-cache events (issue 41), on both cores:
publishers written to vLLM's wire format (tests/support/vllm_publisher.py), real
sockets, a coordinator that never routed the prefixes it is asked about."""

from __future__ import annotations

import hashlib
import random
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from coordkit import Client, Coordinator
from coordkit.engine import Engine
from coordkit.kvpublish import KVPublisher
from coordkit.metrics import scrape
from coordkit.protocol import block_hashes
from coordkit.tools.top import History, Snapshot, engine_rows
from tests.support.peers import m, um, wait_for
from tests.support.processes import coordkit_command, python_env
from tests.support.scripted import run
from tests.support.threads import fake_engines
from tests.support.vllm_publisher import (
    Publisher,
    batch_payload,
    cleared,
    encode_event,
    removed,
    stored,
)
from tests.test_demo import demo, hit_rate, table

SUBMIT, REPLY = 20, 21
BS = 16


def tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def engine_hash(kind: str, n: int) -> Any:
    """An engine's own hash of a block: a u64 above 2**63, an i64, or 32 bytes."""
    if kind == "u64":
        return (1 << 63) + n
    if kind == "i64":
        return -n - 1
    return hashlib.sha256(n.to_bytes(8, "little")).digest()


def store_chain(kind: str, prompt: list[int], first: int, per_event: int = 2) -> list[dict]:
    """BlockStored events for the full blocks of ``prompt``, ``per_event`` blocks each,
    chained by parent; engine hashes numbered from ``first``."""
    events = []
    parent = None
    n = len(prompt) // BS
    for start in range(0, n, per_event):
        ids = [engine_hash(kind, first + i) for i in range(start, min(start + per_event, n))]
        events.append(stored(ids, parent, prompt[start * BS : (start + len(ids)) * BS], BS))
        parent = ids[-1]
    return events


@pytest.fixture
def publishers() -> Iterator[Any]:
    ctx = zmq.Context()
    made: list[Publisher] = []

    def make(**options: Any) -> Publisher:
        made.append(Publisher(ctx, **options))
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()
    ctx.term()


def kv(c: Any) -> dict[str, Any]:
    return c.coord.stats()["kv_events"]


def blocks(c: Any, rank: int) -> int | None:
    """The blocks ``rank`` holds per its events, None while its state is not known."""
    for line in kv(c)["engines"]:
        if line["rank"] == rank:
            return line["blocks"] if line["state"] == "exact" else None
    return None


def settled(c: Any, batches: int) -> bool:
    """``batches`` decoded by the events' thread and every record it made applied (the
    blocks by the thread itself, the states by the loop between two messages)."""
    stats = kv(c)
    return stats["batches"] >= batches and stats["records"] == stats["handed"]


def route(c: Any, client: Any, prompt: list[int], rid: int = 0) -> int:
    """The rank a request carrying ``prompt``'s hashes went to (its reply sent, so every
    engine is idle again)."""
    poller = zmq.Poller()
    for engine in c.engines:
        poller.register(engine.sock, zmq.POLLIN)
    client.send(m([SUBMIT, rid, {}]), b"prompt", block_hashes(prompt, BS))
    ready = dict(poller.poll(5000))
    rank = next(i for i, e in enumerate(c.engines) if e.sock in ready)
    engine = c.engines[rank]
    sid = um(engine.recv()[0])[1]
    engine.send(m([REPLY, [[sid, False]]]), b"done")
    assert um(client.recv()[0])[1] == rid
    return rank


def cluster_of(make_cluster: Any, pubs: list[Publisher], **options: Any) -> Any:
    specs = {rank: p.spec for rank, p in enumerate(pubs)}
    options.setdefault("policy", "prefix")
    return make_cluster(n_engines=len(pubs), block_size=BS, kv_events=specs, **options)


@pytest.mark.parametrize(
    ("events", "batch", "kind", "shape"),
    [
        ("array", "array", "u64", "bare"),
        ("map", "map", "i64", "topic"),
        ("array", "map", "bytes", "topic"),
        ("map", "array", "u64", None),
    ],
)
def test_events_route_a_prefix_never_routed_to_its_holder(
    make_cluster, publishers, events, batch, kind, shape
):
    pubs = [publishers(events=events, batch=batch, replay=shape, rank=r) for r in range(2)]
    prompt = tokens(1, 4)
    if shape is not None:  # published before the coordinator: its replay from 0 tells
        pubs[1].publish(*store_chain(kind, prompt, 0))
    with cluster_of(make_cluster, pubs) as c:
        if shape is None:
            wait_for(lambda: blocks(c, 1) == 0)
            for _ in range(50):  # the subscription takes a while to reach the publisher
                pubs[1].publish()
                if kv(c)["batches"]:
                    break
                time.sleep(0.05)
            pubs[1].publish(*store_chain(kind, prompt, 0))
        wait_for(lambda: blocks(c, 1) == 4)
        client = c.client(coordkit=True)
        # Without the events the first request would go to rank 0 (the rotating start).
        assert route(c, client, prompt) == 1
        if shape is not None:
            assert kv(c)["resets"] == 0 and kv(c)["gaps"] == 0


@pytest.mark.parametrize("kind", ["u64", "i64", "bytes"])
def test_removed_and_cleared_blocks_no_longer_attract(make_cluster, publishers, kind):
    pubs = [publishers(rank=r) for r in range(2)]
    prompt = tokens(2, 4)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 0) == 0 and blocks(c, 1) == 0)
        client = c.client(coordkit=True)
        pubs[1].publish(*store_chain(kind, prompt, 0))
        wait_for(lambda: blocks(c, 1) == 4)
        assert route(c, client, prompt, 0) == 1  # rotation would say 0
        # Rank 1 evicts them, rank 0 stores them: rotation would say 1.
        pubs[1].publish(removed([engine_hash(kind, i) for i in range(4)]))
        pubs[0].publish(*store_chain(kind, prompt, 100))
        wait_for(lambda: blocks(c, 1) == 0 and blocks(c, 0) == 4)
        assert route(c, client, prompt, 1) == 0
        # Rank 0 drops everything, rank 1 holds them again: a stale rank 0 would tie
        # with it, and rotation would say 0.
        pubs[0].publish(cleared())
        pubs[1].publish(*store_chain(kind, prompt, 200))
        wait_for(lambda: blocks(c, 0) == 0 and blocks(c, 1) == 4)
        assert route(c, client, prompt, 2) == 1


def test_a_block_stored_twice_goes_when_removed_twice(make_cluster, publishers):
    pubs = [publishers(rank=r) for r in range(2)]
    prompt = tokens(3, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        pubs[1].publish(*store_chain("u64", prompt, 0))
        pubs[1].publish(*store_chain("u64", prompt, 0))
        pubs[1].publish(removed([engine_hash("u64", 0), engine_hash("u64", 1)]))
        wait_for(lambda: settled(c, 3))
        assert blocks(c, 1) == 2
        pubs[1].publish(removed([engine_hash("u64", 1)]))
        wait_for(lambda: blocks(c, 1) == 1)


def test_another_medium_group_or_lora_does_not_count(make_cluster, publishers):
    pubs = [publishers(events="map", rank=r) for r in range(2)]
    prompt = tokens(4, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        ids = [engine_hash("u64", i) for i in range(2)]
        pubs[1].publish(
            stored(ids, None, prompt, BS, medium="CPU"),
            stored(ids, None, prompt, BS, group_idx=1),
            stored(ids, None, prompt, BS, lora_name="adapter"),
            stored(ids, None, prompt[: BS // 2], BS // 2),  # another block size
        )
        wait_for(lambda: settled(c, 1))
        assert blocks(c, 1) == 0
        pubs[1].publish(stored(ids, None, prompt, BS, medium=None, unknown_field=7))
        wait_for(lambda: blocks(c, 1) == 2)


@pytest.mark.parametrize("shape", ["bare", "topic"])
def test_a_dropped_batch_is_recovered_through_replay(make_cluster, publishers, shape):
    pubs = [publishers(replay=shape, rank=r) for r in range(2)]
    a, b, d = tokens(5, 3), tokens(6, 2), tokens(7, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        client = c.client(coordkit=True)
        pubs[1].publish(*store_chain("u64", a, 0))
        pubs[1].publish(*store_chain("u64", b, 10))
        wait_for(lambda: blocks(c, 1) == 5)
        # (Those two may have come before the subscription did: replayed, then.) The
        # recheck after subscribing asked, from the batch after the last one applied.
        wait_for(lambda: len(pubs[1].replays) == 2)
        before = kv(c)
        # Lost on the way: a's blocks removed, d's stored.
        pubs[1].publish(
            removed([engine_hash("u64", i) for i in range(3)]),
            *store_chain("u64", d, 20),
            send=False,
        )
        pubs[1].publish(removed([engine_hash("u64", 10)]))
        # As an index that saw every batch: b's second block and d's two.
        wait_for(lambda: kv(c)["gaps"] == before["gaps"] + 1 and blocks(c, 1) == 3)
        stats = kv(c)
        assert stats["resets"] == 0 and stats["replays"] == before["replays"] + 1
        assert pubs[1].replays[-1] == 2  # from the batch after the last one applied
        assert route(c, client, a, 0) == 0  # removed: a stale rank 1 would have it
        assert route(c, client, tokens(99, 1), 1) == 1  # (rotation back to 0)
        assert route(c, client, d, 2) == 1  # stored in the batch it missed


def test_a_publisher_restart_clears_its_engine(make_cluster, publishers):
    pubs = [publishers(rank=r) for r in range(2)]
    a, b = tokens(8, 3), tokens(9, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        for _ in range(3):
            pubs[1].publish(*store_chain("u64", a, 0))
        wait_for(lambda: blocks(c, 1) == 3)
        pubs[1].restart()  # seq back to 0: the new process holds none of a
        pubs[1].publish(*store_chain("u64", b, 50))
        wait_for(lambda: kv(c)["resets"] == 1 and blocks(c, 1) == 2)


def test_lost_history_clears_instead_of_going_stale(make_cluster, publishers):
    pubs = [publishers(rank=r, buffer_steps=2) for r in range(2)]
    a, b = tokens(10, 3), tokens(11, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        client = c.client(coordkit=True)
        pubs[1].publish(*store_chain("u64", a, 0))
        wait_for(lambda: blocks(c, 1) == 3)
        gaps = kv(c)["gaps"]
        # Missed, and more than the replay buffer holds: one of them removed a's blocks.
        pubs[1].publish(removed([engine_hash("u64", i) for i in range(3)]), send=False)
        for _ in range(3):
            pubs[1].publish(send=False)
        pubs[1].publish(*store_chain("u64", b, 50))
        wait_for(lambda: kv(c)["resets"] == 1)
        wait_for(lambda: blocks(c, 1) == 2)  # b's, not a's
        assert kv(c)["gaps"] == gaps + 1
        assert route(c, client, a, 0) == 0  # a stale rank 1 would have it
        assert route(c, client, b, 1) == 1


def test_without_replay_a_gap_clears(make_cluster, publishers):
    pubs = [publishers(rank=r, replay=None) for r in range(2)]
    a = tokens(12, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        for _ in range(50):  # until the subscription reaches the publisher
            pubs[1].publish(*store_chain("u64", a, 0))
            if blocks(c, 1):
                break
            time.sleep(0.05)
        resets = kv(c)["resets"]
        pubs[1].publish(send=False)
        pubs[1].publish(removed([engine_hash("u64", 0)]))
        wait_for(lambda: kv(c)["resets"] == resets + 1 and blocks(c, 1) == 0)


def test_garbage_on_the_event_socket_never_stops_the_loop(make_cluster, publishers):
    pubs = [publishers(rank=r) for r in range(2)]
    prompt = tokens(13, 2)
    with cluster_of(make_cluster, pubs) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        pub = pubs[1].pub
        pub.send(b"one frame")
        pub.send_multipart([b"", b"short", b"x"])
        pub.send_multipart([b"", b"\0" * 8, b"x", b"four"])
        ok = stored([1], None, prompt[:BS], BS)
        # A batch with malformed events among good ones: those skipped, the rest applied.
        bad_events = [
            ["BlockStored", "not a list", None, [], BS],
            {"type": "BlockStored", "block_hashes": [True], "token_ids": [], "block_size": BS},
            {"type": "BlockRemoved", "block_hashes": [1.5]},
            {"type": 7},
            "a string",
            ["BlockStored", [2], None, [-1] * BS, BS],
            {"type": "SomethingNew", "x": 1},
            {"type": "BlockStored", **{k: v for k, v in ok.items() if k != "type"}},
        ]
        pubs[1].publish_raw(msgpack.packb([0.0, bad_events, 1]))
        wait_for(lambda: blocks(c, 1) == 1)
        assert kv(c)["events_malformed"] == 6
        pubs[1].publish_raw(b"\xc1 not msgpack")  # a whole batch lost: anew
        pubs[1].publish_raw(msgpack.packb({"events": 3}))
        wait_for(lambda: kv(c)["resets"] == 2 and blocks(c, 1) == 0)
        assert kv(c)["malformed"] >= 2
        text = scrape(c.coord)
        assert "coordkit_kv_events_resets_total 2.0" in text
        assert 'coordkit_kv_index_blocks{rank="1",state="exact"} 0.0' in text
        pubs[1].publish(stored([9, 10], None, prompt, BS))
        wait_for(lambda: blocks(c, 1) == 2)
        client = c.client(coordkit=True)
        assert route(c, client, prompt) == 1


def test_a_configured_publisher_follows_its_engines_routing_id(make_cluster, publishers):
    """``kv_events`` names engines by data-parallel rank (Megatron's ``mp-coord-N``)
    or routing id, not by the order they register in: rank 1, registered first, is
    priced by rank 1's events; a routing id names its engine as well."""
    pubs = [publishers(rank=0), publishers(rank=1), publishers(rank=7)]
    prompt = tokens(14, 3)
    config = {0: pubs[0].spec, 1: pubs[1].spec, "gpu-7": pubs[2].spec}
    with make_cluster(policy="prefix", block_size=BS, kv_events=config) as c:
        for identity in (b"mp-coord-1", b"gpu-7", b"mp-coord-0"):
            c.add_engine(identity)
        for rank in range(3):
            wait_for(lambda rank=rank: blocks(c, rank) == 0)
        publishers_at = {e["rank"]: e["endpoint"] for e in kv(c)["engines"]}
        assert publishers_at == {0: pubs[1].endpoint, 1: pubs[2].endpoint, 2: pubs[0].endpoint}
        pubs[1].publish(*store_chain("u64", prompt, 0))
        wait_for(lambda: blocks(c, 0) == 3)
        client = c.client(coordkit=True)
        assert route(c, client, prompt, 1) == 0  # where rank 1 (mp-coord-1) registered


def test_an_engine_without_events_keeps_the_approximate_table(make_cluster, publishers):
    pub = publishers(rank=0)
    prompt = tokens(14, 3)
    with make_cluster(n_engines=2, policy="prefix", block_size=BS, kv_events={0: pub.spec}) as c:
        wait_for(lambda: blocks(c, 0) == 0)
        client = c.client(coordkit=True)
        engines = kv(c)["engines"]
        assert [(e["rank"], e["state"]) for e in engines] == [(0, "exact")]
        assert route(c, client, prompt, 0) == 0  # no match: the rotating start
        # Rank 0 publishes: what was routed there is not guessed. Rotation says 1 now,
        # and rank 1 is recorded for what it is sent...
        assert route(c, client, prompt, 1) == 1
        # ...so the table sends the prefix back to it, wherever rotation stands.
        assert route(c, client, prompt, 2) == 1
        assert route(c, client, prompt, 3) == 1
        # coordkit top says which is which.
        history = History(10.0)
        history.add(Snapshot(0.0, c.coord.stats(), None))
        assert [row[-1] for row in engine_rows(history)] == ["exact", "guessed"]


@pytest.mark.parametrize("chains", ["py", "c"])
def test_the_index_twins_agree(c_impl, py_impl, chains):
    """Both cores' index rooms, fed the same records (chained by either core's
    KVChains), answer the same depths."""
    from coordkit._loop_c import KVIndex as CIndex
    from coordkit._routing_c import Router as CRouter

    from coordkit._kvevents import OP_STATE, STATE, STATE_KNOWN, Filter, decode_batch
    from coordkit._loop_py.kvindex import KVIndex as PyIndex
    from coordkit._routing_py import Router as PyRouter

    a, b = tokens(15, 4), tokens(16, 3)
    batches = [
        store_chain("u64", a, 0, 3),
        store_chain("bytes", b, 10, 1),
        [removed([engine_hash("u64", 2)])],
        store_chain("u64", a, 0, 4),
        [removed([engine_hash("bytes", 10)]), stored([5], 999, b[:BS], BS)],
    ]
    records = [STATE.pack(OP_STATE, 3, STATE_KNOWN)]
    for events in batches:
        records += decode_batch(batch_payload(events, "map", "array", 3), 3, Filter(BS))[0]
    chainer = (py_impl if chains == "py" else c_impl).codec.KVChains(8)
    records = [h for h in map(chainer.hand, records) if h is not None]
    cores = [(PyIndex(), PyRouter("prefix", 8)), (CIndex(8), CRouter("prefix", 8))]
    answers = []
    for index, router in cores:
        for record in records:
            index.apply(record, router)
        frames = [block_hashes(p, BS) for p in (a, b, a[: 2 * BS], tokens(17, 2))]
        answers.append(
            ([index.depth(3, f) for f in frames], index.stats(), index.publishes(3), index.known)
        )
    assert answers[0] == answers[1]
    assert answers[0][0] == [4, 0, 2, 0]  # a's third block removed, then stored again
    assert chainer.unresolved == 1


def test_the_events_thread_counts_the_blocks_and_leaves_the_loop_the_states(impl, publishers):
    """The events' thread counts the blocks in the index itself (under its lock, off the
    request path): with no loop running, the index holds an engine's prefix; all that
    waits for the loop is the engine's state, which the router's table depends on."""
    import importlib

    from coordkit._kvevents import OP_STATE, Subscriber

    module = "coordkit._loop_c" if impl.name == "c" else "coordkit._loop_py.kvindex"
    index = importlib.import_module(module).KVIndex(*([8] if impl.name == "c" else []))
    router = impl.Router("prefix", 8, block_size=BS)
    router.attach_kv(index)
    for rank in range(2):
        router.add_rank(rank)
    pub = publishers()
    nudged: list[int] = []
    ctx = zmq.Context()
    sub = Subscriber(
        ctx,
        lambda: nudged.append(1),
        BS,
        decode=impl.codec.decode_kv_batch,
        chains=impl.codec.KVChains(8),
    )
    sub.attach(index)
    sub.add(1, pub.endpoint, pub.replay_endpoint)
    sub.start()
    try:
        prompt = tokens(7, 4)
        wait_for(lambda: pub.replays == [0])
        pub.publish(*store_chain("u64", prompt, 0))
        frame = block_hashes(prompt, BS)
        wait_for(lambda: index.depth(1, frame) == 4)
        # Counted, and not yet priced: the rank's state is the loop's to apply.
        assert index.stats()["engines"] == {} and index.known == []
        wait_for(lambda: len(nudged) > 0)
        states = sub.take()
        assert states and all(record[0] == OP_STATE for record in states)
        for record in states:
            index.apply(record, router)
        assert index.known == [1]
        assert [router.choose(frame, 0.0) for _ in range(2)] == [1, 1]
    finally:
        sub.stop()
        ctx.destroy(linger=0)


def test_the_index_lock_never_meets_the_gil(impl):
    """Three threads at one index, as the coordinator's are (the events' thread counting
    blocks, the loop applying states, ``stats()`` read from another): none may wait for
    the index's lock holding the GIL while another holds the lock waiting for the GIL."""
    import importlib
    import struct
    import threading

    from coordkit._kvevents import HASHED, OP_HASHED, OP_STATE, STATE, STATE_KNOWN, STATE_NONE

    module = "coordkit._loop_c" if impl.name == "c" else "coordkit._loop_py.kvindex"
    index = importlib.import_module(module).KVIndex(*([8] if impl.name == "c" else []))
    router = impl.Router("prefix", 8)
    index.attach(router)
    n = 2000
    hashed = HASHED.pack(OP_HASHED, 1, n) + struct.pack(f"<{2 * n}Q", *range(1, 2 * n + 1))
    states = [STATE.pack(OP_STATE, 1, s) for s in (STATE_KNOWN, STATE_NONE)]
    until = time.monotonic() + 1.0
    done: list[str] = []

    def run(name: str, step: Any) -> None:
        while time.monotonic() < until:
            step()
        done.append(name)

    steps = {
        "events": lambda: index.apply_blocks(hashed),
        "loop": lambda: [index.apply(record, router) for record in states],
        "stats": index.stats,
    }
    threads = [threading.Thread(target=run, args=item, daemon=True) for item in steps.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert sorted(done) == sorted(steps)


def _odd_event(rng: random.Random) -> Any:
    """An event with one field that may be malformed, filtered or unusual."""
    blocks = rng.randrange(0, 4)
    size = rng.choice([BS, BS, BS, 8, 0, -1, True, "16", 1 << 64 - 1])
    sized = size if type(size) is int and 0 < size < 64 else BS
    event = stored(
        [
            rng.choice(
                [
                    rng.randrange(1 << 64),
                    engine_hash("i64", 5),
                    engine_hash("bytes", 6),
                    "x",
                    None,
                    1.5,
                    True,
                    [1],
                ]
            )
            if rng.random() < 0.2
            else rng.randrange(1 << 64)
            for _ in range(blocks)
        ],
        rng.choice([None, None, 7, engine_hash("bytes", 8), "s", False]),
        [
            rng.choice(
                [0, 2**32 - 1, rng.randrange(1 << 17), -1, 1 << 32, True, 1.0, "a", 2**64 - 1]
            )
            if rng.random() < 0.05
            else rng.randrange(1 << 32)
            for _ in range(blocks * sized + rng.choice([0, 0, 0, 1, -1]))
        ],
        size,
        lora_id=rng.choice([None] * 8 + [1]),
        lora_name=rng.choice([None] * 8 + ["l"]),
        medium=rng.choice([None, "GPU", "GPU", "CPU", 3, b"GPU", "GP\u00dc"]),
        extra_keys=rng.choice([None, [None] * blocks, [None, ["x"]], [], 5, [None] * (blocks + 2)]),
        group_idx=rng.choice([None, 0, 0, 1, False, True, 0.0, "", [], 1 << 63]),
    )
    kind = rng.choice(["BlockStored"] * 4 + ["BlockRemoved"] * 2 + ["AllBlocksCleared", "Next", 5])
    if kind == "BlockRemoved":
        event = removed(event["block_hashes"], medium=event["medium"], group_idx=event["group_idx"])
    if rng.random() < 0.5 and kind in ("BlockStored", "BlockRemoved"):
        array = encode_event(event, "array")
        return array[: rng.randrange(1, len(array) + 1)] if rng.random() < 0.2 else array
    event["type"] = kind
    if rng.random() < 0.1:
        event[rng.choice(["later", 5, None, 2.5])] = {"k": [1, 2.5, "\u00e9", b"\xff"]}
    return event


def _odd_batch(rng: random.Random) -> bytes:
    events = [_odd_event(rng) for _ in range(rng.randrange(0, 4))]
    shape = rng.random()
    if shape < 0.6:
        return msgpack.packb([1.5, events, 0])
    if shape < 0.8:
        return msgpack.packb({"events": events, "ts": 1.5})
    if shape < 0.85:
        return msgpack.packb(rng.choice([[1.5], {"ts": 1}, "events", {"events": 5}]))
    payload = bytearray(msgpack.packb([1.5, events, 0]))
    payload[rng.randrange(len(payload))] = rng.randrange(256)  # a str's UTF-8, a length...
    return bytes(payload) + rng.choice([b"", b"", b"\x01", b"\xc1", b"\xa2\xff\xfe"])


@pytest.mark.c_extension
def test_the_codec_twins_read_batches_alike(c_impl, py_impl, monkeypatch):
    """The C reader of the batches gives the Python reader's records and counts, reading
    in C every batch of the usual shapes and leaving the others to the Python reader."""
    from coordkit._kvevents import Filter

    assert py_impl.codec.decode_kv_batch.__module__ == "coordkit._kvevents"
    left: list[bytes] = []
    python_reader = c_impl.codec._decode_batch_py

    def counted(payload: bytes, rank: int, keep: Filter) -> tuple[list[bytes], int]:
        left.append(payload)
        return python_reader(payload, rank, keep)

    monkeypatch.setattr(c_impl.codec, "_decode_batch_py", counted)

    def both(payload: bytes, keep: Filter) -> Any:
        answers = []
        for decode in (py_impl.codec.decode_kv_batch, c_impl.codec.decode_kv_batch):
            try:
                answers.append(decode(payload, 3, keep))
            except ValueError as exc:
                answers.append(str(exc))
        assert answers[0] == answers[1], payload.hex()
        return answers[0]

    a, b = tokens(20, 3), [70_000 + i for i in range(2 * BS)]
    usual = [
        store_chain(kind, prompt, 0, per) + [removed([engine_hash(kind, 1)]), cleared()]
        for kind in ("u64", "i64", "bytes")
        for prompt in (a, b)
        for per in (1, 3)
    ] + [[stored([1, 2], None, a[: 2 * BS], BS, extra_keys=[None, ["mm"]], group_idx=0)]]
    for events in usual:
        for form in ("array", "map"):
            for batch in ("array", "map"):
                records, bad = both(batch_payload(events, form, batch, 3), Filter(BS))
                assert records and not bad
    assert not left  # every one read in C
    rng = random.Random(41)
    for _ in range(3000):
        both(_odd_batch(rng), Filter(BS, ("GPU", "GP\u00dc"), (0, 1)))
    assert 500 < len(left) < 2900  # both readers had their share


# -- coordkit's own engines publish ------------------------------------------------------


def test_a_coordinator_that_never_routed_a_prefix_finds_it_by_fake_engines_events(impl, tmp_path):
    """FakeEngines publish their caches' events and announce them at their hello: a
    coordinator started after the prefix was cached (engines keep no hashes to report)
    sends its first request carrying it to the engine that caches it."""
    address = f"ipc://{tmp_path}/coord.sock"
    prompt = tokens(20, 4)

    def coordinator() -> Coordinator:
        coord = Coordinator(
            address, implementation=impl.name, policy="prefix", block_size=BS, kv_events={}
        )
        coord.start()
        return coord

    async def ask(prompts: list[list[int]]) -> list[dict]:
        async with await Client.connect(address, timeout=10, implementation=impl.name) as client:
            await client.wait_for_engines(2, timeout=10)
            return [await client.submit(p, block_size=BS) for p in prompts]

    first = coordinator()
    with fake_engines(address, 2, kv_events=True, held_hashes=0, cache_blocks=64):
        try:
            # A dummy first, then the prompt: the other engine caches it.
            dummy, held = run(ask([tokens(21, 1), prompt]))
            assert dummy["rank"] != held["rank"]  # (an engine's own rank, in its bodies)
        finally:
            first.stop()
        second = coordinator()
        try:
            # (The engines find the new coordinator when libzmq reconnects them; its ranks
            # are in the order they came back.)
            wait_for(lambda: len(second.stats()["kv_events"]["engines"]) == 2, 30)
            wait_for(
                lambda: (
                    sorted(e["blocks"] for e in second.stats()["kv_events"]["engines"]) == [1, 4]
                )
            )
            engines = second.stats()["kv_events"]["engines"]
            holder = next(e["rank"] for e in engines if e["blocks"] == 4)
            # Where rotation would send a request no table knows: away from the holder.
            unknown = [tokens(24, 1)] if holder == 0 else []
            *_, reply = run(ask([*unknown, prompt]))
            assert (reply["rank"], reply["cached_blocks"]) == (held["rank"], 4)
            assert all(e["state"] == "exact" for e in second.stats()["kv_events"]["engines"])
        finally:
            second.stop()


def test_an_engine_announces_its_publisher_and_publishes_through_it(make_cluster):
    with make_cluster(policy="prefix", block_size=BS, kv_events={}) as c:
        with KVPublisher(block_size=BS, rank=0) as publisher:
            engine = Engine(c.coord.address, 0, kv_events=publisher, context=c.ctx)
            try:
                wait_for(lambda: blocks(c, 0) == 0)
                line = kv(c)["engines"][0]
                assert (line["endpoint"], line["replay"]) == (
                    publisher.endpoint,
                    publisher.replay_endpoint,
                )
                prompt = tokens(22, 3)
                ids = [engine_hash("bytes", i) for i in range(3)]
                engine.kv_stored(ids[:2], None, prompt[: 2 * BS])
                engine.kv_stored(ids[2:], ids[1], prompt[2 * BS :])
                wait_for(lambda: blocks(c, 0) == 3)
                engine.kv_removed(ids[2:])
                wait_for(lambda: blocks(c, 0) == 2)
                engine.kv_cleared()
                wait_for(lambda: blocks(c, 0) == 0)
            finally:
                engine.close()
            # Gone (over ipc, its connection's end): the publisher it announced with it.
            wait_for(lambda: kv(c)["engines"] == [])


def test_an_engine_without_a_publisher_cannot_publish(make_cluster):
    with make_cluster() as c:
        engine = Engine(c.coord.address, 0, context=c.ctx)
        try:
            with pytest.raises(RuntimeError, match="publishes no events"):
                engine.kv_stored([1], None, list(range(16)))
        finally:
            engine.close()


def test_the_demo_runs_on_the_engines_events(impl):
    """``coordkit demo --kv-events``: fake engine processes publish, the coordinator reads."""
    args = ["--kv-events", "--shared-prefixes", "4", "--policy", "prefix", "--engines", "3"]
    result = demo(*args, "--requests", "200", "--implementation", impl.name)
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert (rows["requests"], rows["errors"]) == ("200 of 200", "none")
    assert rows["prefix index"] == "the engines' KV events"
    assert hit_rate(rows["prefix cache hit rate"]) > 50


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("0=tcp://h:5557", (0, "tcp://h:5557")),
        ("3=tcp://h:5557,tcp://h:5558", (3, "tcp://h:5557,tcp://h:5558")),
        ("mp-coord-2=tcp://h:5557", ("mp-coord-2", "tcp://h:5557")),
        ("engines", None),
    ],
)
def test_serve_takes_kv_events(spec, parsed):
    from coordkit.tools.cli import _kv_events_spec

    assert _kv_events_spec(spec) == parsed


def test_serve_refuses_a_bad_kv_events():
    result = subprocess.run(
        coordkit_command("serve", "--kv-events", "tcp://h:5557"),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "RANK=ENDPOINT[,REPLAY]" in result.stderr


def test_a_publisher_out_of_reach_never_stops_the_thread(make_cluster, publishers):
    """An endpoint no socket takes is not read (counted); one that never answers has its
    replay time out: cleared, counted, priced as caching nothing. The others read on."""
    pub = publishers(rank=1)
    away = "tcp://no-such-host.invalid:5557"
    bad = {0: "tcp://127.0.0.1:not-a-port", 2: f"{away},{away}"}
    with make_cluster(
        n_engines=3, policy="prefix", block_size=BS, kv_events={**bad, 1: pub.spec}
    ) as c:
        wait_for(lambda: blocks(c, 1) == 0)
        pub.publish(*store_chain("u64", tokens(23, 2), 0))
        wait_for(lambda: blocks(c, 1) == 2)
        wait_for(lambda: blocks(c, 2) == 0)  # its replay timed out (2 s)
        assert [e["rank"] for e in kv(c)["engines"]] == [1, 2]
        assert kv(c)["malformed"] == 1 and kv(c)["resets"] == 1


def test_the_routers_decide_alike_on_the_engines_events(c_impl, py_impl):
    """Both routers, each reading its core's index, fed the same events and requests,
    make the same decisions: the contract's, exact ranks priced by their events."""
    import random

    from coordkit._loop_c import KVIndex as CIndex
    from coordkit._routing_c import Router as CRouter

    from coordkit._kvevents import OP_STATE, STATE, STATE_KNOWN, STATE_UNKNOWN, Chains, Filter
    from coordkit._kvevents import decode_batch as decode
    from coordkit._loop_py.kvindex import KVIndex as PyIndex
    from coordkit._routing_py import Router as PyRouter

    rng = random.Random(41)
    size = 4
    pairs = [(PyRouter("prefix", 16, block_size=size), PyIndex())]
    pairs.append((CRouter("prefix", 16, block_size=size), CIndex(16)))
    chains = Chains(16)
    for router, index in pairs:
        router.attach_kv(index)
        for rank in range(8):
            router.add_rank(rank)
    prefixes = [[rng.randrange(50) for _ in range(size * rng.randrange(1, 6))] for _ in range(12)]
    held: dict[int, list[int]] = {}  # rank -> keys stored

    def feed(record: bytes) -> None:
        handed = chains.hand(record)
        for router, index in pairs:
            if handed is not None:
                index.apply(handed, router)

    for rank in range(4):
        feed(STATE.pack(OP_STATE, rank, STATE_KNOWN))
    feed(STATE.pack(OP_STATE, 4, STATE_UNKNOWN))
    decisions = []
    for step in range(600):
        kind = rng.random()
        rank = rng.randrange(5)
        if kind < 0.3:
            prompt = rng.choice(prefixes)
            keys = [rng.getrandbits(64) for _ in range(len(prompt) // size)]
            held.setdefault(rank, []).extend(keys)
            events = [stored(keys, None, prompt, size)]
        elif kind < 0.4 and held.get(rank):
            events = [removed(rng.sample(held[rank], min(3, len(held[rank]))))]
        elif kind < 0.42:
            events, held[rank] = [cleared()], []
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(size)]
            frame = block_hashes(prompt, size)
            chosen = [(r.choose(frame, float(step)), r.charged) for r, _ in pairs]
            assert chosen[0] == chosen[1], step
            decisions.append(chosen[0][0])
            if rng.random() < 0.7:
                for router, _ in pairs:
                    router.release(chosen[0][0], chosen[0][1])
            continue
        for record in decode(batch_payload(events, "array", "array", rank), rank, Filter(size))[0]:
            feed(record)
    assert len(set(decisions)) > 4  # the load and the events spread them
