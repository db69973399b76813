"""The coordinator speaks the protocol table, on both implementations.

Every peer here is a raw pyzmq DEALER that knows only the published frame
layouts (Megatron-LM's multipart coordinator protocol), never coordkit.
"""

from __future__ import annotations

import random
import threading

import pytest
import zmq

from coordkit import Coordinator
from coordkit.protocol import ErrorCode
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    DISCONNECT,
    ERROR,
    PARTIAL,
    PAUSE,
    RELEASE_KV,
    REPLY,
    RESUME,
    SET_GENERATION_EPOCH,
    SHUTDOWN,
    START_CUDA_PROFILER,
    STATS,
    STATS_REPLY,
    STOP,
    STOP_CUDA_PROFILER,
    SUBMIT,
    SUBMIT_KV,
    SUSPEND,
    UNPAUSE,
    RawClient,
    m,
    um,
    wait_for,
)

SP = {"temperature": 0.7, "num_tokens_to_generate": 8}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_megatron_client_round_trip(make_cluster, transport):
    with make_cluster(n_engines=1, transport=transport) as c:
        if transport == "tcp":
            assert c.coord.address.startswith("tcp://127.0.0.1:")
            assert not c.coord.address.endswith(":0")
        client = c.client()
        client.send(m([SUBMIT, 7, SP]), m([1, 2, 3]))
        meta, prompt = c.engines[0].recv()
        assert meta == m([SUBMIT, 0, SP])  # only the id is rewritten
        assert prompt == m([1, 2, 3])
        body = m({"request_id": 0, "generated_tokens": [4, 5]})
        c.engines[0].send(m([REPLY, [[0, False]]]), body)
        assert client.recv() == [m([REPLY, 7]), body]


def test_sampling_params_bytes_forwarded_verbatim(cluster):
    client = cluster.client()
    # A non-minimal encoding of the params map (map16 for two entries) stays as sent.
    params = b"\xde\x00\x02\xa1a\x01\xa1b\xcb?\xf8\x00\x00\x00\x00\x00\x00"
    client.send(b"\x93\x14\x05" + params, b"p")
    meta, _ = cluster.engines[0].recv()
    assert meta == b"\x93\x14\x00" + params


def test_payload_forwarded_byte_identical_even_if_not_msgpack(cluster):
    client = cluster.client()
    prompt = b"\xc1\xc1\xff" + bytes(range(256)) * 64
    client.send(m([SUBMIT, 1, {}]), prompt)
    assert cluster.engines[0].recv()[1] == prompt
    body = b"\xc1not msgpack either"
    cluster.engines[0].send(m([REPLY, [[0, False]]]), body)
    assert client.recv() == [m([REPLY, 1]), body]


def test_submit_with_kv(cluster):
    client = cluster.client()
    kv_meta = {"src_rank": 3, "blocks": 4}
    blocks = b"\x01\x02\x03\x04"
    client.send(m([SUBMIT_KV, 11, SP, kv_meta]), m([9, 9]), blocks)
    assert cluster.engines[0].recv() == [m([SUBMIT_KV, 0, SP, kv_meta]), m([9, 9]), blocks]
    cluster.engines[0].send(m([REPLY, [[0, False]]]), b"done")
    assert client.recv() == [m([REPLY, 11]), b"done"]


def test_block_hash_frame_is_consumed(cluster):
    client = cluster.client()
    client.send(m([SUBMIT, 1, {}]), m([1] * 64), (12345).to_bytes(8, "little") * 2)
    assert cluster.engines[0].recv() == [m([SUBMIT, 0, {}]), m([1] * 64)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_two_clients_three_engines_thousands_of_requests(make_cluster, transport):
    n_per_client = 1500
    with make_cluster(n_engines=3, transport=transport, policy="round_robin") as c:
        clients = [c.client(), c.client(coordkit=True)]
        rng = random.Random(7)
        for i in range(n_per_client):
            for k, client in enumerate(clients):
                # Overlapping request ids; the prompt says who sent it.
                client.send(m([SUBMIT, i, SP]), m([k, i]))
        by_owner: list[list[tuple[int, bytes]]] = [[], [], []]
        received = 0
        poller = zmq.Poller()
        for engine in c.engines:
            poller.register(engine.sock, zmq.POLLIN)
        while received < 2 * n_per_client:
            ready = dict(poller.poll(5000))
            assert ready, "engines starved"
            for rank, engine in enumerate(c.engines):
                while engine.sock in ready and engine.sock.poll(0):
                    meta, prompt = engine.sock.recv_multipart()
                    header, server_rid, params = um(meta)
                    assert (header, params) == (SUBMIT, SP)
                    by_owner[rank].append((server_rid, prompt))
                    received += 1
        assert [len(items) for items in by_owner] == [1000, 1000, 1000]
        # Each owner replies in shuffled batches that mix both clients.
        for rank, items in enumerate(by_owner):
            rng.shuffle(items)
            for start in range(0, len(items), 7):
                batch = items[start : start + 7]
                entries = [[rid, False] for rid, _ in batch]
                c.engines[rank].send(m([REPLY, entries]), *[p for _, p in batch])
        for k, client in enumerate(clients):
            got = {}
            for _ in range(n_per_client):
                meta, body = client.recv()
                header, rid = um(meta)
                assert header == REPLY
                assert rid not in got
                got[rid] = um(body)
            assert got == {i: [k, i] for i in range(n_per_client)}
        assert c.coord.stats()["inflight"] == 0


def test_batch_split_across_clients(cluster):
    a, b = cluster.client(), cluster.client()
    a.send(m([SUBMIT, 5, {}]), b"pa")
    b.send(m([SUBMIT, 5, {}]), b"pb")
    engine = cluster.engines[0]
    got = [um(engine.recv()[0])[1] for _ in range(2)]
    engine.send(m([REPLY, [[got[1], False], [got[0], False]]]), b"second", b"first")
    assert a.recv() == [m([REPLY, 5]), b"first"]
    assert b.recv() == [m([REPLY, 5]), b"second"]


def test_partials_then_final(cluster):
    client = cluster.client()
    client.send(m([SUBMIT, 3, {}]), b"p")
    engine = cluster.engines[0]
    engine.recv()
    engine.send(m([PARTIAL, [0]]), b"part1")
    engine.send(m([PARTIAL, [0]]), b"part2")
    engine.send(m([REPLY, [[0, False]]]), b"final")
    assert client.recv() == [m([PARTIAL, 3]), b"part1"]
    assert client.recv() == [m([PARTIAL, 3]), b"part2"]
    assert client.recv() == [m([REPLY, 3]), b"final"]
    # A second final for the same id is dropped: a request never gets two.
    engine.send(m([REPLY, [[0, False]]]), b"again")
    client.assert_silent()
    wait_for(lambda: cluster.coord.stats()["counters"]["unknown_request"] == 1)


def test_late_joining_engine_gets_traffic(cluster):
    client = cluster.client()
    client.send(m([SUBMIT, 0, {}]), b"x")
    cluster.engines[0].recv()
    late = cluster.add_engine()
    client.send(m([SUBMIT, 1, {}]), b"y")  # least_loaded: rank 0 holds one, rank 1 none
    assert late.recv() == [m([SUBMIT, 1, {}]), b"y"]


def test_abort_reaches_only_the_owner(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client()
        client.send(m([SUBMIT, 10, {}]), b"a")
        client.send(m([SUBMIT, 11, {}]), b"b")
        assert um(c.engines[0].recv()[0])[1] == 0
        assert um(c.engines[1].recv()[0])[1] == 1
        client.send(m([ABORT, 11]))
        assert c.engines[1].recv() == [m([ABORT, 1])]
        c.engines[0].assert_silent()
        # After an abort the engine still sends a final, which is forwarded.
        c.engines[1].send(m([REPLY, [[1, False]]]), b"aborted")
        assert client.recv() == [m([REPLY, 11]), b"aborted"]


def test_abort_unknown_request_answers_coordkit_client(cluster):
    client = cluster.client(coordkit=True)
    client.send(m([ABORT, 99]))
    header, rid, code, message = um(client.recv()[0])
    assert (header, rid, code) == (ERROR, 99, ErrorCode.UNKNOWN_REQUEST)
    assert "ABORT_REQUEST" in message


def test_release_kv_goes_to_all_engines_untranslated(make_cluster):
    with make_cluster(n_engines=3) as c:
        client = c.client()
        client.send(m([RELEASE_KV, 42]))
        for engine in c.engines:
            assert engine.recv() == [m([RELEASE_KV, 42])]


def test_control_signals_follow_the_state_machine(make_cluster):
    with make_cluster(n_engines=2) as c:
        client = c.client(coordkit=True)

        def signal(*meta, allowed: bool):
            client.send(m(list(meta)))
            for engine in c.engines:
                if allowed:
                    assert engine.recv() == [m(list(meta))]
                else:
                    engine.assert_silent(0.1)
            if not allowed:
                assert um(client.recv()[0])[2] == ErrorCode.INVALID_STATE

        signal(UNPAUSE, allowed=False)  # while running
        signal(SUSPEND, allowed=False)  # while running
        signal(STOP, allowed=False)  # while running
        signal(PAUSE, allowed=True)
        signal(PAUSE, allowed=False)  # again
        signal(SET_GENERATION_EPOCH, 3, allowed=True)  # in any state
        signal(SUSPEND, allowed=True)
        signal(UNPAUSE, allowed=False)  # while suspended
        signal(RESUME, allowed=True)  # -> paused
        signal(SUSPEND, allowed=True)
        signal(STOP, allowed=True)  # from suspended -> running
        signal(START_CUDA_PROFILER, allowed=True)  # profiler signals in any state
        signal(STOP_CUDA_PROFILER, allowed=True)
        signal(PAUSE, allowed=True)
        signal(UNPAUSE, allowed=True)  # -> running
        stats = c.coord.stats()
        assert stats["control_state"] == "running"
        assert stats["counters"]["invalid_control"] == 5


def test_unconnected_client_is_dropped_and_counted(cluster):
    stranger = RawClient(cluster.ctx, cluster.coord.address)
    cluster.peers.append(stranger)
    stranger.send(m([SUBMIT, 1, {}]), b"p")
    wait_for(lambda: cluster.coord.stats()["counters"]["not_connected"] == 1)
    cluster.engines[0].assert_silent()
    stranger.assert_silent()


def test_each_connect_gets_one_ack(cluster):
    client = cluster.client()
    client.send(m([CONNECT]))
    assert client.recv() == [m([CONNECT_ACK])]
    client.assert_silent()
    assert cluster.coord.stats()["counters"]["duplicate_connect"] == 1


def test_disconnect_removes_engine_after_its_finals(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client()
        client.send(m([SUBMIT, 0, {}]), b"a")
        c.engines[0].recv()
        c.engines[0].send(m([DISCONNECT]))
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "draining")
        for rid in range(1, 4):  # no new work for the leaving engine
            client.send(m([SUBMIT, rid, {}]), b"b")
            c.engines[1].recv()
        c.engines[0].assert_silent()
        c.engines[0].send(m([REPLY, [[0, False]]]), b"last")  # flushed after DISCONNECT
        assert client.recv() == [m([REPLY, 0]), b"last"]
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "gone")


def test_least_loaded_spreads_and_follows_load(make_cluster):
    with make_cluster(n_engines=3, policy="least_loaded") as c:
        client = c.client()
        for rid in range(3):
            client.send(m([SUBMIT, rid, {}]), b"p")
        firsts = [um(e.recv()[0])[1] for e in c.engines]
        assert sorted(firsts) == [0, 1, 2]
        c.engines[1].send(m([REPLY, [[firsts[1], False]]]), b"done")
        client.recv()
        client.send(m([SUBMIT, 3, {}]), b"p")  # rank 1 is now the least loaded
        assert um(c.engines[1].recv()[0])[1] == 3


def test_detokenizer_only_for_flagged_entries(make_cluster):
    def detok(tokens):
        return " ".join(f"t{t}" for t in tokens)

    with make_cluster(n_engines=1, detokenizer=detok) as c:
        client = c.client()
        client.send(m([SUBMIT, 0, {}]), b"a")
        client.send(m([SUBMIT, 1, {}]), b"b")
        engine = c.engines[0]
        engine.recv(), engine.recv()
        flagged = m({"generated_tokens": [1, 2], "generated_text": None, "x": 1})
        plain = m({"generated_tokens": [3], "generated_text": None})
        engine.send(m([REPLY, [[0, True], [1, False]]]), flagged, plain)
        assert um(client.recv()[1]) == {
            "generated_tokens": [1, 2],
            "generated_text": "t1 t2",
            "x": 1,
        }
        assert client.recv()[1] == plain


def test_stats_reply_for_coordkit_clients(cluster):
    client = cluster.client(coordkit=True)
    client.send(m([STATS]))
    meta, body = client.recv()
    assert meta == m([STATS_REPLY])
    stats = um(body)
    assert stats["engines"][0]["identity"] == "engine-0"
    assert stats["clients"] == 1


def test_shutdown_ends_serve_forever(make_coordinator):
    ctx = zmq.Context()
    coord = make_coordinator()
    thread = threading.Thread(target=coord.serve_forever)
    thread.start()
    client = RawClient(ctx, coord.address).connect()
    client.send(m([SHUTDOWN]))
    thread.join(5)
    assert not thread.is_alive()
    client.close()
    ctx.term()


def loop_threads() -> list[threading.Thread]:
    """The live threads running a coordinator's loop (start() names them "coordkit")."""
    return [thread for thread in threading.enumerate() if thread.name == "coordkit"]


def test_a_background_loop_returns_to_python_only_to_stop(make_coordinator):
    # Its timers run inside serve(): on a thread that is not the main one (no signal
    # handlers to run) and with no term, serve_forever makes one call, however many
    # ticks pass (a return to Python waits for the GIL).
    coord = make_coordinator(request_timeout=0.1)
    loop, calls = coord._loop, []

    class Counting:
        def serve(self, *args: float) -> bool:
            calls.append(args)
            return bool(loop.serve(*args))

        def __getattr__(self, name: str) -> object:
            return getattr(loop, name)

    coord._loop = Counting()
    coord.start()
    wait_for(lambda: calls)
    threading.Event().wait(0.3)  # ticks go by
    coord.stop()
    assert len(calls) == 1


def test_stop_from_another_thread(make_coordinator):
    coord = make_coordinator()
    coord.start()
    assert loop_threads()  # else the check below would hold whatever stop() did
    coord.stop()
    assert not loop_threads()  # stop() returns once the loop has ended, not just been told to
    with pytest.raises(RuntimeError):
        coord.serve_forever()


def test_a_wait_shorter_than_a_millisecond_still_handles_messages(make_coordinator):
    # serve() waits until its deadline, rounded up to the millisecond: rounded down,
    # the last millisecond before a timer returned at once without polling, and
    # serve_forever spun through it handling nothing.
    ctx = zmq.Context()
    coord = make_coordinator()
    client = RawClient(ctx, coord.address)
    client.send(m([CONNECT]))
    try:
        for _ in range(5000):  # a bounded wait for the CONNECT to arrive
            assert coord._loop.serve(0.0005)
            if client.sock.poll(0):
                break
        assert client.recv() == [m([CONNECT_ACK])]
    finally:
        client.close()
        ctx.term()


def test_a_taken_address_raises_the_bind_error(make_coordinator, impl):
    first = make_coordinator(transport="tcp")
    try:
        with pytest.raises(zmq.ZMQError) as raised:
            Coordinator(first.address, implementation=impl.name)
        assert raised.value.errno == zmq.EADDRINUSE
    finally:
        first.stop()
