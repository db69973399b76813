"""P/D requests against engines that really die or freeze, on both implementations.

coordkit's own P/D engines (FakeEngine with roles: a prefill on a thread of this
process, whose pins the test reads, and decode processes that are SIGKILLed or
SIGSTOPped) and PR #6675's peers (tests/support/megatron_pd.py): a decode killed
after its read, once it streamed, ends its request with one typed error, its
prefill's pins gone at the read; a decode that takes the handoff and never reads
loses it to the pins' lease; a prefill killed while its decode imports, no retry
left, ends the request and frees each seat once; a seeded random run of submits, aborts, kills and
restarts over a small fleet leaves each request one terminal reply and nothing
held. And what a P/D request in flight gets across a coordinator's loss (docs/pd.md,
"Across a coordinator's failover"): a stream at its decode fails, a request that
streamed nothing runs again, a handoff not read yet has its pins released.

Each client is a peer on the wire that keeps every message per request (exactly one
terminal reply is counted, not assumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import zmq

from coordkit import Client, Coordinator, CoordinatorError, _pd
from coordkit.protocol import ErrorCode
from coordkit.tools.fake_engine import NO_COST, FakeEngine
from tests.support import megatron_pd as pd
from tests.support.peers import ABORT, ERROR, PARTIAL, REPLY, SUBMIT, RawClient, m, um, wait_for
from tests.support.processes import (
    engine_processes,
    fake_engine_command,
    free_tcp_address,
    python_env,
    serve,
)
from tests.support.scripted import run
from tests.support.threads import fake_engines

pytestmark = pytest.mark.timeout(90)

PROMPT = list(range(1, 41))
DECODE = ("--quiet", "--role", "decode", "--batch", "4")
SETTLE = 15.0  # seconds for the room to be empty again, on a loaded 2-core machine


class Recorder:
    """A coordkit client on the wire: every message it gets, per request id."""

    def __init__(self, address: str):
        self.peer = RawClient(zmq.Context.instance(), address).connect(coordkit=True)
        self.got: dict[int, list[tuple[int, Any]]] = {}

    def submit(self, prompt: list[int], **params: Any) -> int:
        rid = len(self.got)
        self.got[rid] = []
        self.peer.send(m([SUBMIT, rid, params]), m(prompt))
        return rid

    def abort(self, rid: int) -> None:
        self.peer.send(m([ABORT, rid]))

    def pump(self, timeout: float = 0.01) -> None:
        for frames in self.peer.recv_all(timeout):
            head = um(frames[0])
            if head[0] in (REPLY, PARTIAL):
                self.got[head[1]].append((head[0], um(frames[1])))
            elif head[0] == ERROR and head[1] is not None:
                self.got[head[1]].append((ERROR, head[2]))

    def terminals(self, rid: int) -> list[tuple[int, Any]]:
        """The request's terminal replies: its final or its ERROR. An ERROR
        UNKNOWN_REQUEST answers an ABORT that came after the end, not the request."""
        return [
            (header, value)
            for header, value in self.got[rid]
            if header == REPLY or (header == ERROR and value != ErrorCode.UNKNOWN_REQUEST)
        ]

    def partials(self, rid: int) -> int:
        return sum(header == PARTIAL for header, _ in self.got[rid])

    def until(self, condition: Callable[[], bool], timeout: float = SETTLE) -> None:
        def pumped() -> bool:
            self.pump()
            return condition()

        wait_for(pumped, timeout)

    def close(self) -> None:
        self.peer.close()


@pytest.fixture
def coordinator(start_coordinator) -> Callable[..., Any]:
    return functools.partial(start_coordinator, policy="prefix", pd_mode="always")


def registered(coord: Any, count: int) -> None:
    wait_for(lambda: sum(e["state"] == "alive" for e in coord.stats()["engines"]) == count, 20)
    wait_for(lambda: len(coord.stats()["pd"]["engines"]) == count, 20)


def settled(coord: Any) -> bool:
    """Nothing in flight, no seat reserved, no pin held, nothing queued or orphaned."""
    stats = coord.stats()
    room = stats["pd"]
    return (
        stats["inflight"] == 0
        and room["orphans"] == 0
        and room["queued"] == {"prefill": 0, "decode": 0}
        and all(seat["reserved"] == seat["pinned"] == 0 for seat in room["engines"].values())
    )


def wait_settled(coord: Any, also: Callable[[], bool] = lambda: True) -> None:
    try:
        wait_for(lambda: settled(coord) and also(), SETTLE)
    except TimeoutError:
        stats = coord.stats()
        raise AssertionError(f"not settled: inflight {stats['inflight']}, {stats['pd']}") from None


def seats_pinned(coord: Any) -> int:
    return sum(seat["pinned"] for seat in coord.stats()["pd"]["engines"].values())


# -- coordkit's own P/D engines --------------------------------------------------------


def test_a_decode_killed_after_its_read_ends_its_stream_with_one_error(coordinator):
    coord = coordinator()
    with (
        fake_engines(coord.address, 1, role="prefill", max_batch=4) as [prefill],
        engine_processes(coord.address, [1], *DECODE, "--latency", "0.05") as [decode],
    ):
        registered(coord, 2)
        client = Recorder(coord.address)
        rid = client.submit(PROMPT, stream=True, output_tokens=200)
        client.until(lambda: client.partials(rid) >= 2)
        # the read is over: the prefill's pins went with it, before any death
        wait_for(lambda: prefill.stats()["releases"] == 1)
        assert prefill.stats()["pinned"] == 0 and seats_pinned(coord) == 0
        decode.kill()  # SIGKILL: seen by its connection's end
        client.until(lambda: bool(client.terminals(rid)))
        client.pump(0.3)
        assert client.terminals(rid) == [(ERROR, ErrorCode.ENGINE_FAILED)]
        wait_settled(coord)
        counts = coord.stats()["pd"]["counts"]
        assert counts["reprefilled"] == counts["rehanded"] == 0  # a stream is not moved
        assert prefill.stats()["handoffs"] == 1
        client.close()


def test_a_frozen_decode_loses_the_handoff_to_the_lease(coordinator):
    coord = coordinator(pd_lease=0.5, pd_retries=0, heartbeat_timeout=30.0)
    with (
        fake_engines(coord.address, 1, role="prefill", max_batch=4) as [prefill],
        engine_processes(coord.address, [1], *DECODE) as [decode],
    ):
        registered(coord, 2)
        client = Recorder(coord.address)
        decode.send_signal(signal.SIGSTOP)  # alive to its connection, never reading
        try:
            rid = client.submit(PROMPT, output_tokens=4)
            client.until(lambda: bool(client.terminals(rid)))
            assert client.terminals(rid) == [(ERROR, ErrorCode.ENGINE_FAILED)]
            wait_for(lambda: prefill.stats()["releases"] == 1)
            assert prefill.stats()["pinned"] == 0
            assert coord.stats()["pd"]["counts"]["leases_expired"] == 1
            wait_settled(coord)
        finally:
            decode.send_signal(signal.SIGCONT)
        # woken, it takes the handoff and its ABORT: nothing more reaches the client
        client.pump(0.5)
        assert len(client.terminals(rid)) == 1 and client.partials(rid) == 0
        wait_settled(coord)
        client.close()


def test_a_prefill_killed_before_the_read_with_no_retry_frees_each_seat_once(coordinator):
    coord = coordinator(pd_retries=0)
    slow = NO_COST._replace(transfer_latency=30.0)  # the decode reads nothing meanwhile
    with (
        fake_engines(coord.address, 1, 1, role="decode", max_batch=4, cost=slow) as [decode],
        engine_processes(coord.address, [0], "--quiet", "--role", "prefill") as [prefill],
    ):
        registered(coord, 2)
        client = Recorder(coord.address)
        rid = client.submit(PROMPT, output_tokens=4)
        wait_for(lambda: decode.stats()["imports"] == 1)
        prefill.kill()  # its KV is gone: the import stops, no retry is left
        client.until(lambda: bool(client.terminals(rid)))
        client.pump(0.3)
        assert client.terminals(rid) == [(ERROR, ErrorCode.ENGINE_FAILED)]
        wait_settled(coord)
        wait_for(lambda: decode.stats()["importing"] == 0)  # its ABORT reached it
        client.close()


# -- a random run: submits, aborts, kills and restarts ----------------------------------


class Fleet:
    """Fake engine processes by rank, each killed (SIGKILL) and started again at will;
    those left are killed at exit."""

    def __init__(self, address: str, options: dict[int, tuple[str, ...]]):
        self.address, self.options = address, options
        self.live: dict[int, subprocess.Popen] = {}
        self.kills = 0

    def __enter__(self) -> Fleet:
        for rank in self.options:
            self.start(rank)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.live.values():
            process.kill()
            process.wait()

    def dead(self) -> list[int]:
        return [rank for rank in self.options if rank not in self.live]

    def start(self, rank: int) -> None:
        command = fake_engine_command(self.address, rank, *self.options[rank])
        self.live[rank] = subprocess.Popen(command, env=python_env())

    def kill(self, rank: int) -> None:
        process = self.live.pop(rank)
        process.kill()
        process.wait()
        self.kills += 1


STEPS = 40
PREFILL = ("--quiet", "--role", "prefill", "--batch", "2", "--latency", "0.01")
FAST_DECODE = (*DECODE, "--latency", "0.05")


def plan(rng: random.Random, ranks: list[int]) -> list[tuple[Any, ...]]:
    """STEPS of: a request (streamed or not, 2-8 tokens), an abort of one not ended
    (picked by a fraction), a kill, a restart, each followed by a pause; drawn before
    the run, so that a seed is the same run whatever the timing."""
    steps: list[tuple[Any, ...]] = []
    for _ in range(STEPS):
        action = rng.choices(["submit", "abort", "kill", "start"], [6, 2, 1, 2])[0]
        if action == "submit":
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 80))]
            steps.append((action, prompt, rng.random() < 0.5, rng.randint(2, 8)))
        elif action == "abort":
            steps.append((action, rng.random()))
        else:
            steps.append((action, rng.choice(ranks)))
        steps.append(("pause", rng.choice([0.0, 0.02, 0.05])))
    return steps


def random_run(steps: list[tuple[Any, ...]], client: Recorder, fleet: Fleet) -> None:
    """The plan's steps, then every engine up again."""
    for action, *args in steps:
        if action == "submit":
            prompt, stream, tokens = args
            client.submit(prompt, stream=stream, output_tokens=tokens)
        elif action == "abort":
            pending = [rid for rid in client.got if not client.terminals(rid)]
            if pending:
                client.abort(pending[int(args[0] * len(pending))])
        elif action == "kill" and args[0] in fleet.live:
            fleet.kill(args[0])
        elif action == "start" and args[0] not in fleet.live:
            fleet.start(args[0])
        client.pump(args[0] if action == "pause" else 0.0)
    for rank in fleet.dead():
        fleet.start(rank)


@pytest.mark.parametrize("seed", [3])
def test_random_submits_aborts_and_kills_end_each_request_once(coordinator, seed):
    coord = coordinator(pd_lease=3.0)  # pins a read never frees go within SETTLE
    options = {2: PREFILL, 3: FAST_DECODE, 4: FAST_DECODE}
    # Beside the killable processes, a prefill and a decode on threads that never die
    # (the prefill's pins are read at the end).
    with (
        fake_engines(coord.address, 1, role="prefill", max_batch=2, latency=0.01) as [steady],
        fake_engines(coord.address, 1, 1, role="decode", max_batch=4, latency=0.05),
        Fleet(coord.address, options) as fleet,
    ):
        registered(coord, 5)
        client = Recorder(coord.address)
        random_run(plan(random.Random(seed), sorted(options)), client, fleet)
        client.until(lambda: all(client.terminals(rid) for rid in client.got), 30)
        client.pump(0.3)
        many = {rid: got for rid in client.got if len(got := client.terminals(rid)) != 1}
        assert not many, f"seed {seed}: not one terminal reply each: {many}"
        wait_settled(coord, lambda: steady.stats()["pinned"] == 0)
        assert fleet.kills  # the plan's: whatever the timing
        client.close()


# -- a coordinator's loss ---------------------------------------------------------------

RESTART_OPTIONS = ("--pd-mode", "always", "--rebuild-window", "0.5")


@contextlib.asynccontextmanager
async def restartable_fleet(
    address: str, impl: Any, tmp_path: Any, *decode: str
) -> AsyncIterator[tuple[Any, Any, Client]]:
    """A coordinator process to kill (its log first.log), a prefill, a decode process
    (``decode``: its options) and a client, once both engines have their roles."""
    with (
        serve(address, impl.name, tmp_path / "first.log", *RESTART_OPTIONS) as first,
        fake_engines(address, 1, role="prefill", max_batch=4) as [prefill],
        engine_processes(address, [1], *DECODE, *decode),
    ):
        async with await Client.connect(address, timeout=10.0) as client:
            while len((await client.stats())["pd"]["engines"]) < 2:
                await asyncio.sleep(0.05)
            yield first, prefill, client


def test_across_a_coordinators_restart_a_stream_fails_and_a_silent_request_runs_again(
    impl, tmp_path
):
    """Both requests at the decode after the read when the coordinator is SIGKILLed;
    the new one (same address) adopts no hop: the decode's HELD names no client."""
    address = free_tcp_address()
    silent = [token + 100 for token in PROMPT]

    async def body() -> tuple[BaseException, Any, dict[str, Any]]:
        fleet = restartable_fleet(address, impl, tmp_path, "--latency", "0.05")
        async with fleet as (first, prefill, client):
            stream = client.stream(PROMPT, {"output_tokens": 200})
            future = client.submit(silent, {"output_tokens": 40})
            for _ in range(2):
                await anext(stream)
            # both read (a handoff not yet read would leave its pins: docs/pd.md)
            await asyncio.to_thread(wait_for, lambda: prefill.stats()["releases"] == 2)
            first.kill()
            first.wait()
            with serve(address, impl.name, tmp_path / "second.log", *RESTART_OPTIONS):
                with pytest.raises(CoordinatorError) as failed:
                    async for _ in stream:
                        pass
                reply = await asyncio.wait_for(future, 30)
                room = (await client.stats())["pd"]
                await asyncio.to_thread(wait_for, lambda: prefill.stats()["pinned"] == 0)
                return failed.value, reply, room

    error, reply, room = run(body())
    assert isinstance(error, CoordinatorError) and error.code == ErrorCode.ENGINE_FAILED
    assert reply["generated_tokens"] == FakeEngine.generate(silent, 40)
    assert room["counts"]["requests"] == room["counts"]["handoffs"] == 1  # run again, anew


def test_across_a_coordinators_restart_a_handoff_not_read_yet_is_released(impl, tmp_path):
    """The decode still reading (a slow transfer) when the coordinator is SIGKILLed: the
    prefill's HELD lists the pinned handoff, which the new coordinator never knew of and
    releases; the request runs again, anew, and no pin is left."""
    address = free_tcp_address()

    async def body() -> tuple[Any, dict[str, Any], dict[str, Any]]:
        fleet = restartable_fleet(address, impl, tmp_path, "--transfer-latency", "2")
        async with fleet as (first, prefill, client):
            future = client.submit(PROMPT, {"output_tokens": 5})
            await asyncio.to_thread(wait_for, lambda: prefill.stats()["handoffs"] == 1)
            first.kill()
            first.wait()
            assert prefill.stats()["pinned"] == 1  # the decode had not read it
            with serve(address, impl.name, tmp_path / "second.log", *RESTART_OPTIONS):
                reply = await asyncio.wait_for(future, 30)
                room = (await client.stats())["pd"]
                await asyncio.to_thread(wait_for, lambda: prefill.stats()["pinned"] == 0)
                return reply, room, prefill.stats()

    reply, room, stats = run(body())
    assert reply["generated_tokens"] == FakeEngine.generate(PROMPT, 5)
    assert stats["handoffs"] == stats["releases"] == 2  # the first's by the new coordinator
    assert room["counts"]["handoffs"] == 1 and room["counts"]["pins_released"] == 2


# -- PR #6675's peers -------------------------------------------------------------------


@contextlib.contextmanager
def megatron_coordinator(impl: Any, kv_dir: str, **options: Any) -> Iterator[Any]:
    """A coordinator serving #6675's peers, every request through both hops."""
    coord = Coordinator(
        f"ipc://{kv_dir}/coord",
        implementation=impl.name,
        dialect="megatron-core",
        megatron_version="pr6675",
        pd_mode="always",
        **options,
    )
    coord.start()
    try:
        yield coord
    finally:
        coord.stop()


def test_a_6675_decode_killed_after_its_read(impl, kv_dir, tmp_path):
    with megatron_coordinator(impl, kv_dir) as coord:
        prefill = pd.PDEngine(coord.address, "prefill", kv_dir=kv_dir).start()
        with pd.engine_process(
            coord.address, "decode", tmp_path / "decode.json", "--kv-dir", kv_dir,
            "--index", "1", "--step-seconds", "0.05",
        ) as decode:  # fmt: skip
            decode.wait_registered()
            peer = pd.PDClient(coord.address).connect()
            rid = peer.submit_streaming(pd.tokenize(PROMPT), num_tokens_to_generate=200)
            wait_for(lambda: peer.pump(0.01) >= 0 and len(peer.outcomes[rid].partials) >= 2)
            [hop] = prefill.received(pd.SUBMIT)
            assert prefill.releases == [hop[1]] and prefill.pins() == {}  # at the read
            decode.kill()
            outcome = peer.wait(rid)
            peer.pump(0.3)
            assert outcome.error == (_pd.removed(b"decode_s1_dp0"), True)
            assert outcome.terminals == [pd.REQUEST_ERROR] and peer.violations == []
            wait_settled(coord)
            peer.close()
        prefill.stop()


def test_a_6675_decode_that_never_reads_loses_the_handoff_to_the_lease(impl, kv_dir):
    with megatron_coordinator(impl, kv_dir, pd_lease=0.5, pd_retries=0) as coord:
        prefill = pd.PDEngine(coord.address, "prefill", kv_dir=kv_dir).start()
        decode = pd.PDEngine(coord.address, "decode", kv_dir=kv_dir, index=1).start()
        decode.hold()  # takes the handoff, admits no import
        peer = pd.PDClient(coord.address).connect()
        rid = peer.submit(PROMPT, num_tokens_to_generate=3)
        outcome = peer.wait(rid)
        assert outcome.error == (_pd.LEASE_EXPIRED, True)
        wait_for(lambda: prefill.pins() == {})
        [hop] = decode.received(pd.SUBMIT_KV)
        wait_for(lambda: decode.received(pd.ABORT) == [[pd.ABORT, hop[1]]])
        peer.pump(0.3)
        assert outcome.terminals == [pd.REQUEST_ERROR] and peer.violations == []
        assert prefill.violations == decode.violations == []  # nothing was read
        wait_settled(coord)
        peer.close()
        decode.kill()  # never let go: its read would find the blocks freed
        prefill.stop()
