"""Several coordinators serving at once (``coordkit serve --cluster``), on a real etcd.

Rendezvous alone (a pure function), then real processes: ``coordkit serve --cluster
etcd://.../NAME`` members, engine processes connected to every member
(tests/support/steady_engine.py, ``Engine("etcd://...")``: each request it starts
logged), and Clients in this process that connect to ``etcd://...`` and spread over
the members by rendezvous. Each process test runs on both implementations.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordkit import Client, Coordinator
from coordkit.cluster import Member, Spread, read_members, rendezvous
from coordkit.engine import Engine, Request
from coordkit.kvpublish import KVPublisher
from coordkit.tools.etcd_server import free_port
from tests.support.etcd import EtcdServer, etcd_server
from tests.support.peers import wait_for
from tests.support.processes import (
    coordkit_command,
    engine_processes,
    free_tcp_address,
    python_env,
)
from tests.support.scripted import run
from tests.support.steady_engine import started, steady_engines
from tests.test_kv_events import BS, tokens

TTL = 1
#: Bounds for a loaded 2-core machine; none is asserted as a timing.
SETTLE = 40.0


# -- rendezvous ------------------------------------------------------------------------


def test_rendezvous_moves_only_about_one_in_n():
    keys = [f"c{n:014x}".encode() for n in range(4000)]
    three = [f"tcp://10.0.0.{i}:5555" for i in range(3)]
    four = [*three, "tcp://10.0.0.3:5555"]
    before = {key: rendezvous(key, three)[0] for key in keys}
    after = {key: rendezvous(key, four)[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    # A member joining takes about 1/4 of the keys, every one of them to itself...
    assert 0.22 < len(moved) / len(keys) < 0.28
    assert {after[key] for key in moved} == {four[3]}
    # ...spread evenly, and one leaving moves only its own keys, each to its next choice.
    assert min(collections.Counter(after.values()).values()) > 0.22 * len(keys)
    gone = three[1]
    left = {key: rendezvous(key, [a for a in three if a != gone])[0] for key in keys}
    for key in keys:
        if before[key] == gone:
            assert left[key] == rendezvous(key, three)[1]
        else:
            assert left[key] == before[key]
    # The order is the key's own: the same members given in any order.
    assert rendezvous(keys[0], three) == rendezvous(keys[0], reversed(three))


def test_a_static_list_is_followed_in_rendezvous_order():
    addresses = [free_tcp_address() for _ in range(3)]
    spread = Spread(b"c0123456789abcd", addresses)
    assert list(spread.addresses) == rendezvous(b"c0123456789abcd", addresses)
    assert spread.current == spread.addresses[0] and spread.several


def test_a_move_leaves_a_member_gone_from_the_view():
    """The member followed left the view (its lease lapsed) but lives: a move leaves its
    connection all the same, so nothing sent after goes its way (a DEALER sends
    round-robin: a CONNECT there, the REJOIN at the next, would lose the REJOIN)."""
    key = b"c0123456789abcd"
    first, second = rendezvous(key, [free_tcp_address() for _ in range(2)])
    view = [first, second]
    context = zmq.Context()
    try:
        routers = {}
        for address in view:
            routers[address] = context.socket(zmq.ROUTER)
            routers[address].bind(address)
        spread = Spread(key, view, lambda: list(view))
        dealer = context.socket(zmq.DEALER)
        dealer.connect(spread.current)
        view.remove(first)
        spread.refresh()
        spread.move(dealer)
        assert spread.current == second
        for n in range(4):
            dealer.send(b"%d" % n)
        got = [routers[second].recv_multipart()[1] for _ in range(4) if routers[second].poll(2000)]
        assert got == [b"0", b"1", b"2", b"3"]
        assert not routers[first].poll(200)
    finally:
        context.destroy(linger=0)


# -- membership ------------------------------------------------------------------------


def test_members_hold_leases_and_a_lapsed_one_is_gone(etcd: EtcdServer):
    name = etcd.endpoint(f"members-{time.monotonic_ns()}")
    with Member(name, "tcp://127.0.0.1:7001", ttl=TTL) as first:
        second = Member(name, "tcp://127.0.0.1:7002", ttl=TTL)
        second.join()
        assert read_members(name) == {
            first.id: "tcp://127.0.0.1:7001",
            second.id: "tcp://127.0.0.1:7002",
        }
        # Its keepalive stopped without revoking (a member that died): gone within a TTL.
        second._stop.set()
        wait_for(lambda: second.id not in read_members(name), 10 * TTL)
        assert first.id in read_members(name)
        second._lease_id = None
        second.leave()
    assert read_members(name) == {}  # left: revoked at once


def test_a_member_whose_lease_lapsed_joins_again(etcd: EtcdServer):
    """Its lease gone behind its back (as when etcd was away past the TTL): its next
    keepalive puts its key under a new lease."""
    name = etcd.endpoint(f"lapsed-{time.monotonic_ns()}")
    with Member(name, "tcp://127.0.0.1:7003", ttl=TTL) as one:
        assert one.joins == 1 and one._lease_id is not None
        revoked = one._lease_id
        etcd3gw = pytest.importorskip("etcd3gw")
        client = etcd3gw.client(host="127.0.0.1", port=etcd.port, api_path="/v3/")
        etcd3gw.Lease(revoked, client).revoke()
        wait_for(lambda: one.joins == 2, 10 * TTL)
        assert one._lease_id != revoked
        assert read_members(name) == {one.id: "tcp://127.0.0.1:7003"}


def test_no_member_joins_without_etcd(tmp_path):
    nowhere = f"etcd://127.0.0.1:{free_port()}/nobody"
    with pytest.raises(ConnectionError, match="not reachable"):
        Member(nowhere, "tcp://127.0.0.1:7001", ttl=TTL).join()
    command = coordkit_command("serve", "--bind", free_tcp_address(), "--cluster", nowhere)
    done = subprocess.run(command, env=python_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "not reachable" in done.stderr


# -- members, clients and engines: real processes --------------------------------------


@contextlib.contextmanager
def member(address: str, impl_name: str, log: Path, name: str) -> Iterator[subprocess.Popen]:
    """``coordkit serve --cluster NAME`` at ``address`` (stderr in ``log``), killed at exit."""
    command = coordkit_command(
        "serve", "--bind", address, "--implementation", impl_name,
        "--cluster", name, "--ha-ttl", str(TTL),
    )  # fmt: skip
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, env=python_env(), stderr=stderr)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def live(name: str) -> set[str]:
    return set(read_members(name).values())


async def connect(name: str, impl_name: str, count: int) -> list[Client]:
    return [
        await Client.connect(
            name, implementation=impl_name, coordinator_timeout=1.0, failover_timeout=30
        )
        for _ in range(count)
    ]


async def engines_at(client: Client, count: int) -> None:
    """Until ``count`` engines are registered at the client's member (a client that
    reconnects meanwhile, on a loaded machine, asks again)."""
    deadline = time.monotonic() + SETTLE
    while True:
        with contextlib.suppress(ConnectionError):
            if len((await client.stats())["engines"]) >= count:
                return
        assert time.monotonic() < deadline, "the engines did not register"
        await asyncio.sleep(0.1)


async def fleet(
    stack: contextlib.AsyncExitStack,
    name: str,
    impl_name: str,
    tmp_path: Path,
    addresses: list[str],
    logs: list[Path],
    clients: int,
) -> tuple[list[subprocess.Popen], list[Client]]:
    """Members at ``addresses``, a steady engine per log at every member, and
    ``clients`` clients, each once every engine registered at its member."""
    members = [
        stack.enter_context(member(address, impl_name, tmp_path / f"m{i}.log", name))
        for i, address in enumerate(addresses)
    ]
    wait_for(lambda: len(live(name)) == len(addresses), SETTLE)
    stack.enter_context(steady_engines(name, impl_name, logs))
    connected = await connect(name, impl_name, clients)
    for client in connected:
        stack.push_async_callback(client.close)
        await engines_at(client, len(logs))
    return members, connected


def test_members_share_engines_and_spread_clients(tmp_path, impl, etcd: EtcdServer):
    """3 members: every client at its rendezvous choice, each member with clients, both
    engines registered at each member and serving them all; a 4th member joining takes
    about a quarter of the clients that connect then, and moves no other."""
    name = etcd.endpoint(f"spread/{impl.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address() for _ in range(4)]
    logs = [tmp_path / f"engine-{rank}.log" for rank in range(2)]

    async def body():
        async with contextlib.AsyncExitStack() as stack:
            for i in range(3):
                stack.enter_context(member(addresses[i], impl.name, tmp_path / f"m{i}.log", name))
            wait_for(lambda: len(live(name)) == 3, SETTLE)
            stack.enter_context(steady_engines(name, impl.name, logs))
            # Random ids: 12 clients leave a member without any in 1 test of 40; up to
            # 48 leave one in 10**8.
            clients = await connect(name, impl.name, 12)
            three = set(addresses[:3])
            while {client.address for client in clients} != three and len(clients) < 48:
                clients += await connect(name, impl.name, 1)
            for client in clients:
                stack.push_async_callback(client.close)
            for client in clients:
                assert client.address == rendezvous(client._socket.identity, three)[0]
            assert set(client.address for client in clients) == three
            for client in clients:
                await engines_at(client, 2)
            futures = [client.submit([n, 1]) for n, client in enumerate(clients)]
            finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
            assert [final["n"] for final in finals] == list(range(len(clients)))

            stack.enter_context(member(addresses[3], impl.name, tmp_path / "m3.log", name))
            wait_for(lambda: len(live(name)) == 4, SETTLE)
            later = await connect(name, impl.name, 40)
            for client in later:
                stack.push_async_callback(client.close)
            four = set(addresses)
            for client in later:
                key = client._socket.identity
                assert client.address == rendezvous(key, four)[0]
                if client.address != addresses[3]:  # the others' choice is as before
                    assert client.address == rendezvous(key, three)[0]
            share = sum(client.address == addresses[3] for client in later) / len(later)
            # About a quarter (the pure test above): outside these, 1 run in 10**5.
            assert 0 < share < 0.6, share
            for client in later:
                if client.address == addresses[3]:  # once the engines joined the new member
                    await engines_at(client, 2)
                    final = await asyncio.wait_for(client.submit([1000, 1]), SETTLE)
                    assert final["n"] == 1000
                    break

    run(body(), timeout=4 * SETTLE)


def test_a_fake_engine_serves_every_member(tmp_path, impl, etcd: EtcdServer):
    """``coordkit fake-engine --address etcd://...``: one process registered at both
    members (of ``impl``; the engine's core the one selected at import), answering
    each member's clients."""
    name = etcd.endpoint(f"fake/{impl.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address() for _ in range(2)]

    async def body():
        async with contextlib.AsyncExitStack() as stack:
            for i in range(2):
                stack.enter_context(member(addresses[i], impl.name, tmp_path / f"m{i}.log", name))
            wait_for(lambda: len(live(name)) == 2, SETTLE)
            stack.enter_context(engine_processes(name, 1))
            clients = await connect(name, impl.name, 8)
            for client in clients:
                stack.push_async_callback(client.close)
                await engines_at(client, 1)
            assert {client.address for client in clients} == set(addresses)
            replies = await asyncio.wait_for(
                asyncio.gather(*[c.submit([1, 2, 3], {"max_tokens": 2}) for c in clients]),
                SETTLE,
            )
            assert all(reply["status"] == "finished" for reply in replies)

    run(body(), timeout=2 * SETTLE)


def test_a_member_killed_under_load(tmp_path, impl, etcd: EtcdServer):
    """SIGKILL the member some clients follow with their requests in flight: every
    request of every client ends with exactly one reply, its real final, and none runs
    twice: the engines hand the killed member's requests to each client's next choice,
    where the client REJOINs them; the others' are untouched by the loss. Restarted,
    the member joins again and new clients reach it."""
    name = etcd.endpoint(f"kill/{impl.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address() for _ in range(3)]
    logs = [tmp_path / f"engine-{rank}.log" for rank in range(2)]
    per_client = 20

    async def body():
        async with contextlib.AsyncExitStack() as stack:
            members, clients = await fleet(stack, name, impl.name, tmp_path, addresses, logs, 9)
            victim = clients[0].address
            theirs = [client for client in clients if client.address == victim]
            others = [client for client in clients if client.address != victim]
            futures = {
                id(client): client.submit_many([[i * per_client + k, 1] for k in range(per_client)])
                for i, client in enumerate(clients)
            }
            total = len(clients) * per_client
            deadline = time.monotonic() + SETTLE
            while sum(started(logs).values()) < total:
                assert time.monotonic() < deadline, "the requests did not all start"
                await asyncio.sleep(0.05)
            killed = members[addresses.index(victim)]
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            results = {}
            for client in clients:
                done = asyncio.gather(*futures[id(client)], return_exceptions=True)
                results[id(client)] = await asyncio.wait_for(done, SETTLE)
            for i, client in enumerate(clients):
                finals = results[id(client)]
                assert [f["n"] for f in finals] == [i * per_client + k for k in range(per_client)]
            for client in theirs:
                assert client.address != victim and client.connected
            for client in others:
                assert client.address != victim
            counts = started(logs)
            assert sorted(counts) == list(range(total))
            assert max(counts.values()) == 1, [n for n, c in counts.items() if c > 1]

            # Restarted at its address: it joins again, and new clients reach it.
            wait_for(lambda: victim not in live(name), SETTLE)
            index = addresses.index(victim)
            stack.enter_context(member(victim, impl.name, tmp_path / "again.log", name))
            wait_for(lambda: victim in live(name), SETTLE)
            later = await connect(name, impl.name, 12)
            for client in later:
                stack.push_async_callback(client.close)
            assert any(client.address == addresses[index] for client in later)

    run(body(), timeout=4 * SETTLE)


def test_a_member_paused_past_the_timeouts(tmp_path, impl, etcd: EtcdServer):
    """A member stopped (SIGSTOP, as a starved machine or a long pause stalls one) past
    its clients' and engines' timeouts and its lease, then resumed: its clients moved
    on and the engines handed its requests over, as for a member lost; every request of
    every client ends with its own final, once. The member back draws server ids that
    may be its adopters' (at the engines: ids of their own) and sends its requests
    again to engines it takes for restarted: those may run twice (docs/scaling.md)."""
    name = etcd.endpoint(f"paused/{impl.name}-{time.monotonic_ns()}")
    addresses = [free_tcp_address() for _ in range(3)]
    logs = [tmp_path / f"engine-{rank}.log" for rank in range(2)]

    async def body():
        async with contextlib.AsyncExitStack() as stack:
            members, clients = await fleet(stack, name, impl.name, tmp_path, addresses, logs, 12)
            paused = members[addresses.index(clients[0].address)]
            futures = [client.submit([n, 1]) for n, client in enumerate(clients)]
            await asyncio.sleep(0.2)
            paused.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.5 * TTL)  # its clients' and engines' 1 s, and its lease
            paused.send_signal(signal.SIGCONT)
            finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
            assert [final["n"] for final in finals] == list(range(len(clients)))
            assert sorted(started(logs)) == list(range(len(clients)))

    run(body(), timeout=4 * SETTLE)


def test_members_serve_on_while_etcd_is_down(tmp_path, impl):
    """etcd stopped: the members serve their clients on, through the engines they know,
    and no member joins; a member killed meanwhile: its clients move to the other on
    their last view. etcd back: the live member is there (again, if its lease lapsed),
    the dead one gone."""
    addresses = [free_tcp_address() for _ in range(2)]
    logs = [tmp_path / "engine-0.log"]

    async def body():
        with etcd_server(tmp_path) as server:
            async with contextlib.AsyncExitStack() as stack:
                name = server.endpoint("outage")
                first = stack.enter_context(
                    member(addresses[0], impl.name, tmp_path / "m0.log", name)
                )
                stack.enter_context(member(addresses[1], impl.name, tmp_path / "m1.log", name))
                wait_for(lambda: len(live(name)) == 2, SETTLE)
                stack.enter_context(steady_engines(name, impl.name, logs))
                clients = await connect(name, impl.name, 6)
                for client in clients:
                    stack.push_async_callback(client.close)
                    await engines_at(client, 1)
                server.process.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(3 * TTL)  # every lease lapsed, were etcd counting
                    futures = [client.submit([n, 1]) for n, client in enumerate(clients)]
                    finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
                    assert [final["n"] for final in finals] == list(range(len(clients)))
                    with pytest.raises(ConnectionError):  # and nobody joins meanwhile
                        Member(name, free_tcp_address(), ttl=TTL).join()
                    # A member lost meanwhile: its clients move on their last view.
                    first.kill()
                    first.wait()
                    await asyncio.sleep(1.0)
                    futures = [client.submit([10 + n, 1]) for n, client in enumerate(clients)]
                    finals = await asyncio.wait_for(asyncio.gather(*futures), SETTLE)
                    assert [final["n"] for final in finals] == [10 + n for n in range(6)]
                    assert {client.address for client in clients} == {addresses[1]}
                finally:
                    server.process.send_signal(signal.SIGCONT)
                wait_for(lambda: live(name) == {addresses[1]}, SETTLE)

    run(body(), timeout=4 * SETTLE)


# -- one prefix view: every member reads every engine's KV events -----------------------


@contextlib.contextmanager
def publishing_engines(
    name: str, impl_name: str, count: int
) -> Iterator[list[tuple[Engine, KVPublisher]]]:
    """``count`` Engines shared by NAME's members, each announcing a KVPublisher the test
    publishes through; on threads, each answering every request with ``{"rank": r}``."""
    stop = threading.Event()
    made: list[tuple[Engine, KVPublisher]] = []

    def serve(engine: Engine, rank: int) -> None:
        while not stop.is_set():
            for event in engine.poll(0.05):
                if isinstance(event, Request):
                    engine.reply([(event.server_rid, {"rank": rank})])

    threads = []
    try:
        for rank in range(count):
            publisher = KVPublisher(block_size=BS, rank=rank)
            engine = Engine(name, rank, kv_events=publisher, implementation=impl_name)
            made.append((engine, publisher))
            threads.append(threading.Thread(target=serve, args=(engine, rank), daemon=True))
            threads[-1].start()
        yield made
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for engine, publisher in made:
            engine.close()
            publisher.close()


def test_every_member_routes_on_every_engines_events(impl, etcd: EtcdServer):
    """2 members, 2 shared engines publishing their KV events: each engine's hello at
    each member names its publisher, so both members read both engines' events, and a
    prefix neither member ever routed goes, from either member, to the engine whose
    events hold it (without the events: each member's rotating guess)."""
    name = etcd.endpoint(f"prefix-view/{impl.name}-{time.monotonic_ns()}")
    prompts = [tokens(30 + n, 3) for n in range(6)]
    holders = [1, 0, 0, 1, 1, 0]  # engine rank whose events hold prompts[n]

    async def ask(address: str) -> list[int]:
        async with await Client.connect(address, implementation=impl.name) as client:
            await client.wait_for_engines(2, timeout=SETTLE)
            return [(await client.submit(p, block_size=BS))["rank"] for p in prompts]

    with contextlib.ExitStack() as stack:
        coords = []
        for _ in range(2):
            coord = Coordinator(
                free_tcp_address(), implementation=impl.name, policy="prefix",
                block_size=BS, kv_events={}, cluster=True,
            )  # fmt: skip
            coord.start()
            stack.callback(coord.stop)
            stack.enter_context(Member(name, coord.address, ttl=TTL))
            coords.append(coord)
        wait_for(lambda: len(live(name)) == 2, SETTLE)
        engines = stack.enter_context(publishing_engines(name, impl.name, 2))

        def rows(coord: Coordinator) -> dict[str, dict]:
            """The member's index by publisher endpoint (its ranks are its own)."""
            return {row["endpoint"]: row for row in coord.stats()["kv_events"]["engines"]}

        endpoints = [publisher.endpoint for _, publisher in engines]
        for coord in coords:  # each member got each engine's hello, and subscribed
            wait_for(lambda c=coord: sorted(rows(c)) == sorted(endpoints), SETTLE)
            wait_for(lambda c=coord: all(r["state"] == "exact" for r in rows(c).values()), SETTLE)
        for n, (prompt, holder) in enumerate(zip(prompts, holders, strict=True)):
            engines[holder][0].kv_stored([100 * n + i for i in range(3)], None, prompt)
        held = {endpoints[0]: 9, endpoints[1]: 9}
        for coord in coords:
            wait_for(lambda c=coord: {e: r["blocks"] for e, r in rows(c).items()} == held, SETTLE)
        for coord in coords:
            assert run(ask(coord.address), timeout=SETTLE) == holders
