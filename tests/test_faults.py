"""An engine's fault costs no double work and no stream: the grace for a blip, a new
process told from the old, the migration of a stream mid-way, the breaker.

Both loop cores, real sockets: a blip is a TCP proxy between an engine and the
coordinator that goes down and comes back (tests/support/proxy.py); a death is a
fake engine process SIGKILLed (or a socket closed over ipc, where a connection's end
is its process's).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

import coordkit
from coordkit.engine import Engine, Request
from coordkit.tools.fake_engine import FakeEngine
from tests.support.peers import (
    ENGINE_ACK,
    ENGINE_HELLO,
    HELD,
    PARTIAL,
    REPLY,
    SUBMIT,
    MainEngine,
    RawEngine,
    finished_request,
    m,
    main_partial,
    um,
    wait_for,
)
from tests.support.processes import engine_processes
from tests.support.proxy import Proxy

SP = {"num_tokens_to_generate": 8}


def counters(c) -> dict[str, int]:
    return c.coord.stats()["counters"]


def state(c, rank: int) -> str:
    return c.coord.stats()["engines"][rank]["state"]


# -- the grace -------------------------------------------------------------------------


def test_a_megatron_engines_blip_runs_nothing_twice(make_cluster):
    """Megatron main's engine loses its tcp connection holding 5 requests and comes
    back 1 s later without registering again, with its 5 finals (what main's own
    coordinator routes): they are the answers, and nothing ran elsewhere."""
    with make_cluster(
        transport="tcp", dialect="megatron-core", megatron_version="main", policy="round_robin"
    ) as c:
        proxy = Proxy(c.coord.address)
        victim = MainEngine(c.ctx, proxy.address, b"mp-coord-0").register()
        c.peers.append(victim)
        wait_for(lambda: len(c.coord.stats()["engines"]) == 1)
        survivor = c.add_main_engine(b"mp-coord-1")
        client = c.main_client()
        for rid in range(10):
            client.submit(rid, [rid, 1], SP)
        held = [um(victim.recv_frame())[1] for _ in range(5)]
        answered = [um(survivor.recv_frame())[1] for _ in range(5)]
        proxy.outage()
        wait_for(lambda: state(c, 0) == "away")
        client.submit(10, [10, 1], SP)  # meanwhile, new work goes elsewhere
        answered.append(um(survivor.recv_frame())[1])
        time.sleep(1.0)
        proxy.restore()
        for server_rid in held:
            victim.reply(finished_request(server_rid))
        for server_rid in answered:
            survivor.reply(finished_request(server_rid))
        finals = {}
        while len(finals) < 11:
            header, rid, body = client.recv_message()
            assert header == REPLY and rid not in finals
            finals[rid] = um(body)
        survivor.assert_silent(0.3)  # none of the 5 ran there
        stats = c.coord.stats()
        assert stats["counters"]["engines_back"] == 1 and stats["counters"]["rerouted"] == 0
        assert stats["engines"][0]["state"] == "alive" and stats["inflight"] == 0
        proxy.close()


def test_a_coordkit_engines_blip_runs_nothing_twice(make_cluster, impl):
    """A coordkit Engine that does not heartbeat loses its tcp connection and comes
    back (its hello names the same process): what it held is its own, and its HELD
    confirms it holds all of it."""
    with make_cluster(transport="tcp") as c:
        proxy = Proxy(c.coord.address)
        engine = Engine(proxy.address, implementation=impl.name, heartbeat_interval=None)
        try:
            assert engine.wait_registered(10)
            client = c.client(coordkit=True)
            for rid in range(5):
                client.send(m([SUBMIT, rid, {}]), m([rid]))
            requests: list[Request] = []
            while len(requests) < 5:
                requests += [e for e in engine.poll(0.1) if isinstance(e, Request)]
            proxy.outage()
            wait_for(lambda: state(c, 0) == "away")
            time.sleep(0.5)
            proxy.restore()
            deadline = time.monotonic() + 10
            while counters(c)["engines_back"] < 1 or not engine.registered:
                assert time.monotonic() < deadline
                engine.poll(0.05)
            engine.poll(0.3)  # its HELD went: what it did not hold would be sent again
            engine.reply((r.server_rid, {"n": i}) for i, r in enumerate(requests))
            got = sorted(um(client.recv()[0])[1] for _ in range(5))
            assert got == list(range(5))
            client.assert_silent(0.3)
            stats = c.coord.stats()
            assert stats["counters"]["rerouted"] == 0 and stats["inflight"] == 0
        finally:
            engine.close()
            proxy.close()


def test_what_a_connection_lost_on_its_way_is_sent_again(make_cluster):
    """An engine back on a new connection lists in HELD what it holds (every request,
    when its ENGINE_ACK says held_all): one it never got (the connection broke with it
    on the way) is sent again, elsewhere or to it."""
    with make_cluster(transport="tcp", policy="round_robin") as c:
        engine = c.add_engine(b"e0")
        engine.hello(ack=1, rebuild=1, base=1, session=5)
        assert um(engine.recv()[0]) == [
            ENGINE_ACK,
            {"rebuild": 1, "epoch": c.coord.epoch, "held_all": 1},
        ]
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 1, {}]), m([1]))
        client.send(m([SUBMIT, 2, {}]), m([2]))
        kept, lost = (um(engine.recv()[0])[1] for _ in range(2))
        engine.close()
        c.peers.remove(engine)
        wait_for(lambda: state(c, 0) == "away")
        back = RawEngine(c.ctx, c.coord.address, b"e0").register()
        c.peers.append(back)
        back.hello(ack=1, rebuild=1, base=1, session=5)
        assert um(back.recv()[0])[0] == ENGINE_ACK
        back.send(m([HELD, [[kept, 1, None, 0, False]]]), b"")
        resent = back.recv()  # the lost one, under its id, to the only engine there is
        assert um(resent[0])[:2] == [SUBMIT, lost]
        for server_rid in (kept, lost):
            back.send(m([REPLY, [[server_rid, False]]]), b"done")
        assert sorted(um(client.recv()[0])[1] for _ in range(2)) == [1, 2]
        assert counters(c)["rerouted"] == 1 and c.coord.stats()["inflight"] == 0


def test_over_ipc_a_connection_that_ends_is_a_death(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 1, {}]), m([1]))
        sid = um(c.engines[0].recv()[0])[1]
        c.engines[0].close()
        assert um(c.engines[1].recv()[0])[:2] == [SUBMIT, sid]  # at once, no grace
        assert state(c, 0) == "gone"


def test_an_engine_restarted_before_its_death_is_noticed(make_cluster, impl, tmp_path):
    """A fake engine process SIGKILLed over tcp is away for the grace; a new process of
    the same rank registering within it is another process: what the old one held is
    answered from elsewhere at once, not after the grace or the heartbeat timeout."""
    with make_cluster(transport="tcp", engine_grace=30.0, heartbeat_timeout=30.0) as c:
        address = c.coord.address
        options = ["--latency", "0.05", "--output-tokens", "40", "--heartbeat", "0.2"]
        with engine_processes(address, [0], *options) as [old]:
            wait_for(lambda: len(c.coord.stats()["engines"]) == 1, 20)
            outcome = _run_streams(
                address, impl.name, 12, lambda: old.send_signal(signal.SIGKILL), restart=True
            )
        assert outcome.failed == [] and outcome.wrong == []
        stats = c.coord.stats()
        assert stats["counters"]["engine_restarts"] == 1 and stats["inflight"] == 0


# -- the migration ---------------------------------------------------------------------


class Outcome:
    def __init__(self) -> None:
        self.failed: list[object] = []
        self.wrong: list[int] = []
        self.partials = 0


def _run_streams(
    address: str, impl: str, n: int, kill, restart: bool = False, options: tuple = ()
) -> Outcome:
    """``n`` streams of 40 tokens (and as many submits); ``kill()`` once half have
    streamed a few tokens (``restart``: a new process of the killed rank is started
    then, under the same address); each checked against an undisturbed generation."""
    outcome = Outcome()

    async def main() -> None:
        async with await coordkit.Client.connect(address, implementation=impl) as client:
            await client.wait_for_engines(1)
            started = asyncio.Event()

            async def one_stream(i: int) -> None:
                prompt = [i + 1, 2, 3]
                tokens: list[int] = []
                try:
                    async for part in client.stream(prompt, {"output_tokens": 40}):
                        if part["status"] == "generating":
                            tokens += part["new_tokens"]
                            outcome.partials += 1
                            if len(tokens) >= 3:
                                started.set()
                        else:
                            final = part["generated_tokens"]
                except coordkit.CoordinatorError as exc:
                    outcome.failed.append(exc)
                    return
                expected = FakeEngine.generate(prompt, 40)
                if final != expected or tokens != expected[: len(tokens)]:
                    outcome.wrong.append(i)

            async def one_submit(i: int) -> None:
                prompt = [i + 100, 5]
                try:
                    reply = await client.submit(prompt, {"output_tokens": 40})
                except coordkit.CoordinatorError as exc:
                    outcome.failed.append(exc)
                    return
                if reply["generated_tokens"] != FakeEngine.generate(prompt, 40):
                    outcome.wrong.append(100 + i)

            tasks = [asyncio.ensure_future(one_stream(i)) for i in range(n)]
            tasks += [asyncio.ensure_future(one_submit(i)) for i in range(n)]
            await asyncio.wait_for(started.wait(), 30)
            kill()
            if restart:
                with engine_processes(address, [0], "--output-tokens", "40", *options):
                    await asyncio.wait_for(asyncio.gather(*tasks), 60)
            else:
                await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(main())
    return outcome


def test_streams_go_on_when_their_engine_is_killed(make_cluster, impl):
    """24 streams (and 24 submits) of 40 tokens on two fake engine processes; one is
    SIGKILLed once they streamed a few tokens: every stream goes on elsewhere from the
    tokens it got, and ends with exactly the tokens of an undisturbed run."""
    with make_cluster() as c:
        address = c.coord.address
        options = ["--latency", "0.03", "--output-tokens", "40"]
        with engine_processes(address, [0, 1], *options) as processes:
            wait_for(lambda: len(c.coord.stats()["engines"]) == 2, 20)
            outcome = _run_streams(
                address, impl.name, 24, lambda: processes[0].send_signal(signal.SIGKILL)
            )
        assert outcome.failed == [] and outcome.wrong == []
        stats = c.coord.stats()
        assert stats["counters"]["migrated"] >= 1 and stats["counters"]["engine_failed"] == 0
        assert stats["inflight"] == 0


def test_a_request_that_opts_out_fails_as_before(make_cluster):
    with make_cluster(n_engines=2, policy="round_robin") as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 1, {"resumable": False}]), m([1, 2]))
        client.send(m([SUBMIT, 2, {}]), m([1, 2]))
        sid = um(c.engines[0].recv()[0])[1]
        other = um(c.engines[1].recv()[0])[1]
        c.engines[0].send(m([PARTIAL, [sid]]), m({"new_tokens": [7]}))
        c.engines[1].send(m([PARTIAL, [other]]), m({"new_tokens": [7]}))
        assert [um(client.recv()[0])[0] for _ in range(2)] == [PARTIAL, PARTIAL]
        c.engines[0].close()
        error = um(client.recv()[0])
        assert error[:3] == [90, 1, 5]  # ERROR(ENGINE_FAILED) for request 1
        assert counters(c)["migrated"] == 0


def test_a_migrated_stream_continues_at_a_megatron_engine(make_cluster):
    """Main's partials carry their new tokens: a stream whose engine died goes on at
    another main engine, prompt extended and budget reduced, its final continuing."""
    with make_cluster(dialect="megatron-core", megatron_version="main", policy="round_robin") as c:
        first, second = c.add_main_engine(), c.add_main_engine()
        client = c.main_client()
        client.submit(0, [4, 5], {**SP, "streaming": True})
        sid = um(first.recv_frame())[1]
        first.partial(main_partial(sid, [9, 10]))
        assert client.recv_message()[:2] == (PARTIAL, 0)
        first.close()
        moved = um(second.recv_frame())
        assert moved[:4] == [
            SUBMIT,
            sid,
            [4, 5, 9, 10],
            {**SP, "streaming": True, "num_tokens_to_generate": 6},
        ]
        second.partial(main_partial(sid, [11]))
        second.reply(finished_request(sid, generated_tokens=[11, 12]))
        header, rid, body = client.recv_message()
        assert (header, rid, um(body)["new_tokens"]) == (PARTIAL, 0, [11])
        header, rid, body = client.recv_message()
        assert (header, rid, um(body)["generated_tokens"]) == (REPLY, 0, [9, 10, 11, 12])
        assert counters(c)["migrated"] == 1 and c.coord.stats()["inflight"] == 0


# -- the breaker -----------------------------------------------------------------------


def test_a_flapping_engine_is_quarantined_and_let_back(make_cluster):
    """An engine whose process is replaced three times within the window is
    quarantined (no work) for the backoff; then it takes work again."""
    with make_cluster(
        policy="round_robin", breaker_failures=3, breaker_window=30, breaker_backoff=1.0
    ) as c:
        steady = c.add_engine(b"steady")
        flapping = None
        for session in range(1, 5):  # a registration, then three new processes
            flapping = RawEngine(c.ctx, c.coord.address, b"flappy").register()
            flapping.send(m([ENGINE_HELLO, {"coordkit": 1, "session": session}]))
            c.peers.append(flapping)
            wait_for(lambda s=session: counters(c)["engine_restarts"] == s - 1)
            time.sleep(0.05)
        assert flapping is not None
        wait_for(lambda: counters(c)["quarantines"] == 1)
        engine = c.coord.stats()["engines"][1]
        assert engine["quarantined"] > 0
        assert engine["last_failure"] == "a new process registered under its identity"
        client = c.client(coordkit=True)
        for rid in range(4):
            client.send(m([SUBMIT, rid, {}]), m([rid]))
        assert len(steady.recv_all(0.3)) == 4 and flapping.recv_all(0.1) == []
        wait_for(lambda: c.coord.stats()["engines"][1]["quarantined"] == 0, 5)
        time.sleep(0.2)  # the timer's next tick lets it back
        for rid in range(4, 8):
            client.send(m([SUBMIT, rid, {}]), m([rid]))
        assert len(flapping.recv_all(0.3)) == 2  # round robin again


def test_stats_say_which_engines_are_quarantined(make_cluster):
    with make_cluster(n_engines=1) as c:
        engine = c.coord.stats()["engines"][0]
        assert (engine["quarantined"], engine["failures"], engine["last_failure"]) == (
            0,
            0,
            None,
        )


@pytest.mark.parametrize("grace", [-1.0])
def test_a_negative_grace_is_refused(make_coordinator, grace):
    with pytest.raises(ValueError, match="engine_grace"):
        make_coordinator(engine_grace=grace)
