"""A peer's bad input costs no other peer anything: one identity, one role; a reply
counts only from the engine that holds the request; a rebuild claim is adopted only
where it can be true; and a soak of rogue peers beside well-behaved ones.

Each test runs on both loop cores. The wire tests speak the layouts as raw peers
(tests/support/peers.py); the soak runs honest engines and rogue peers as processes
of their own (tests/support/rogues.py) beside a coordkit client and a Megatron main
client, and checks every reply the clean clients got against what their engines sent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.support.cluster import Cluster
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    ENGINE_ACK,
    ERROR,
    HANDLED,
    HELD,
    PARTIAL,
    REJOIN,
    REPLAY,
    REPLAYED,
    REPLY,
    RESEND,
    SUBMIT,
    MainClient,
    RawClient,
    RawEngine,
    m,
    um,
    wait_for,
)
from tests.support.processes import ROOT, python_env
from tests.support.rogues import STREAM

MALFORMED = 1


def counters(c: Cluster) -> dict[str, int]:
    return c.coord.stats()["counters"]


def engine_ids(c: Cluster) -> list[bytes]:
    return [e["identity"].encode() for e in c.coord.stats()["engines"]]


def rebuild_client(c: Cluster, identity: bytes) -> RawClient:
    client = RawClient(c.ctx, c.coord.address, identity)
    c.peers.append(client)
    client.send(m([CONNECT, {"coordkit": 1, "rebuild": 1}]))
    assert um(client.recv()[0])[0] == CONNECT_ACK
    return client


def rebuild_engine(c: Cluster, identity: bytes, session: int = 1) -> RawEngine:
    engine = c.add_engine(identity)
    engine.hello(ack=1, rebuild=1, base=1, session=session)
    assert um(engine.recv()[0])[0] == ENGINE_ACK
    return engine


def submitted(engine: RawEngine) -> int:
    """The server id of the next SUBMIT the engine gets."""
    meta = um(engine.recv()[0])
    assert meta[0] == SUBMIT
    return meta[1]


# -- one identity, one role -----------------------------------------------------------


def test_a_departed_clients_registration_is_refused(make_cluster):
    """A Megatron client CONNECTs, its socket closes, a new socket with its identity
    sends the empty frame: it is not an engine (it was before: the departure is seen
    at once and the client forgotten)."""
    with make_cluster(n_engines=1) as c:
        client = c.main_client(b"mg")
        departed = counters(c)["clients_departed"]
        client.close()
        c.peers.remove(client)
        wait_for(lambda: counters(c)["clients_departed"] > departed)
        ghost = RawEngine(c.ctx, c.coord.address, b"mg")
        c.peers.append(ghost)
        malformed = counters(c)["malformed"]
        ghost.register()
        wait_for(lambda: counters(c)["malformed"] > malformed)
        assert engine_ids(c) == [b"engine-0"]


def test_a_live_clients_registration_is_refused_in_any_order(make_cluster):
    with make_cluster(n_engines=1) as c:
        client = c.client(identity=b"mg")
        client.send(b"")  # from the same socket, after its CONNECT
        wait_for(lambda: counters(c)["malformed"] == 1)
        client.send(m([SUBMIT, 1, {}]), m([1]))  # still a client: served
        assert um(c.engines[0].recv()[0])[0] == SUBMIT
        assert engine_ids(c) == [b"engine-0"]


def test_an_evicted_clients_registration_is_refused(make_cluster):
    """A full client table forgets the client idle longest: its identity stays a client's."""
    with make_cluster(n_engines=1, max_clients=1) as c:
        first = c.client(identity=b"first")
        c.client(identity=b"second")  # takes first's place
        first.send(b"")
        wait_for(lambda: counters(c)["malformed"] == 1)
        assert engine_ids(c) == [b"engine-0"]


def test_a_retired_engines_identity_never_connects_as_a_client(make_cluster):
    """A gone engine's rank reused once the table is full: its identity stays an engine's."""
    with make_cluster(max_engines=1) as c:
        old = c.add_engine(b"old")
        old.send(m([60]))  # DISCONNECT, nothing in flight: gone
        wait_for(lambda: c.coord.stats()["engines"][0]["state"] == "gone")
        new = RawEngine(c.ctx, c.coord.address, b"new").register()  # the gone rank's place
        c.peers.append(new)
        wait_for(lambda: engine_ids(c) == [b"new"])
        old.send(m([CONNECT, {"coordkit": 1}]))
        wait_for(lambda: counters(c)["malformed"] == 1)
        old.assert_silent()  # no CONNECT_ACK
        assert c.coord.stats()["clients"] == 0


# -- a reply counts only from the engine that holds the request ----------------------


def test_a_reply_from_another_engine_is_refused(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = submitted(c.engines[0])
        c.engines[1].send(m([REPLY, [[sid, False]]]), b"forged")
        wait_for(lambda: counters(c)["unknown_request"] == 1)
        c.engines[0].send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]
        c.engines[0].send(m([REPLY, [[sid, False]]]), b"again")  # never delivered twice
        client.assert_silent()


def test_a_second_process_under_an_engines_identity_takes_none_of_its_requests(make_cluster):
    """A new process registers under a live engine's identity (a duplicate rank, or a
    restart not noticed yet): the old process's requests are re-sent elsewhere (it
    never started them), and its late replies, from its old connection, reach nobody."""
    for hello in (False, True):
        with make_cluster(policy="round_robin") as c:
            victim = rebuild_engine(c, b"e0", session=11) if hello else c.add_engine(b"e0")
            other = c.add_engine(b"e1")
            client = c.client(coordkit=True)
            client.send(m([SUBMIT, 1, {}]), m([1]))
            sid = submitted(victim)
            duplicate = RawEngine(c.ctx, c.coord.address, b"e0").register()
            c.peers.append(duplicate)
            if hello:
                duplicate.hello(ack=1, session=22)
            wait_for(lambda: counters(c)["engine_restarts"] == 1)
            assert submitted(other) == sid  # re-sent to a live engine, under its id
            other.send(m([REPLY, [[sid, False]]]), b"true")
            assert client.recv() == [m([REPLY, 1]), b"true"]
            victim.send(m([REPLY, [[sid, False]]]), b"late")
            client.assert_silent()
            assert c.coord.stats()["inflight"] == 0


def test_the_same_process_back_on_a_new_connection_keeps_its_requests(make_cluster):
    """A coordkit engine whose hello names the same process (a blip over tcp, within
    the grace) is not a restart."""
    with make_cluster(transport="tcp") as c:
        engine = rebuild_engine(c, b"e0", session=7)
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = submitted(engine)
        engine.close()
        c.peers.remove(engine)
        back = RawEngine(c.ctx, c.coord.address, b"e0").register().hello(ack=1, session=7)
        c.peers.append(back)
        assert um(back.recv()[0])[0] == ENGINE_ACK
        back.send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]
        assert counters(c)["engine_restarts"] == 0


# -- a claim is adopted only where it can be true ------------------------------------


def test_a_report_of_another_engines_request_is_refused(make_cluster):
    with make_cluster(rebuild_window=30.0) as c:
        honest = rebuild_engine(c, b"e0")
        liar = rebuild_engine(c, b"e1")
        client = rebuild_client(c, b"ck")
        client.send(m([SUBMIT, 1, {}]), m([1]))
        engine, other = (honest, liar) if honest.sock.poll(2000) else (liar, honest)
        sid = submitted(engine)
        other.send(m([HELD, [[sid, 1, b"ck", 0, False]]]), b"")
        assert other.recv() == [m([ABORT, sid])]  # the first claim stands
        other.send(m([REPLAYED, [[sid, 0, 1, True]]]), b"forged")
        wait_for(lambda: counters(c)["refused_claims"] == 2)
        engine.send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]
        client.assert_silent()


def test_a_report_of_a_request_answered_in_this_life_is_refused(make_cluster):
    with make_cluster(rebuild_window=30.0) as c:
        engine = rebuild_engine(c, b"e0")
        client = rebuild_client(c, b"ck")
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = submitted(engine)
        engine.send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]
        # Reported again (a restarted engine's stale snapshot), under its id or another.
        engine.send(m([HELD, [[sid, 1, b"ck", 0, False], [5, 1, b"ck", 0, False]]]), b"")
        assert engine.recv_all() == [[m([ABORT, sid])], [m([ABORT, 5])]]
        assert counters(c)["adopted"] == 0 and c.coord.stats()["inflight"] == 0


def test_two_reports_of_one_request_the_first_stands(make_cluster):
    with make_cluster(rebuild_window=30.0) as c:
        first = rebuild_engine(c, b"e0")
        second = rebuild_engine(c, b"e1")
        first.send(m([HELD, [[500, 3, b"ck", 0, False]]]), b"")
        wait_for(lambda: counters(c)["adopted"] == 1)
        second.send(m([HELD, [[500, 3, b"ck", 0, False], [501, 3, b"ck", 0, False]]]), b"")
        assert second.recv_all() == [[m([ABORT, 500])], [m([ABORT, 501])]]
        client = rebuild_client(c, b"ck")
        client.send(m([REJOIN, [[3, 0]]]))
        assert first.recv() == [m([REPLAY, [[500, 0]]])]
        second.send(m([REPLAYED, [[500, 0, 1, True]]]), b"forged")  # never asked of it
        first.send(m([REPLAYED, [[500, 0, 1, True]]]), b"true")
        assert client.recv() == [m([REPLAYED, [[3, 0, True]]]), b"true"]
        client.assert_silent()
        # Answered: reported once more, it is not adopted again.
        second.send(m([HELD, [[500, 3, b"ck", 0, False]]]), b"")
        assert second.recv() == [m([ABORT, 500])]
        assert counters(c)["adopted"] == 1 and c.coord.stats()["inflight"] == 0


def test_a_replay_never_asked_is_refused(make_cluster):
    with make_cluster(rebuild_window=0.0) as c:
        engine = rebuild_engine(c, b"e0")
        client = rebuild_client(c, b"ck")
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = submitted(engine)
        engine.send(m([REPLAYED, [[sid, 0, 1, True]]]), b"unasked")
        wait_for(lambda: counters(c)["refused_claims"] == 1)
        client.assert_silent()
        engine.send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]


def test_a_report_for_a_client_that_asked_for_nothing_is_refused(make_cluster):
    """A connected client that did not ask for the rebuild, or a rebuild client whose
    first message was not a REJOIN: a report naming it is not adopted, and its own
    request of that id is not taken for a duplicate."""
    with make_cluster(n_engines=1, rebuild_window=30.0) as c:
        reporter = rebuild_engine(c, b"e9")
        plain = c.client(coordkit=True, identity=b"plain")
        rebuild = rebuild_client(c, b"ck")
        rebuild.send(m([SUBMIT, 1, {}]), m([1]))  # its first message: nothing to rejoin
        for engine in (c.engines[0], reporter):
            engine.recv_all(0.2)
        reporter.send(m([HELD, [[7, 2, b"plain", 0, False], [8, 2, b"ck", 0, False]]]), b"")
        assert reporter.recv_all() == [[m([ABORT, 7])], [m([ABORT, 8])]]
        plain.send(m([SUBMIT, 2, {}]), m([2]))
        rebuild.send(m([SUBMIT, 2, {}]), m([2]))
        got = [um(f[0])[0] for e in (c.engines[0], reporter) for f in e.recv_all()]
        assert got == [SUBMIT, SUBMIT]  # neither refused as a duplicate


def test_orphans_of_a_client_whose_first_message_is_no_rejoin_are_aborted(make_cluster):
    with make_cluster(rebuild_window=30.0) as c:
        engine = rebuild_engine(c, b"e0")
        client = rebuild_client(c, b"ck")
        engine.send(m([HELD, [[40, 2, b"ck", 0, False]]]), b"")  # while it is fresh
        wait_for(lambda: counters(c)["adopted"] == 1)
        client.send(m([SUBMIT, 2, {}]), m([2]))  # the same id: its first message
        aborted, new = engine.recv_all()
        assert aborted == [m([ABORT, 40])] and um(new[0])[:1] == [SUBMIT]
        assert counters(c)["duplicate_request"] == 0


def test_a_rejoin_is_the_first_message_only(make_cluster):
    with make_cluster(rebuild_window=0.0) as c:
        client = rebuild_client(c, b"ck")
        client.send(m([REJOIN, []]))
        client.send(m([REJOIN, [[1, 0]]]))
        [frames] = client.recv_all()
        assert um(frames[0])[:3] == [ERROR, None, MALFORMED]


@pytest.mark.parametrize("header", [RESEND, HANDLED, REPLAY, HELD])
def test_a_coordinators_message_from_a_peer_changes_nothing(make_cluster, header):
    with make_cluster(n_engines=1) as c:
        client = rebuild_client(c, b"ck")
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = submitted(c.engines[0])
        client.send(m([header, [[sid, 0]]]) if header != HANDLED else m([header, sid]))
        c.engines[0].send(m([header, [[sid, 0]]]), b"")
        assert um(client.recv()[0])[0] == ERROR  # unknown header
        c.engines[0].send(m([REPLY, [[sid, False]]]), b"true")
        assert client.recv() == [m([REPLY, 1]), b"true"]
        assert c.coord.stats()["inflight"] == 0


# -- the soak ------------------------------------------------------------------------

ROGUE_SECONDS = 8.0


def _process(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.support.rogues", *args]
    return subprocess.Popen(command, env=python_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)


class Outcome:
    """What a clean client got: each request's terminal replies, the bodies that are not
    what an honest engine sent for it, and the ERRORs."""

    def __init__(self) -> None:
        self.terminals: dict[int, int] = {}
        self.forged: list[tuple[int, object]] = []
        self.errors: list[list[object]] = []

    def reply(self, rid: int, prompt: bytes, body: object, final: bool) -> None:
        if not (isinstance(body, dict) and body.get("prompt") == prompt):
            self.forged.append((rid, body))
        elif final == bool(body.get("partial")):
            self.forged.append((rid, body))
        if final:
            self.terminals[rid] = self.terminals.get(rid, 0) + 1


def _clean_client(c: Cluster, kind: str, n: int, outcome: Outcome) -> None:
    """``n`` requests, 32 in flight, a quarter streamed, from a coordkit rebuild client
    (its identity travels in the trailers, for the rogues to forge; it sends again what
    it is told to, RESEND) or a Megatron main client; every message it gets is checked."""
    if kind == "coordkit":
        client: RawClient | MainClient = RawClient(c.ctx, c.coord.address, b"coordkit-clean")
        client.send(m([CONNECT, {"coordkit": 1, "rebuild": 1, "hold_ms": 5000}]))
        assert um(client.recv()[0])[0] == CONNECT_ACK
    else:
        client = MainClient(c.ctx, c.coord.address, b"megatron-clean").connect()
    prompts: dict[int, list[int]] = {}
    params: dict[int, dict[str, int]] = {}
    sent = 0
    deadline = time.monotonic() + 90
    while len(outcome.terminals) < n and time.monotonic() < deadline:
        while sent < n and sent - len(outcome.terminals) < 32:
            prompts[sent] = [sent, 9]
            params[sent] = {"num_tokens_to_generate": 1, **({STREAM: 1} if sent % 4 == 0 else {})}
            if isinstance(client, MainClient):
                client.submit(sent, prompts[sent], params[sent])
            else:
                client.send(m([SUBMIT, sent, params[sent]]), m(prompts[sent]))
            sent += 1
        if not client.sock.poll(100):
            continue
        if isinstance(client, MainClient):
            header, rid, body = client.recv_message()
        else:
            meta, *bodies = client.sock.recv_multipart()
            header, rid, *error = um(meta)
            if header == ERROR:
                outcome.errors.append([rid, *error])
                outcome.terminals[rid] = outcome.terminals.get(rid, 0) + 1
                continue
            if header == RESEND:  # its engine died before it started: sent again
                for resent in rid:
                    client.send(m([SUBMIT, resent, params[resent]]), m(prompts[resent]))
                continue
            if header not in (REPLY, PARTIAL) or len(bodies) != 1:
                outcome.errors.append([header, rid, *error, bodies])
                continue
            [body] = bodies
        outcome.reply(rid, m(prompts[rid]), um(body), header == REPLY)
    client.close()


def _clean_client_thread(c: Cluster, kind: str, n: int, outcome: Outcome) -> threading.Thread:
    """``_clean_client`` on a thread; an exception in it is an error of its outcome."""

    def run() -> None:
        try:
            _clean_client(c, kind, n, outcome)
        except Exception as exc:  # the test reports it, not the thread
            outcome.errors.append([repr(exc)])

    return threading.Thread(target=run)


def test_rogue_peers_cost_the_well_behaved_nothing(impl, tmp_path):
    """The failure model's promise under a storm: 10 rogue peers (Megatron main and
    coordkit clients and engines, churning their connections) send mutated and forged
    copies of every header, the rebuild's included, with live server ids and the live
    clients' identities, for 8 s, beside a coordkit client and a Megatron main client
    (2 000 requests each, a quarter streamed) served by two honest engines; the
    coordinator is in its rebuild window for the first 5 s. Every clean request ends
    with exactly one terminal reply, every body is what its engine sent, and when
    everyone has left, nothing is in flight."""
    address = f"ipc://{tmp_path}/coord.sock"
    n = 2000
    with Cluster(
        impl, address, dialect="megatron-core", megatron_version="main", heartbeat_timeout=10
    ) as c:
        honest = _process("honest", address, "2", impl.name)
        try:
            wait_for(lambda: len(engine_ids(c)) >= 2, 20)
            rogues = _process("hostile", address, str(ROGUE_SECONDS), "27")
            outcomes = {"coordkit": Outcome(), "megatron": Outcome()}
            threads = [_clean_client_thread(c, k, n, o) for k, o in outcomes.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            out, _ = rogues.communicate(timeout=60)
            assert rogues.returncode == 0 and "rogue messages sent" in out, out
            for name, outcome in outcomes.items():
                lost = [rid for rid in range(n) if rid not in outcome.terminals]
                twice = [rid for rid, count in outcome.terminals.items() if count > 1]
                assert not lost, (
                    f"{name}: {len(lost)} requests without a terminal reply "
                    f"{outcome.errors[:5]} {c.coord.stats()}"
                )
                assert not twice, f"{name}: {len(twice)} requests ended twice"
                assert not outcome.forged, f"{name}: forged {outcome.forged[:5]}"
                assert not outcome.errors, f"{name}: {outcome.errors[:5]}"
            wait_for(lambda: c.coord.stats()["inflight"] == 0, 15)
            stats = c.coord.stats()
            clean_engines = {b"honest-0", b"honest-1"}
            alive = {e["identity"].encode() for e in stats["engines"] if e["state"] == "alive"}
            assert not any(i.startswith(b"rogue") and b"client" in i for i in alive), alive
            assert clean_engines <= alive
            if os.environ.get("COORDKIT_SOAK_REPORT"):
                print(out, stats["counters"])
        finally:
            honest.kill()
            honest.wait()
