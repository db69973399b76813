"""The endpoints end to end: coordkit's Client and Engines through a real Coordinator.

Each test runs the client, the coordinator and the engines on one
implementation (``impl``). The client and the engines either ask for batches
(what they do by default) or not; the coordinator grants them to those that
ask, so the asking case is the batched protocol end to end (SUBMIT_BATCH in,
ENGINE_SUBMIT_BATCH out, REPLY_BATCH back) and the other the per-request one.
Every request must come back right either way.
"""

from __future__ import annotations

import array
import asyncio

import pytest

from coordkit import Client, CoordinatorError, ErrorCode
from coordkit.protocol import Header, packb
from coordkit.tools.fake_engine import FakeEngine
from tests.support.scripted import TIMEOUT, run
from tests.support.threads import fake_engines

ASKED = pytest.mark.parametrize("asked", [False, True], ids=["plain", "asking"])


@ASKED
def test_submit_many_and_submit(make_coordinator, impl, asked):
    np = pytest.importorskip("numpy")

    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, batch=asked, implementation=impl.name
        ) as client:
            assert client.batch is asked
            await client.wait_for_engines(2, timeout=TIMEOUT)
            prompts = [[i, i + 1, i + 2] for i in range(500)]
            others = [np.arange(7, dtype=np.int32), array.array("q", [3, 4]), "text"]
            futures = client.submit_many(prompts + others, {"temperature": 0.5})
            singles = [client.submit([i], raw=True) for i in range(100)]  # one iteration
            replies = await asyncio.gather(*futures)
            expected = prompts + [list(range(7)), [3, 4], "text"]
            for prompt, reply in zip(expected, replies, strict=True):
                assert reply["status"] == "finished"
                assert reply["generated_tokens"] == FakeEngine.generate(prompt, 4)
            assert {reply["rank"] for reply in replies} == {0, 1}
            assert len(await asyncio.gather(*singles)) == 100
            raw = await client.submit(packb([9, 9]), raw=True)
            assert isinstance(raw, bytes)
            stats = await client.stats()
            assert stats["inflight"] == 0
            assert stats["counters"]["submitted"] == len(expected) + 101
            assert client.pending == 0

    with (
        make_coordinator(max_inflight=100_000) as coord,
        fake_engines(coord.address, 2, implementation=impl.name, output_tokens=4, batch=asked),
    ):
        run(body(coord.address))
        traffic = {(t["direction"], t["header"]) for t in coord.metrics()["traffic"]}
    batched = {
        ("in", Header.SUBMIT_BATCH),
        ("out", Header.SUBMIT_BATCH),
        ("out", Header.REPLY_BATCH),
    }
    assert batched <= traffic if asked else not batched & traffic


@ASKED
def test_stream_cancel_and_errors(make_coordinator, impl, asked):
    async def body(address):
        async with await Client.connect(
            address, timeout=TIMEOUT, batch=asked, implementation=impl.name
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            # 1000 steps of 5 ms: only an abort ends these within the test's time
            stream = client.stream([1, 2])
            parts = [await anext(stream), await anext(stream)]
            await client.abort(stream)
            parts += [part async for part in stream]
            assert [p["status"] for p in parts[:2]] == ["generating"] * 2
            assert parts[-1]["status"] == "aborted"
            slow = client.submit_many([[5], [6]], {"stream": False})
            await asyncio.sleep(0.05)
            slow[0].cancel()  # cancelling aborts at the engine
            await client.abort(slow[1])
            final = await asyncio.wait_for(slow[1], TIMEOUT)
            assert final["status"] == "aborted"
            with pytest.raises(asyncio.CancelledError):
                await slow[0]
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while (await client.stats())["inflight"]:  # the cancelled one ended too
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
            assert client.pending == 0
            left = client.submit([7])
            await asyncio.sleep(0.05)
            await client.shutdown_coordinator()  # ends what is in flight with an ERROR
            with pytest.raises(CoordinatorError) as caught:
                await asyncio.wait_for(left, TIMEOUT)
            assert caught.value.code is ErrorCode.SHUTTING_DOWN

    with (
        make_coordinator() as coord,
        fake_engines(
            coord.address,
            1,
            implementation=impl.name,
            output_tokens=1000,
            batch=asked,
            latency=0.005,
        ),
    ):
        run(body(coord.address))
