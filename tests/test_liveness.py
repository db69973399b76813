"""The endpoints in production: a coordinator process that dies or freezes and
comes back, and a CURVE coordinator, seen by a real Client and Engine.

Every test runs on both endpoint cores (``impl``), against a coordinator of
the same implementation: a ``coordkit serve`` process on tcp for liveness (it
must be killed and restarted at the same address), one in this process for
CURVE. Async bodies run under ``asyncio.run`` with an overall timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import zmq.auth

from coordkit import Client, CoordinatorError, ErrorCode
from coordkit.engine import Engine
from coordkit.tools.fake_engine import FakeEngine
from tests.support.peers import wait_for
from tests.support.processes import engine_processes, free_tcp_address, serve
from tests.support.scripted import run

#: The coordinator_timeout of these tests' endpoints, and the slack allowed on top of it.
COORDINATOR_TIMEOUT = 1.0
SLACK = 1.5


@contextlib.contextmanager
def engine_thread(engine: FakeEngine) -> Iterator[FakeEngine]:
    """``engine`` running in a thread; stopped and closed at exit."""
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        stop.set()
        thread.join(10)
        engine.close()


def slow_engine(address: str, impl_name: str, **options) -> FakeEngine:
    """An engine whose requests take 10 s unless their params ask for fewer tokens."""
    return FakeEngine(
        address,
        latency=0.05,
        output_tokens=200,
        implementation=impl_name,
        coordinator_timeout=COORDINATOR_TIMEOUT,
        **options,
    )


async def read_all(stream) -> None:
    async for _ in stream:
        pass


async def requests_in_flight(client: Client, count: int) -> None:
    """Until the coordinator holds ``count`` requests."""
    while (await client.stats())["inflight"] < count:
        await asyncio.sleep(0.02)


async def until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def lose_the_coordinator(client: Client, coordinator: subprocess.Popen, how: int) -> None:
    """Two requests in flight, ``how`` (a signal) to the coordinator: both fail in time."""
    held = client.submit([1, 2, 3])
    stream = client.stream([4, 5])
    await asyncio.wait_for(requests_in_flight(client, 2), 10)
    coordinator.send_signal(how)
    sent = time.monotonic()
    for pending in (held, read_all(stream)):
        with pytest.raises(ConnectionError, match=client.address):
            await asyncio.wait_for(pending, COORDINATOR_TIMEOUT + SLACK)
    assert time.monotonic() - sent < COORDINATOR_TIMEOUT + SLACK
    assert not client.connected and client.pending == 0
    with pytest.raises(ConnectionError, match="not connected"):
        client.submit([6])  # fails at once while the coordinator is away


def test_a_restarted_coordinator_serves_the_same_client_and_engine(tmp_path, impl):
    address = free_tcp_address()

    async def body():
        with (
            serve(address, impl.name, tmp_path / "first.log") as first,
            engine_thread(slow_engine(address, impl.name)) as engine,
        ):
            client = await Client.connect(
                address,
                implementation=impl.name,
                coordinator_timeout=COORDINATOR_TIMEOUT,
                failover_timeout=0,  # fail at once (tests/test_failover.py rides through)
            )
            async with client:
                await client.wait_for_engines(1)
                await lose_the_coordinator(client, first, signal.SIGKILL)
                first.wait()
                with serve(address, impl.name, tmp_path / "second.log"):
                    await until(lambda: client.connected, 10)
                    await client.wait_for_engines(1)
                    reply = await asyncio.wait_for(client.submit([7, 8], {"output_tokens": 2}), 10)
                    assert reply["status"] == "finished" and len(reply["generated_tokens"]) == 2
                    stats = await client.stats()
                    assert [e["identity"] for e in stats["engines"]] == ["engine-0"]
                    assert engine.connected

    run(body(), timeout=90)


def test_a_frozen_coordinator_is_noticed_by_the_heartbeats_and_found_again(tmp_path, impl):
    address = free_tcp_address()

    async def body():
        with (
            serve(address, impl.name, tmp_path / "coord.log") as frozen,
            engine_thread(slow_engine(address, impl.name)),
        ):
            client = await Client.connect(
                address,
                implementation=impl.name,
                coordinator_timeout=COORDINATOR_TIMEOUT,
                failover_timeout=0,  # fail at once (tests/test_failover.py rides through)
            )
            async with client:
                await client.wait_for_engines(1)
                # SIGSTOP closes nothing: only the heartbeats can tell.
                await lose_the_coordinator(client, frozen, signal.SIGSTOP)
                # Back, as after a network blip: the same coordinator, new connections.
                frozen.send_signal(signal.SIGCONT)
                await until(lambda: client.connected, 10)
                # A SUBMIT sent before the engine's new connection is attached finds it
                # unreachable (NO_ENGINES); its connections that ended meanwhile may have
                # tripped the breaker (one quarantine: 5 s); after that, it serves.
                deadline = time.monotonic() + 15
                while True:
                    try:
                        reply = await asyncio.wait_for(
                            client.submit([7, 8], {"output_tokens": 2}), 10
                        )
                        break
                    except CoordinatorError as exc:
                        assert exc.code == ErrorCode.NO_ENGINES and time.monotonic() < deadline
                        await asyncio.sleep(0.1)
                assert reply["status"] == "finished"

    run(body(), timeout=60)


def test_coordinator_timeout_must_be_positive(tmp_path, impl):
    address = f"ipc://{tmp_path}/x.sock"
    with pytest.raises(ValueError, match="coordinator_timeout"):
        Engine(address, coordinator_timeout=0, implementation=impl.name)

    async def body():
        with pytest.raises(ValueError, match="coordinator_timeout"):
            await Client.connect(address, coordinator_timeout=-1, implementation=impl.name)

    run(body())


# -- CURVE ----------------------------------------------------------------------------------


def test_curve_endpoints(make_cluster, keys, impl):
    server_key = keys / "server" / "coordinator.key"
    admitted = keys / "admitted"
    options = {
        "curve_secret_key": keys / "server" / "coordinator.key_secret",
        "curve_authorized_keys": admitted,
    }

    async def body(address, coord):
        # Keys as files for the client, as the (public, secret) pair for the engine.
        engine_pair = zmq.auth.load_certificate(admitted / "engine.key_secret")
        with engine_thread(
            slow_engine(address, impl.name, curve_server_key=server_key, curve_keys=engine_pair)
        ):
            client = await Client.connect(
                address,
                implementation=impl.name,
                curve_server_key=server_key,
                curve_keys=admitted / "client.key_secret",
            )
            async with client:
                await client.wait_for_engines(1)
                reply = await asyncio.wait_for(client.submit([1, 2], {"output_tokens": 3}), 10)
                assert len(reply["generated_tokens"]) == 3
                # Refused at the handshake: no CONNECT_ACK, so connect() times out.
                for curve in ({}, {"curve_keys": keys / "strangers" / "mallory.key_secret"}):
                    with pytest.raises(ConnectionError, match="no coordinator answered"):
                        await Client.connect(
                            address,
                            timeout=0.5,
                            implementation=impl.name,
                            **({"curve_server_key": server_key, **curve} if curve else {}),
                        )
                stranger = Engine(
                    address,
                    rank=1,
                    implementation=impl.name,
                    curve_server_key=server_key,
                    curve_keys=keys / "strangers" / "mallory.key_secret",
                )
                with stranger:
                    stranger.poll(0.5)
                    stats = await client.stats()
                assert [e["identity"] for e in stats["engines"]] == ["engine-0"]
                assert stats["clients"] == 1
                assert stats["counters"]["auth_refused"] >= 3
                assert stats["counters"]["not_connected"] == 0

    with make_cluster(transport="tcp", **options) as c:
        run(body(c.coord.address, c.coord), timeout=60)


def test_a_fake_engine_process_with_keys(make_cluster, keys):
    options = {
        "curve_secret_key": keys / "server" / "coordinator.key_secret",
        "curve_authorized_keys": keys / "admitted",
    }
    with make_cluster(transport="tcp", **options) as c:
        curve = ["--curve-server-key", str(keys / "server" / "coordinator.key")]
        curve += ["--curve-keys", str(keys / "admitted" / "engine.key_secret")]
        with engine_processes(c.coord.address, 1, "--coordinator-timeout", "1", *curve):
            wait_for(lambda: len(c.coord.stats()["engines"]) == 1, 30)
        assert c.coord.stats()["counters"]["auth_refused"] == 0


def test_curve_needs_both_keys(keys, impl):
    async def body():
        with pytest.raises(ValueError, match="both"):
            await Client.connect(
                "tcp://127.0.0.1:1",
                implementation=impl.name,
                curve_server_key=keys / "server" / "coordinator.key",
            )

    run(body())
    with pytest.raises(ValueError, match="both"):
        Engine(
            "tcp://127.0.0.1:1",
            implementation=impl.name,
            curve_keys=keys / "admitted" / "engine.key_secret",
        )
