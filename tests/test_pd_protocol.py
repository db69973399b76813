"""The messages of disaggregated prefill/decode (P/D): PR #6675's layouts, byte for
byte, coordkit's HANDOFF, a coordkit engine's role in its ENGINE_HELLO and the
ENGINE_ACK that grants it."""

from __future__ import annotations

import msgpack
import pytest

from coordkit import _pd, protocol
from coordkit.protocol import EngineRole, ErrorCode, Header, ProtocolError
from tests.support.peers import (
    ENGINE_ACK,
    ENGINE_HELLO,
    ERROR,
    HANDOFF,
    KV_READ_DONE,
    KV_TRANSFER_READY,
    REGISTER_ROLE,
    REGISTER_ROLE_ACK,
    RELEASE_KV,
    REQUEST_ABORTED,
    REQUEST_ERROR,
    SEND_KV,
    SUBMIT_BATCH,
    SUBMIT_KV,
    RawClient,
    RawEngine,
    um,
    wait_for,
)


def m(obj):
    return msgpack.packb(obj, use_bin_type=True)


SP = {"temperature": 0.5}
META = [{"tokens_per_block": 16, "request_capacity": 4}]

LAYOUTS = [
    (
        protocol.REGISTER_ROLE,
        ("prefill", "nixl", META),
        [m([REGISTER_ROLE, "prefill", "nixl", META])],
    ),
    (protocol.REGISTER_ROLE_ACK, (), [m([REGISTER_ROLE_ACK])]),
    (protocol.ROLE_REFUSED, ("no",), [m([REQUEST_ERROR, "no"])]),
    (protocol.REQUEST_ERROR, (5, "failed", False), [m([REQUEST_ERROR, 5, "failed", False])]),
    (protocol.REQUEST_ABORTED, (5, True), [m([REQUEST_ABORTED, 5, True])]),
    (protocol.KV_TRANSFER_READY, (5, 3), [m([KV_TRANSFER_READY, 5, 3])]),
    (protocol.KV_READ_DONE, (5,), [m([KV_READ_DONE, 5])]),
    (protocol.SEND_KV, (5, META, 2), [m([SEND_KV, 5, META, 2])]),
    (protocol.SEND_KV, (5, META), [m([SEND_KV, 5, META])]),  # main's: no cached prefix
    (
        protocol.SINGLE_SUBMIT_REQUEST_WITH_KV,
        (5, [1, 2], SP, {"k": 1}, [7, 8]),
        [m([SUBMIT_KV, 5, [1, 2], SP, {"k": 1}, [7, 8]])],
    ),
]


@pytest.mark.parametrize(("spec", "values", "frames"), LAYOUTS)
def test_pack_gives_pr_6675s_layout_and_parse_inverts_it(spec, values, frames):
    assert spec.pack(*values) == frames
    assert spec.parse(frames) == spec.message_type(*values)


def test_the_headers_are_6675s_and_coordkits_own_apart():
    assert {h.name: int(h) for h in Header if 2 <= h <= 31 and h not in range(20, 26)} == {
        "REGISTER_ROLE_ACK": 2,
        "SEND_KV": 26,
        "REGISTER_ROLE": 27,
        "KV_READ_DONE": 28,
        "REQUEST_ERROR": 29,
        "KV_TRANSFER_READY": 30,
        "REQUEST_ABORTED": 31,
    }
    assert Header.HANDOFF == HANDOFF == 104


def test_send_kv_takes_an_optional_last_field():
    assert protocol.SEND_KV.parse([m([SEND_KV, 5, META])]).cached_prefix_blocks is None
    with pytest.raises(ProtocolError, match="expected 2-3 metadata fields, got 4"):
        protocol.SEND_KV.parse([m([SEND_KV, 5, META, 2, 9])])
    with pytest.raises(ProtocolError, match="'cached_prefix_blocks' must be int") as error:
        protocol.SEND_KV.parse([m([SEND_KV, 5, META, "2"])])
    assert error.value.rid == 5
    with pytest.raises(ValueError, match="without payload frames"):
        protocol.MessageSpec(
            "X", Header.SEND_KV, [], ["frame"], optional_fields=[protocol.Field("f")]
        )


def test_handoff_is_a_batch_with_one_block_frame_per_entry():
    blocks = [m([3, 4]), m([9])]
    frames = protocol.HANDOFF.pack([(5, {"a": 1}), (6, None)], blocks)
    assert frames == [m([HANDOFF, [[5, {"a": 1}], [6, None]]]), *blocks]
    assert protocol.HANDOFF.parse(frames) == ([[5, {"a": 1}], [6, None]], blocks)
    with pytest.raises(ProtocolError, match="2 entries but 1 payload frames"):
        protocol.HANDOFF.parse(frames[:2])


def test_the_request_error_refusal_and_report_share_a_header():
    """#6675 sends three layouts under 29: a refusal [29, reason], an engine's report
    and a client's terminal error [29, rid, reason, source_safe]; each spec takes its own."""
    with pytest.raises(ProtocolError):
        protocol.REQUEST_ERROR.parse([m([REQUEST_ERROR, "refused"])])
    with pytest.raises(ProtocolError):
        protocol.ROLE_REFUSED.parse([m([REQUEST_ERROR, 5, "failed", True])])


def hello(**fields):
    return [m([ENGINE_HELLO, {"coordkit": 1, "ack": 1, **fields}])]


@pytest.mark.parametrize(
    ("fields", "role", "capacity", "domain", "transfer"),
    [
        ({}, EngineRole.AGGREGATED, 0, "", None),
        ({"capacity": 9}, EngineRole.AGGREGATED, 9, "", None),  # no role: its capacity
        ({"role": "prefill", "capacity": 4}, EngineRole.PREFILL, 4, "", None),
        (
            {"role": "decode", "capacity": 1, "domain": "rack-2"},
            EngineRole.DECODE,
            1,
            "rack-2",
            None,
        ),
        (
            {"role": "both", "capacity": 8, "transfer": {"rank": 3}},
            EngineRole.BOTH,
            8,
            "",
            {"rank": 3},
        ),
    ],
)
def test_a_coordkit_engine_says_its_role_in_its_hello(fields, role, capacity, domain, transfer):
    said = protocol.parse_engine_hello(hello(**fields))
    assert (said.role, said.capacity, said.domain, said.transfer) == (
        role,
        capacity,
        domain,
        transfer,
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"role": "router", "capacity": 1}, "unknown role 'router'"),
        ({"role": 1, "capacity": 1}, "unknown role 1"),
        ({"role": "decode"}, "a decode engine's capacity must be an int >= 1"),
        ({"role": "decode", "capacity": 0}, "capacity must be an int >= 1"),
        ({"role": "decode", "capacity": True}, "capacity must be an int >= 1"),
        ({"role": "prefill", "capacity": 2, "domain": 3}, "domain must be a str"),
    ],
)
def test_a_role_that_is_not_one_is_refused(fields, reason):
    """Taken for an aggregated engine, a decode engine would be sent prompts."""
    with pytest.raises(ProtocolError, match=reason):
        protocol.parse_engine_hello(hello(**fields))


def test_a_role_is_a_coordkit_engines():
    frames = [m([ENGINE_HELLO, {"role": "prefill", "capacity": 2}])]
    assert protocol.parse_engine_hello(frames).role == EngineRole.AGGREGATED


def test_engine_ack_grants_the_role_when_the_coordinator_runs_pd():
    said = protocol.parse_engine_hello(hello(batch=1, role="decode", capacity=2))
    assert protocol.engine_ack(said, 7) == [m([ENGINE_ACK, {"batch": 1}])]
    assert protocol.engine_ack(said, 7, roles=True) == [
        m([ENGINE_ACK, {"batch": 1, "role": "decode"}])
    ]
    aggregated = protocol.parse_engine_hello(hello())
    assert protocol.engine_ack(aggregated, 7, roles=True) == [m([ENGINE_ACK, {}])]
    assert [protocol.role_name(r) for r in EngineRole] == [
        "aggregated",
        "prefill",
        "decode",
        "both",
    ]
    assert protocol.ROLE_NAMES == {r: EngineRole[r.upper()] for r in ("prefill", "decode", "both")}


@pytest.mark.parametrize("rid", [0, 7, 2**63 - 1])
def test_the_codecs_read_the_decode_hop_a_coordkit_engine_is_sent(impl, rid):
    """[24, rid, params, kv_meta], the prompt and src_block_ids: what the engine cores'
    codec reads of a submission, the rid in place."""
    meta = protocol.SUBMIT_REQUEST_WITH_KV.pack(rid, SP, {"k": 1}, b"p", m([1, 2]))[0]
    header, length, got, offset = impl.codec.read_submit(meta)
    assert (header, length, got) == (SUBMIT_KV, 4, rid)
    assert meta[offset:] == m(SP) + m({"k": 1})


@pytest.mark.parametrize("n_keys", [0, 14, 15, 65534, 65535])
def test_a_coordkit_engines_hops_are_the_reference_frames(make_cluster, n_keys):
    """Hop 1, hop 2 and the release a coordkit prefill and decode are sent, byte for
    byte as _pd writes them, on both loop cores; the client's params cross each width
    of a map's head once the hop's override is spliced in (fixmap, map16, map32); the
    prefill's kv_meta reaches the decode as it came."""
    params = {f"k{i}": i for i in range(n_keys)}
    prompt = list(range(40))
    with make_cluster(pd_mode="always") as c:
        prefill, decode = (
            RawEngine(c.ctx, c.coord.address, role.encode()) for role in ("prefill", "decode")
        )
        c.peers += [prefill, decode]
        for engine, role in ((prefill, "prefill"), (decode, "decode")):
            engine.register().hello(role=role, capacity=4, transfer={"t": 1})
        wait_for(lambda: len(c.coord.stats().get("pd", {}).get("engines", ())) == 2)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(coordkit=True)
        c.peers.append(client)
        client.send(m([20, 1, params]), m(prompt))
        hop1 = prefill.recv()
        rid = um(hop1[0])[1]
        assert hop1 == _pd.prefill_frames(False, rid, m(prompt), m(params), False)
        # kv_meta as msgpack would not write it ({"k": 1.0} as map16 and float32): it
        # reaches the decode as it came, not re-encoded
        kv_meta = b"\xde\x00\x01\xa1k\xca\x3f\x80\x00\x00"
        prefill.send(b"\x92" + m(HANDOFF) + b"\x91\x92" + m(rid) + kv_meta, m([3, 4]))
        hop2 = decode.recv()
        assert hop2 == _pd.decode_frames(False, rid, m(prompt), m(params), kv_meta, m([3, 4]))
        decode.send(m([KV_READ_DONE, rid]))
        assert prefill.recv() == [protocol.rids_message(RELEASE_KV, rid)]
        decode.send(m([21, [[rid, True]]]), m({"text": "x"}))
        assert client.recv() == [m([21, 1]), m({"text": "x"})]  # the final: no flag


def pd_engines(c, capacity=4, **features):
    """A coordkit prefill and decode registered with ``c``'s coordinator."""
    prefill, decode = (
        RawEngine(c.ctx, c.coord.address, role.encode()) for role in ("prefill", "decode")
    )
    c.peers += [prefill, decode]
    for engine, role in ((prefill, "prefill"), (decode, "decode")):
        engine.register().hello(role=role, capacity=capacity, transfer={"t": 1}, **features)
        if features.get("ack"):
            assert um(engine.recv()[0])[0] == ENGINE_ACK
    wait_for(lambda: len(c.coord.stats().get("pd", {}).get("engines", ())) == 2)
    return prefill, decode


def test_a_client_batchs_hops_go_to_a_batched_prefill_as_one_batch(make_cluster):
    """The prefill hops of a client's SUBMIT_BATCH leave as one ENGINE_SUBMIT_BATCH to a
    prefill granted batches, each entry's params with the override spliced in (fixmap
    to map16 at 15 keys), its prompt, its trailer to a rebuild engine; the requests go
    on to their finals."""
    params = [{}, {f"k{i}": i for i in range(15)}, SP]
    with make_cluster(pd_mode="always") as c:
        prefill, decode = pd_engines(c, batch=1, rebuild=1, base=1, ack=1)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(batch=True)
        c.peers.append(client)
        client.send(
            m([SUBMIT_BATCH, [[i, p, False] for i, p in enumerate(params)]]),
            *(m([i, 1, 2]) for i in range(3)),
        )
        batch = prefill.recv()
        head = um(batch[0])
        assert head[0] == SUBMIT_BATCH and len(head[1]) == 3
        rids = [rid for rid, _ in head[1]]
        entries = b"".join(
            b"\x92" + m(rid) + _pd.with_keys(m(p), {protocol.HANDOFF_KEY: True})
            for rid, p in zip(rids, params, strict=True)
        )
        assert batch[0] == b"\x92" + m(SUBMIT_BATCH) + b"\x93" + entries
        for i in range(3):
            assert batch[1 + 2 * i] == m([i, 1, 2])
            assert batch[2 + 2 * i] == protocol.pack_trailer(i, None, False)
        prefill.send(m([HANDOFF, [[rid, {"b": 1}] for rid in rids]]), *(m([rid]) for rid in rids))
        for rid, p in zip(rids, params, strict=True):
            hop2 = decode.recv()
            assert hop2[:3] == _pd.decode_frames(
                False, rid, m([rids.index(rid), 1, 2]), m(p), m({"b": 1}), m([rid])
            )
        decode.send(m([21, [[rid, True] for rid in rids]]), *(m({"t": rid}) for rid in rids))
        finals = [um(f[0]) for f in client.recv_all()]
        assert sorted(i for f in finals for i, _ in f[1]) == [0, 1, 2]


def test_a_decodes_reads_of_a_step_release_in_one_message_per_prefill(make_cluster):
    """A coordkit decode's KV_READ_DONE naming several requests: their prefill gets one
    RELEASE_KV naming them, before the hop its freed seat takes; a rid of no read of
    that decode is skipped, and a malformed one drops the message whole."""
    with make_cluster(pd_mode="always") as c:
        prefill, decode = pd_engines(c, capacity=2)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(coordkit=True)
        c.peers.append(client)
        for rid in range(3):
            client.send(m([20, rid, SP]), m([rid, 1]))
        rids = [um(prefill.recv()[0])[1] for _ in range(2)]  # the third waits for a seat
        prefill.send(m([HANDOFF, [[rid, {"b": 1}] for rid in rids]]), m([1]), m([2]))
        for _ in rids:
            decode.recv()
        decode.send(m([KV_READ_DONE, rids[0], "x"]))  # malformed: nothing released
        assert not prefill.sock.poll(300)
        decode.send(m([KV_READ_DONE, rids[0], 999, rids[1]]))
        assert prefill.recv() == [protocol.rids_message(RELEASE_KV, *rids)]
        third = prefill.recv()
        assert um(third[0])[0] == 20 and third[1] == m([2, 1])
        assert c.coord.stats()["pd"]["counts"]["pins_released"] == 2


@pytest.mark.parametrize("batched", [False, True])
def test_a_pd_request_whose_params_are_not_a_map_ends_with_an_error(make_cluster, batched):
    """Hop 1 adds a key to the params: params that are not a map end the request with
    a malformed-message error, and the loop serves the next request."""
    with make_cluster(pd_mode="always") as c:
        prefill, _ = pd_engines(c, batch=1)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(True, batch=batched)
        c.peers.append(client)
        if batched:
            client.send(m([SUBMIT_BATCH, [[1, 5, False]]]), m([1, 2]))
        else:
            client.send(m([20, 1, 5]), m([1, 2]))
        error = um(client.recv()[0])
        assert error[:3] == [ERROR, 1, ErrorCode.MALFORMED]
        client.send(m([20, 2, SP]), m([1, 2]))
        assert um(prefill.recv()[0])[0] in (20, SUBMIT_BATCH)
        assert c.coord.stats()["pd"]["counts"]["requests"] == 1


def test_hops_past_the_small_share_bound_send_copied_prompts(make_cluster):
    """Past SHARED_SMALL_MAX small prompt frames kept at once (2 048), the room keeps a
    copy of each new one (a small frame shared pins its whole receive buffer): those
    requests' hops carry the same bytes as the shared ones'."""
    n = 2048 + 40
    with make_cluster(pd_mode="always", max_inflight=4096) as c:
        prefill, decode = (
            RawEngine(c.ctx, c.coord.address, role.encode()) for role in ("prefill", "decode")
        )
        c.peers += [prefill, decode]
        for engine, role in ((prefill, "prefill"), (decode, "decode")):
            engine.register().hello(role=role, capacity=n, transfer={"t": 1})
        wait_for(lambda: len(c.coord.stats().get("pd", {}).get("engines", ())) == 2)
        client = RawClient(c.ctx, c.coord.address, b"client").connect(coordkit=True)
        c.peers.append(client)
        for rid in range(n):
            client.send(m([20, rid, SP]), m([rid, 1, 2]))
        rids = {}  # server id -> client id, each hop 1 as the reference writes it
        for _ in range(n):
            hop1 = prefill.recv()
            rid = msgpack.unpackb(hop1[0])[1]
            prompt = hop1[1]
            rids[rid] = msgpack.unpackb(prompt)[0]
            assert hop1 == _pd.prefill_frames(False, rid, prompt, m(SP), False)
        last = max(rids)  # the newest: kept past the bound, a copy
        prefill.send(m([HANDOFF, [[last, {"blocks": 1}]]]), m([5]))
        assert decode.recv() == _pd.decode_frames(
            False, last, m([rids[last], 1, 2]), m(SP), m({"blocks": 1}), m([5])
        )
