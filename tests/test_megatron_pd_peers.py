"""The #6675 peers (tests/support/megatron_pd.py) against a scripted ROUTER that plays
PR #6675's coordinator frame by frame: they speak the PR's P/D protocol.

Each test drives one exchange the way the PR's coordinator runs it -- registration
and its refusals, both hops under one server id, the NCCL ordering, the release
after the read, aborts at each hop, the hybrid handoff -- and holds what each peer
sent and saw to the PR's layouts. The router takes its words from coordkit._pd, the
part of the P/D room both loop cores share: a refusal is check_register_role's
text for the peers' own registration metadata, the prefill hop's params are the
client's with PREFILL_OVERRIDES spliced in, the handoff is read by handoff_of and
its NIXL blobs restored by restore_nixl_blobs. No peer may see a frame its PR
counterpart would raise on (``violations``) unless the test says why.

What needs a coordinator that runs the P/D room -- the capacity queues, the
failures (an engine's death before and after the read), release_handoff from a
client, str prompts end to end -- is for the tests against coordkit's coordinator.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from coordkit import _pd
from coordkit._pd import Registration, check_register_role
from tests.support import megatron_pd as pd
from tests.support.peers import WAIT, m, um, wait_for

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 10))  # 9 tokens: 3 blocks of 4, the last partial
SHARED = list(range(100, 116))  # 4 full blocks


class Coordinator:
    """A bare ROUTER standing in for PR #6675's coordinator; the test says each frame."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as coordkit's: the newest connection
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = address
        self.fleet: dict[bytes, Registration] = {}

    def recv(self, timeout: float = WAIT) -> tuple[bytes, list[Any]]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no message came to the coordinator")
        identity, frame = self.sock.recv_multipart()
        return identity, um(frame)

    def expect(self, identity: bytes, header: int, timeout: float = WAIT) -> list[Any]:
        """The next message, which must be ``identity``'s with ``header``."""
        sender, message = self.recv(timeout)
        assert (sender, message[0]) == (identity, header), (sender, message)
        return message

    def send(self, identity: bytes, message: list[Any]) -> None:
        self.sock.send_multipart([identity, m(message)])

    def register(self, engine: pd.PDEngine) -> list[Any]:
        """Take the engine's REGISTER_ROLE and answer as the PR does: ACK, or the
        refusal check_register_role gives; the reply the engine read."""
        replies: list[list[Any]] = []
        thread = threading.Thread(target=lambda: replies.append(engine.register()))
        thread.start()
        identity, message = self.recv()
        check = check_register_role(message, identity, self.fleet)
        if check.replaces:
            del self.fleet[identity]
        if check.registration is None:
            self.send(identity, [pd.REQUEST_ERROR, check.refusal])
        else:
            self.fleet[identity] = check.registration
            self.send(identity, [pd.REGISTER_ROLE_ACK])
        thread.join(WAIT)
        return replies[0]

    def start(self, engine: pd.PDEngine) -> pd.PDEngine:
        assert self.register(engine) == [pd.REGISTER_ROLE_ACK]
        return engine.start(register=False)

    def prefill_hop(self, prefill: bytes, rid: int, prompt: Any, params: dict) -> dict:
        """SUBMIT [20, rid, prompt, prefill params] to ``prefill``; its finished request."""
        spliced = _pd.with_keys(msgpack.packb(params), _pd.PREFILL_OVERRIDES["megatron"])
        self.send(prefill, [pd.SUBMIT, rid, prompt, msgpack.unpackb(spliced)])
        [record] = self.expect(prefill, pd.REPLY)[1]
        assert record["request_id"] == rid
        return dict(record)

    def decode_hop(
        self, decode: bytes, rid: int, prompt: Any, params: dict, record: dict
    ) -> list[Any]:
        """The handoff read and sent as the PR does: [24, rid, the client's prompt and
        params, kv_meta (NIXL blobs restored), block_ids]; the message sent."""
        handoff = _pd.handoff_of(record)
        assert not isinstance(handoff, str), handoff
        kv_meta, blocks = handoff
        prefill = self.fleet[self.owner(record)]
        if prefill.transport == "nixl":
            kv_meta = _pd.restore_nixl_blobs(kv_meta, prefill.instance_meta)
        message = [pd.SUBMIT_KV, rid, prompt, params, kv_meta, blocks]
        self.send(decode, message)
        return message

    def owner(self, record: dict) -> bytes:
        """The prefill a record came from (its kv_meta's first global rank)."""
        rank = min(pd.global_ranks(record["disaggregated_params"]["kv_meta"]))
        [identity] = [
            name
            for name, registration in self.fleet.items()
            if rank in pd.global_ranks(registration.instance_meta)
        ]
        return identity

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coord(kv_dir) -> Iterator[Coordinator]:
    router = Coordinator(f"ipc://{kv_dir}/coordinator")
    yield router
    router.close()


def peer(coord: Coordinator, role: str, kv_dir: str, **options: Any) -> pd.PDEngine:
    return pd.PDEngine(coord.address, role, kv_dir=kv_dir, **options)


def collect(coord: Coordinator, engine: bytes, rid: int) -> list[list[Any]]:
    """What ``engine`` sends (to the coordinator) until request ``rid``'s final."""
    out: list[list[Any]] = []
    while True:
        identity, message = coord.recv()
        assert identity == engine, (identity, message)
        out.append(message)
        if message[0] == pd.REPLY and any(r["request_id"] == rid for r in message[1]):
            return out


def settle(*engines: pd.PDEngine, seconds: float = 0.1) -> None:
    time.sleep(seconds)
    for engine in engines:
        assert engine.violations == [], engine.violations
        engine.stop()


# -- registration ------------------------------------------------------------------------


def test_registration_layout_and_ack(coord, kv_dir):
    prefill = peer(coord, "prefill", kv_dir, capacity=3)
    assert coord.register(prefill) == [pd.REGISTER_ROLE_ACK] and prefill.registered
    sent = prefill.sent(pd.REGISTER_ROLE)[0]
    assert prefill.identity == b"prefill_s0_dp0"
    assert sent[:3] == [pd.REGISTER_ROLE, "prefill", "nixl"]
    [entry] = sent[3]  # one entry per model-parallel rank
    assert entry["request_capacity"] == 3
    assert {"tokens_per_block", "element_size", "head_dim", "num_layers_global",
            "num_kv_heads_global", "agent_name", "agent_metadata_b64"} <= set(entry)  # fmt: skip
    assert coord.fleet[b"prefill_s0_dp0"].request_capacity == 3
    decode = peer(coord, "decode", kv_dir, geometry=pd.Geometry(tp=2, pp=2))
    assert coord.register(decode) == [pd.REGISTER_ROLE_ACK]
    assert len(decode.sent(pd.REGISTER_ROLE)[0][3]) == 4  # PP-major, then TP
    prefill.close()
    decode.close()


def _partial_capacity(engine: pd.PDEngine) -> list[Any]:
    entries = [dict(e) for e in engine.instance_meta]
    del entries[1]["request_capacity"]
    return entries


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        ({"transport": "nccl"}, "prefill and decode engines must use the same state transport"),
        (
            {"geometry": pd.Geometry(head_dim=64)},
            "prefill and decode engines have incompatible transfer geometry",
        ),
        (
            {"geometry": pd.Geometry(hybrid=True)},
            "prefill and decode engines have incompatible transfer geometry",
        ),
        ({"role": "both"}, "unknown disaggregated role 'both'"),
        ({"capacity": 0}, "Request capacity must be positive, got 0"),
        ({"instance_meta": []}, "state transfer metadata must be a non-empty list"),
        (
            {"geometry": pd.Geometry(tp=2), "partial": True},
            "Request capacity is missing from part of an engine's model-parallel metadata",
        ),
    ],
    ids=["transport", "head_dim", "hybrid", "role", "capacity", "empty", "partial-capacity"],
)
def test_refusals(coord, kv_dir, second, reason):
    """REQUEST_ERROR [29, reason], two elements: the peer takes it as the PR's engine
    does (it is not registered; the PR's engine then raises RuntimeError)."""
    first = peer(coord, "prefill", kv_dir)
    assert coord.register(first) == [pd.REGISTER_ROLE_ACK]
    options = dict(second)
    role = options.pop("role", "decode")
    partial = options.pop("partial", False)
    refused = peer(coord, role, kv_dir, **options)
    if partial:
        refused.instance_meta = _partial_capacity(refused)
    assert coord.register(refused) == [pd.REQUEST_ERROR, reason]
    assert not refused.registered and refused.refusal == reason
    assert set(coord.fleet) == {first.identity}
    first.close()
    refused.close()


def test_a_reconnecting_engine_may_not_change_its_role(coord, kv_dir):
    decode = peer(coord, "decode", kv_dir, identity=b"same")
    assert coord.register(decode) == [pd.REGISTER_ROLE_ACK]
    decode.kill()
    again = peer(coord, "prefill", kv_dir, identity=b"same")
    assert coord.register(again) == [
        pd.REQUEST_ERROR,
        "engine b'same' cannot change disaggregated role or transport",
    ]
    assert coord.fleet == {}  # removed, then refused
    again.close()


def test_hybrid_registration_advertises_ssm_slots(coord, kv_dir):
    prefill = peer(coord, "prefill", kv_dir, geometry=pd.Geometry(hybrid=True, tp=2))
    assert coord.register(prefill) == [pd.REGISTER_ROLE_ACK]
    registration = coord.fleet[prefill.identity]
    assert (registration.ssm_capacity, registration.slot_cost) == (4, 1)
    assert [kind for kind, *_ in registration.signature[1]] == ["conv", "recurrent"]
    prefill.close()


# -- one request, both hops ----------------------------------------------------------------


def test_both_hops_under_one_id_nixl(coord, kv_dir):
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir))
    params = pd.sampling_params(num_tokens_to_generate=4, streaming=True)
    record = coord.prefill_hop(prefill.identity, 5, PROMPT, params)

    # hop 1: the prefill's own params (do_kv_handoff, no tokens), its pins, its handoff
    [submit] = prefill.received(pd.SUBMIT)
    assert submit[2] == PROMPT and len(submit) == 4
    assert submit[3]["do_kv_handoff"] is True and submit[3]["num_tokens_to_generate"] == 0
    assert submit[3]["skip_prompt_log_probs"] is True and submit[3]["num_tokens_total"] is None
    handoff = record["disaggregated_params"]
    assert handoff["request_id"] == 5 and len(handoff["block_ids"]) == 3
    assert "agent_metadata_b64" not in handoff["kv_meta"]  # stripped by the NIXL prefill
    assert record["generated_tokens"] == [] and list(prefill.pins()) == [5]

    # hop 2: the same id, the client's own params, the kv_meta with the registered blob
    sent = coord.decode_hop(decode.identity, 5, PROMPT, params, record)
    assert sent[4] == {**handoff["kv_meta"], "agent_metadata_b64": pd.agent_blob(prefill.agent)}
    replies = collect(coord, decode.identity, 5)
    headers = [message[0] for message in replies]
    assert headers == [pd.PARTIAL, pd.KV_READ_DONE, pd.PARTIAL, pd.PARTIAL, pd.REPLY]
    assert decode.sent(pd.KV_TRANSFER_READY) == []  # NIXL: the decode reads
    assert prefill.reads == [(5, handoff["block_ids"])]
    coord.send(prefill.identity, [pd.RELEASE_KV, 5])  # after the read: the pins go
    wait_for(lambda: prefill.pins() == {})
    tokens = [
        t for message in replies if message[0] == pd.PARTIAL for t in message[1][0]["new_tokens"]
    ]
    assert tokens == pd.expected_tokens(PROMPT, 3)  # incremental, the last one in the final
    final = replies[-1][1][0]
    assert final["generated_tokens"] == pd.expected_tokens(PROMPT, 4)
    assert final["status"] == "COMPLETED" and final["disaggregated_params"] is None
    settle(prefill, decode)


def test_a_handoff_without_its_nixl_blob_cannot_be_read(coord, kv_dir):
    """Why the coordinator restores the blobs: the prefill leaves them out."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir))
    params = pd.sampling_params(num_tokens_to_generate=2)
    record = coord.prefill_hop(prefill.identity, 1, PROMPT, params)
    handoff = record["disaggregated_params"]
    coord.send(
        decode.identity, [pd.SUBMIT_KV, 1, PROMPT, params, handoff["kv_meta"], handoff["block_ids"]]
    )
    [error] = [coord.expect(decode.identity, pd.REQUEST_ERROR)]
    assert error[1] == 1 and "has no agent metadata to load" in error[2] and error[3] is True
    settle(prefill, decode)


def test_nccl_ordering_and_cached_prefix(coord, kv_dir):
    """KV_TRANSFER_READY from the decode, then SEND_KV to the prefill with the decode's
    registered metadata and its cached prefix, then the push, KV_READ_DONE."""
    prefill = coord.start(peer(coord, "prefill", kv_dir, transport="nccl"))
    decode = coord.start(peer(coord, "decode", kv_dir, transport="nccl"))
    params = pd.sampling_params(num_tokens_to_generate=2)
    for rid, (prompt, cached) in enumerate(((SHARED + [1, 2], 0), (SHARED + [3], 4))):
        record = coord.prefill_hop(prefill.identity, rid, prompt, params)
        coord.decode_hop(decode.identity, rid, prompt, params, record)
        ready = coord.expect(decode.identity, pd.KV_TRANSFER_READY)
        assert ready == [pd.KV_TRANSFER_READY, rid, cached]
        coord.send(
            prefill.identity, [pd.SEND_KV, rid, coord.fleet[decode.identity].instance_meta, cached]
        )
        replies = collect(coord, decode.identity, rid)
        assert [message[0] for message in replies] == [pd.KV_READ_DONE, pd.REPLY]
        blocks = record["disaggregated_params"]["block_ids"]
        assert [p for p in prefill.pushes if p[0] == rid] == [(rid, blocks[cached:], decode.rank0)]
        assert replies[-1][1][0]["generated_tokens"] == pd.expected_tokens(prompt, 2)
        coord.send(prefill.identity, [pd.RELEASE_KV, rid])
    wait_for(lambda: prefill.pins() == {})
    settle(prefill, decode)


def test_a_push_before_the_decode_is_ready_is_caught(coord, kv_dir):
    """SEND_KV only after KV_TRANSFER_READY: an early push is what the real transfer
    would hang on (the peer keeps it, and takes it once its receive is posted)."""
    prefill = coord.start(peer(coord, "prefill", kv_dir, transport="nccl"))
    decode = coord.start(peer(coord, "decode", kv_dir, transport="nccl"))
    params = pd.sampling_params(num_tokens_to_generate=2)
    record = coord.prefill_hop(prefill.identity, 0, PROMPT, params)
    coord.send(prefill.identity, [pd.SEND_KV, 0, coord.fleet[decode.identity].instance_meta, 0])
    wait_for(lambda: decode.violations)
    assert decode.violations == ["a push of request 0 before its KV_TRANSFER_READY"]
    decode.violations.clear()
    coord.decode_hop(decode.identity, 0, PROMPT, params, record)
    assert coord.expect(decode.identity, pd.KV_TRANSFER_READY) == [pd.KV_TRANSFER_READY, 0, 0]
    replies = collect(coord, decode.identity, 0)
    assert replies[-1][1][0]["generated_tokens"] == pd.expected_tokens(PROMPT, 2)
    settle(prefill, decode)


def test_a_release_before_the_read_breaks_the_transfer(coord, kv_dir):
    """Why RELEASE_KV waits for KV_READ_DONE (and why a client's release_handoff may
    not reach another's prefill): the read finds the blocks freed."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir, import_delay=0.3))
    params = pd.sampling_params(num_tokens_to_generate=2)
    record = coord.prefill_hop(prefill.identity, 3, PROMPT, params)
    coord.decode_hop(decode.identity, 3, PROMPT, params, record)
    coord.send(prefill.identity, [pd.RELEASE_KV, 3])
    error = coord.expect(decode.identity, pd.REQUEST_ERROR)
    assert error == [
        pd.REQUEST_ERROR,
        3,
        "KV handoff transfer of request 3 read wrong or freed blocks",
        True,
    ]
    assert any("not pinned" in v for v in prefill.violations)
    prefill.violations.clear()
    decode.violations.clear()
    settle(prefill, decode)


def test_hybrid_handoff_carries_ssm_state(coord, kv_dir):
    geometry = pd.Geometry(hybrid=True, tp=2)
    prefill = coord.start(peer(coord, "prefill", kv_dir, geometry=geometry))
    decode = coord.start(peer(coord, "decode", kv_dir, geometry=geometry))
    params = pd.sampling_params(num_tokens_to_generate=3)
    record = coord.prefill_hop(prefill.identity, 0, PROMPT, params)
    kv_meta = coord.decode_hop(decode.identity, 0, PROMPT, params, record)[4]
    assert set(kv_meta) == {"tp_metas", "resume_tokens", "ssm"}
    assert all(meta["block_ids"] == [0] for meta in kv_meta["ssm"]["conv"])
    assert _pd.decode_slots(kv_meta) == 1
    replies = collect(coord, decode.identity, 0)
    assert replies[-1][1][0]["generated_tokens"] == pd.expected_tokens(PROMPT, 3)
    settle(prefill, decode)


def test_a_str_prompt_is_served_with_the_prefills_tokens(coord, kv_dir):
    """A #6675 decode cannot take a str prompt (torch.tensor of it raises); with
    return_prompt_tokens on the prefill hop the prefill's record carries the tokens,
    and the decode hop takes them: how a coordinator without a tokenizer serves it."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir))
    params = pd.sampling_params(num_tokens_to_generate=2)
    record = coord.prefill_hop(prefill.identity, 0, "hello world", params)
    coord.decode_hop(decode.identity, 0, "hello world", params, record)
    assert coord.expect(decode.identity, pd.REQUEST_ERROR)[2] == pd.STR_PROMPT_ERROR
    coord.send(prefill.identity, [pd.RELEASE_KV, 0])
    with_tokens = {**params, "return_prompt_tokens": True}
    record = coord.prefill_hop(prefill.identity, 1, "hello world", with_tokens)
    tokens = record["prompt_tokens"]
    assert tokens == pd.tokenize("hello world")
    coord.decode_hop(decode.identity, 1, tokens, params, record)
    replies = collect(coord, decode.identity, 1)
    assert replies[-1][1][0]["generated_tokens"] == pd.expected_tokens("hello world", 2)
    settle(prefill, decode)


# -- what each role refuses, aborts --------------------------------------------------------


def test_a_decode_refuses_a_prompt(kv_dir):
    decode = pd.PDEngine(f"ipc://{kv_dir}/nowhere", "decode", kv_dir=kv_dir)
    decode._on_message([pd.SUBMIT, 7, PROMPT, pd.sampling_params()])
    assert decode.sent() == [[pd.REQUEST_ERROR, 7, pd.DECODE_REFUSES_PROMPT, True]]
    decode.close()


def test_a_pd_engine_takes_four_submit_fields_only(kv_dir):
    """Main's client sends five (multi_modal_data); a #6675 engine unpacks three after
    the header: a coordinator must send it [20, rid, prompt, params]."""
    engine = pd.PDEngine(f"ipc://{kv_dir}/nowhere", "prefill", kv_dir=kv_dir)
    engine._on_message([pd.SUBMIT, 0, PROMPT, pd.sampling_params(), None])
    assert engine.violations == ["SUBMIT_REQUEST with 4 fields: ValueError"]
    engine.close()


def test_abort_at_the_prefill_hop(coord, kv_dir):
    """A prefill confirms no abort: its reply (pins and all) comes, the coordinator
    releases it."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    prefill.hold()
    params = pd.sampling_params(num_tokens_to_generate=4)
    coord.send(prefill.identity, [pd.SUBMIT, 0, PROMPT, {**params, "do_kv_handoff": True}])
    wait_for(lambda: prefill.received(pd.SUBMIT))
    coord.send(prefill.identity, [pd.ABORT, 0])
    wait_for(lambda: prefill.received(pd.ABORT))
    prefill.proceed()
    [record] = coord.expect(prefill.identity, pd.REPLY)[1]
    assert record["disaggregated_params"]["block_ids"] and prefill.sent(pd.REQUEST_ABORTED) == []
    coord.send(prefill.identity, [pd.RELEASE_KV, 0])
    wait_for(lambda: prefill.pins() == {})
    settle(prefill)


def test_abort_at_the_decode_hop(coord, kv_dir):
    """An active decode confirms at once ([31, rid, True]) and still sends a final a
    step later, which the coordinator drops."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir, step_seconds=0.05))
    params = pd.sampling_params(num_tokens_to_generate=100, streaming=True)
    record = coord.prefill_hop(prefill.identity, 0, PROMPT, params)
    coord.decode_hop(decode.identity, 0, PROMPT, params, record)
    wait_for(lambda: len(decode.sent(pd.PARTIAL)) >= 2)
    coord.send(decode.identity, [pd.ABORT, 0])
    wait_for(lambda: decode.sent(pd.REPLY))
    assert decode.sent(pd.REQUEST_ABORTED) == [[pd.REQUEST_ABORTED, 0, True]]
    aborted = decode.headers("out").index(pd.REQUEST_ABORTED)
    assert decode.headers("out").index(pd.REPLY) > aborted
    settle(prefill, decode)


def test_an_import_aborted_is_confirmed_when_the_read_is_over(coord, kv_dir):
    """Aborted while it reads, the decode answers [31, rid, True] once the read ended,
    and sends no KV_READ_DONE: the coordinator releases the prefill on the 31."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir, import_delay=0.2))
    params = pd.sampling_params(num_tokens_to_generate=4)
    record = coord.prefill_hop(prefill.identity, 0, PROMPT, params)
    coord.decode_hop(decode.identity, 0, PROMPT, params, record)
    coord.send(decode.identity, [pd.ABORT, 0])
    assert coord.expect(decode.identity, pd.REQUEST_ABORTED) == [pd.REQUEST_ABORTED, 0, True]
    assert decode.sent(pd.KV_READ_DONE) == []
    settle(prefill, decode)


def test_a_decode_over_its_capacity_is_recorded(coord, kv_dir):
    """What the coordinator's reservations must prevent: the peer records a handoff
    arriving past the capacity it declared (the real engine would defer it)."""
    prefill = coord.start(peer(coord, "prefill", kv_dir))
    decode = coord.start(peer(coord, "decode", kv_dir, capacity=1, step_seconds=0.05))
    params = pd.sampling_params(num_tokens_to_generate=20)
    records = [coord.prefill_hop(prefill.identity, rid, [rid + 1] * 5, params) for rid in (0, 1)]
    for rid, record in enumerate(records):
        coord.decode_hop(decode.identity, rid, [rid + 1] * 5, params, record)
    wait_for(lambda: decode.over_capacity)
    assert decode.over_capacity == [1]
    prefill.stop()
    decode.stop()


# -- the client ----------------------------------------------------------------------------


def test_the_client_parses_what_a_pd_coordinator_sends(coord):
    client = pd.PDClient(coord.address)
    thread = threading.Thread(target=client.connect)
    thread.start()
    identity, message = coord.recv()
    assert message == [pd.CONNECT]
    coord.send(identity, [pd.CONNECT_ACK])
    thread.join(WAIT)
    done, failed, aborted = (client.submit(PROMPT) for _ in range(3))
    for rid in (done, failed, aborted):
        assert coord.recv() == (identity, [pd.SUBMIT, rid, PROMPT, pd.sampling_params()])
    coord.send(identity, [pd.PARTIAL, done, {"request_id": 9, "new_tokens": [1]}])
    coord.send(identity, [pd.REPLY, done, {"request_id": 9, "generated_tokens": [1, 2]}])
    coord.send(identity, [pd.REQUEST_ERROR, failed, "engine b'decode' removed", False])
    coord.send(identity, [pd.REQUEST_ABORTED, failed, True])  # the safe one after it
    coord.send(identity, [pd.REQUEST_ABORTED, aborted, True])
    for rid in (done, failed, aborted):
        client.wait(rid)
    client.pump(0.1)
    assert client.outcomes[done].terminals == [pd.REPLY] and client.outcomes[done].tokens == [1]
    assert client.outcomes[failed].terminals == [pd.REQUEST_ERROR, pd.REQUEST_ABORTED]
    assert client.outcomes[failed].error == ("engine b'decode' removed", False)
    assert client.outcomes[aborted].aborted == [True]
    assert client.violations == []
    coord.send(identity, [pd.REPLY, 77, {}])  # a reply for no request of its
    coord.send(identity, [90, None, 4, "busy"])  # coordkit's ERROR: not a #6675 header
    client.pump(0.1)
    assert client.violations == [
        "a reply for request 77, which this client never sent",
        "UnknownHeaderError: [90, None, 4, 'busy']",
    ]
    client.close()


# -- processes -----------------------------------------------------------------------------


def test_engines_as_processes(coord, kv_dir, tmp_path):
    prefill_status, decode_status = tmp_path / "prefill.json", tmp_path / "decode.json"
    common = ("--kv-dir", kv_dir, "--transport", "nccl")
    with (
        pd.engine_process(coord.address, "prefill", prefill_status, *common, "--rank", "10") as p,
        pd.engine_process(coord.address, "decode", decode_status, *common, "--rank", "20") as d,
    ):
        for _ in range(2):
            identity, message = coord.recv(timeout=30)
            check = check_register_role(message, identity, coord.fleet)
            assert check.registration is not None, check.refusal
            coord.fleet[identity] = check.registration
            coord.send(identity, [pd.REGISTER_ROLE_ACK])
        assert p.wait_registered(10)["registered"] and d.wait_registered(10)["registered"]
        params = pd.sampling_params(num_tokens_to_generate=3)
        prefill, decode = b"prefill_s0_dp0", b"decode_s0_dp0"
        record = coord.prefill_hop(prefill, 0, PROMPT, params)
        coord.decode_hop(decode, 0, PROMPT, params, record)
        ready = coord.expect(decode, pd.KV_TRANSFER_READY)
        decode_meta = coord.fleet[decode].instance_meta
        coord.send(prefill, [pd.SEND_KV, 0, decode_meta, ready[2]])
        replies = collect(coord, decode, 0)
        assert replies[-1][1][0]["generated_tokens"] == pd.expected_tokens(PROMPT, 3)
        coord.send(prefill, [pd.RELEASE_KV, 0])
        wait_for(lambda: p.status().get("releases") == [0])
        assert p.status()["pins"] == {} and p.status()["violations"] == []
        d.stop()  # SIGTERM: its shutdown sends DISCONNECT
        assert coord.expect(decode, pd.DISCONNECT) == [pd.DISCONNECT]
        assert json.loads(Path(decode_status).read_text())["log"][-1][2] == [pd.DISCONNECT]
        p.kill()
