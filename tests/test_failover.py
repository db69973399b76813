"""A coordinator that dies loses nothing: the rebuild from the peers, end to end.

Real processes: a ``coordkit serve`` coordinator, two engine processes
(tests/support/steady_engine.py: 1.5-3 s per request, partials every 0.25 s
for streams, each request it starts logged), and a Client in this process.
The coordinator is SIGKILLed with hundreds of requests in flight and a new one
started at the same address 0.5 s later: every request must end with its real
final, every stream with its partials in order, none missing or repeated, and
no request may start twice at an engine. Each test runs on both endpoint cores
against a coordinator of the same implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordkit import Client
from tests.support.processes import free_tcp_address, serve
from tests.support.proxy import Proxy
from tests.support.scripted import run
from tests.support.steady_engine import (
    aborted,
    check_outcome,
    collect,
    started,
    steady_engines,
)

REQUESTS = 300
STREAMS = 60
#: Bounds, generous for a loaded 2-core machine; none is asserted as a timing.
SETTLE = 60.0


def test_a_restart_at_the_same_address_loses_nothing(tmp_path, impl):
    address = free_tcp_address()
    logs = [tmp_path / f"engine-{rank}.log" for rank in range(2)]

    async def body():
        with (
            serve(address, impl.name, tmp_path / "first.log") as first,
            steady_engines(address, impl.name, logs),
        ):
            # Two clients: each must get its own requests back from the engines' reports.
            clients = [
                await Client.connect(address, implementation=impl.name, coordinator_timeout=1.0)
                for _ in range(2)
            ]
            async with clients[0] as client, clients[1] as other:
                await client.wait_for_engines(2, timeout=30)
                half = REQUESTS // 2
                futures = client.submit_many([[n, 1, 2] for n in range(half)])
                futures += other.submit_many([[n, 1, 2] for n in range(half, REQUESTS)])
                numbers = range(REQUESTS, REQUESTS + STREAMS)
                streams = [
                    asyncio.ensure_future(collect((client, other)[n % 2].stream([n, 3])))
                    for n in numbers
                ]
                # In flight at the engines, and the streams well under way.
                deadline = time.monotonic() + SETTLE
                while sum(started(logs).values()) < REQUESTS + STREAMS:
                    assert time.monotonic() < deadline, "the requests did not all start"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.8)
                first.send_signal(signal.SIGKILL)
                first.wait()
                await asyncio.sleep(0.5)
                with serve(address, impl.name, tmp_path / "second.log") as second:
                    finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
                    parts = await asyncio.wait_for(asyncio.gather(*streams), SETTLE)
                    stats = await client.stats()
                    assert second.poll() is None
        return finals, parts, stats

    finals, parts, stats = run(body(), timeout=4 * SETTLE)
    assert len(parts) == STREAMS
    check_outcome(logs, finals, parts, REQUESTS)
    # The second coordinator took the requests over from the engines.
    assert stats["counters"]["adopted"] > 0 and stats["inflight"] == 0


@pytest.mark.parametrize("timeout", [0, 1.0])
def test_failover_timeout_fails_what_is_pending(tmp_path, impl, timeout):
    """No coordinator comes back: with failover_timeout=0 at once, else after it."""
    address = free_tcp_address()

    async def body():
        with (
            serve(address, impl.name, tmp_path / "coord.log") as coordinator,
            steady_engines(address, impl.name, [tmp_path / "engine.log"]),
        ):
            client = await Client.connect(
                address,
                implementation=impl.name,
                coordinator_timeout=1.0,
                failover_timeout=timeout,
            )
            async with client:
                await client.wait_for_engines(1, timeout=30)
                held = client.submit([1, 2])  # 1.5 s at the engine
                while (await client.stats())["inflight"] < 1:
                    await asyncio.sleep(0.02)
                coordinator.kill()
                coordinator.wait()
                lost = time.monotonic()
                with pytest.raises(ConnectionError, match=address):
                    await asyncio.wait_for(held, 30)
                # Past the timeout (or at once with 0) what is sent raises, as before.
                assert time.monotonic() - lost >= timeout
                with pytest.raises(ConnectionError, match="not connected"):
                    client.submit([3])
                with pytest.raises(ConnectionError, match="not connected"):
                    await client.pause()

    run(body(), timeout=60)


def test_calls_wait_for_a_coordinator_while_riding_through(tmp_path, impl):
    address = free_tcp_address()

    async def body():
        with (
            serve(address, impl.name, tmp_path / "first.log") as first,
            steady_engines(address, impl.name, [tmp_path / "engine.log"]),
        ):
            client = await Client.connect(
                address, implementation=impl.name, coordinator_timeout=1.0, failover_timeout=30
            )
            async with client:
                await client.wait_for_engines(1, timeout=30)
                first.kill()
                first.wait()
                while client.connected:
                    await asyncio.sleep(0.02)
                waiting = client.submit([5])  # accepted while nobody serves
                paused = asyncio.ensure_future(client.pause())
                await asyncio.sleep(0.3)
                assert not paused.done() and not waiting.done()
                with serve(address, impl.name, tmp_path / "second.log"):
                    await asyncio.wait_for(paused, 20)
                    stats = await asyncio.wait_for(client.stats(), 20)
                    assert stats["control_state"] == "paused"
                    await client.unpause()
                    # The request went out once a coordinator was back, and ran once.
                    assert (await asyncio.wait_for(waiting, 30))["n"] == 5

    run(body(), timeout=90)


async def all_started(logs: list[Path], count: int) -> None:
    deadline = time.monotonic() + SETTLE
    while sum(started(logs).values()) < count:
        assert time.monotonic() < deadline, "the requests did not all start"
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def behind_a_proxy(tmp_path: Path, impl_name: str, logs: list[Path]) -> Iterator[Proxy]:
    """A coordinator and one steady engine at a free address, and a Proxy to it."""
    address = free_tcp_address()
    with (
        serve(address, impl_name, tmp_path / "coord.log"),
        steady_engines(address, impl_name, logs),
    ):
        proxy = Proxy(address)
        try:
            yield proxy
        finally:
            proxy.close()


def test_a_blip_costs_no_double_work(tmp_path, impl):
    """The client's connection (through a proxy) is cut while its requests run: the
    coordinator keeps them for its REJOIN, so none is aborted or started again."""
    logs = [tmp_path / "engine.log"]

    async def body():
        with behind_a_proxy(tmp_path, impl.name, logs) as proxy:
            client = await Client.connect(
                proxy.address, implementation=impl.name, coordinator_timeout=1.0
            )
            async with client:
                await client.wait_for_engines(1, timeout=30)
                futures = client.submit_many([[n, 1] for n in range(30)])
                streams = [asyncio.ensure_future(collect(client.stream([n, 3]))) for n in (30, 31)]
                await all_started(logs, 32)
                # Amid the finals (they end 1.5 s to 3 s in): some are on their way.
                await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
                proxy.cut()
                finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
                parts = await asyncio.wait_for(asyncio.gather(*streams), SETTLE)
                stats = await client.stats()
        return finals, parts, stats

    finals, parts, stats = run(body(), timeout=4 * SETTLE)
    assert [final["n"] for final in finals] == list(range(30))
    for n, got in zip((30, 31), parts, strict=True):
        *partials, final = got
        assert final == {"n": n, "partials": len(partials)}, (n, got)
        assert partials == [{"n": n, "i": i} for i in range(len(partials))], (n, got)
    counts = started(logs)
    assert sorted(counts) == list(range(32)) and max(counts.values()) == 1, counts
    assert not aborted(logs)
    assert stats["counters"]["clients_returned"] == 1 and stats["inflight"] == 0


def test_past_the_hold_a_clients_requests_are_aborted(tmp_path, impl):
    """The client never comes back: past its failover_timeout the coordinator aborts
    its requests at the engine, and its tables are empty."""
    logs = [tmp_path / "engine.log"]

    async def body():
        with behind_a_proxy(tmp_path, impl.name, logs) as proxy:
            client = await Client.connect(
                proxy.address,
                implementation=impl.name,
                coordinator_timeout=1.0,
                failover_timeout=1.0,
            )
            watcher = await Client.connect(proxy.upstream, implementation=impl.name)
            async with client, watcher:
                await client.wait_for_engines(1, timeout=30)
                futures = [client.submit([n, 1]) for n in range(3)]
                await all_started(logs, 3)
                proxy.refuse()
                for future in futures:
                    with pytest.raises(ConnectionError):
                        await asyncio.wait_for(future, SETTLE)
                deadline = time.monotonic() + SETTLE
                while sum(aborted(logs).values()) < 3 or (await watcher.stats())["inflight"]:
                    assert time.monotonic() < deadline, "the requests were not aborted"
                    await asyncio.sleep(0.05)
                return await watcher.stats()

    stats = run(body(), timeout=4 * SETTLE)
    assert aborted(logs) == {0: 1, 1: 1, 2: 1}
    assert stats["inflight"] == 0 and stats["clients"] == 1  # the watcher only
    assert stats["engines"][0]["pending"] == 0


def test_an_abort_while_no_coordinator_serves_reaches_the_engine(tmp_path, impl):
    """ABORT and a control call issued while the coordinator is down go out, in order,
    once a new one accepted the REJOIN: the abort reaches the engine that runs the
    request, which ends it with its one final and does not run it again."""
    address = free_tcp_address()
    logs = [tmp_path / "engine.log"]

    async def body():
        with (
            serve(address, impl.name, tmp_path / "first.log") as first,
            steady_engines(address, impl.name, logs),
        ):
            client = await Client.connect(
                address, implementation=impl.name, coordinator_timeout=1.0
            )
            async with client:
                await client.wait_for_engines(1, timeout=30)
                doomed = client.submit([6, 1])  # 3 s at the engine
                kept = client.submit([0, 1])
                await all_started(logs, 2)
                first.kill()
                first.wait()
                while client.connected:
                    await asyncio.sleep(0.02)
                await client.abort(doomed)
                paused = asyncio.ensure_future(client.pause())
                with serve(address, impl.name, tmp_path / "second.log"):
                    final = await asyncio.wait_for(doomed, SETTLE)
                    await asyncio.wait_for(paused, SETTLE)
                    stats = await client.stats()
                    await client.unpause()
                    other = await asyncio.wait_for(kept, SETTLE)
        return final, other, stats

    final, other, stats = run(body(), timeout=4 * SETTLE)
    assert final["n"] == 6 and other["n"] == 0
    assert aborted(logs) == {6: 1}
    assert started(logs) == {6: 1, 0: 1}
    assert stats["control_state"] == "paused"
