"""coordkit.Client: exact frames against a scripted ROUTER, round trips through both coordinators.

Every test runs on both client cores (``impl``: the Cython and the Python
one); through a real coordinator, on the coordinator of the same
implementation. Async bodies run under ``asyncio.run`` with an overall
timeout (no pytest-asyncio); every receive has its own timeout too.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading

import pytest

from coordkit import Client, CoordinatorError, ErrorCode, Header
from coordkit.engine import Control, Engine
from coordkit.protocol import block_hashes, packb, unpackb
from coordkit.tools.fake_engine import FakeEngine
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    ERROR,
    PARTIAL,
    PAUSE,
    REJOIN,
    REPLY,
    RESEND,
    STATS,
    STATS_REPLY,
    SUBMIT,
    SUBMIT_BATCH,
)
from tests.support.processes import engine_processes
from tests.support.scripted import TIMEOUT, Script, run, scripted
from tests.support.threads import fake_engines

# -- against a scripted coordinator ---------------------------------------------------------


def test_submit_frames(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl) as (script, client):
            client.submit("héllo", {"temperature": 0.5})
            client.submit([1, 2, 3])
            prompt = bytearray(packb([4, 5]))
            client.submit(memoryview(prompt))  # bytes-like: sent as they are
            tokens = list(range(40))
            client.submit(tokens, block_size=16)
            assert await script.recv() == [packb([SUBMIT, 0, {"temperature": 0.5}]), packb("héllo")]
            assert await script.recv() == [packb([SUBMIT, 1, {}]), packb([1, 2, 3])]
            assert await script.recv() == [packb([SUBMIT, 2, {}]), bytes(prompt)]
            hashes = block_hashes(tokens, 16)
            assert len(hashes) == 16  # two full blocks of 16; the last 8 tokens have none
            assert await script.recv() == [packb([SUBMIT, 3, {}]), packb(tokens), hashes]
            client.stream([7])
            assert await script.recv() == [packb([SUBMIT, 4, {"stream": True}]), packb([7])]
            for not_tokens in ("text", b"bytes"):
                with pytest.raises(ValueError, match="token ids"):
                    client.submit(not_tokens, block_size=16)

    run(body())


def test_replies_and_errors(tmp_path, impl):
    errors: list[CoordinatorError] = []

    async def body():
        async with scripted(tmp_path, impl, on_error=errors.append) as (script, client):
            plain = client.submit([1])
            raw = client.submit([2], raw=True)
            failing = client.submit([3])
            stream = client.stream([4])
            for _ in range(4):
                await script.recv()
            # partials of a submit: dropped
            await script.send(packb([PARTIAL, 0]), packb({"part": 1}))
            await script.send(packb([REPLY, 0]), packb({"status": "finished"}))
            await script.send(packb([REPLY, 1]), b"\x01raw")
            await script.send(packb([ERROR, 2, int(ErrorCode.BUSY), "SUBMIT_REQUEST: busy"]))
            await script.send(packb([PARTIAL, 3]), packb([1]))
            await script.send(packb([PARTIAL, 3]), packb([1, 2]))
            await script.send(packb([REPLY, 3]), packb([1, 2, 3]))
            await script.send(packb([ERROR, None, int(ErrorCode.INVALID_STATE), "UNPAUSE: no"]))
            await script.send(packb([REPLY, 77]), packb({}))  # not pending: dropped
            assert await plain == {"status": "finished"}
            assert await raw == b"\x01raw"
            with pytest.raises(CoordinatorError) as caught:
                await failing
            assert caught.value.code is ErrorCode.BUSY
            assert caught.value.request_id == 2
            assert caught.value.message == "SUBMIT_REQUEST: busy"
            assert [part async for part in stream] == [[1], [1, 2], [1, 2, 3]]
            stats = asyncio.ensure_future(client.stats())
            assert await script.recv() == [packb([STATS])]
            await script.send(packb([STATS_REPLY]), packb({"inflight": 0}))
            assert await stats == {"inflight": 0}
            assert client.pending == 0
            assert [e.code for e in client.errors] == [ErrorCode.INVALID_STATE]
            assert errors == list(client.errors)

    run(body())


def test_abort_cancel_and_close(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl) as (script, client):
            aborted = client.submit([1])
            cancelled = client.submit([2])
            stream = client.stream([3])
            left = client.submit([4])
            for _ in range(4):
                await script.recv()
            await client.abort(aborted)
            assert await script.recv() == [packb([ABORT, 0])]
            await client.abort(stream)
            assert await script.recv() == [packb([ABORT, 2])]
            cancelled.cancel()  # cancelling aborts the request at its engine
            assert await script.recv() == [packb([ABORT, 1])]
            # After an abort the engine's final still resolves the request.
            await script.send(packb([REPLY, 0]), packb({"status": "aborted"}))
            assert await aborted == {"status": "aborted"}
            await client.abort(0)  # already ended: nothing is sent
            await client.pause()
            assert await script.recv() == [packb([PAUSE])]
        # Closing failed what was still pending.
        with pytest.raises(ConnectionError, match="closed"):
            await left
        with pytest.raises(ConnectionError, match="closed"):
            await anext(stream)
        with pytest.raises(ConnectionError):
            client.submit([5])

    run(body())


async def _riding(script: Script, impl, granted: bytes, **kwargs) -> tuple[Client, Script]:
    """A rebuild client of ``impl`` connected to ``script``, which then goes away: the
    client rides through; the script that comes back at the same address."""
    connecting = asyncio.ensure_future(
        Client.connect(script.address, implementation=impl.name, timeout=TIMEOUT, **kwargs)
    )
    await script.recv()  # CONNECT
    await script.send(granted)
    client = await connecting
    return client, script


def test_aborts_and_control_while_riding_go_after_the_rejoin(tmp_path, impl):
    """While no coordinator serves, ABORT and control calls are kept, and go out, in
    the order issued, right after the REJOIN; a request aborted meanwhile that the
    coordinator asks for again (RESEND) is not sent again: it ends; one submitted and
    aborted meanwhile was never sent: it ends at once, and nothing of it goes out."""
    granted = packb([CONNECT_ACK, {"rebuild": 1, "epoch": 1}])

    async def body():
        client, script = await _riding(Script(tmp_path), impl, granted, batch=False)
        async with client:
            sent = client.submit([1])
            resent = client.submit([2])
            for rid in range(2):
                assert unpackb((await script.recv())[0])[:2] == [SUBMIT, rid]
            script.close()  # the coordinator is gone
            while client.connected:
                await asyncio.sleep(0.01)
            late = client.submit([3])  # not sent
            await client.abort(sent)
            await client.abort(late)
            await client.abort(resent)
            with pytest.raises(CoordinatorError) as error:
                await asyncio.wait_for(late, TIMEOUT)
            assert error.value.code == ErrorCode.UNKNOWN_REQUEST
            paused = asyncio.ensure_future(client.pause())
            script = Script(tmp_path)  # one comes back at the same address
            assert unpackb((await script.recv())[0])[0] == CONNECT
            await script.send(granted)
            assert await script.recv() == [packb([REJOIN, [[0, 0], [1, 0]]])]
            assert await script.recv() == [packb([ABORT, 0])]
            assert await script.recv() == [packb([ABORT, 1])]
            assert await script.recv() == [packb([PAUSE])]
            await asyncio.wait_for(paused, TIMEOUT)
            await script.send(packb([RESEND, [1]]))
            with pytest.raises(CoordinatorError) as error:
                await asyncio.wait_for(resent, TIMEOUT)
            assert error.value.code == ErrorCode.UNKNOWN_REQUEST
            await script.silent()  # neither is sent again
            await script.send(packb([REPLY, 0]), packb({"status": "aborted"}))
            assert await asyncio.wait_for(sent, TIMEOUT) == {"status": "aborted"}
        script.close()

    run(body())


@pytest.mark.parametrize("grant", [False, True], ids=["single", "batched"])
def test_requests_never_sent_while_riding_go_right_after_the_rejoin(tmp_path, impl, grant):
    """A request submitted while no coordinator serves (or still coalescing when the
    loss is seen) is at no engine: the REJOIN names only the one sent before the loss,
    and the others go, as submissions under their ids, right after it (before a
    control call issued meanwhile)."""
    granted = packb([CONNECT_ACK, {"rebuild": 1, "epoch": 1, **({"batch": 1} if grant else {})}])

    async def body():
        client, script = await _riding(Script(tmp_path), impl, granted, batch=grant)
        async with client:
            sent = client.submit([1])
            assert (await script.recv())[1:] == [packb([1])]
            script.close()  # the coordinator is gone
            coalesced = client.submit([2]) if grant else None
            if grant:
                client._lost()  # seen before that submission was flushed
            while client.connected:
                await asyncio.sleep(0.01)
            late = client.submit([2 + grant])
            stream = client.stream([3 + grant])
            paused = asyncio.ensure_future(client.pause())
            script = Script(tmp_path)  # one comes back at the same address
            assert unpackb((await script.recv())[0])[0] == CONNECT
            await script.send(granted)
            assert await script.recv() == [packb([REJOIN, [[0, 0]]])]
            if grant:
                batch = [[1, {}, False], [2, {}, False], [3, {"stream": True}, False]]
                prompts = [packb([2]), packb([3]), packb([4])]
                assert await script.recv() == [packb([SUBMIT_BATCH, batch]), *prompts]
            else:
                assert await script.recv() == [packb([SUBMIT, 1, {}]), packb([2])]
                assert await script.recv() == [packb([SUBMIT, 2, {"stream": True}]), packb([3])]
            assert await script.recv() == [packb([PAUSE])]
            await asyncio.wait_for(paused, TIMEOUT)
            for rid in range(3 + grant):
                await script.send(packb([REPLY, rid]), packb({"rid": rid}))
            assert await asyncio.wait_for(sent, TIMEOUT) == {"rid": 0}
            if coalesced is not None:
                assert await asyncio.wait_for(coalesced, TIMEOUT) == {"rid": 1}
            assert await asyncio.wait_for(late, TIMEOUT) == {"rid": 1 + grant}
            assert [part async for part in stream] == [{"rid": 2 + grant}]
        script.close()

    run(body())


def test_connect_timeout(tmp_path, impl):
    async def body():
        with pytest.raises(ConnectionError, match="no coordinator answered"):
            await Client.connect(
                f"ipc://{tmp_path}/nobody.sock", timeout=0.3, implementation=impl.name
            )
        with pytest.raises(ConnectionError, match="no coordinator answered"):
            await Client.connect("tcp://127.0.0.1:1", timeout=0.3, implementation=impl.name)

    run(body())


# -- through a real coordinator ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_round_trip(make_coordinator, impl, transport):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            prompts = [[i, i + 1, i + 2] for i in range(20)]
            replies = await asyncio.gather(*(client.submit(p) for p in prompts))
            for prompt, reply in zip(prompts, replies, strict=True):
                assert reply["status"] == "finished"
                assert reply["generated_tokens"] == FakeEngine.generate(prompt, 4)
            assert {reply["rank"] for reply in replies} == {0, 1}
            text = await client.submit("hello")
            assert text["generated_tokens"] == FakeEngine.generate("hello", 4)
            raw = await client.submit(packb([9, 9]), raw=True)
            assert unpackb(raw)["generated_tokens"] == FakeEngine.generate([9, 9], 4)
            stats = await client.stats()
            assert stats["inflight"] == 0
            assert len(stats["engines"]) == 2

    with (
        make_coordinator(transport) as coord,
        fake_engines(coord.address, 2, output_tokens=4),
    ):
        run(body(coord.address))


def test_prefix_routing_round_trip(make_coordinator, impl):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            prompt = list(range(64))
            replies = [await client.submit(prompt, block_size=16) for _ in range(4)]
            # Sequential and idle, the same prefix stays with the rank that has it cached.
            assert len({reply["rank"] for reply in replies}) == 1

    with make_coordinator(policy="prefix") as coord, fake_engines(coord.address, 2):
        run(body(coord.address))


def test_stream(make_coordinator, impl):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            parts = [part async for part in client.stream([1, 2], {"max_tokens": 4})]
            tokens = FakeEngine.generate([1, 2], 4)
            assert [p["generated_tokens"] for p in parts] == [tokens[:n] for n in range(1, 5)]
            assert [p["status"] for p in parts] == ["generating"] * 3 + ["finished"]

    with make_coordinator() as coord, fake_engines(coord.address, 1, output_tokens=4):
        run(body(coord.address))


def test_abort(make_coordinator, impl):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            # 1000 steps of 10 ms: only an abort ends it within the test's time.
            stream = client.stream([5])
            first = await anext(stream)
            await client.abort(stream)
            parts = [first] + [part async for part in stream]
            assert parts[-1]["status"] == "aborted"
            future = client.submit([6])
            await client.abort(future)
            reply = await asyncio.wait_for(future, TIMEOUT)
            assert reply["status"] == "aborted"
            assert len(reply["generated_tokens"]) < 1000

    options = {"output_tokens": 1000, "latency": 0.01}
    with make_coordinator() as coord, fake_engines(coord.address, 1, **options):
        run(body(coord.address))


def test_error_reply_fails_the_future(make_coordinator, impl):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            with pytest.raises(CoordinatorError) as caught:
                await client.submit([1, 2, 3])  # no engine registered
            assert caught.value.code is ErrorCode.NO_ENGINES
            assert caught.value.request_id == 0
            assert client.pending == 0

    with make_coordinator() as coord:
        run(body(coord.address))


def test_control_signals_reach_engines(make_coordinator, impl):
    received: queue.Queue[Control] = queue.Queue()

    def engine_loop(engine: Engine, stop: threading.Event) -> None:
        while not stop.is_set():
            for event in engine.poll(0.05):
                received.put(event)

    async def body(address):
        refused: asyncio.Future[CoordinatorError] = asyncio.get_running_loop().create_future()
        async with await Client.connect(
            address, timeout=TIMEOUT, on_error=refused.set_result, implementation=impl.name
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            await client.pause()
            await client.suspend()
            await client.resume()
            await client.set_generation_epoch(3)
            await client.unpause()
            await client.pause()
            await client.stop_engines()
            for expected in [
                Control(Header.PAUSE),
                Control(Header.SUSPEND),
                Control(Header.RESUME),
                Control(Header.SET_GENERATION_EPOCH, 3),
                Control(Header.UNPAUSE),
                Control(Header.PAUSE),
                Control(Header.STOP),
            ]:
                event = await asyncio.to_thread(received.get, timeout=TIMEOUT)
                assert event == expected
            assert not client.errors
            await client.resume()  # RUNNING after STOP: not allowed
            error = await asyncio.wait_for(refused, TIMEOUT)
            assert error.code is ErrorCode.INVALID_STATE
            assert error.request_id is None

    stop = threading.Event()
    with make_coordinator() as coord, Engine(coord.address) as engine:
        thread = threading.Thread(target=engine_loop, args=(engine, stop))
        thread.start()
        try:
            run(body(coord.address))
        finally:
            stop.set()
            thread.join(TIMEOUT)


def test_stop_ends_engine_processes(make_coordinator, impl):
    async def body(address, processes):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(len(processes), timeout=TIMEOUT)
            await client.pause()
            await client.stop_engines()
        for process in processes:
            assert await asyncio.to_thread(process.wait, TIMEOUT) == 0

    with make_coordinator() as coord, engine_processes(coord.address, 2) as processes:
        run(body(coord.address, processes))


def test_killed_engine(make_coordinator, impl):
    """SIGKILL one of two engine processes mid-flight: every request still ends."""

    async def body(address, processes):
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            futures = [client.submit([i]) for i in range(20)]
            stats = await client.stats()
            assert stats["inflight"] == 20
            processes[1].send_signal(signal.SIGKILL)
            # None had produced output, so the dead engine's requests are re-routed to rank 0.
            replies = await asyncio.gather(*futures)
        assert {(reply["status"], reply["rank"]) for reply in replies} == {("finished", 0)}

    # 40 steps of 20 ms: the requests are still running when the engine dies.
    options = ("--latency", "0.02", "--output-tokens", "40", "--heartbeat", "0.1")
    with (
        make_coordinator(heartbeat_timeout=1.0) as coord,
        engine_processes(coord.address, 2, *options) as processes,
    ):
        run(body(coord.address, processes))
