"""Endpoints given several coordinator addresses follow the one that serves, never an older epoch.

Scripted coordinators (bare ROUTERs) show the rule itself: a client or an
engine that followed a coordinator of epoch 7 refuses one that answers with
epoch 5 (and acts on nothing it sent), and follows one of epoch 7 again. The
end-to-end tests run real processes on a real etcd: two ``coordkit serve --ha``
candidates at two addresses, two engine processes and a client given both
addresses, hundreds of requests and streams in flight; the leader is SIGKILLed,
or SIGSTOPped (frozen past its lease, then woken): the standby takes over,
every request ends with its real final, every stream with each partial once,
no request starts twice, and the woken leader serves nobody. Both
implementations.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import zmq

from coordkit import Client, Coordinator, Engine
from coordkit.engine import Request
from tests.support.etcd import EtcdServer
from tests.support.peers import (
    CONNECT,
    CONNECT_ACK,
    ENGINE_ACK,
    ENGINE_HELLO,
    REJOIN,
    REPLY,
    SUBMIT,
    m,
    um,
    wait_for,
)
from tests.support.processes import engine_processes, free_tcp_address, ha_candidate
from tests.support.scripted import Script, run
from tests.support.steady_engine import check_outcome, collect, started, steady_engines

REQUESTS = 200
STREAMS = 40
LATER = 20  # sent once the frozen leader woke
#: Bounds, generous for a loaded 2-core machine; none is asserted as a timing.
SETTLE = 60.0
#: The lease's: 2 s, not 1, for a leader's keepalives on a loaded machine.
TTL = 2
#: Long enough for an endpoint to have gone round both addresses a few times.
ROUNDS = 1.5


def granted(epoch: int) -> bytes:
    return m([ENGINE_ACK, {"rebuild": 1, "epoch": epoch}])


def test_an_address_list_is_checked_before_anything_opens():
    for bad, problem in [
        ("tcp://a:1,,tcp://b:1", "an empty address"),
        ("tcp://a:1, tcp://a:1", "an address twice"),
        ("tcp://a:1,tcp://b", "no HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=problem):
            Engine(bad)
        with pytest.raises(ValueError, match=problem):
            asyncio.run(Client.connect(bad))
    with pytest.raises(ValueError, match="needs the rebuild"):
        Engine("tcp://a:1,tcp://b:1", rebuild=False)
    with pytest.raises(ValueError, match="needs failover_timeout > 0"):
        asyncio.run(Client.connect("tcp://a:1,tcp://b:1", failover_timeout=0))


def test_an_engine_refuses_a_coordinator_older_than_one_it_followed(tmp_path, impl):
    ctx = zmq.Context.instance()
    first, second = f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"

    def router(address: str) -> zmq.Socket:
        socket = ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as a coordinator's: a peer back takes over
        socket.bind(address)
        return socket

    def registration(engine: Engine, socket: zmq.Socket) -> bytes:
        """Poll ``engine`` (handing out nothing) until it registered at ``socket``
        with its ENGINE_HELLO; its identity."""
        deadline = time.monotonic() + 10.0
        while not socket.poll(0):
            assert engine.poll(0.02) == [] and time.monotonic() < deadline
        identity, empty = socket.recv_multipart()
        assert empty == b""
        assert socket.poll(5000)
        _, hello = socket.recv_multipart()
        assert um(hello)[0] == ENGINE_HELLO
        return identity

    a, b = router(first), router(second)
    with Engine(f"{first},{second}", implementation=impl.name) as engine:
        assert engine.addresses == (first, second)
        a.send_multipart([registration(engine, a), granted(7)])
        assert engine.wait_registered(5.0)
        assert engine.address == first and engine.coordinator_epoch == 7

        a.close()  # the leader is lost; b answers, a stale leader: epoch 5
        identity = registration(engine, b)
        b.send_multipart([identity, m([SUBMIT, 1, {}]), m([1, 2])])  # before its ENGINE_ACK
        b.send_multipart([identity, granted(5)])
        deadline = time.monotonic() + ROUNDS
        while time.monotonic() < deadline:
            assert engine.poll(0.02) == []  # the stale leader's request is not handed out
            while b.poll(0):  # it comes round again: registrations only, never HELD
                _, frame = b.recv_multipart()
                assert frame == b"" or um(frame)[0] == ENGINE_HELLO, frame
                b.send_multipart([identity, granted(5)])
        assert not engine.registered and engine.pending == 0

        a = router(first)  # the leader of epoch 7 is back: followed again
        identity = registration(engine, a)
        a.send_multipart([identity, granted(7)])
        assert engine.wait_registered(5.0) and engine.address == first
        trailer = m([0, None, False])  # the rebuild granted: every request has one
        a.send_multipart([identity, m([SUBMIT, 2, {}]), m([3]), trailer])
        events: list = []
        deadline = time.monotonic() + 5.0
        while not events and time.monotonic() < deadline:
            events = engine.poll(0.05)
        assert [event.server_rid for event in events if isinstance(event, Request)] == [2]
    a.close()
    b.close()


def test_a_client_refuses_a_coordinator_older_than_one_it_followed(tmp_path, impl):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    def script(directory: Path) -> Script:
        script = Script(directory)
        script.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as a coordinator's
        return script

    async def body():
        a, b = script(tmp_path / "a"), script(tmp_path / "b")
        addresses = f"{a.address},{b.address}"
        connecting = asyncio.ensure_future(
            Client.connect(addresses, implementation=impl.name, timeout=10)
        )
        assert um((await a.recv())[0])[0] == CONNECT
        await a.send(m([CONNECT_ACK, {"rebuild": 1, "epoch": 7}]))
        client = await connecting
        async with client:
            assert client.address == a.address and client.coordinator_epoch == 7
            future = client.submit([1, 2])
            assert um((await a.recv())[0])[0] == SUBMIT

            a.close()  # the leader is lost; b answers, a stale leader: epoch 5
            assert um((await b.recv())[0])[0] == CONNECT
            await b.send(m([CONNECT_ACK, {"rebuild": 1, "epoch": 5}]))
            await b.send(m([REPLY, 0]), m({"from": "the stale leader"}))
            deadline = time.monotonic() + ROUNDS
            while time.monotonic() < deadline:  # b hears CONNECTs only (no REJOIN)
                frames = await b.recv(timeout=ROUNDS)
                assert um(frames[0])[0] == CONNECT, frames
                await b.send(m([CONNECT_ACK, {"rebuild": 1, "epoch": 5}]))
            assert not client.connected and not future.done()

            a = script(tmp_path / "a")  # the leader of epoch 7 is back: followed again
            assert um((await a.recv(timeout=10))[0])[0] == CONNECT
            await a.send(m([CONNECT_ACK, {"rebuild": 1, "epoch": 7}]))
            assert um((await a.recv())[0]) == [REJOIN, [[0, 0]]]
            assert client.connected and client.address == a.address
            await a.send(m([REPLY, 0]), m({"from": "the leader"}))
            assert await asyncio.wait_for(future, 5) == {"from": "the leader"}
        a.close()
        b.close()

    run(body(), timeout=60)


def test_a_fake_engine_follows_the_coordinator_that_serves(tmp_path, impl, real_clock, monkeypatch):
    """``coordkit fake-engine --address A,B``: the standby's address once the first dies."""
    first, second = f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"

    async def body():
        client = await Client.connect(
            f"{first},{second}", implementation=impl.name, coordinator_timeout=1.0
        )
        async with client:
            await client.wait_for_engines(1, timeout=30)
            return await client.submit([1, 2, 3], {"max_tokens": 2}), client.address

    if impl.name == "py":  # the fake engine's core is chosen by the environment
        monkeypatch.setenv("COORDKIT_PUREPYTHON", "1")
    with engine_processes(f"{first},{second}", 1):
        with Coordinator(first, implementation=impl.name):
            assert run(body(), timeout=60)[1] == first
        with Coordinator(second, implementation=impl.name):
            assert run(body(), timeout=60)[1] == second


def leader_of(logs: list[Path]) -> int:
    wait_for(lambda: any("listening" in log.read_text() for log in logs), SETTLE)
    return next(i for i, log in enumerate(logs) if "listening" in log.read_text())


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_endpoints_follow_the_standby_that_takes_over(tmp_path, impl, etcd: EtcdServer, fault):
    name = etcd.endpoint(f"follow/{impl.name}-{fault.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address(), free_tcp_address()]
    both = ",".join(addresses)
    coordinators = [tmp_path / "a.log", tmp_path / "b.log"]
    logs = [tmp_path / f"engine-{rank}.log" for rank in range(2)]

    async def body():
        with (
            ha_candidate(addresses[0], impl.name, coordinators[0], name, TTL) as first,
            ha_candidate(addresses[1], impl.name, coordinators[1], name, TTL) as second,
            steady_engines(both, impl.name, logs),
        ):
            lead = leader_of(coordinators)
            leader = (first, second)[lead]
            client = await Client.connect(both, implementation=impl.name, coordinator_timeout=1.0)
            async with client:
                await client.wait_for_engines(2, timeout=SETTLE)
                assert client.address == addresses[lead]
                epoch = client.coordinator_epoch
                futures = client.submit_many([[n, 1, 2] for n in range(REQUESTS)])
                numbers = range(REQUESTS, REQUESTS + STREAMS)
                streams = [asyncio.ensure_future(collect(client.stream([n, 3]))) for n in numbers]
                deadline = time.monotonic() + SETTLE
                while sum(started(logs).values()) < REQUESTS + STREAMS:
                    assert time.monotonic() < deadline, "the requests did not all start"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # the streams under way
                leader.send_signal(fault)
                finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
                parts = await asyncio.wait_for(asyncio.gather(*streams), SETTLE)
                assert client.address == addresses[1 - lead]
                assert client.coordinator_epoch is not None and client.coordinator_epoch > epoch
                if fault == signal.SIGSTOP:
                    # Woken past its lease: its term is over, it serves nobody; what comes
                    # next is served by the new leader, to both engines still.
                    leader.send_signal(signal.SIGCONT)
                    wait_for(lambda: "ended" in coordinators[lead].read_text(), SETTLE)
                    later = range(REQUESTS + STREAMS, REQUESTS + STREAMS + LATER)
                    more = client.submit_many([[n, 1] for n in later])
                    got = await asyncio.wait_for(asyncio.gather(*more), SETTLE)
                    assert [final["n"] for final in got] == list(later)
                    stats = await client.stats()
                    assert sum(e["state"] == "alive" for e in stats["engines"]) == 2
                    assert coordinators[lead].read_text().count("listening") == 1
                assert client.address == addresses[1 - lead]
        return finals, parts

    finals, parts = run(body(), timeout=4 * SETTLE)
    check_outcome(logs, finals, parts, REQUESTS, LATER if fault == signal.SIGSTOP else 0)
