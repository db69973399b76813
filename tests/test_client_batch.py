"""Client: batched messages and submit_many, frame by frame against a scripted coordinator.

The script grants batches (CONNECT_ACK ``[1, {"batch": 1}]``) or not (``[1]``,
what a coordinator that does not batch answers) and checks the exact frames
either way, on both cores; a differential test runs random sequences of calls
through both and compares every frame sent.
"""

from __future__ import annotations

import array
import asyncio
import functools
import itertools
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordkit import CoordinatorError, ErrorCode, ProtocolError
from coordkit.protocol import block_hashes
from tests.support.peers import (
    ABORT,
    DISCONNECT,
    ERROR,
    PARTIAL,
    PAUSE,
    REPLY,
    REPLY_BATCH,
    STATS,
    STATS_REPLY,
    SUBMIT,
    SUBMIT_BATCH,
)
from tests.support.scripted import Script, packb, run, same_frames, scripted


def test_submit_many_without_batches(tmp_path, impl):
    """A coordinator that did not grant batches gets one SUBMIT per prompt, at once."""

    async def body():
        async with scripted(tmp_path, impl) as (script, client):
            first = client.submit([9])
            futures = client.submit_many([[1, 2], "two", b"\x91\x03"], {"t": 1}, raw=True)
            assert [f.request_id for f in futures] == [1, 2, 3]
            assert await script.recv() == [packb([SUBMIT, 0, {}]), packb([9])]
            assert await script.recv() == [packb([SUBMIT, 1, {"t": 1}]), packb([1, 2])]
            assert await script.recv() == [packb([SUBMIT, 2, {"t": 1}]), packb("two")]
            assert await script.recv() == [packb([SUBMIT, 3, {"t": 1}]), b"\x91\x03"]
            for rid in (3, 1, 0, 2):
                await script.send(packb([REPLY, rid]), packb(rid))
            assert await first == 0
            assert await asyncio.gather(*futures) == [packb(1), packb(2), packb(3)]
            assert client.submit_many([]) == []
            await script.silent()

    run(body())


def test_one_iteration_coalesces(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            tokens = list(range(40))
            a = client.submit([1], {"t": 1})
            b = client.submit("x", raw=True)
            c = client.stream([2])
            d = client.submit(tokens, block_size=16)
            entries = [[0, {"t": 1}, False], [1, {}, False], [2, {"stream": True}, False]]
            entries.append([3, {}, True])
            assert await script.recv() == [
                packb([SUBMIT_BATCH, entries]),
                packb([1]),
                packb("x"),
                packb([2]),
                packb(tokens),
                block_hashes(tokens, 16),
            ]
            lone = client.submit([5])  # alone in its iteration: a plain SUBMIT
            assert await script.recv() == [packb([SUBMIT, 4, {}]), packb([5])]
            await script.send(
                packb([REPLY_BATCH, [[2, False], [0, True], [2, False], [1, True], [2, True]]]),
                packb([7]),
                packb({"a": 0}),
                packb([7, 8]),
                b"raw one",
                packb([7, 8, 9]),
            )
            assert await a == {"a": 0}
            assert await b == b"raw one"
            assert [part async for part in c] == [[7], [7, 8], [7, 8, 9]]
            # single replies, partials of a submit (dropped) and ERROR still work
            await script.send(packb([PARTIAL, 3]), packb("part"))
            await script.send(packb([REPLY, 3]), packb(3))
            await script.send(packb([ERROR, 4, int(ErrorCode.BUSY), "SUBMIT_REQUEST: busy"]))
            assert await d == 3
            with pytest.raises(CoordinatorError) as caught:
                await lone
            assert caught.value.request_id == 4
            assert client.pending == 0

    run(body())


def test_submit_many_is_one_message(tmp_path, impl):
    np = pytest.importorskip("numpy")

    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            early = client.submit([0])  # coalescing when submit_many comes: it goes first
            rows = np.arange(12, dtype=np.int32).reshape(3, 4)  # a row per prompt
            prompts = [[1, 2, 3], array.array("q", [4, 5]), *rows]
            futures = client.submit_many(prompts, {"t": 1}, block_size=2)
            assert [f.request_id for f in futures] == [1, 2, 3, 4, 5]
            assert await script.recv() == [packb([SUBMIT, 0, {}]), packb([0])]
            lists = [[1, 2, 3], [4, 5], *rows.tolist()]
            frames = await script.recv()
            assert frames[0] == packb([SUBMIT_BATCH, [[i, {"t": 1}, True] for i in range(1, 6)]])
            expected = []
            for tokens in lists:
                expected += [packb(tokens), block_hashes(tokens, 2)]
            assert frames[1:] == expected
            await script.send(
                packb([REPLY_BATCH, [[i, True] for i in range(5, -1, -1)]]),
                *[packb(i) for i in range(5, -1, -1)],
            )
            assert await asyncio.gather(early, *futures) == list(range(6))

    run(body())


def test_submit_many_bounded_messages(tmp_path, impl):
    limit = impl.client.MAX_BATCH_ENTRIES

    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            futures = client.submit_many([[i % 7] for i in range(2 * limit + 1)])
            sizes = []
            for _ in range(3):
                frames = await script.recv()
                sizes.append(len(frames) - 1)
            assert sizes == [limit, limit, 1]
            assert frames[0] == packb([SUBMIT, 2 * limit, {}])  # the last one, alone
            await script.silent()
            assert len(futures) == client.pending == 2 * limit + 1

    run(body())


def test_batch_bounded_by_bytes(tmp_path, impl):
    limit = impl.client.MAX_BATCH_BYTES

    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            big = bytes(limit // 2 + 1)
            client.submit_many([big, big, big, b"small"], raw=True)
            assert [len(await script.recv()) - 1 for _ in range(2)] == [2, 2]

    run(body())


def test_order_with_abort_cancel_and_control(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            first = client.submit([1])
            client.submit([2])
            await client.abort(first)  # the coalesced submissions leave first
            assert (await script.recv())[0] == packb(
                [SUBMIT_BATCH, [[0, {}, False], [1, {}, False]]]
            )
            assert await script.recv() == [packb([ABORT, 0])]
            third = client.submit([3])
            third.cancel()
            assert await script.recv() == [packb([SUBMIT, 2, {}]), packb([3])]
            assert await script.recv() == [packb([ABORT, 2])]
            client.submit([4])
            await client.pause()
            assert await script.recv() == [packb([SUBMIT, 3, {}]), packb([4])]
            assert await script.recv() == [packb([PAUSE])]
            client.submit([5])
            stats = asyncio.ensure_future(client.stats())
            assert await script.recv() == [packb([SUBMIT, 4, {}]), packb([5])]
            assert await script.recv() == [packb([STATS])]
            await script.send(packb([STATS_REPLY]), packb({"inflight": 3}))
            assert await stats == {"inflight": 3}

    run(body())


def test_malformed_reply_batches(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            a, b = client.submit([1]), client.submit([2])
            await script.recv()
            # entries and bodies disagree: the requests it names fail, nothing waits forever
            await script.send(packb([REPLY_BATCH, [[0, True], [1, True]]]), packb("only one"))
            for future, rid in ((a, 0), (b, 1)):
                with pytest.raises(ProtocolError) as caught:
                    await future
                assert caught.value.rid == rid
            c = client.submit([3])
            await script.recv()
            await script.send(b"\xc1")  # not msgpack: dropped
            await script.send(packb([REPLY_BATCH, [[2]]]), packb("x"))  # names no id: dropped
            await script.send(packb([REPLY_BATCH, {}]))
            await script.send(packb([REPLY_BATCH, [[0, True], 7]]), packb("x"))  # 0 not pending
            # does not read whole, but names request 2: it fails
            await script.send(packb([REPLY_BATCH, [[2, 1]]]), packb("x"))  # final is an int
            with pytest.raises(ProtocolError, match="malformed REPLY_BATCH") as caught:
                await c
            assert caught.value.rid == 2
            d = client.submit([4])
            await script.recv()
            await script.send(packb([REPLY_BATCH, [[3, True]]]), b"\xc1")  # body not msgpack
            with pytest.raises(ProtocolError) as caught:
                await d
            assert caught.value.rid == 3
            e = client.submit([5])
            await script.recv()
            await script.send(packb([REPLY_BATCH, [[4, True]]]), packb("fine"))
            assert await e == "fine"

    run(body())


def test_close_fails_what_was_coalesced(tmp_path, impl):
    async def body():
        script = Script(tmp_path)
        try:
            client = await script.connect(impl, grant=True)
            future = client.submit([1])
            await client.close()  # before the flush: the request never leaves
            with pytest.raises(ConnectionError):
                await future
            assert await script.recv() == [packb([DISCONNECT])]  # only the goodbye
            await script.silent()
            with pytest.raises(ConnectionError):
                client.submit_many([[1]])
        finally:
            script.close()

    run(body())


def test_sampling_params_are_checked(tmp_path, impl):
    """A map or None, in every call; anything else raises before anything is sent."""
    refused = [
        (True, TypeError, "coordkit: sampling_params must be a map (a dict) or None, not bool"),
        ([0.5], TypeError, "coordkit: sampling_params must be a map (a dict) or None, not list"),
        ("x", TypeError, "coordkit: sampling_params must be a map (a dict) or None, not str"),
        ({"n": 2**64}, ValueError, "coordkit: sampling_params cannot be packed: "),
        ({"f": object()}, TypeError, "coordkit: sampling_params cannot be packed: "),
    ]

    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            for params, error, text in refused:
                for call in (client.submit, client.stream, client.submit_many):
                    prompt = [[1]] if call == client.submit_many else [1]
                    with pytest.raises(error) as caught:
                        call(prompt, params)
                    assert str(caught.value).startswith(text)
            await script.silent()
            client.submit([1], types.MappingProxyType({"top_k": 2}))  # any Mapping
            assert await script.recv() == [packb([SUBMIT, 0, {"top_k": 2}]), packb([1])]

    run(body())


def test_batch_not_asked(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, batch=False) as (script, client):
            client.submit([1])
            client.submit([2])
            assert await script.recv() == [packb([SUBMIT, 0, {}]), packb([1])]
            assert await script.recv() == [packb([SUBMIT, 1, {}]), packb([2])]

    run(body())


def test_refused_sends_wait_for_pollout(tmp_path, impl):
    """Far more than the high-water mark, while nobody reads: libzmq refuses some
    sends, the client keeps them and sends them, in order, once it can."""
    n = 5000

    async def body():
        async with scripted(tmp_path, impl) as (script, client):
            prompt = bytes(1000)
            futures = client.submit_many([prompt] * n, raw=True)
            assert client._core.queued > 0  # this test is about them
            await asyncio.sleep(0.2)
            for rid in range(n):
                frames = await script.recv()
                assert frames[0] == packb([SUBMIT, rid, {}])
                await script.send(packb([REPLY, rid]), b"")
            assert await asyncio.gather(*futures) == [b""] * n

    run(body())


def test_large_prompts_are_pinned_until_sent(tmp_path, impl):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            prompt = bytearray(range(256)) * 400  # 100 KiB, above every copy threshold
            expected = bytes(prompt)
            client.submit_many([prompt, prompt], raw=True)
            frames = await script.recv()
            assert frames[1:] == [expected, expected]
            # Held while libzmq had it; released by a later call: then it can grow again.
            for attempt in itertools.count():
                client.submit([attempt])
                await asyncio.sleep(0.01)
                try:
                    prompt.append(0)
                    break
                except BufferError:
                    assert attempt < 200, "the prompt's buffer was never released"

    run(body())


# -- C against Python: the same calls, the same frames --------------------------------------

prompts = st.one_of(
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.text(max_size=10),
    st.binary(max_size=10),
)
params = st.none() | st.dictionaries(st.sampled_from(["t", "n"]), st.integers(0, 9), max_size=2)
calls = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), prompts, params, st.booleans()),
        st.tuples(st.just("stream"), prompts, params, st.booleans()),
        st.tuples(st.just("many"), st.lists(prompts, max_size=5), params, st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("pause")),
        st.tuples(st.just("yield")),
    ),
    max_size=12,
)


async def _play(client, script_calls) -> None:
    for call in script_calls:
        name = call[0]
        hashed = len(call) > 3 and call[3]
        if name in ("submit", "stream"):
            block = 4 if hashed and isinstance(call[1], list) else None
            getattr(client, name)(call[1], call[2], block_size=block)
        elif name == "many":
            block = 4 if hashed and all(isinstance(p, list) for p in call[1]) else None
            client.submit_many(call[1], call[2], block_size=block)
        elif name == "abort":
            await client.abort(call[1])
        elif name == "pause":
            await client.pause()
        else:
            await asyncio.sleep(0)


@pytest.mark.c_extension
@settings(max_examples=40, deadline=None)
@given(script_calls=calls, grant=st.booleans())
def test_differential_frames(c_impl, py_impl, tmp_path_factory, script_calls, grant):
    play = functools.partial(_play, script_calls=script_calls)
    same_frames(c_impl, py_impl, tmp_path_factory, play, grant=grant)
