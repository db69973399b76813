"""A standby through an etcd lease: ``coordkit serve --ha``, on a real etcd server.

Two ``coordkit serve --ha etcd://.../NAME`` processes at two addresses: only
the lease's holder binds and serves. SIGSTOP it: its lease expires, the other
takes over with a higher epoch; SIGCONT it: its term is over, and it serves
nobody (its loop stops at its first wake-up past the term's deadline) but
stands again. Raw clients ask each address in turn. Both implementations.
"""

from __future__ import annotations

import signal
import time

import zmq

from tests.support.etcd import EtcdServer, etcd_server
from tests.support.peers import CONNECT, CONNECT_ACK, RawClient, m, um, wait_for
from tests.support.processes import free_tcp_address, ha_candidate

TTL = 1
TAKEOVER = 30.0  # seconds allowed for a lease to expire and the standby to serve


def epoch_at(address: str, timeout: float = 5.0) -> int | None:
    """The epoch a coordinator at ``address`` announces to a rebuild client, or None
    when nobody answers within ``timeout``."""
    client = RawClient(zmq.Context.instance(), address)
    try:
        client.send(m([CONNECT, {"coordkit": 1, "rebuild": 1}]))
        try:
            frames = client.recv(timeout)
        except TimeoutError:
            return None
        header, features = um(frames[0])
        assert header == CONNECT_ACK
        return int(features["epoch"])
    finally:
        client.close()


def test_a_standby_takes_over_and_a_frozen_leader_serves_nobody(tmp_path, impl, etcd: EtcdServer):
    name = etcd.endpoint(f"standby/{impl.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address(), free_tcp_address()]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with (
        ha_candidate(addresses[0], impl.name, logs[0], name, TTL) as first,
        ha_candidate(addresses[1], impl.name, logs[1], name, TTL) as second,
    ):
        wait_for(lambda: any("listening" in log.read_text() for log in logs), TAKEOVER)
        time.sleep(0.5)  # the other one, were it serving too, would have said so by now
        serving = ["listening" in log.read_text() for log in logs]
        assert serving.count(True) == 1, [log.read_text() for log in logs]
        lead = serving.index(True)
        leader, standby = (first, second) if lead == 0 else (second, first)
        epoch = epoch_at(addresses[lead])
        assert epoch is not None
        assert epoch_at(addresses[1 - lead], 1.0) is None  # the standby has not bound

        leader.send_signal(signal.SIGSTOP)
        wait_for(lambda: "listening" in logs[1 - lead].read_text(), TAKEOVER)
        taken_over = epoch_at(addresses[1 - lead])
        assert taken_over is not None and taken_over > epoch

        leader.send_signal(signal.SIGCONT)
        wait_for(lambda: "ended" in logs[lead].read_text(), TAKEOVER)
        assert epoch_at(addresses[lead], 2.0) is None  # the old leader serves nobody
        assert epoch_at(addresses[1 - lead]) == taken_over
        assert standby.poll() is None and leader.poll() is None


def test_a_candidate_outlives_an_etcd_outage_and_leads_again(tmp_path, impl):
    """etcd frozen past the lease: the leader's term ends and campaigning fails, but the
    candidate stays up (etcd answered once: the endpoint is right) and leads again,
    with a higher epoch, once etcd is back."""
    address, log = free_tcp_address(), tmp_path / "a.log"
    with etcd_server(tmp_path) as server:
        name = server.endpoint("outage")
        with ha_candidate(address, impl.name, log, name, TTL) as candidate:
            wait_for(lambda: "listening" in log.read_text(), TAKEOVER)
            epoch = epoch_at(address)
            assert epoch is not None
            server.process.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: "not reachable" in log.read_text(), TAKEOVER)
                time.sleep(3 * TTL)  # campaigning keeps failing meanwhile
                assert candidate.poll() is None, log.read_text()
            finally:
                server.process.send_signal(signal.SIGCONT)
            wait_for(lambda: (e := epoch_at(address, 1.0)) is not None and e > epoch, TAKEOVER)
            assert candidate.poll() is None
