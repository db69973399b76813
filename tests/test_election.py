"""The election through an etcd lease (coordkit/election.py), on a real etcd server.

In-process terms for the API; candidate processes (tests/support/candidate.py)
for what a standby must survive: a leader killed, frozen past its lease, or
resigning. Every time a candidate reports is one host's monotonic clock, so
"the old leader acted only before the new one's lease began" is checked
exactly: each ``serving`` check of the old term precedes the new term's start.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coordkit.election import MISSING_EXTRA, Election, Leader, Term, parse_endpoint
from tests.support.candidate import CandidateProcess
from tests.support.etcd import HOST, EtcdServer, etcd_server

#: The lease's TTL in these tests (the server's raft timers allow 1 s).
TTL = 1
#: How long past its TTL a lease may take to be expired: etcd checks every 0.5 s.
EXPIRY = TTL + 3.0

_names = itertools.count()


@pytest.fixture
def endpoint(etcd: EtcdServer) -> str:
    """A NAME no other test elects on."""
    return etcd.endpoint(f"test/{next(_names)}-{time.monotonic_ns()}")


@pytest.fixture
def spawn(endpoint: str) -> Iterator[Callable[..., CandidateProcess]]:
    """``spawn(value, ttl=TTL)``: a candidate process for ``endpoint``, killed at teardown."""
    made: list[CandidateProcess] = []

    def make(value: str, ttl: float = TTL) -> CandidateProcess:
        made.append(CandidateProcess(endpoint, ttl, value))
        return made[-1]

    yield make
    for candidate in made:
        candidate.close()


@contextlib.contextmanager
def term_of(election: Election, timeout: float = 10.0) -> Iterator[Term]:
    with election, election.campaign(timeout) as term:
        yield term


def etcd_client(endpoint: str) -> Any:
    """A plain etcd3gw client for the server of ``endpoint`` (the test's own hand on etcd)."""
    import etcd3gw

    host, port, _ = parse_endpoint(endpoint)
    return etcd3gw.client(host=host, port=port)


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and text.startswith("coordkit: "), text
    return text


# -- addresses and arguments -----------------------------------------------------------


@pytest.mark.parametrize(
    "text, parts",
    [
        ("etcd://127.0.0.1:2379/dp0", ("127.0.0.1", 2379, "dp0")),
        ("etcd://etcd-0.example:12379/prod/dp-0.a_b", ("etcd-0.example", 12379, "prod/dp-0.a_b")),
        ("etcd://[::1]:2379/x", ("::1", 2379, "x")),
    ],
)  # fmt: skip
def test_parse_endpoint(text: str, parts: tuple[str, int, str]) -> None:
    endpoint = parse_endpoint(text)
    assert tuple(endpoint) == parts
    assert str(endpoint) == text
    assert endpoint.key == "coordkit/leader/" + parts[2]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("http://h:2379/x", "it must start with etcd://"),
        ("h:2379/x", "it must start with etcd://"),
        ("etcd://h/x", "no port"),
        ("etcd://[::1]/x", "no port"),
        ("etcd://:2379/x", "no HOST"),
        ("etcd://h_1:2379/x", "'h_1' is not a host name or address"),
        ("etcd://h:/x", "the port must be a number from 1 to 65535, not ''"),
        ("etcd://h:0/x", "the port must be a number from 1 to 65535, not '0'"),
        ("etcd://h:99999/x", "the port must be a number from 1 to 65535, not '99999'"),
        ("etcd://h:2379", "no NAME after HOST:PORT/"),
        ("etcd://h:2379/", "no NAME after HOST:PORT/"),
        ("etcd://h:2379/a b", "NAME takes letters"),
        ("etcd://h:2379/a//b", "NAME takes letters"),
        ("etcd://h:2379/a/", "NAME takes letters"),
    ],
)
def test_malformed_endpoint_gets_one_line(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as exc:
        Election(text)
    assert one_line(exc).startswith(f"coordkit: {text!r} is not etcd://HOST:PORT/NAME ({reason}")


@pytest.mark.parametrize("ttl", [0, 0.5, 2.5, -3, "3"])
def test_ttl_is_whole_seconds(ttl: object) -> None:
    with pytest.raises(ValueError) as exc:
        Election("etcd://127.0.0.1:2379/x", ttl=ttl)  # type: ignore[arg-type]
    assert "ttl must be a whole number of seconds" in one_line(exc)


def test_missing_extra_gets_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd3gw", None)  # what an uninstalled package imports as
    with pytest.raises(ImportError) as exc:
        Election("etcd://127.0.0.1:2379/x")
    assert (
        one_line(exc)
        == MISSING_EXTRA
        == ("coordkit: --ha needs the ha extra: pip install 'coordkit[ha]'")
    )


def test_unreachable_etcd_fails_the_campaign_within_a_ttl() -> None:
    with socket.socket() as sock:  # a port that was free: nothing listens on it
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    with Election(f"etcd://{HOST}:{port}/x", ttl=TTL) as election:
        with pytest.raises(ConnectionError) as exc:
            election.campaign()
    assert time.monotonic() - began < TTL + 2
    assert one_line(exc) == f"coordkit: etcd at {HOST}:{port} is not reachable: connection refused"


# -- terms in one process --------------------------------------------------------------


def test_one_leader_at_a_time_and_epochs_increase(endpoint: str) -> None:
    first, second = Election(endpoint, ttl=TTL, value="tcp://a:1"), Election(endpoint, ttl=TTL)
    with first, second:
        assert second.leader() is None
        term = first.campaign(timeout=5)
        assert term.valid() and not term.lost.is_set()
        assert second.leader() == Leader(b"tcp://a:1", term.epoch)
        with pytest.raises(TimeoutError) as exc:
            second.campaign(timeout=0.3)
        assert f"held by b'tcp://a:1', epoch {term.epoch}" in one_line(exc)

        time.sleep(2.5 * TTL)  # kept alive past its TTL
        assert term.valid() and second.leader() == Leader(b"tcp://a:1", term.epoch)
        assert term.publish("tcp://a:2")
        assert second.leader() == Leader(b"tcp://a:2", term.epoch)

        lost: list[str] = []
        term.on_lost(lost.append)
        term.resign()
        assert lost == ["resigned"] and term.reason == "resigned"
        assert term.lost.is_set() and not term.valid()
        with second.campaign(timeout=TTL / 2) as successor:  # no wait for the old lease
            assert successor.epoch > term.epoch
            assert not term.publish("tcp://a:3")  # a term that is over cannot write
            assert first.leader() == Leader(b"", successor.epoch)
        term.resign()  # again: nothing


def test_a_key_deleted_by_hand_ends_the_term(endpoint: str) -> None:
    with term_of(Election(endpoint, ttl=TTL)) as term:
        assert etcd_client(endpoint).delete(parse_endpoint(endpoint).key)
        assert term.lost.wait(TTL + 1), "the keepalive did not notice"
        assert not term.valid() and "deleted or taken" in str(term.reason)


def test_a_revoked_lease_ends_the_term(endpoint: str) -> None:
    with term_of(Election(endpoint, ttl=TTL)) as term:
        from etcd3gw import Lease

        Lease(term.lease_id, etcd_client(endpoint)).revoke()
        assert term.lost.wait(TTL + 1), "the keepalive did not notice"
        assert not term.valid() and term.reason == "the lease expired"


def test_etcd_gone_ends_the_term_within_its_ttl(tmp_path) -> None:
    with etcd_server(tmp_path) as server:
        with term_of(Election(server.endpoint("gone"), ttl=TTL)) as term:
            server.process.kill()
            gone = time.monotonic()
            assert term.lost.wait(TTL + 1)
            assert time.monotonic() - gone <= TTL + 0.5
            assert term.reason == f"no keepalive was answered for {TTL} s"
            assert term.deadline < time.monotonic() and not term.valid()


# -- candidate processes ---------------------------------------------------------------


def test_standby_takes_over_a_killed_leader(spawn: Callable[..., CandidateProcess]) -> None:
    a = spawn("tcp://a:5555")
    leading = a.wait_for("leading", 10)
    b = spawn("tcp://b:5555")
    b.wait_for("waiting", 10)
    time.sleep(2 * TTL)
    assert b.first("leading") is None, "two leaders"
    killed = a.signal(signal.SIGKILL)
    taken = b.wait_for("leading", EXPIRY)
    assert taken.epoch is not None and leading.epoch is not None
    assert taken.epoch > leading.epoch
    assert taken.at - killed < EXPIRY
    assert b.wait_for("serving", 1).epoch == taken.epoch


def test_frozen_leader_loses_its_term_before_it_acts(
    spawn: Callable[..., CandidateProcess],
) -> None:
    a = spawn("tcp://a:5555")
    old = a.wait_for("leading", 10)
    b = spawn("tcp://b:5555")
    b.wait_for("waiting", 10)
    a.wait_for("serving", 1)
    a.signal(signal.SIGSTOP)
    new = b.wait_for("leading", EXPIRY)
    assert new.epoch is not None and old.epoch is not None and new.epoch > old.epoch
    time.sleep(0.2)
    woken = a.signal(signal.SIGCONT)
    lost = a.wait_for("lost", 5)
    a.wait_for("exited", 5)
    assert a.process.wait(5) == 0
    # It learned on waking, and never served its old term after the new one began.
    assert lost.epoch == old.epoch and lost.at >= woken
    served = [line.at for line in a.lines if line.word == "serving"]
    assert served and max(served) < new.at
    assert [line.word for line in a.lines].count("leading") == 1
    assert b.wait_for("serving", 1).epoch == new.epoch


def test_resign_hands_over_at_once(spawn: Callable[..., CandidateProcess]) -> None:
    ttl = 5  # a takeover sooner than this did not wait for the lease
    a = spawn("tcp://a:5555", ttl)
    old = a.wait_for("leading", 10)
    b = spawn("tcp://b:5555", ttl)
    b.wait_for("waiting", 10)
    time.sleep(0.5)  # b is watching
    asked = time.monotonic()
    a.send("resign")
    new = b.wait_for("leading", ttl - 1)
    assert new.at - asked < ttl - 1
    assert a.wait_for("lost", 1).rest == "resigned"
    assert new.epoch is not None and old.epoch is not None and new.epoch > old.epoch
    assert max(line.at for line in a.lines if line.word == "serving") < new.at
