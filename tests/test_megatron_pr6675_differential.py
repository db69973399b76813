"""coordkit against PR #6675's own coordinator (b0a1727), scenario by scenario.

The oracle is the PR's real coordinator process (tests/support/megatron_reference.py:
its ``DataParallelInferenceCoordinator`` with ``disaggregated=True``, its zmq loop, its
``DisaggCoordinatorRuntime``, flow control and routing, unmodified, from
``$COORDKIT_MEGATRON_REFERENCE``; the tests skip without it). Each scenario is one
script run twice with the same real peers (tests/support/megatron_pd.py: PDEngine and
PDClient act as the PR's engines and client on the wire, each on a thread with its
own sockets): once against the PR's coordinator, once against coordkit's (both cores,
``impl``), with **no P/D option set** -- a #6675 user sets none. What each client and
each engine received is then compared: request ids are the coordinators' own, so an
engine's messages are compared by the request they name (each prompt's first token,
or the str prompt, labels it).

Compared exactly: every client's replies (terminal kinds, tokens, partials, finals but
their server ``request_id``, error reasons); where one engine serves a role, every
message it received, in order (SUBMIT with its params, SUBMIT_REQUEST_WITH_KV, SEND_KV,
RELEASE_KV, ABORT_REQUEST, the control signals). Where a role has several engines,
placement within it is each coordinator's own policy (the PR's free-capacity score,
coordkit's router) and is not compared; compared are what each request got, that it
went through one prefill and one decode, each role's FIFO order, and capacity at every
moment (no engine handed a request beyond its declared ``request_capacity``, a
prefill's pinned handoffs counted until RELEASE_KV).

Deliberate differences are named in the tests that show them (``BEYOND``): a str
prompt, which the PR's decode cannot read and coordkit serves; a prefill's death, after
which the PR fails the requests a live decode had already imported and coordkit lets
them complete; a decode's death, whose requests the PR ends (or loses) and coordkit
prefills again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import megatron_pd as pd
from tests.support import megatron_reference as reference
from tests.support.peers import wait_for

pytestmark = pytest.mark.timeout(120)

BLOCK = 4  # the peers' tokens per block


def prompt(label: int, length: int = 10) -> list[int]:
    """A prompt its first token labels (unique per request of a scenario)."""
    return [label, *range(1, length)]


@dataclass
class Run:
    """What one coordinator gave a scenario's peers."""

    clients: list[Any] = field(default_factory=list)  # per client: {crid: outcome}
    engines: dict[str, list[Any]] = field(default_factory=dict)  # identity: its inbox
    roles: dict[str, str] = field(default_factory=dict)
    over_capacity: dict[str, list[Any]] = field(default_factory=dict)
    violations: dict[str, list[str]] = field(default_factory=dict)
    pins: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def role_inboxes(self, role: str) -> dict[str, list[Any]]:
        return {name: inbox for name, inbox in self.engines.items() if self.roles[name] == role}


class Fleet:
    """A scenario's peers on one coordinator's address."""

    def __init__(self, address: str, kv_dir: str):
        self.address, self.kv_dir = address, kv_dir
        self.engines: list[pd.PDEngine] = []
        self.clients: list[pd.PDClient] = []

    def engine(self, role: str, index: int = 0, **options: Any) -> pd.PDEngine:
        engine = pd.PDEngine(self.address, role, index=index, kv_dir=self.kv_dir, **options)
        self.engines.append(engine.start())
        return engine

    def client(self) -> pd.PDClient:
        peer = pd.PDClient(self.address).connect()
        self.clients.append(peer)
        return peer

    def settle(self) -> None:
        """Every prefill's pins gone (or given up on), and the last replies taken."""
        with_pins = [e for e in self.engines if not e._dead]
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(e.pins() for e in with_pins):
            time.sleep(0.02)
        for peer in self.clients:
            peer.pump(0.2)

    def run(self) -> Run:
        labels = _labels(self.engines)
        result = Run()
        for peer in self.clients:
            result.clients.append({rid: _outcome(o) for rid, o in peer.outcomes.items()})
            assert peer.violations == [], peer.violations
        for engine in self.engines:
            name = engine.identity.decode()
            result.roles[name] = engine.role
            result.engines[name] = [_message(msg, labels) for msg in engine.received()]
            result.over_capacity[name] = [labels.get(rid, rid) for rid in engine.over_capacity]
            result.violations[name] = list(engine.violations)
            result.pins[name] = {} if engine._dead else engine.pins()  # a killed one's froze
        return result

    def close(self) -> None:
        for engine in self.engines:
            if not engine._stop.is_set():
                engine.stop()
        for peer in self.clients:
            peer.close()


def _labels(engines: list[pd.PDEngine]) -> dict[int, Any]:
    """Server request id -> the request's label, from the prompts the engines got."""
    labels: dict[int, Any] = {}
    for engine in engines:
        for msg in engine.received():
            if msg[0] in (pd.SUBMIT, pd.SUBMIT_KV) and len(msg) > 2:
                body = msg[2]
                label = body if isinstance(body, str) else body[0] if body else None
                labels.setdefault(int(msg[1]), label)
    return labels


def _message(msg: list[Any], labels: dict[int, Any]) -> tuple[Any, ...]:
    """An engine's inbound message with its request id replaced by its label; a
    handoff's kv_meta by its block ids and resume token (agents are per process)."""
    header = msg[0]
    if header == pd.SUBMIT:
        return (header, labels.get(msg[1], msg[1]), msg[2], msg[3])
    if header == pd.SUBMIT_KV:
        kv_meta = msg[4] if isinstance(msg[4], dict) else {}
        return (header, labels.get(msg[1], msg[1]), msg[2], msg[3], kv_meta.get("resume_tokens"))
    if header in (pd.RELEASE_KV, pd.ABORT):
        return (header, labels.get(msg[1], msg[1]))
    if header == pd.SEND_KV:
        return (header, labels.get(msg[1], msg[1]), msg[3])
    return tuple(msg)


def _outcome(outcome: pd.Outcome) -> dict[str, Any]:
    final = None
    if outcome.final is not None:
        final = {k: v for k, v in outcome.final.items() if k != "request_id"}
    return {
        "terminals": list(outcome.terminals),
        "final": final,
        "error": outcome.error,
        "aborted": list(outcome.aborted),
        "partial_tokens": outcome.tokens,
    }


# -- the two coordinators -----------------------------------------------------------------

Scenario = Callable[[Fleet], None]
Compare = Callable[[Scenario], tuple[Run, Run]]
_ORACLE: dict[str, Run] = {}


@pytest.fixture(scope="session")
def reference_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    release = reference.release_dir(reference.RELEASES["pr6675"])
    return reference.build_tree(release, tmp_path_factory.mktemp("pr6675"))


def _play(scenario: Scenario, address: str, kv_dir: str) -> Run:
    fleet = Fleet(address, kv_dir)
    try:
        scenario(fleet)
        fleet.settle()
        return fleet.run()
    finally:
        fleet.close()


@pytest.fixture
def compare(reference_tree: Path, impl: Any, kv_dir: str) -> Iterator[Compare]:
    """``compare(scenario)``: (the PR's run, coordkit's run) of one scripted scenario;
    the PR's is played once per session."""
    from coordkit import Coordinator

    coords: list[Any] = []

    def play(scenario: Scenario) -> tuple[Run, Run]:
        name = scenario.__name__
        if name not in _ORACLE:
            oracle = reference.reference_coordinator(reference_tree, 0, disaggregated=True)
            with oracle as (process, address):
                _ORACLE[name] = _play(scenario, address, kv_dir + "/pr")
                assert process.poll() is None, "the PR's coordinator died"
        coord = Coordinator(
            f"ipc://{kv_dir}/coord",
            implementation=impl.name,
            dialect="megatron-core",
            megatron_version="pr6675",
        )
        coord.start()
        coords.append(coord)
        return _ORACLE[name], _play(scenario, coord.address, kv_dir + "/ck")

    yield play
    for coord in coords:
        coord.stop()


def assert_sound(run: Run) -> None:
    """No engine over its capacity, no transfer violated, no pin left."""
    assert {k: v for k, v in run.over_capacity.items() if v} == {}
    assert {k: v for k, v in run.violations.items() if v} == {}
    assert {k: v for k, v in run.pins.items() if v} == {}


def per_kind(inbox: list[Any]) -> dict[Any, list[Any]]:
    """An engine's messages by header, each kind in the order it came."""
    kinds: dict[Any, list[Any]] = {}
    for msg in inbox:
        kinds.setdefault(msg[0], []).append(msg)
    return kinds


def two_hops_each(run: Run, labels: list[Any]) -> None:
    """Every request went through exactly one prefill and one decode."""
    for label in labels:
        prefills = [
            msg
            for inbox in run.role_inboxes("prefill").values()
            for msg in inbox
            if msg[:2] == (pd.SUBMIT, label)
        ]
        decodes = [
            msg
            for inbox in run.role_inboxes("decode").values()
            for msg in inbox
            if msg[:2] == (pd.SUBMIT_KV, label)
        ]
        assert (len(prefills), len(decodes)) == (1, 1), (label, prefills, decodes)


def fifo(run: Run, role: str, header: int, clients: int = 1) -> None:
    """Each engine of ``role`` got each client's hops in its submission order (client
    ``c``'s labels are ``1000 * (c + 1) + i``)."""
    for name, inbox in run.role_inboxes(role).items():
        for c in range(clients):
            mine = range(1000 * (c + 1), 1000 * (c + 2))
            order = [msg[1] for msg in inbox if msg[0] == header and msg[1] in mine]
            assert order == sorted(order), (name, order)


# -- scenarios ------------------------------------------------------------------------------


def unequal_capacities_under_load(fleet: Fleet) -> None:
    """Four engines of unequal capacity; two clients' 24 short requests each (below any
    threshold), interleaved, one in two streaming, more than the fleet holds at once;
    then PAUSE and STOP."""
    fleet.engine("prefill", 0, capacity=2, prefill_seconds=0.01)
    fleet.engine("prefill", 1, capacity=3, prefill_seconds=0.01)
    fleet.engine("decode", 0, capacity=2, step_seconds=0.005)
    fleet.engine("decode", 1, capacity=4, step_seconds=0.005)
    peers = [fleet.client(), fleet.client()]
    rids: list[tuple[pd.PDClient, int]] = []
    for i in range(24):
        for c, peer in enumerate(peers):
            submit = peer.submit_streaming if i % 2 else peer.submit
            rids.append((peer, submit(prompt(1000 * (c + 1) + i), num_tokens_to_generate=4)))
    for peer, rid in rids:
        peer.wait(rid, 30)
    peers[0].signal(pd.PAUSE)
    peers[0].signal(pd.STOP)
    wait_for(lambda: all(e.received(pd.STOP) for e in fleet.engines))


def test_registration_unequal_capacities_and_a_load_above_capacity(compare: Compare) -> None:
    """Point 1-3: every request of a #6675 fleet gets both hops (never run whole on a
    role engine, however short), a decode's reply; capacity counted as the PR does
    (prompts and pinned handoffs until RELEASE_KV); FIFO per role and client; PAUSE
    then STOP reach every engine."""
    oracle, ours = compare(unequal_capacities_under_load)
    assert ours.clients == oracle.clients
    labels = [1000 * c + i for c in (1, 2) for i in range(24)]
    for run in (oracle, ours):
        two_hops_each(run, labels)
        fifo(run, "prefill", pd.SUBMIT, clients=2)
        assert_sound(run)
        for inbox in run.engines.values():
            assert [m for m in inbox if m[0] in pd.CONTROL] == [(pd.PAUSE,), (pd.STOP,)]
    for name in oracle.engines:  # registration: one ACK each, first
        assert ours.engines[name][0] == oracle.engines[name][0] == (pd.REGISTER_ROLE_ACK,)


def aborts_at_every_point(fleet: Fleet) -> None:
    """One prefill and one decode, each of capacity 1, so that every abort point is
    reached in turn."""
    prefill = fleet.engine("prefill", capacity=1)
    decode = fleet.engine("decode", capacity=1, step_seconds=0.02)
    peer = fleet.client()
    # queued at the coordinator, and at the prefill (its reply pinned after the abort)
    prefill.hold()
    at_prefill = peer.submit(prompt(1), num_tokens_to_generate=30)
    queued = peer.submit(prompt(2), num_tokens_to_generate=30)
    wait_for(lambda: len(prefill.received(pd.SUBMIT)) == 1)
    time.sleep(0.1)
    peer.abort(queued)
    peer.wait(queued)
    peer.abort(at_prefill)
    wait_for(lambda: len(prefill.received(pd.ABORT)) == 1)
    prefill.proceed()
    peer.wait(at_prefill)
    # decoding (a stream), and one queued for the decode's capacity behind it
    stream = peer.submit_streaming(prompt(3), num_tokens_to_generate=200)
    wait_for(lambda: peer.pump(0.01) >= 0 and len(peer.outcomes[stream].partials) >= 2)
    behind = peer.submit(prompt(4), num_tokens_to_generate=30)
    wait_for(lambda: len(prefill.received(pd.SUBMIT)) == 3)
    wait_for(lambda: bool(prefill.pins()))  # its handoff made, waiting for the decode
    time.sleep(0.1)
    peer.abort(behind)
    peer.wait(behind)
    peer.abort(stream)
    peer.wait(stream)
    # Both free the decode's seat at its REQUEST_ABORTED, which the engine sends before
    # its next step drops the request: the next import waits for that step, so that
    # what the engine holds is the script's, not the race's.
    wait_for(lambda: not decode.requests())
    # decoding (a future)
    future = peer.submit(prompt(5), num_tokens_to_generate=200)
    wait_for(lambda: len(decode.sent(pd.KV_READ_DONE)) == 2)  # the stream's, then its
    time.sleep(0.05)
    peer.abort(future)
    peer.wait(future)
    wait_for(lambda: not decode.requests())
    # the fleet serves on
    after = peer.submit(prompt(6), num_tokens_to_generate=3)
    peer.wait(after)


def test_aborts_at_every_point(compare: Compare) -> None:
    """Point 4: queued at the coordinator, at the prefill (its pinned reply not handed
    on, RELEASE_KV to it), queued for decode capacity, decoding (a stream, a future):
    each ends with one REQUEST_ABORTED [31, crid, True]; every engine got the same."""
    oracle, ours = compare(aborts_at_every_point)
    for run in (oracle, ours):
        outcomes = run.clients[0]
        for rid in range(5):
            assert outcomes[rid]["terminals"] == [pd.REQUEST_ABORTED], (rid, outcomes[rid])
            assert outcomes[rid]["aborted"] == [True]
        assert outcomes[5]["terminals"] == [pd.REPLY]
        assert_sound(run)
    # a stream's partials before its abort are timing's: compared by the rest
    strip = [{**o, "partial_tokens": None} for o in ours.clients[0].values()]
    assert strip == [{**o, "partial_tokens": None} for o in oracle.clients[0].values()]
    assert ours.engines == oracle.engines


def hybrid_ssm_capacity(fleet: Fleet) -> None:
    """A hybrid (Mamba) fleet: each engine's SSM slots as many as its requests, a
    prefill's handoff holding a slot until RELEASE_KV, a decode's one per import."""
    hybrid = pd.Geometry(hybrid=True)
    fleet.engine("prefill", capacity=2, geometry=hybrid, prefill_seconds=0.01)
    fleet.engine("decode", capacity=2, geometry=hybrid, step_seconds=0.005)
    peer = fleet.client()
    rids = [peer.submit(prompt(1000 + i), num_tokens_to_generate=5) for i in range(8)]
    for rid in rids:
        peer.wait(rid, 30)


def test_a_hybrid_fleets_ssm_slots(compare: Compare) -> None:
    """Point 2 for a hybrid model: SSM slots reserved as the PR's flow control reserves
    them (a prefill's until RELEASE_KV, a decode's from its handoff), every message the
    same, in order, and no engine past its slots."""
    oracle, ours = compare(hybrid_ssm_capacity)
    assert ours.clients == oracle.clients
    assert all(o["terminals"] == [pd.REPLY] for o in ours.clients[0].values())
    for run in (oracle, ours):
        two_hops_each(run, [1000 + i for i in range(8)])
        fifo(run, "prefill", pd.SUBMIT)
        assert_sound(run)
    assert {k: per_kind(v) for k, v in ours.engines.items()} == {
        k: per_kind(v) for k, v in oracle.engines.items()
    }


def refusals_and_engine_errors(fleet: Fleet) -> None:
    fleet.engine("prefill")
    fleet.engine("decode")
    peer = fleet.client()
    refused = peer.submit(prompt(1), return_log_probs=True, skip_prompt_log_probs=False)
    peer.wait(refused)
    top_n = peer.submit(prompt(2), num_tokens_to_generate=3, top_n_logprobs=2)
    peer.wait(top_n)
    served = peer.submit(
        prompt(3), num_tokens_to_generate=3, return_log_probs=True, skip_prompt_log_probs=True
    )
    peer.wait(served)


def test_refusals_and_a_decodes_request_error(compare: Compare) -> None:
    """Point 5: prompt log probs are refused [29, crid, reason, True] and reach no
    engine; a decode's REQUEST_ERROR (top-n log probs cannot be handed off) reaches the
    client once, its prefill's pins released; generation log probs are served."""
    oracle, ours = compare(refusals_and_engine_errors)
    assert oracle.clients[0][0]["terminals"] == [pd.REQUEST_ERROR]
    assert oracle.clients[0][1]["terminals"] == [pd.REQUEST_ERROR]
    assert ours.clients == oracle.clients
    assert ours.engines == oracle.engines
    assert_sound(ours)


def pause_cycle_and_stop(fleet: Fleet) -> None:
    """Over NCCL: KV_TRANSFER_READY, then SEND_KV to the prefill."""
    fleet.engine("prefill", 0, capacity=2, transport="nccl")
    fleet.engine("decode", 0, capacity=3, step_seconds=0.005, transport="nccl")
    peer = fleet.client()
    first = peer.submit(prompt(100), num_tokens_to_generate=3)
    peer.wait(first)
    peer.signal(pd.PAUSE)
    peer.signal(pd.SUSPEND)
    peer.signal(pd.SET_GENERATION_EPOCH, 7)
    rids = [peer.submit(prompt(200 + i), num_tokens_to_generate=3) for i in range(12)]
    peer.signal(pd.RESUME)
    peer.signal(pd.UNPAUSE)
    for rid in rids:
        peer.wait(rid)
    peer.signal(pd.PAUSE)
    peer.signal(pd.STOP)
    wait_for(lambda: all(e.received(pd.STOP) for e in fleet.engines))


def test_pause_cycle_then_stop_reaches_every_engine(compare: Compare) -> None:
    """Point 6: PAUSE, SUSPEND, SET_GENERATION_EPOCH, RESUME, UNPAUSE reach each engine
    in order; the 12 requests submitted meanwhile complete with decode replies; PAUSE
    then STOP reach every live engine, prefills and decodes alike. Over NCCL: each
    SEND_KV after its decode's KV_TRANSFER_READY, in the same order."""
    oracle, ours = compare(pause_cycle_and_stop)
    assert ours.clients == oracle.clients
    for run in (oracle, ours):
        two_hops_each(run, [100, *range(200, 212)])
        for inbox in run.engines.values():
            controls = [msg for msg in inbox if msg[0] in pd.CONTROL]
            assert controls == [(40,), (42,), (44, 7), (43,), (41,), (40,), (45,)]
        for inbox in run.role_inboxes("prefill").values():  # each SEND_KV between them
            for label in [100, *range(200, 212)]:
                kinds = [m[0] for m in inbox if m[0] in (20, 25, 26) and m[1] == label]
                assert kinds == [pd.SUBMIT, pd.SEND_KV, pd.RELEASE_KV], (label, kinds)
    # Each kind of message in the same order; how kinds interleave is the peers' timing
    # (a SEND_KV waits for the decode, a control signal for the client).
    assert {k: per_kind(v) for k, v in ours.engines.items()} == {
        k: per_kind(v) for k, v in oracle.engines.items()
    }


def str_prompt(fleet: Fleet) -> None:
    fleet.engine("prefill", tensor_prompt_tokens=True)  # as Megatron serializes them
    fleet.engine("decode")
    peer = fleet.client()
    rid = peer.submit("hello world", num_tokens_to_generate=3)
    peer.wait(rid)
    after = peer.submit(prompt(5), num_tokens_to_generate=3)
    peer.wait(after)


def test_a_str_prompt(compare: Compare) -> None:
    """Point 7, BEYOND the PR: the PR hands a decode the str prompt, which it cannot read
    (its REQUEST_ERROR reaches the client); coordkit serves it (docs/pd.md), its decode
    hop carrying the prompt's tokens as a list -- what the PR's decode reads -- taken
    from the prefill's record, where Megatron serializes them as ["tensor", [ids]]."""
    oracle, ours = compare(str_prompt)
    assert oracle.clients[0][0]["error"] == (pd.STR_PROMPT_ERROR, True)
    final = ours.clients[0][0]["final"]
    assert final is not None and final["generated_tokens"] == pd.expected_tokens("hello world", 3)
    decode = ours.role_inboxes("decode")["decode_s0_dp0"]
    [hop2] = [m for m in decode if m[:2] == (pd.SUBMIT_KV, "hello world")]
    assert hop2[2] == pd.tokenize("hello world")
    assert ours.clients[0][1] == oracle.clients[0][1]
    assert_sound(ours)


def prefill_death(fleet: Fleet) -> None:
    first = fleet.engine("prefill", 0, capacity=2)
    fleet.engine("prefill", 1, capacity=2)
    decode = fleet.engine("decode", 0, capacity=4, step_seconds=0.02)
    peer = fleet.client()
    rids = [peer.submit(prompt(10 + i), num_tokens_to_generate=40) for i in range(4)]
    wait_for(lambda: len(decode.sent(pd.KV_READ_DONE)) == 4)  # all imported
    first.kill()
    time.sleep(0.2)
    later = [peer.submit(prompt(20 + i), num_tokens_to_generate=3) for i in range(3)]
    for rid in rids + later:
        peer.wait(rid, 30)


def test_a_prefills_death(compare: Compare) -> None:
    """Point 8, BEYOND the PR: a prefill dies (killed, no DISCONNECT) after a live decode
    imported its requests. The PR, on its next failed send to it, fails every request
    it ever routed there, the imported ones too, while the decode goes on generating
    them (and the next request it sends to the dead one); coordkit lets those complete,
    sends nothing new to the dead prefill, and the decode stays within its capacity."""
    oracle, ours = compare(prefill_death)
    ours_outcomes = ours.clients[0]
    assert all(o["terminals"] == [pd.REPLY] for o in ours_outcomes.values()), ours_outcomes
    failed = [o for o in oracle.clients[0].values() if o["terminals"] == [pd.REQUEST_ERROR]]
    assert failed and all("removed" in o["error"][0] for o in failed)
    assert_sound(ours)


def decode_death(fleet: Fleet) -> None:
    fleet.engine("prefill", 0, capacity=8)
    first = fleet.engine("decode", 0, capacity=4, step_seconds=0.05)
    fleet.engine("decode", 1, capacity=4, step_seconds=0.05)
    peer = fleet.client()
    rids = [peer.submit(prompt(10 + i), num_tokens_to_generate=60) for i in range(6)]
    wait_for(lambda: len(first.sent(pd.KV_READ_DONE)) >= 2)  # some imported at the first
    first.kill()
    time.sleep(0.2)
    rids += [peer.submit(prompt(20 + i), num_tokens_to_generate=3) for i in range(4)]
    deadline = time.monotonic() + 8  # the PR's lost ones never end
    while time.monotonic() < deadline and not all(peer.outcomes[r].done for r in rids):
        peer.pump(0.05)


def test_a_decodes_death(compare: Compare) -> None:
    """BEYOND the PR: a decode dies (killed, no DISCONNECT) while generating requests it
    imported. The PR sees it only when a later send to it fails; the requests it held
    end then with REQUEST_ERROR (source_safe False), or never where no send fails.
    coordkit sees the connection end: each of them prefills again (nothing of it was
    streamed) and completes at the live decode, one terminal reply each, no pin left."""
    oracle, ours = compare(decode_death)
    outcomes = ours.clients[0]
    assert len(outcomes) == 10
    assert all(o["terminals"] == [pd.REPLY] for o in outcomes.values()), outcomes
    assert_sound(ours)
    lost = [o for o in oracle.clients[0].values() if o["terminals"] != [pd.REPLY]]
    assert lost  # what the PR's fleet lost to the death
    assert all(o["terminals"] in ([], [pd.REQUEST_ERROR]) for o in lost)


def a_role_missing(fleet: Fleet) -> None:
    decode = fleet.engine("decode")
    peer = fleet.client()
    peer.wait(peer.submit(prompt(1), num_tokens_to_generate=3))  # no prefill
    decode.stop()
    fleet.engine("prefill")
    time.sleep(0.2)
    peer.wait(peer.submit(prompt(2), num_tokens_to_generate=3))  # no decode


def test_a_fleet_missing_a_role(compare: Compare) -> None:
    """No prefill registered, then no decode: each request ends with the PR's own
    ``[29, crid, "cannot route to ...: no ... engines registered", True]``, never run
    whole on the engine of the other role. Deliberately different: with no decode, the
    PR prefills the request first (and releases it); coordkit sends nothing."""
    oracle, ours = compare(a_role_missing)
    assert ours.clients == oracle.clients
    assert [o["error"] for o in ours.clients[0].values()] == [
        ("cannot route to prefill: no prefill engines registered", True),
        ("cannot route to decode: no decode engines registered", True),
    ]
    assert ours.engines["decode_s0_dp0"] == oracle.engines["decode_s0_dp0"] == [(2,)]
    hops = [m[:2] for m in oracle.engines["prefill_s0_dp0"]]
    assert hops == [(2,), (pd.SUBMIT, 2), (pd.RELEASE_KV, 2)]
    assert ours.engines["prefill_s0_dp0"] == [(2,)]
    assert_sound(ours)
