"""coordkit's coordinator running PR #6675's disaggregated prefill/decode, with the PR's
peers (tests/support/megatron_pd.py: its engines and its InferenceClient on the wire),
on both implementations: registration and its refusals, both hops under one server id,
NCCL's ordering, the release to the owning prefill only, capacity queues, errors,
aborts at each hop, a str prompt served, a client's release_handoff kept to its own
requests; and the failures with engines really killed (SIGKILL): a dead engine seen
without traffic, a prefill's death leaving a live decode's import alone, a decode's
death before its read handed off again, and every prefill left with no pins."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordkit import _pd
from tests.support import megatron_pd as pd
from tests.support.peers import wait_for

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(1, 11))  # three #6675 blocks of 4 tokens


@pytest.fixture
def coordinator(impl, kv_dir) -> Iterator[Any]:
    """A coordinator serving #6675's peers: its dialect, megatron_version="pr6675",
    every request through both hops."""
    from coordkit import Coordinator

    coord = Coordinator(
        f"ipc://{kv_dir}/coord",
        implementation=impl.name,
        dialect="megatron-core",
        megatron_version="pr6675",
        pd_mode="always",
        pd_lease=2.0,
    )
    coord.start()
    yield coord
    coord.stop()


def engine(coord: Any, role: str, kv_dir: str, **options: Any) -> pd.PDEngine:
    return pd.PDEngine(coord.address, role, kv_dir=kv_dir, **options).start()


def client(coord: Any) -> pd.PDClient:
    return pd.PDClient(coord.address).connect()


def no_pins(*engines: pd.PDEngine) -> None:
    """Every prefill's pins gone, no transfer violated, nothing over capacity."""
    for peer in engines:
        wait_for(lambda peer=peer: peer.pins() == {})
        assert peer.violations == [] and peer.over_capacity == []


def stop(*engines: pd.PDEngine) -> None:
    for peer in engines:
        peer.stop()


# -- registration ----------------------------------------------------------------------


def test_registration_and_its_refusals(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir)
    both = pd.PDEngine(coordinator.address, "both", kv_dir=kv_dir)
    assert both.register() == [pd.REQUEST_ERROR, "unknown disaggregated role 'both'"]
    other = pd.PDEngine(
        coordinator.address, "decode", kv_dir=kv_dir, geometry=pd.Geometry(head_dim=64)
    )
    reason = "prefill and decode engines have incompatible transfer geometry"
    assert other.register() == [pd.REQUEST_ERROR, reason]
    nccl = pd.PDEngine(coordinator.address, "decode", kv_dir=kv_dir, transport="nccl")
    reason = "prefill and decode engines must use the same state transport"
    assert nccl.register() == [pd.REQUEST_ERROR, reason]
    # no decode registered: nothing is prefilled for nothing, the request fails safe
    peer = client(coordinator)
    outcome = peer.wait(peer.submit(PROMPT, num_tokens_to_generate=2))
    assert outcome.error == (_pd.cannot_route("decode"), True) or outcome.final is not None
    stats = coordinator.stats()["pd"]
    assert stats["counts"]["roles_refused"] == 3
    for peer_ in (both, other, nccl):
        peer_.close()
    no_pins(prefill)
    stop(prefill)


def test_register_role_needs_a_disaggregated_coordinator(impl, kv_dir):
    from coordkit import Coordinator

    coord = Coordinator(f"ipc://{kv_dir}/plain", implementation=impl.name, dialect="megatron-core")
    coord.start()
    try:
        peer = pd.PDEngine(coord.address, "prefill", kv_dir=kv_dir)
        reason = "REGISTER_ROLE requires a disaggregated coordinator"
        assert peer.register() == [pd.REQUEST_ERROR, reason]
        peer.close()
    finally:
        coord.stop()


@pytest.mark.parametrize(
    "frame",
    [
        b"\x92\x1b\xc1",  # a byte msgpack never uses
        b"\x92\x1b\xdc\xf1\x8e",  # an array of 61838 entries, none there
        b"\x92\x1b\x81\x91\x01\x02",  # a map keyed by an array
        b"\x91\x1b\x01",  # a byte after the message
    ],
)
def test_a_garbled_register_role_is_malformed_and_the_loop_serves_on(coordinator, kv_dir, frame):
    """A REGISTER_ROLE that is not msgpack (whatever msgpack raises) is counted malformed;
    the loop goes on and registers the next engine."""
    import zmq

    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.connect(coordinator.address)
    rogue.send(frame)
    wait_for(lambda: coordinator.stats()["counters"]["malformed"] == 1)
    rogue.close(linger=0)
    prefill = engine(coordinator, "prefill", kv_dir)
    decode = engine(coordinator, "decode", kv_dir)
    peer = client(coordinator)
    outcome = peer.wait(peer.submit(PROMPT, num_tokens_to_generate=2))
    assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 2)
    no_pins(prefill)
    stop(prefill, decode)


# -- both hops -------------------------------------------------------------------------


def test_both_hops_under_one_id_nixl(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir)
    decode = engine(coordinator, "decode", kv_dir)
    peer = client(coordinator)
    rid = peer.submit_streaming(PROMPT, num_tokens_to_generate=4)
    outcome = peer.wait(rid)
    assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 4)
    assert outcome.tokens == pd.expected_tokens(PROMPT, 3)  # the last one in the final
    assert outcome.terminals == [pd.REPLY] and peer.violations == []
    [hop1] = prefill.received(pd.SUBMIT)
    [hop2] = decode.received(pd.SUBMIT_KV)
    assert hop1[1] == hop2[1] and len(hop1) == 4  # one server id, four SUBMIT fields
    assert hop1[3]["do_kv_handoff"] is True and hop1[3]["num_tokens_to_generate"] == 0
    assert hop2[3]["num_tokens_to_generate"] == 4  # the client's params
    assert hop2[4]["agent_metadata_b64"] == pd.agent_blob(prefill.agent)  # restored
    assert prefill.received(pd.RELEASE_KV) == [[pd.RELEASE_KV, hop1[1]]]
    no_pins(prefill)
    stop(prefill, decode)


def test_nccl_sends_kv_after_the_decode_is_ready(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir, transport="nccl")
    decode = engine(coordinator, "decode", kv_dir, transport="nccl")
    peer = client(coordinator)
    outcome = peer.wait(peer.submit(PROMPT, num_tokens_to_generate=3))
    assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 3)
    [ready] = decode.sent(pd.KV_TRANSFER_READY)
    [send] = prefill.received(pd.SEND_KV)
    assert send[1] == ready[1] and send[3] == ready[2]
    assert send[2] == decode.instance_meta  # the decode's registration, verbatim
    assert decode.violations == [] and prefill.violations == []
    no_pins(prefill)
    stop(prefill, decode)


def test_release_goes_to_the_owning_prefill_only(coordinator, kv_dir):
    first = engine(coordinator, "prefill", kv_dir, index=0)
    second = engine(coordinator, "prefill", kv_dir, index=1)
    decode = engine(coordinator, "decode", kv_dir)
    peer = client(coordinator)
    rids = [peer.submit([i, *PROMPT], num_tokens_to_generate=2) for i in range(6)]
    for rid in rids:
        assert peer.wait(rid).final is not None
    for prefill in (first, second):
        hop1 = {message[1] for message in prefill.received(pd.SUBMIT)}
        released = {message[1] for message in prefill.received(pd.RELEASE_KV)}
        assert released == hop1  # its own requests, each once
    no_pins(first, second)
    stop(first, second, decode)


def test_capacity_queues_in_fifo_order(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir, capacity=1)
    decode = engine(coordinator, "decode", kv_dir, capacity=1, step_seconds=0.01)
    peer = client(coordinator)
    rids = [peer.submit([i, *PROMPT], num_tokens_to_generate=3) for i in range(5)]
    for rid in rids:
        assert peer.wait(rid).final is not None
    order = [message[1] for message in prefill.received(pd.SUBMIT)]
    assert order == sorted(order)  # first come, first prefilled
    # a seat counts pins: the next SUBMIT only after the last RELEASE_KV
    headers = [h for h in prefill.headers() if h in (pd.SUBMIT, pd.RELEASE_KV)]
    assert headers == [pd.SUBMIT, pd.RELEASE_KV] * 5
    assert prefill.over_capacity == [] and decode.over_capacity == []
    no_pins(prefill)
    stop(prefill, decode)


def test_str_prompt_is_served_end_to_end(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir)
    decode = engine(coordinator, "decode", kv_dir)
    peer = client(coordinator)
    outcome = peer.wait(peer.submit("hello world", num_tokens_to_generate=2))
    assert outcome.final["generated_tokens"] == pd.expected_tokens("hello world", 2)
    [hop2] = decode.received(pd.SUBMIT_KV)
    assert hop2[2] == pd.tokenize("hello world")
    no_pins(prefill)
    stop(prefill, decode)


# -- errors and aborts -------------------------------------------------------------------


def test_prompt_log_probs_are_refused_before_any_engine(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir)
    decode = engine(coordinator, "decode", kv_dir)
    peer = client(coordinator)
    outcome = peer.wait(peer.submit(PROMPT, return_log_probs=True))
    assert outcome.error == (_pd.PROMPT_LOG_PROBS, True)
    assert prefill.received(pd.SUBMIT) == []
    stop(prefill, decode)


def test_aborts_at_each_hop_and_while_queued(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir, capacity=1)
    decode = engine(coordinator, "decode", kv_dir, step_seconds=0.05)
    peer = client(coordinator)
    prefill.hold()
    at_prefill = peer.submit(PROMPT, num_tokens_to_generate=20)
    queued = peer.submit([7, *PROMPT], num_tokens_to_generate=20)
    wait_for(lambda: len(prefill.received(pd.SUBMIT)) == 1)
    peer.abort(queued)
    assert peer.wait(queued).aborted == [True]  # nothing was sent for it
    peer.abort(at_prefill)
    prefill.proceed()
    assert peer.wait(at_prefill).aborted == [True]
    at_decode = peer.submit_streaming([9, *PROMPT], num_tokens_to_generate=50)
    wait_for(lambda: peer.pump(0.01) >= 0 and len(peer.outcomes[at_decode].partials) >= 2)
    peer.abort(at_decode)
    outcome = peer.wait(at_decode)
    assert outcome.aborted == [True] and outcome.final is None
    peer.pump(0.2)
    assert peer.outcomes[at_decode].terminals == [pd.REQUEST_ABORTED]  # its late final dropped
    assert len(prefill.received(pd.SUBMIT)) == 2
    no_pins(prefill)
    stop(prefill, decode)


def test_release_handoff_frees_only_the_clients_own(coordinator, kv_dir):
    prefill = engine(coordinator, "prefill", kv_dir)
    decode = engine(coordinator, "decode", kv_dir, import_delay=0.5)
    owner, stranger = client(coordinator), client(coordinator)
    rid = owner.submit(PROMPT, num_tokens_to_generate=2)
    wait_for(lambda: prefill.pins() != {})
    [server_rid] = prefill.pins()
    for n in (rid, server_rid):
        stranger.release_handoff(n)
    time.sleep(0.1)
    assert list(prefill.pins()) == [server_rid]  # nothing of another client's freed
    assert owner.wait(rid).final is not None
    no_pins(prefill)
    assert decode.violations == []
    stop(prefill, decode)


# -- failures, engines killed ------------------------------------------------------------


def _process(coord: Any, role: str, tmp_path: Path, name: str, kv_dir: str, *options: str):
    return pd.engine_process(
        coord.address, role, tmp_path / f"{name}.json", "--kv-dir", kv_dir, *options
    )


def test_a_decode_killed_before_its_read_hands_off_again(coordinator, kv_dir, tmp_path):
    prefill = engine(coordinator, "prefill", kv_dir)
    with _process(
        coordinator, "decode", tmp_path, "slow", kv_dir, "--index", "1", "--import-delay", "30"
    ) as slow:
        slow.wait_registered()
        peer = client(coordinator)
        rid = peer.submit(PROMPT, num_tokens_to_generate=3)
        wait_for(lambda: prefill.pins() != {})
        time.sleep(0.3)  # at the slow decode, reading nothing yet
        decode = engine(coordinator, "decode", kv_dir, index=2)
        slow.kill()  # seen without traffic: its connection's end
        outcome = peer.wait(rid)
        assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 3)
        assert coordinator.stats()["pd"]["counts"]["rehanded"] == 1
        no_pins(prefill)
        stop(prefill, decode)


def test_a_prefill_killed_after_the_read_leaves_the_decode_alone(coordinator, kv_dir, tmp_path):
    decode = engine(coordinator, "decode", kv_dir, step_seconds=0.05)
    with _process(coordinator, "prefill", tmp_path, "p", kv_dir) as prefill:
        prefill.wait_registered()
        peer = client(coordinator)
        rid = peer.submit_streaming(PROMPT, num_tokens_to_generate=12)
        wait_for(lambda: peer.pump(0.01) >= 0 and len(peer.outcomes[rid].partials) >= 2)
        prefill.kill()
        outcome = peer.wait(rid)
        assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 12)
        assert outcome.terminals == [pd.REPLY]
    stop(decode)


def test_a_prefill_killed_before_its_handoff_prefills_again(coordinator, kv_dir, tmp_path):
    decode = engine(coordinator, "decode", kv_dir)
    with _process(
        coordinator, "prefill", tmp_path, "p0", kv_dir, "--prefill-seconds", "30"
    ) as stuck:
        stuck.wait_registered()
        peer = client(coordinator)
        rid = peer.submit(PROMPT, num_tokens_to_generate=2)
        time.sleep(0.3)
        other = engine(coordinator, "prefill", kv_dir, index=1)
        stuck.kill()
        outcome = peer.wait(rid)
        assert outcome.final["generated_tokens"] == pd.expected_tokens(PROMPT, 2)
        assert coordinator.stats()["pd"]["counts"]["reprefilled"] == 1
        no_pins(other)
        stop(other, decode)
