"""The failure model: bad input, lost clients, dead engines, admission control.

Whatever arrives, the loop goes on, every accepted request ends with exactly
one terminal reply (a final ENGINE_REPLY or an ERROR), and the tables return
to empty when the traffic ends.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import hypothesis
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordkit._shared import COPY_BELOW, SHARED_SMALL_MAX
from coordkit.protocol import ErrorCode
from tests.support.cluster import Cluster
from tests.support.peers import (
    ABORT,
    CONNECT,
    DISCONNECT,
    ENGINE_HELLO,
    ERROR,
    HEARTBEAT,
    PARTIAL,
    PAUSE,
    RELEASE_KV,
    REPLY,
    SET_GENERATION_EPOCH,
    SHUTDOWN,
    STATS,
    STATS_REPLY,
    SUBMIT,
    SUBMIT_KV,
    RawClient,
    RawEngine,
    m,
    um,
    wait_for,
)
from tests.support.processes import engine_processes

# -- helpers -------------------------------------------------------------------------


def error_of(frames: list[bytes]) -> tuple[int | None, int]:
    header, rid, code, message = um(frames[0])
    assert header == ERROR and isinstance(message, str) and message
    return rid, code


def expect_error(client: RawClient, rid: int | None, code: ErrorCode) -> None:
    assert error_of(client.recv()) == (rid, code)


def round_trip(cluster: Cluster, client: RawClient, rid: int, engine: RawEngine | None = None):
    """A request that must still go through: the loop is alive and routing."""
    client.send(m([SUBMIT, rid, {}]), b"alive?")
    engine = engine or cluster.engines[0]
    meta, _ = engine.recv()
    engine.send(m([REPLY, [[um(meta)[1], False]]]), b"yes")
    assert client.recv() == [m([REPLY, rid]), b"yes"]


def terminal(frames: list[bytes]) -> int | None:
    """The client rid a final reply or an ERROR ends, None for a partial."""
    header, rid = um(frames[0])[:2]
    return rid if header in (REPLY, ERROR) else None


# -- malformed input -----------------------------------------------------------------

BAD_FROM_CLIENT = [
    # (frames, rid in the ERROR, code)
    ([b"\xc1"], None, ErrorCode.MALFORMED),
    ([m([])], None, ErrorCode.MALFORMED),
    ([m("not an array")], None, ErrorCode.MALFORMED),
    ([m(["20", 1, {}]), b"p"], None, ErrorCode.MALFORMED),
    ([m([SUBMIT]), b"p"], None, ErrorCode.MALFORMED),
    ([m([SUBMIT, "x", {}]), b"p"], None, ErrorCode.MALFORMED),
    ([m([SUBMIT, 2**64 - 1, {}]), b"p"], None, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7]), b"p"], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {}, 1]), b"p"], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {}])], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {}]), b"p", b"h" * 8, b"extra"], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {}]), b"p", b"h" * 7], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {}]) + b"\x00", b"p"], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT, 7, {"a": 1}])[:-1], b"p"], 7, ErrorCode.MALFORMED),
    ([m([SUBMIT_KV, 7, {}]), b"p"], 7, ErrorCode.MALFORMED),
    ([m([ABORT]), b"x"], None, ErrorCode.MALFORMED),
    ([m([ABORT, 1, 2])], 1, ErrorCode.MALFORMED),
    ([m([PAUSE, 1])], None, ErrorCode.MALFORMED),
    ([m([SET_GENERATION_EPOCH])], None, ErrorCode.MALFORMED),
    ([m([SHUTDOWN]), b"x"], None, ErrorCode.MALFORMED),
    ([m([77])], None, ErrorCode.UNKNOWN_HEADER),
    ([m([REPLY, [[0, False]]]), b"body"], None, ErrorCode.UNKNOWN_HEADER),
    ([m([HEARTBEAT, 0, 0])], None, ErrorCode.UNKNOWN_HEADER),
]


@pytest.mark.parametrize(("frames", "rid", "code"), BAD_FROM_CLIENT)
def test_malformed_from_client_answered_and_survived(cluster, frames, rid, code):
    client = cluster.client(coordkit=True)
    client.send(*frames)
    expect_error(client, rid, code)
    round_trip(cluster, client, 1000)
    cluster.engines[0].assert_silent(0.05)
    assert cluster.coord.stats()["inflight"] == 0


def test_megatron_client_gets_no_error_frames(cluster):
    client = cluster.client()  # never said {"coordkit": 1}: it could not parse ERROR
    client.send(b"\xc1", b"p")
    client.send(m([ABORT, 5]))
    client.assert_silent()
    counters = cluster.coord.stats()["counters"]
    assert counters["malformed"] == 1 and counters["unknown_request"] == 1
    round_trip(cluster, client, 1)


BAD_FROM_ENGINE = [
    # (frames, the counter that counts them)
    ([b"\xc1"], "malformed"),
    ([m([REPLY, [[0, False], [1, False]]]), b"only one body"], "malformed"),
    ([m([REPLY, [[0, False]]]), b"one", b"two"], "malformed"),
    # a readable batch with an entry of the wrong shape: that entry is skipped
    ([m([REPLY, [[0]]]), b"b"], "malformed_entries"),
    ([m([REPLY, [[0, 1]]]), b"b"], "malformed_entries"),
    ([m([REPLY, [0]]), b"b"], "malformed_entries"),
    ([m([PARTIAL, [[0, False]]]), b"b"], "malformed_entries"),
    ([m([REPLY, [[2**63, False]]]), b"b"], "malformed_entries"),
    ([m([REPLY, "x"]), b"b"], "malformed"),
    ([m([REPLY])], "malformed"),
    ([m([REPLY, [[-1, False]]]), b"b"], "unknown_request"),
    ([m([REPLY, [[12345, False]]]), b"b"], "unknown_request"),
    ([m([HEARTBEAT, "x", 0])], "malformed"),
    ([m([DISCONNECT, 1])], "malformed"),
    ([m([SUBMIT, 0, {}]), b"p"], "unknown_header"),
]


@pytest.mark.parametrize(("frames", "counter"), BAD_FROM_ENGINE)
def test_malformed_from_engine_counted_and_survived(cluster, frames, counter):
    client = cluster.client(coordkit=True)
    client.send(m([SUBMIT, 0, {}]), b"p")
    engine = cluster.engines[0]
    engine.recv()
    # The loop counts a SUBMIT after forwarding it: the snapshot waits for that count.
    wait_for(lambda: cluster.coord.stats()["counters"]["submitted"] == 1)
    before = cluster.coord.stats()
    engine.send(*frames)
    wait_for(lambda: cluster.coord.stats()["messages"] > before["messages"])
    wait_for(lambda: cluster.coord.stats()["counters"] != before["counters"])
    client.assert_silent(0.05)
    counters = cluster.coord.stats()["counters"]
    moved = {name: n - before["counters"][name] for name, n in counters.items()}
    assert {name: n for name, n in moved.items() if n} == {counter: 1}
    engine.send(m([REPLY, [[0, False]]]), b"real")  # the request is still there, untouched
    assert client.recv() == [m([REPLY, 0]), b"real"]
    round_trip(cluster, client, 1)
    assert cluster.coord.stats()["engines"][0]["state"] == "alive"


def test_reply_from_engine_not_owning_the_request_is_dropped(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client()
        client.send(m([SUBMIT, 0, {}]), b"p")
        server_rid = um(c.engines[0].recv()[0])[1]
        c.engines[1].send(m([REPLY, [[server_rid, False]]]), b"impostor")
        client.assert_silent()
        c.engines[0].send(m([REPLY, [[server_rid, False]]]), b"owner")
        assert client.recv() == [m([REPLY, 0]), b"owner"]
        assert c.coord.stats()["counters"]["unknown_request"] == 1


def test_a_bad_entry_does_not_take_the_good_finals_with_it(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), b"p0")
        mine = um(c.engines[0].recv()[0])[1]
        client.send(m([SUBMIT, 1, {}]), b"p1")
        theirs = um(c.engines[1].recv()[0])[1]
        # The owner's real final, an id that does not fit int64, an unknown id,
        # and a request another engine owns: only the first is delivered.
        entries = [[mine, False], [2**63, False], [12345, False], [theirs, False]]
        c.engines[0].send(m([REPLY, entries]), b"real", b"x", b"y", b"z")
        assert client.recv() == [m([REPLY, 0]), b"real"]
        client.assert_silent(0.05)
        counters = c.coord.stats()["counters"]
        assert (counters["malformed_entries"], counters["unknown_request"]) == (1, 2)
        assert counters["malformed"] == 0
        c.engines[1].send(m([REPLY, [[theirs, False]]]), b"theirs")  # untouched by the forgery
        assert client.recv() == [m([REPLY, 1]), b"theirs"]
        assert c.coord.stats()["inflight"] == 0


def test_a_coordkit_engine_is_told_which_entries_were_not_delivered(make_cluster):
    with make_cluster(n_engines=0) as c:
        engine = c.add_engine(b"ck-engine")
        engine.hello()
        client = c.client()
        client.send(m([SUBMIT, 0, {}]), b"p")
        server_rid = um(engine.recv()[0])[1]
        engine.send(m([PARTIAL, [server_rid, "x", 777]]), b"part", b"bad", b"unknown")
        assert client.recv() == [m([PARTIAL, 0]), b"part"]
        assert error_of(engine.recv()) == (None, ErrorCode.MALFORMED)
        assert error_of(engine.recv()) == (777, ErrorCode.UNKNOWN_REQUEST)
        engine.send(m([REPLY, [[server_rid, False]]]), b"done")
        assert client.recv() == [m([REPLY, 0]), b"done"]
        engine.assert_silent(0.05)


def test_engine_hello_registers_an_engine(make_cluster):
    with make_cluster(n_engines=0) as c:
        engine = RawEngine(c.ctx, c.coord.address, b"hello-only")
        c.peers.append(engine)
        engine.hello()  # no empty frame first
        wait_for(lambda: len(c.coord.stats()["engines"]) == 1)
        client = c.client()
        round_trip(c, client, 0, engine)
        engine.send(m([ENGINE_HELLO, "not a map"]))
        wait_for(lambda: c.coord.stats()["counters"]["malformed"] == 1)
        assert c.coord.stats()["engines"][0]["state"] == "alive"
        assert c.coord.stats()["counters"]["duplicate_register"] == 0


def test_a_request_whose_engine_never_answers_times_out(make_cluster):
    with make_cluster(n_engines=1, request_timeout=0.3) as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), b"forgotten")
        server_rid = um(c.engines[0].recv()[0])[1]
        round_trip(c, client, 1)  # a request that is answered is not touched
        started = time.monotonic()
        expect_error(client, 0, ErrorCode.TIMED_OUT)
        assert time.monotonic() - started < 5.0
        assert c.engines[0].recv() == [m([ABORT, server_rid])]
        stats = c.coord.stats()
        assert stats["inflight"] == 0 and stats["counters"]["timed_out"] == 1
        c.engines[0].send(m([REPLY, [[server_rid, False]]]), b"too late")  # counted, dropped
        wait_for(lambda: c.coord.stats()["counters"]["unknown_request"] == 1)
        client.assert_silent(0.05)
        round_trip(c, client, 2)


def test_requests_time_out_oldest_first_and_only_when_due(make_cluster):
    with make_cluster(n_engines=1, request_timeout=0.4) as c:
        client = c.client(coordkit=True)
        for rid in range(3):
            client.send(m([SUBMIT, rid, {}]), b"p")
            c.engines[0].recv()
            time.sleep(0.1)
        client.send(m([ABORT, 1]))  # aborted: its engine is not sent a second ABORT
        assert um(c.engines[0].recv()[0])[0] == ABORT
        assert [error_of(client.recv()) for _ in range(3)] == [
            (rid, ErrorCode.TIMED_OUT) for rid in range(3)
        ]
        aborts = [um(f[0]) for f in c.engines[0].recv_all()]
        assert [a[0] for a in aborts] == [ABORT, ABORT]


def test_the_timers_run_inside_one_serve_call(make_coordinator):
    # serve() runs the timers itself (here a request's deadline): the loop need not
    # return to Python for them, where it would wait for the GIL (in a busy process,
    # up to the interpreter's switch interval, handling nothing meanwhile).
    ctx = zmq.Context()
    coord = make_coordinator(request_timeout=0.2)
    engine = RawEngine(ctx, coord.address, b"engine-0").register()
    client = RawClient(ctx, coord.address)
    returned: list[bool] = []
    serving = threading.Thread(target=lambda: returned.append(coord._loop.serve(60.0)))
    serving.start()
    try:
        client.connect(coordkit=True)
        wait_for(lambda: len(coord.stats()["engines"]) == 1)
        client.send(m([SUBMIT, 0, {}]), b"forgotten")
        server_rid = um(engine.recv()[0])[1]
        expect_error(client, 0, ErrorCode.TIMED_OUT)
        assert engine.recv() == [m([ABORT, server_rid])]
        assert returned == []  # all in the one call
    finally:
        coord._sockets.wake()
        serving.join(10.0)
        client.close()
        engine.close()
        coord.stop()
        ctx.term()
    assert returned == [False]  # stopped by the wake-up, not by its time


def test_reply_from_unregistered_sender_is_dropped(cluster):
    client = cluster.client()
    client.send(m([SUBMIT, 0, {}]), b"p")
    server_rid = um(cluster.engines[0].recv()[0])[1]
    stranger = RawEngine(cluster.ctx, cluster.coord.address, b"stranger")
    cluster.peers.append(stranger)
    stranger.send(m([REPLY, [[server_rid, False]]]), b"forged")
    wait_for(lambda: cluster.coord.stats()["counters"]["not_connected"] == 1)
    client.assert_silent()


def test_duplicate_registration_counted(cluster):
    cluster.engines[0].register()
    wait_for(lambda: cluster.coord.stats()["counters"]["duplicate_register"] == 1)
    assert len(cluster.coord.stats()["engines"]) == 1


def test_message_over_max_message_size_drops_the_sender_only(make_cluster):
    with make_cluster(n_engines=1, max_message_size=64 * 1024) as c:
        good = c.client(coordkit=True)
        hostile = c.client(coordkit=True)
        hostile.send(m([SUBMIT, 0, {}]), b"x" * (256 * 1024))
        round_trip(c, good, 0)
        hostile.assert_silent()
        c.engines[0].assert_silent(0.05)


def test_duplicate_request_id_in_flight(cluster):
    client = cluster.client(coordkit=True)
    client.send(m([SUBMIT, 3, {}]), b"a")
    cluster.engines[0].recv()
    client.send(m([SUBMIT, 3, {}]), b"b")
    expect_error(client, 3, ErrorCode.DUPLICATE_REQUEST)
    cluster.engines[0].assert_silent(0.05)


# -- admission control ---------------------------------------------------------------


def test_busy_exactly_at_max_inflight(make_cluster):
    with make_cluster(n_engines=1, max_inflight=5) as c:
        client = c.client(coordkit=True)
        for rid in range(5):
            client.send(m([SUBMIT, rid, {}]), b"p")
        server_rids = [um(c.engines[0].recv()[0])[1] for _ in range(5)]
        client.assert_silent(0.05)
        client.send(m([SUBMIT, 5, {}]), b"p")
        expect_error(client, 5, ErrorCode.BUSY)
        c.engines[0].send(m([REPLY, [[server_rids[0], False]]]), b"done")
        assert client.recv() == [m([REPLY, 0]), b"done"]
        client.send(m([SUBMIT, 6, {}]), b"p")
        assert um(c.engines[0].recv()[0])[0] == SUBMIT
        assert c.coord.stats()["counters"]["busy"] == 1


def test_busy_at_the_per_engine_cap_without_a_queue(make_cluster):
    """With a queue (the default) the fifth waits (test_queueing.py); without, BUSY."""
    with make_cluster(n_engines=2, max_inflight_per_engine=2, queue_limit=0) as c:
        client = c.client(coordkit=True)
        for rid in range(4):
            client.send(m([SUBMIT, rid, {}]), b"p")
        for engine in c.engines:
            engine.recv(), engine.recv()
        client.send(m([SUBMIT, 4, {}]), b"p")
        expect_error(client, 4, ErrorCode.BUSY)


def test_no_engines(make_cluster):
    with make_cluster() as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), b"p")
        expect_error(client, 0, ErrorCode.NO_ENGINES)
        c.add_engine()
        round_trip(c, client, 1)


def test_client_table_is_bounded(make_cluster):
    with make_cluster(n_engines=1, max_clients=2) as c:
        busy = c.client(coordkit=True)
        busy.send(m([SUBMIT, 0, {}]), b"p")  # in flight: this client cannot be evicted
        c.engines[0].recv()
        c.client()  # idle: the next newcomer takes its place
        newcomer = c.client(coordkit=True)
        newcomer.send(m([SUBMIT, 0, {}]), b"p")
        c.engines[0].recv()
        blocked = RawClient(c.ctx, c.coord.address)
        c.peers.append(blocked)
        blocked.send(m([CONNECT, {"coordkit": 1}]))  # nobody idle to make room
        assert error_of(blocked.recv()) == (None, ErrorCode.BUSY)
        stats = c.coord.stats()
        assert stats["clients"] == 2 and stats["counters"]["table_full"] == 1


def test_the_client_idle_longest_gives_up_its_place(make_cluster):
    # Idle since: its last message, or its last request's end, whichever came later.
    with make_cluster(n_engines=1, max_clients=2) as c:
        early = c.client(coordkit=True)
        early.send(m([SUBMIT, 0, {}]), b"p")
        meta, _ = c.engines[0].recv()
        late = c.client(coordkit=True)  # idle from here
        c.engines[0].send(m([REPLY, [[um(meta)[1], False]]]), b"done")
        assert early.recv() == [m([REPLY, 0]), b"done"]  # idle from here: after late
        c.client()  # takes late's place, not early's
        late.send(m([SUBMIT, 1, {}]), b"p")
        wait_for(lambda: c.coord.stats()["counters"]["not_connected"] == 1)
        round_trip(c, early, 2)
        # A message from an idle client makes it the one seen last: now early is older.
        third = c.client(coordkit=True)  # takes the place of the one made above
        early.send(m([STATS]))
        assert um(early.recv()[0])[0] == STATS_REPLY
        third.send(m([STATS]))
        assert um(third.recv()[0])[0] == STATS_REPLY
        c.client()  # early was seen before third: early goes
        early.send(m([SUBMIT, 3, {}]), b"p")
        wait_for(lambda: c.coord.stats()["counters"]["not_connected"] == 2)
        round_trip(c, third, 0)


# -- vanished peers ------------------------------------------------------------------


def test_vanished_client_leaves_no_state(make_cluster):
    with make_cluster(n_engines=1) as c:
        other = c.client(coordkit=True)
        leaver = c.client(coordkit=True)
        for rid in range(3):
            leaver.send(m([SUBMIT, rid, {}]), b"p")
        server_rids = [um(c.engines[0].recv()[0])[1] for _ in range(3)]
        leaver.close()  # without a word: its connection's end is its departure
        c.peers.remove(leaver)
        # The coordinator aborts the client's requests at their engine...
        aborts = [c.engines[0].recv() for _ in range(3)]
        assert sorted(um(a[0])[1] for a in aborts) == server_rids
        assert all(um(a[0])[0] == ABORT for a in aborts)
        # ...and forgets it: nothing left in flight, the engine's late finals are dropped.
        c.engines[0].send(m([REPLY, [[rid, False] for rid in server_rids]]), b"a", b"b", b"c")
        wait_for(lambda: c.coord.stats()["counters"]["unknown_request"] == 3)
        stats = c.coord.stats()
        assert stats["inflight"] == 0 and stats["clients"] == 1
        assert stats["engines"][0]["pending"] == 0
        assert stats["counters"]["clients_departed"] == 1
        round_trip(c, other, 0)


def test_vanished_clients_among_many_leave_only_their_own_requests(make_cluster):
    # Each client's requests are its own list: one that vanishes takes exactly its
    # requests with it, interleaved as they are with everyone else's in the tables.
    with make_cluster(n_engines=1) as c:
        clients = [c.client(coordkit=True) for _ in range(60)]
        owner: dict[int, tuple[int, int]] = {}  # server rid -> (client index, client rid)
        for rid in range(3):
            for index, client in enumerate(clients):
                client.send(m([SUBMIT, rid, {}]), b"p")
                owner[um(c.engines[0].recv()[0])[1]] = (index, rid)
        leavers = set(range(0, 60, 7))
        for index in sorted(leavers):
            clients[index].close()
            c.peers.remove(clients[index])
        # Each leaver's connection ends: it is dropped with its requests, each aborted
        # at the engine, and nobody else's.
        aborted = sorted(um(c.engines[0].recv()[0])[1] for _ in range(3 * len(leavers)))
        assert aborted == sorted(
            server_rid for server_rid, (index, _) in owner.items() if index in leavers
        )
        wait_for(lambda: c.coord.stats()["clients"] == 60 - len(leavers))
        assert c.coord.stats()["inflight"] == 3 * (60 - len(leavers))
        for server_rid, (index, rid) in owner.items():  # the others' are all still there
            if index not in leavers:
                c.engines[0].send(m([REPLY, [[server_rid, False]]]), b"r")
                assert clients[index].recv() == [m([REPLY, rid]), b"r"]
        wait_for(lambda: c.coord.stats()["inflight"] == 0)


def test_unreachable_engine_is_failed_and_its_requests_rerouted(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        for rid in range(4):
            client.send(m([SUBMIT, rid, {}]), f"p{rid}".encode())
        held = [um(c.engines[0].recv()[0])[1] for _ in range(2)]
        [c.engines[1].recv() for _ in range(2)]
        c.engines[0].send(m([PARTIAL, [held[0]]]), b"started")  # held[0] produced output
        assert client.recv() == [m([PARTIAL, 0]), b"started"]
        c.engines[0].close()  # dies without a word
        c.peers.remove(c.engines[0])
        time.sleep(0.1)
        client.send(m([SUBMIT, 4, {}]), b"p4")  # round robin points at the dead rank
        # held[1] produced nothing: re-sent to rank 1 with its server id and prompt.
        frames = [c.engines[1].recv() for _ in range(2)]
        assert sorted((um(f[0])[1], f[1]) for f in frames) == sorted([(held[1], b"p2"), (4, b"p4")])
        expect_error(client, 0, ErrorCode.ENGINE_FAILED)  # held[0] cannot be re-run
        stats = c.coord.stats()
        assert stats["engines"][0]["state"] == "gone"
        assert stats["counters"]["rerouted"] == 1 and stats["counters"]["engine_failed"] == 1


@pytest.mark.parametrize("keep_prompts", [True, False])
@pytest.mark.parametrize("size", [7, 8191, 8192, 300_000])  # below and above COPY_BELOW
def test_rerouted_prompt_arrives_intact_unless_not_kept(make_cluster, size, keep_prompts):
    options = {"policy": "round_robin", "keep_prompts": keep_prompts}
    with make_cluster(n_engines=2, **options) as c:
        client = c.client(coordkit=True)
        prompt = bytes(range(256)) * (size // 256) + b"\xc1" * (size % 256)
        params = {"temperature": 0.5, "stop": ["\n"]}
        client.send(m([SUBMIT, 0, params]), prompt)
        server_rid = um(c.engines[0].recv()[0])[1]
        client.send(m([SUBMIT, 1, {}]), b"p")
        assert um(c.engines[1].recv()[0])[1] == 1
        c.engines[0].close()
        c.peers.remove(c.engines[0])
        time.sleep(0.1)
        client.send(m([SUBMIT, 2, {}]), b"p")  # round robin: rank 0 is found gone
        if keep_prompts:
            assert c.engines[1].recv() == [m([SUBMIT, server_rid, params]), prompt]
        else:
            expect_error(client, 0, ErrorCode.ENGINE_FAILED)
        assert um(c.engines[1].recv()[0])[1] == 2


def test_small_prompts_past_the_shared_bound_are_kept_as_copies(make_cluster):
    # Below COPY_BELOW a kept prompt is shared while fewer than SHARED_SMALL_MAX of
    # the loop's are, and copied past that: a dead engine's requests on both sides of
    # the bound (and some above COPY_BELOW) are re-sent byte for byte, while the
    # other engine's requests come and go (each ending gives its share back).
    n = SHARED_SMALL_MAX * 3 // 2  # three in four below COPY_BELOW: past the bound
    sizes = (34, 1000, COPY_BELOW - 1, COPY_BELOW)
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        sent: dict[int, bytes] = {}  # server rid on rank 0 -> its prompt
        for rid in range(2 * n):
            prompt = rid.to_bytes(4, "little") * (sizes[rid // 2 % 4] // 4 + 1)
            client.send(m([SUBMIT, rid, {}]), prompt[: sizes[rid // 2 % 4]])
            if rid % 2:  # rank 1 answers at once
                server_rid = um(c.engines[1].recv()[0])[1]
                c.engines[1].send(m([REPLY, [[server_rid, False]]]), b"r")
                assert client.recv() == [m([REPLY, rid]), b"r"]
            else:
                meta, prompt = c.engines[0].recv()
                sent[um(meta)[1]] = prompt
        c.engines[0].close()
        c.peers.remove(c.engines[0])
        time.sleep(0.1)
        client.send(m([SUBMIT, 2 * n, {}]), b"p")  # round robin: rank 0 is found gone
        resent = dict((um(f[0])[1], f[1]) for f in (c.engines[1].recv() for _ in range(n + 1)))
        assert resent.pop(max(resent)) == b"p"
        assert resent == sent
        assert c.coord.stats()["counters"]["rerouted"] == n


def test_heartbeat_timeout_fails_a_silent_engine(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin", heartbeat_timeout=0.3) as c:
        c.engines[0].send(m([HEARTBEAT, 0, 8]))
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), b"p")
        server_rid = um(c.engines[0].recv()[0])[1]
        # Rank 0 stops heartbeating but keeps its socket: only the timeout can tell.
        assert c.engines[1].recv(2.0) == [m([SUBMIT, server_rid, {}]), b"p"]
        assert c.coord.stats()["engines"][0]["state"] == "gone"
        c.engines[1].send(m([REPLY, [[server_rid, False]]]), b"done")
        assert client.recv() == [m([REPLY, 0]), b"done"]


def test_engine_without_heartbeats_is_never_timed_out(make_cluster):
    with make_cluster(n_engines=1, heartbeat_timeout=0.1) as c:
        client = c.client()
        client.send(m([SUBMIT, 0, {}]), b"p")
        c.engines[0].recv()
        time.sleep(0.4)
        assert c.coord.stats()["engines"][0]["state"] == "alive"


def test_drain_timeout_reroutes_what_is_left(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin", drain_timeout=0.3) as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), b"p")
        server_rid = um(c.engines[0].recv()[0])[1]
        c.engines[0].send(m([DISCONNECT]))
        assert c.engines[1].recv(2.0) == [m([SUBMIT, server_rid, {}]), b"p"]
        assert c.coord.stats()["engines"][0]["state"] == "gone"


def test_shutdown_ends_requests_in_flight_with_an_error(cluster):
    client = cluster.client(coordkit=True)
    client.send(m([SUBMIT, 0, {}]), b"p")
    cluster.engines[0].recv()
    client.send(m([SHUTDOWN]))
    expect_error(client, 0, ErrorCode.SHUTTING_DOWN)


# -- killed engine processes ---------------------------------------------------------


@pytest.mark.parametrize("heartbeat", [0.1, 0.0], ids=["heartbeats", "no-heartbeats"])
def test_sigkill_engine_mid_run_loses_and_duplicates_nothing(make_cluster, heartbeat):
    # Without heartbeats a dead rank is found only by sending to it: round robin does.
    policy = "least_loaded" if heartbeat else "round_robin"
    n_requests = 300
    options = ("--latency", "0.02", "--batch", "8", "--heartbeat", str(heartbeat))
    with (
        make_cluster(policy=policy, heartbeat_timeout=0.5) as c,
        engine_processes(c.coord.address, 2, *options) as engines,
    ):
        wait_for(lambda: len(c.coord.stats()["engines"]) == 2, timeout=20)
        client = c.client(coordkit=True)
        terminals: dict[int, list[list[bytes]]] = {}
        sent = 0
        killed = False
        deadline = time.monotonic() + 60
        while len(terminals) < n_requests:
            assert time.monotonic() < deadline, f"{n_requests - len(terminals)} lost"
            while sent < n_requests and sent - len(terminals) < 32:
                client.send(m([SUBMIT, sent, {}]), m(list(range(sent % 50))))
                sent += 1
            frames = client.recv(10)
            rid = terminal(frames)
            if rid is not None:
                terminals.setdefault(rid, []).append(frames)
            if not killed and len(terminals) >= 60:
                engines[0].send_signal(signal.SIGKILL)  # requests in flight there
                killed = True
        client.assert_silent(0.3)
        assert all(len(replies) == 1 for replies in terminals.values())
        assert sorted(terminals) == list(range(n_requests))
        finals = sum(um(r[0][0])[0] == REPLY for r in terminals.values())
        assert finals == n_requests  # nothing had produced output: all re-run
        stats = c.coord.stats()
        assert stats["inflight"] == 0
        states = {e["identity"]: e["state"] for e in stats["engines"]}
        assert states == {"engine-0": "gone", "engine-1": "alive"}


# -- fuzz ----------------------------------------------------------------------------

VALID = [
    [m([CONNECT])],
    [m([CONNECT, {"coordkit": 1}])],
    [m([SUBMIT, 1, {"t": 1}]), m([1, 2])],
    [m([SUBMIT_KV, 2, {}, {"k": 1}]), b"p", b"s"],
    [m([REPLY, [[0, False], [1, True]]]), b"a", b"b"],
    [m([PARTIAL, [0]]), b"a"],
    [m([ABORT, 1])],
    [m([RELEASE_KV, 1])],
    [m([PAUSE])],
    [m([SET_GENERATION_EPOCH, 2])],
    [m([DISCONNECT])],
    [m([HEARTBEAT, 1, 2])],
    [m([STATS])],
]


@st.composite
def hostile_message(draw):
    if draw(st.booleans()):
        frames = [draw(st.binary(max_size=40)) for _ in range(draw(st.integers(1, 4)))]
    else:
        frames = [bytearray(f) for f in draw(st.sampled_from(VALID))]
        for _ in range(draw(st.integers(1, 3))):
            frame = frames[draw(st.integers(0, len(frames) - 1))]
            op = draw(st.sampled_from(["flip", "cut", "grow"]))
            if op == "flip" and frame:
                i = draw(st.integers(0, len(frame) - 1))
                frame[i] = draw(st.integers(0, 255))
            elif op == "cut" and frame:
                del frame[draw(st.integers(0, len(frame) - 1)) :]
            else:
                frame += draw(st.binary(min_size=1, max_size=4))
        frames = [bytes(f) for f in frames]
    try:
        shutdown = um(frames[0]) == [SHUTDOWN]
    except Exception:
        shutdown = False
    if shutdown or frames == [b""]:
        frames = [b"\xc1"]  # a SHUTDOWN or a silent engine's registration: disruptive, not bad
    return draw(st.sampled_from(["client", "stranger", "engine"])), frames


class EchoEngines(threading.Thread):
    """Engines that answer every SUBMIT, and send whatever junk they are handed."""

    def __init__(self, cluster: Cluster, n: int):
        super().__init__(daemon=True)
        self.engines = [cluster.add_engine() for _ in range(n)]
        self.junk: queue.Queue[list[bytes]] = queue.Queue()
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for engine in self.engines:
            poller.register(engine.sock, zmq.POLLIN)
        while not self.stop.is_set():
            while not self.junk.empty():
                self.engines[0].send(*self.junk.get())
            for sock in dict(poller.poll(5)):
                frames = sock.recv_multipart()
                submitted = submitted_rid(frames[0])
                if submitted is not None:
                    if submitted % 3 == 0:
                        sock.send_multipart([m([PARTIAL, [submitted]]), b"partial"])
                    sock.send_multipart([m([REPLY, [[submitted, False]]]), frames[1]])


def submitted_rid(meta: bytes) -> int | None:
    """The rid of a SUBMIT (with or without KV) the coordinator forwarded, else None.

    Only the header and the rid, which the coordinator wrote: the sampling params are
    the client's, forwarded as they came (a hostile one's str need not even be UTF-8).
    """
    unpacker = msgpack.Unpacker()
    unpacker.feed(meta)
    if unpacker.read_array_header() < 2 or unpacker.unpack() not in (SUBMIT, SUBMIT_KV):
        return None
    return unpacker.unpack()


def settled(stats: dict) -> bool:
    engines = stats["engines"]
    idle = all(e["pending"] == 0 and e["state"] != "draining" for e in engines)
    return stats["inflight"] == 0 and idle


# The seed fixes the examples drawn: a failure replays from its test id.
@pytest.mark.parametrize("seed", [0])
def test_fuzz_loop_survives_and_keeps_every_promise(make_cluster, seed):
    with make_cluster(max_clients=64) as c:
        echo = EchoEngines(c, 2)
        echo.start()
        good = c.client(coordkit=True)
        hostile = c.client(coordkit=True)
        stranger = RawClient(c.ctx, c.coord.address, b"stranger")
        c.peers.append(stranger)
        next_rid = iter(range(10**9))
        terminals: dict[int, int] = {}

        def drain_good(timeout: float) -> None:
            while good.sock.poll(int(timeout * 1000)):
                rid = terminal(good.sock.recv_multipart())
                if rid is not None:
                    terminals[rid] = terminals.get(rid, 0) + 1

        @hypothesis.seed(seed)
        @settings(
            max_examples=int(os.environ.get("COORDKIT_FUZZ_EXAMPLES", "60")),
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(st.lists(hostile_message(), min_size=1, max_size=40))
        def interleave(messages):
            sent = []
            for sender, frames in messages:
                if sender == "client":
                    hostile.send(*frames)
                elif sender == "stranger":
                    stranger.send(*frames)
                else:
                    echo.junk.put(frames)
                rid = next(next_rid)
                good.send(m([SUBMIT, rid, {"n": rid}]), m([rid]))
                sent.append(rid)
            deadline = time.monotonic() + 10
            while any(rid not in terminals for rid in sent):
                assert echo.is_alive(), "the echo engines' thread died: see its warning"
                assert time.monotonic() < deadline, "a well-formed request got no reply"
                drain_good(0.05)
            hostile.recv_all(0)

        try:
            interleave()
            drain_good(0.3)
            assert all(count == 1 for count in terminals.values()), "a request got two replies"
            # With nothing in flight, no engine owes work or is left draining. (Waited for:
            # stats() read from this thread may fall between two steps of the loop's bookkeeping.)
            wait_for(lambda: settled(c.coord.stats()), timeout=10)
            # Junk comes from engine 0 alone: a DISCONNECT or a lapsed HEARTBEAT in it may have
            # ended that engine, but engine 1 is untouched.
            states = [engine["state"] for engine in c.coord.stats()["engines"]]
            assert states[0] in ("alive", "gone") and states[1:] == ["alive"], states
            good.send(m([SUBMIT, -1, {}]), m([0]))
            deadline = time.monotonic() + 5
            while -1 not in terminals:
                assert time.monotonic() < deadline
                drain_good(0.05)
        finally:
            echo.stop.set()
            echo.join(5)
