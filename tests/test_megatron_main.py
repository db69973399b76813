"""Megatron main's single frames: ``Coordinator(dialect="megatron-core", megatron_version=...)``.

Megatron-LM main (d98e8a6, megatron-core 0.20) keeps 0.19's frames (see
test_megatron_core.py) and adds, as its ``inference_client.py``, its
coordinator's handlers and its engine's ``schedule_requests`` do:

    SUBMIT_REQUEST          client -> coord      m([20, client_rid, prompt, sampling_params,
                                                    multi_modal_data]), always five fields
                            coord -> engine      the same, the server id in it
    ENGINE_REPLY_PARTIAL    engine -> coord      m([22, [partial, ...]])
                            coord -> client      m([22, client_rid, partial])
    ABORT_REQUEST           client -> coord      m([23, client_rid]); to its engine only,
                                                 m([23, server_rid])
    SUBMIT_REQUEST_WITH_KV  client -> coord      m([24, client_rid, prompt, sampling_params,
                                                    kv_meta, src_block_ids]), routed by load
    RELEASE_KV              client -> coord -> every engine: m([25, request_id]), unchanged

Its clients cannot be told from 0.19's by their CONNECT, nor its engines by their
registration: ``megatron_version`` says what the engines speak ("0.19", the
default, or "main"), and a client is main's once it sends main's layouts. The
peers (``MainClient``, ``MainEngine`` in tests/support/peers.py) parse what they
get as main's receive loops do, and a 0.19 peer's frames are held against what
0.19's loops parse (``parse_019_engine``): no peer gets what it would raise on.
Fields go through byte for byte, in encodings ``msgpack.packb`` would not choose.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from coordkit import Coordinator
from coordkit.protocol import ErrorCode
from tests.support.peers import (
    ABORT,
    CONNECT,
    ERROR,
    PARTIAL,
    PAUSE,
    RELEASE_KV,
    REPLY,
    REPLY_BATCH,
    SEND_KV,
    SET_GENERATION_EPOCH,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    MainClient,
    Raw,
    finished_request,
    m,
    main_partial,
    parse_019_engine,
    parse_main_engine,
    splice,
    um,
    wait_for,
)
from tests.test_megatron_core import (
    PARAMS,
    SP,
    TEXT,
    TOKENS,
    counters,
    finished,
    recv_any,
    reply_to,
)

# multi_modal_data as no re-encoding would keep it: {"image": [<8 bytes of a PNG>]}
# as a map16, a str8 key, an array16 and a bin32
IMAGE = b"\x89PNG\r\n\x1a\n"
MULTIMODAL = b"\xde\x00\x01\xd9\x05image\xdc\x00\x01\xc6\x00\x00\x00\x08" + IMAGE
NIL = b"\xc0"  # a text request's multi_modal_data
# kv_meta {"agent": "decode-0", "layout": [2, 4]} and src_block_ids [3, 7, 300], likewise
KV_META = b"\x82\xd9\x05agent\xa8decode-0\xa6layout\xdc\x00\x02\x02\x04"
BLOCKS = b"\xdc\x00\x03\x03\x07\xcd\x01\x2c"
STREAM = {**SP, "streaming": True}


def partial_bytes(server_rid: int, token: int) -> bytes:
    """A partial as no re-encoding would keep it: a map16, "request_id" as an int64."""
    return (
        b"\xde\x00\x02\xd9\x0arequest_id\xd3"
        + server_rid.to_bytes(8, "big", signed=True)
        + b"\xaanew_tokens\xdc\x00\x01\xce"
        + token.to_bytes(4, "big")
    )


@pytest.fixture
def main(make_cluster):
    """``main(**options)``: a running Cluster serving Megatron main's engines, none yet."""
    return lambda **options: make_cluster(
        dialect="megatron-core", megatron_version="main", **options
    )


@pytest.fixture
def v019(make_cluster):
    """``v019(**options)``: one serving 0.19's engines (the default), none yet."""
    return lambda **options: make_cluster(dialect="megatron-core", **options)


def server_rid_of(engine: Any) -> int:
    """The server id of the next SUBMIT a main engine gets."""
    data, _ = engine.recv_parsed()
    assert data[0] in (SUBMIT, SUBMIT_KV)
    return int(data[1])


def assert_failed_final(client: Any, rid: int) -> None:
    """The one terminal reply of a main client's request that coordkit ended: the
    ENGINE_REPLY main's engine sends for a request it cannot take, a finished request
    whose status is FAILED (its client resolves the future or ends the stream with
    it), holding only fields DynamicInferenceRequest.deserialize takes."""
    header, got, body = client.recv_message()
    reply = um(body)
    assert (header, got) == (REPLY, rid)
    assert reply["status"] == "FAILED" and reply["request_id"] == rid
    assert [event["type"] for event in reply["events"]] == ["FAIL"]
    assert reply["events"][0]["payload"] is None  # main's FAIL event has none
    assert reply["events"][0]["timestamp"] is None  # the same bytes from both cores
    assert (reply["generated_tokens"], reply["generated_text"]) == ([], "")
    # _post_deserialize reads these three; the rest are the dataclass's fields
    assert {"status", "sampling_params", "inference_parameters"} <= set(reply)


# -- the layouts ---------------------------------------------------------------------


@pytest.mark.parametrize("multi_modal_data", [NIL, MULTIMODAL], ids=["text", "image"])
@pytest.mark.parametrize("prompt", [TOKENS, TEXT], ids=["tokens", "text"])
def test_five_field_submit_reaches_a_main_engine_as_it_came(main, prompt, multi_modal_data):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        sent = client.submit(7, Raw(prompt), Raw(PARAMS), Raw(multi_modal_data))
        assert sent == b"\x95\x14\x07" + prompt + PARAMS + multi_modal_data
        # read as far as its request id; the rest, multimodal bytes and all, as it came
        _, frame = engine.recv_parsed()
        assert frame == b"\x95\x14\x00" + prompt + PARAMS + multi_modal_data
        engine.reply(finished(0))
        assert client.recv_message() == (REPLY, 7, finished(0))
        client.assert_silent()
        engine.assert_silent()
        assert c.coord.stats()["inflight"] == 0


def test_a_019_client_on_main_engines(main):
    """0.19's four fields go to a main engine as they came (it takes three fields or
    four after the header); the finished request comes back as for 0.19."""
    with main() as c:
        engine = c.add_main_engine()
        client = c.single_frame_client()
        client.submit(3, Raw(TOKENS), Raw(PARAMS))
        _, frame = engine.recv_parsed()
        assert frame == b"\x94\x14\x00" + TOKENS + PARAMS
        engine.reply(finished(0))
        assert client.recv_frame() == reply_to(3, finished(0))


def test_kv_submission_reaches_an_engine_as_it_came(main):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        sent = client.submit_with_kv(3, Raw(TOKENS), Raw(PARAMS), Raw(KV_META), Raw(BLOCKS))
        assert sent == b"\x96\x18\x03" + TOKENS + PARAMS + KV_META + BLOCKS
        data, frame = engine.recv_parsed()
        assert frame == b"\x96\x18\x00" + TOKENS + PARAMS + KV_META + BLOCKS
        assert data[4:] == [{"agent": "decode-0", "layout": [2, 4]}, [3, 7, 300]]
        engine.reply(finished(0))
        assert client.recv_message() == (REPLY, 3, finished(0))
        assert c.coord.stats()["inflight"] == 0


def test_kv_submissions_and_images_are_routed_by_load(main):
    """As main's coordinator: a KV submission goes to the least loaded engine, and a
    request with multimodal data gets no prefix affinity. Under coordkit's prefix
    policy both are priced by their work alone (no hashes), so the least worked
    engine takes them; text requests still follow their prefix."""
    with main(policy="prefix", block_size=4) as c:
        engines = [c.add_main_engine(), c.add_main_engine()]
        client = c.main_client()
        shared = list(range(100, 164))  # 16 full blocks
        client.submit(0, shared + [1], SP)
        first, _ = recv_any(engines)
        client.submit(1, shared + [2], SP)  # the prefix: the same engine, the busier
        assert recv_any(engines)[0] == first
        client.submit_with_kv(2, shared + [3], SP, {"agent": "d"}, [1, 2])  # by load
        assert recv_any(engines)[0] == 1 - first
        client.submit(3, shared + [4], SP, {"image": [IMAGE]})  # by load, not by its prefix
        assert recv_any(engines)[0] == 1 - first
        client.submit(4, shared + [5], SP)  # text again: the prefix
        assert recv_any(engines)[0] == first


# -- streaming -----------------------------------------------------------------------


def test_partials_stream_in_order_and_the_final_comes_last(main):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.submit(1, [1, 2, 3], STREAM)
        server_rid = server_rid_of(engine)
        for token in (10, 11, 12):
            engine.partial(Raw(partial_bytes(server_rid, token)))
        engine.reply(finished(server_rid))
        got = [client.recv_message() for _ in range(4)]
        assert got == [
            (PARTIAL, 1, partial_bytes(server_rid, 10)),
            (PARTIAL, 1, partial_bytes(server_rid, 11)),
            (PARTIAL, 1, partial_bytes(server_rid, 12)),
            (REPLY, 1, finished(server_rid)),
        ]
        client.assert_silent()
        assert (counters(c)["partials"], counters(c)["replies"]) == (3, 1)
        assert c.coord.stats()["inflight"] == 0


def test_one_engine_step_of_partials_for_two_clients(main):
    with main() as c:
        engine = c.add_main_engine()
        clients = [c.main_client(), c.main_client()]
        rids = []
        for client in clients:  # one after the other: two sockets keep no order between them
            client.submit(5, [1], STREAM)  # the same client rid from both
            rids.append(server_rid_of(engine))
        engine.partial(Raw(partial_bytes(rids[1], 21)), main_partial(rids[0], [20]))
        engine.reply(finished(rids[0]), finished(rids[1]))
        assert clients[0].recv_message() == (PARTIAL, 5, m(main_partial(rids[0], [20])))
        assert clients[0].recv_message() == (REPLY, 5, finished(rids[0]))
        assert clients[1].recv_message() == (PARTIAL, 5, partial_bytes(rids[1], 21))
        assert clients[1].recv_message() == (REPLY, 5, finished(rids[1]))
        for client in clients:
            client.assert_silent(0.05)


def test_a_019_client_gets_no_partial(main):
    """0.19's client decodes every header it gets, and has no 22: it would raise."""
    with main() as c:
        engine = c.add_main_engine()
        client = c.single_frame_client()
        client.submit(1, [1, 2], SP)
        server_rid = server_rid_of(engine)
        engine.partial(main_partial(server_rid, [9]))
        engine.reply(finished(server_rid))
        assert client.recv_frame() == reply_to(1, finished(server_rid))
        client.assert_silent()


def test_partials_from_a_coordkit_engine_reach_a_main_client(main):
    with main() as c:
        engine = c.add_coordkit_engine()
        client = c.main_client()
        client.submit(4, Raw(TOKENS), Raw(PARAMS), Raw(NIL))
        # split at the field boundaries, the nil multi_modal_data left out
        assert engine.recv() == [b"\x93\x14\x00" + PARAMS, TOKENS]
        # a main client takes maps: the second partial, an array, is counted and dropped
        engine.send(m([PARTIAL, [0, 0]]), partial_bytes(0, 1), b"\x92\x01\x02")
        engine.send(m([REPLY, [[0, False]]]), finished(0))
        assert client.recv_message() == (PARTIAL, 4, partial_bytes(0, 1))
        assert client.recv_message() == (REPLY, 4, finished(0))
        client.assert_silent()
        assert counters(c)["malformed_entries"] == 1


def test_partials_from_a_main_engine_reach_a_batched_coordkit_client(main):
    with main() as c:
        engine = c.add_main_engine()
        client = c.client(batch=True)
        client.send(m([SUBMIT, 8, STREAM]), m([1, 2]))
        _, frame = engine.recv_parsed()
        assert frame == m([SUBMIT, 0, [1, 2], STREAM])  # four fields, as 0.19's
        engine.partial(Raw(partial_bytes(0, 5)))
        assert client.recv() == [m([REPLY_BATCH, [[8, False]]]), partial_bytes(0, 5)]
        engine.reply(finished(0))
        assert client.recv() == [m([REPLY_BATCH, [[8, True]]]), finished(0)]


# -- aborts ------------------------------------------------------------------------------


def test_abort_reaches_the_owning_engine_only(main):
    with main(policy="round_robin") as c:
        engines = [c.add_main_engine(), c.add_main_engine()]
        client = c.main_client()
        client.submit(0, [1], STREAM)
        client.submit(1, [2], STREAM)
        owner_rid, other_rid = server_rid_of(engines[0]), server_rid_of(engines[1])
        client.abort(0)
        assert engines[0].recv_parsed()[1] == m([ABORT, owner_rid])
        client.abort(0)  # once is enough: the engine still owes its final
        client.abort(99)  # not in flight: dropped, and a Megatron client hears nothing
        for engine in engines:
            engine.assert_silent()
        wait_for(lambda: counters(c)["unknown_request"] == 1)
        # the final still ends it (main's client drops it, having aborted)
        engines[0].reply(finished(owner_rid))
        assert client.recv_message() == (REPLY, 0, finished(owner_rid))
        engines[1].reply(finished(other_rid))
        assert client.recv_message() == (REPLY, 1, finished(other_rid))
        client.assert_silent()
        assert counters(c)["aborts"] == 2 and c.coord.stats()["inflight"] == 0


def test_timeout_aborts_at_a_main_engine(main):
    with main(request_timeout=0.2) as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.submit(0, [1], SP)
        server_rid = server_rid_of(engine)
        assert engine.recv_parsed(5.0)[1] == m([ABORT, server_rid])
        assert_failed_final(client, 0)  # not ERROR(TIMED_OUT): it cannot parse one
        engine.reply(finished(server_rid))  # the engine's late final: unknown, dropped
        wait_for(lambda: counters(c)["unknown_request"] == 1)
        client.assert_silent()
        assert counters(c)["timed_out"] == 1


# -- the KV handoff's other messages ----------------------------------------------------------


def test_release_kv_reaches_every_engine_with_its_id(main):
    with main() as c:
        engines = [c.add_main_engine(), c.add_main_engine(), c.add_coordkit_engine()]
        client = c.main_client()
        client.release_handoff(12345)  # the id as the client knows it: not translated
        for engine in engines:
            assert engine.recv() == [m([RELEASE_KV, 12345])]
        client.assert_silent()
        assert counters(c)["release_kv"] == 1


def test_send_kv_is_not_a_clients(main):
    """SEND_KV (26) tells a prefill engine to push a handoff's KV; main's coordinator
    has no handler for it (its loop raises on the header): counted and dropped."""
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.signal(SEND_KV, 0, [{"agent": "d"}])
        wait_for(lambda: counters(c)["unknown_header"] == 1)
        engine.assert_silent()
        client.assert_silent()


def test_control_signals_reach_main_engines_as_sent(main):
    with main() as c:
        engines = [c.add_main_engine(), c.add_main_engine()]
        client = c.main_client()
        client.signal(PAUSE)
        client.signal(SET_GENERATION_EPOCH, 9)
        for engine in engines:
            assert engine.recv_parsed()[1] == m([PAUSE])
            assert engine.recv_parsed()[1] == m([SET_GENERATION_EPOCH, 9])


# -- 0.19's engines: main's clients served, nothing they cannot parse ------------------------


def test_main_client_on_019_engines(v019):
    """A text request loses its nil multi_modal_data; an abort and a KV release stop
    at the coordinator (0.19's engine raises on 23 and 25); the final comes back."""
    with v019() as c:
        engine = c.add_single_frame_engine()
        client = c.main_client()
        client.submit(7, Raw(TOKENS), Raw(PARAMS), Raw(NIL))
        frame = engine.recv_frame()
        assert frame == b"\x94\x14\x00" + TOKENS + PARAMS
        parse_019_engine(frame)
        client.abort(7)
        client.release_handoff(7)
        engine.assert_silent()
        engine.reply(finished(0))
        assert client.recv_message() == (REPLY, 7, finished(0))
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0


@pytest.mark.parametrize(
    "frame",
    [
        splice(SUBMIT, 7, Raw(TOKENS), Raw(PARAMS), Raw(MULTIMODAL)),  # an image
        splice(SUBMIT, 7, Raw(TOKENS), Raw(PARAMS), {}),  # anything but nil
        splice(SUBMIT_KV, 7, Raw(TOKENS), Raw(PARAMS), Raw(KV_META), Raw(BLOCKS)),
    ],
    ids=["image", "empty-map", "kv"],
)
def test_what_a_019_engine_cannot_take_is_refused(v019, frame, caplog):
    """Refused, counted and logged, and ended with the FAILED final main's client
    takes (not ERROR: it cannot parse one); the request is not in flight."""
    with v019() as c:
        engine = c.add_single_frame_engine()
        client = c.main_client()
        client.send(frame)
        assert_failed_final(client, 7)
        assert counters(c)["malformed"] == 1 and counters(c)["errors_sent"] == 1
        assert "a Megatron main client's request 7 failed" in caplog.text
        engine.assert_silent()
        client.assert_silent()
        assert c.coord.stats()["inflight"] == 0
        client.submit(8, [1], SP)  # and the client goes on
        parse_019_engine(engine.recv_frame())


def test_a_partial_from_an_engine_taken_for_019s_is_dropped(v019, caplog):
    with v019() as c:
        engine = c.add_single_frame_engine()
        client = c.main_client()
        client.submit(1, [1], STREAM)
        server_rid = um(engine.recv_frame())[1]
        engine.send(m([PARTIAL, [main_partial(server_rid, [3])]]))
        wait_for(lambda: counters(c)["unknown_header"] == 1)
        client.assert_silent()
        assert "megatron_version='main'" in caplog.text
        engine.reply(finished(server_rid))
        assert client.recv_message() == (REPLY, 1, finished(server_rid))


def test_a_main_clients_request_no_engine_takes_fails(main):
    """No engine registered: main's coordinator would exit its loop; coordkit ends the
    request with its one terminal reply, the FAILED final, and goes on."""
    with main() as c:
        client = c.main_client()
        client.submit(4, [1], STREAM)
        assert_failed_final(client, 4)
        assert counters(c)["no_engines"] == 1 and c.coord.stats()["inflight"] == 0
        engine = c.add_main_engine()
        client.submit(5, [1], SP)
        assert server_rid_of(engine) >= 0
        client.assert_silent()


# -- a removed engine (#6025) ------------------------------------------------------------


def test_a_disconnected_engines_late_replies_are_routed(main):
    """Main's coordinator routes the finals of an engine it removed (after DISCONNECT)
    and drops its partials; coordkit routes both while the engine drains (a stream
    gets every token), and gives it no new work."""
    with main(policy="round_robin") as c:
        leaving, staying = c.add_main_engine(), c.add_main_engine()
        client = c.main_client()
        client.submit(0, [1], STREAM)
        server_rid = server_rid_of(leaving)
        leaving.disconnect()
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "draining")
        client.submit(1, [2], SP)
        server_rid_of(staying)
        leaving.partial(Raw(partial_bytes(server_rid, 4)))
        leaving.reply(finished(server_rid))
        assert client.recv_message() == (PARTIAL, 0, partial_bytes(server_rid, 4))
        assert client.recv_message() == (REPLY, 0, finished(server_rid))
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "gone")
        leaving.reply(finished(server_rid, tag="again"))  # after its last: unknown
        wait_for(lambda: counters(c)["unknown_request"] == 1)
        client.assert_silent()


def test_an_unreachable_engines_requests_resent_as_they_came(main):
    """An engine that cannot be reached is gone at once (main's coordinator keeps its
    requests waiting for a final that a dead engine never sends): what produced
    nothing is re-sent to another main engine byte for byte, and what streamed goes on
    there from the tokens its partials carried (main's "new_tokens"): its prompt
    extended by them, its budget reduced, and its final continuing the stream."""
    with main(policy="round_robin") as c:
        victim, survivor = c.add_main_engine(), c.add_main_engine()
        client = c.main_client()
        held = client.submit(0, Raw(TOKENS), Raw(PARAMS), Raw(MULTIMODAL))
        assert victim.recv_frame() == b"\x95\x14\x00" + held[3:]
        client.submit(1, [5], SP)
        answered = server_rid_of(survivor)
        client.submit(2, [6], STREAM)
        streamed = server_rid_of(victim)
        victim.partial(main_partial(streamed, [1]))
        assert client.recv_message()[:2] == (PARTIAL, 2)
        victim.close()
        # a send to it fails once its connection is gone: probe until one does
        probes, deadline = 100, time.monotonic() + 30
        while c.coord.stats()["engines"][0]["state"] != "gone":
            assert time.monotonic() < deadline, "the closed engine was never found gone"
            client.submit(probes, [probes], SP)
            probes += 1
            time.sleep(0.02)
        frames = survivor.recv_frames(0.5)
        # the held request, as it came (its server id too), and no duplicate of anything
        assert frames.count(b"\x95\x14\x00" + held[3:]) == 1
        [moved] = [um(f) for f in frames if um(f)[1] == streamed]
        budget = STREAM["num_tokens_to_generate"] - 1
        assert moved[2:4] == [[6, 1], {**STREAM, "num_tokens_to_generate": budget}]
        for server_rid in [answered, *(um(f)[1] for f in frames if um(f)[1] != streamed)]:
            survivor.reply(finished(server_rid))
        survivor.reply(finished_request(streamed))  # generated_tokens [7, 8, 9]
        replies = {}
        for _ in range(len(frames) + 1):
            _, rid, body = client.recv_message()
            assert rid not in replies  # one final each
            replies[rid] = um(body)
        assert {0, 1, 2} <= set(replies)
        assert replies[2]["generated_tokens"] == [1, 7, 8, 9]  # the token streamed, the rest
        client.assert_silent(0.2)
        stats = c.coord.stats()
        assert stats["counters"]["engine_failed"] == 0 and stats["counters"]["rerouted"] >= 1
        assert stats["counters"]["migrated"] == 1 and stats["inflight"] == 0


# -- mixed pools -----------------------------------------------------------------------------


def test_main_client_to_a_coordkit_engine(main):
    with main() as c:
        engine = c.add_coordkit_engine()
        client = c.main_client()
        client.submit_with_kv(2, Raw(TOKENS), Raw(PARAMS), Raw(KV_META), Raw(BLOCKS))
        # coordkit's multipart KV submission: [24, rid, params, kv_meta], prompt, blocks
        assert engine.recv() == [b"\x94\x18\x00" + PARAMS + KV_META, TOKENS, BLOCKS]
        client.submit(3, Raw(TEXT), Raw(PARAMS), Raw(MULTIMODAL))  # no room for an image
        assert_failed_final(client, 3)
        assert counters(c)["malformed"] == 1
        engine.assert_silent()
        client.assert_silent()
        engine.send(m([REPLY, [[0, False]]]), finished(0))
        assert client.recv_message() == (REPLY, 2, finished(0))


def test_coordkit_kv_submission_goes_to_coordkit_engines_only(main):
    with main() as c:
        engine = c.add_main_engine()
        client = c.client(coordkit=True)
        client.send(m([SUBMIT_KV, 5, SP, {"agent": "d"}]), m([1]), m([3]))
        header, rid, code, _ = um(client.recv()[0])
        assert (header, rid, code) == (ERROR, 5, ErrorCode.MALFORMED)
        engine.assert_silent()


def test_a_mixed_pool(main):
    """A main engine and a batched coordkit engine; a main client, a 0.19 client and a
    batched coordkit client: each request in the format of the engine it reaches,
    each reply in the format of its client."""
    with main(policy="round_robin") as c:
        megatron = c.add_main_engine()
        coordkit = c.add_coordkit_engine(batch=True)
        main_client, old_client = c.main_client(), c.single_frame_client()
        batched = c.client(batch=True)
        main_client.submit(0, Raw(TOKENS), Raw(PARAMS), Raw(NIL))  # -> megatron, as it came
        assert megatron.recv_parsed()[1] == b"\x95\x14\x00" + TOKENS + PARAMS + NIL
        main_client.submit(1, Raw(TEXT), Raw(PARAMS), Raw(NIL))  # -> coordkit, split
        assert coordkit.recv() == [b"\x93\x14\x01" + PARAMS, TEXT]
        old_client.submit(0, Raw(TEXT), Raw(PARAMS))  # -> megatron, as it came
        assert megatron.recv_parsed()[1] == b"\x94\x14\x02" + TEXT + PARAMS
        entries = b"".join(b"\x93" + bytes([rid]) + PARAMS + b"\xc2" for rid in (5, 6))
        batched.send(b"\x92" + m(SUBMIT_BATCH) + b"\x92" + entries, TOKENS, TEXT)
        # 5 -> coordkit (its batch of one), 6 -> megatron as four fields
        assert coordkit.recv() == [b"\x92" + m(SUBMIT_BATCH) + b"\x91\x92\x03" + PARAMS, TOKENS]
        assert megatron.recv_parsed()[1] == b"\x94\x14\x04" + TEXT + PARAMS
        # one step of the main engine: partials and finals for three formats of client
        megatron.partial(*(Raw(partial_bytes(rid, 1)) for rid in (0, 2, 4)))
        assert main_client.recv_message() == (PARTIAL, 0, partial_bytes(0, 1))
        assert batched.recv() == [m([REPLY_BATCH, [[6, False]]]), partial_bytes(4, 1)]
        megatron.reply(*(Raw(finished(rid)) for rid in (4, 2, 0)))
        assert batched.recv() == [m([REPLY_BATCH, [[6, True]]]), finished(4)]
        assert old_client.recv_frame() == reply_to(0, finished(2))  # its partial dropped
        assert main_client.recv_message() == (REPLY, 0, finished(0))
        # the coordkit engine's batch: a partial and finals
        coordkit.send(m([PARTIAL, [1]]), partial_bytes(1, 7))
        assert main_client.recv_message() == (PARTIAL, 1, partial_bytes(1, 7))
        coordkit.send(m([REPLY, [[3, False], [1, False]]]), finished(3), finished(1))
        assert batched.recv() == [m([REPLY_BATCH, [[5, True]]]), finished(3)]
        assert main_client.recv_message() == (REPLY, 1, finished(1))
        for peer in (megatron, coordkit, main_client, old_client, batched):
            peer.assert_silent(0.05)
        assert c.coord.stats()["inflight"] == 0


# -- what the coordinator does to a reply -------------------------------------------------


def test_detokenizer_fills_finals_and_leaves_partials(main):
    """Main's coordinator detokenizes every final (generated_text from generated_tokens)
    and forwards partials untouched (its client detokenizes them); the rest of the map,
    main's uid and disaggregated_params among it, keeps its values."""
    with main(detokenizer=lambda tokens: "-".join(map(str, tokens))) as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.submit(1, [5], STREAM)
        server_rid = server_rid_of(engine)
        engine.partial(Raw(partial_bytes(server_rid, 8)))
        extra = {"uid": "req-1f", "disaggregated_params": {"blocks": [3, 4], "raw": b"\x00\xff"}}
        engine.reply(finished_request(server_rid, [5], generated_tokens=[7, 8], **extra))
        assert client.recv_message() == (PARTIAL, 1, partial_bytes(server_rid, 8))
        header, rid, body = client.recv_message()
        assert (header, rid) == (REPLY, 1)
        expected = finished_request(server_rid, [5], generated_tokens=[7, 8], **extra)
        assert um(body) == expected | {"generated_text": "7-8"}
        assert counters(c)["detokenized"] == 1


def test_reply_fields_byte_for_byte_without_a_detokenizer(main):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.submit(1, [5], SP)
        server_rid = server_rid_of(engine)
        # uid as a str8, disaggregated_params a map16 holding a bin8
        body = (
            b"\x83\xd9\x0arequest_id"
            + m(server_rid)
            + b"\xa3uid\xd9\x06req-1f\xb4disaggregated_params\xde\x00\x01\xa3raw\xc4\x02\x00\xff"
        )
        engine.reply(Raw(body))
        assert client.recv_message() == (REPLY, 1, body)


# -- malformed input ---------------------------------------------------------------------

BAD_FROM_MAIN_CLIENT = [
    # (frame, the counter that counts it); none is answered
    (m([SUBMIT_KV, 7, "p", SP]), "malformed"),  # a KV submission has six fields
    (m([SUBMIT_KV, 7, "p", SP, {}, [1], 2]), "malformed"),
    (m([SUBMIT, 7, "p", SP, None, 1]), "malformed"),  # a SUBMIT four or five
    (m([SUBMIT, 7, "p"]), "malformed"),
    (m([ABORT]), "malformed"),
    (m([ABORT, "7"]), "malformed"),
    (m([RELEASE_KV]), "malformed"),
    (m([RELEASE_KV, 1, 2]), "malformed"),
    (m([PARTIAL, 7, {}]), "unknown_header"),  # a reply is not a client's to send
]


@pytest.mark.parametrize(("frame", "counter"), BAD_FROM_MAIN_CLIENT)
def test_malformed_from_a_main_client_counted_never_answered(main, frame, counter):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        before = c.coord.stats()
        client.send(frame)
        wait_for(lambda: counters(c) != before["counters"])
        moved = {k: n - before["counters"][k] for k, n in counters(c).items()}
        assert {k: n for k, n in moved.items() if n} == {counter: 1}
        client.assert_silent(0.05)
        engine.assert_silent(0.05)
        client.submit(1000, [1], SP)
        assert server_rid_of(engine) == 0


def test_a_bad_body_bound_for_a_main_engine_goes_unread(main):
    """As for 0.19: between peers of one layout the rest goes on as it came."""
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        frame = m([SUBMIT, 7, b"bin", SP, None])
        client.send(frame)
        assert engine.recv_frame() == b"\x95\x14\x00" + frame[3:]


BAD_PARTIALS = [
    ([m([PARTIAL, {}])], "malformed"),
    ([m([PARTIAL, [{"request_id": 0}]]), b"extra"], "malformed"),
    ([m([PARTIAL, [[0, 1]]])], "malformed_entries"),  # not a map
    ([m([PARTIAL, [{"request_id": "0"}]])], "malformed_entries"),
    ([m([PARTIAL, [{"request_id": 12345}]])], "unknown_request"),
]


@pytest.mark.parametrize(("frames", "counter"), BAD_PARTIALS)
def test_malformed_partials_from_a_main_engine(main, frames, counter):
    with main() as c:
        engine = c.add_main_engine()
        client = c.main_client()
        client.submit(0, [1], STREAM)
        assert server_rid_of(engine) == 0
        wait_for(lambda: counters(c)["submitted"] == 1)
        before = counters(c)
        engine.send(*frames)
        wait_for(lambda: counters(c) != before)
        moved = {k: n - before[k] for k, n in counters(c).items()}
        assert {k: n for k, n in moved.items() if n} == {counter: 1}
        client.assert_silent(0.05)
        engine.reply(finished(0))  # the request is still there
        assert client.recv_message() == (REPLY, 0, finished(0))


# -- the option ----------------------------------------------------------------------------


def test_megatron_version_is_checked(impl, tmp_path):
    address = f"ipc://{tmp_path}/c.sock"
    with pytest.raises(ValueError, match="megatron_version must be one of 0.19, main"):
        Coordinator(address, dialect="megatron-core", megatron_version="0.20")
    with pytest.raises(ValueError, match="needs dialect='megatron-core'"):
        Coordinator(address, megatron_version="main")


def test_main_client_is_told_by_its_five_fields(v019):
    """Before its first SUBMIT a main client is taken for 0.19's (their CONNECTs are
    the same); a main client's first SUBMIT has five fields: from then on it is main's."""
    with v019() as c:
        engine = c.add_coordkit_engine()
        client = MainClient(c.ctx, c.coord.address)
        c.peers.append(client)
        client.send(m([CONNECT]))
        client.recv_frame()
        client.submit(0, [1], STREAM)
        assert engine.recv() == [m([SUBMIT, 0, STREAM]), m([1])]
        engine.send(m([PARTIAL, [0]]), m({"request_id": 0, "new_tokens": [2]}))
        assert client.recv_message()[:2] == (PARTIAL, 0)


def test_no_frame_a_peer_would_raise_on(main, v019):
    """A round of every message a main client sends, against each version's engines:
    every frame each engine gets parses as that engine parses it."""
    for make, parse, engines_of in (
        (main, parse_main_engine, "add_main_engine"),
        (v019, parse_019_engine, "add_single_frame_engine"),
    ):
        with make(policy="round_robin") as c:
            engines = [getattr(c, engines_of)() for _ in range(2)]
            client = c.main_client()
            for rid in range(4):
                client.submit(rid, [rid] * 3, STREAM if rid % 2 else SP)
            client.submit_with_kv(9, [1], SP, {"agent": "d"}, [1])
            client.abort(1)
            client.release_handoff(9)
            client.signal(PAUSE)
            wait_for(lambda c=c: counters(c)["control"] == 1)
            got = [f for engine in engines for f in engine.recv_frames(0.2)]
            assert len(got) >= 5
            for frame in got:
                parse(frame)
            assert [um(f)[0] for f in got].count(PAUSE) == 2


# -- the queue, for single frames ----------------------------------------------------------


@pytest.mark.parametrize("version", ["0.19", "main"])
def test_single_frames_wait_in_the_queue_and_go_as_they_came(make_cluster, version):
    """Past an engine's capacity a Megatron client's single frames wait at the
    coordinator, and leave as they came once a final frees room (the frame kept whole)."""
    options = {} if version == "0.19" else {"megatron_version": "main"}
    with make_cluster(dialect="megatron-core", max_inflight_per_engine=1, **options) as c:
        engine = c.add_main_engine() if version == "main" else c.add_single_frame_engine()
        client = c.main_client() if version == "main" else c.single_frame_client()
        fields = [Raw(TOKENS), Raw(PARAMS)] + ([Raw(NIL)] if version == "main" else [])
        for rid in range(3):
            client.submit(rid, *fields)
        wait_for(lambda: c.coord.stats()["queue"]["depth"] == 2)
        head = b"\x95\x14" if version == "main" else b"\x94\x14"
        for expected in range(3):
            frame = engine.recv_frame()
            server_rid = msgpack.unpackb(frame)[1]
            assert frame == head + m(server_rid) + b"".join(f.data for f in fields)
            engine.reply(finished(server_rid))
            if version == "main":
                assert client.recv_message() == (REPLY, expected, finished(server_rid))
            else:
                assert client.recv_frame() == reply_to(expected, finished(server_rid))
        assert c.coord.stats()["inflight"] == 0
