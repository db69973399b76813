"""FakeEngine's cost model, stepped by hand against a bare ROUTER.

Durations are the model's own arithmetic (``engine.busy``, seconds of model
time), never measured: the engines run with a huge speedup, so their waits
are nothing, and the assertions are about what each step does and charges.
"""

from __future__ import annotations

import subprocess
import time

import msgpack
import pytest
import zmq

from coordkit.protocol import Header, packb, unpackb
from coordkit.tools.fake_engine import H100, NO_COST, CostModel, FakeEngine
from tests.support.cluster import bind_address
from tests.support.peers import REBUILD_HELLO, SUBMIT, engine_hello
from tests.support.processes import engine_processes

TIMEOUT_MS = 5000
FAST = 1e6  # speedup: the model's seconds become microseconds of waiting
HELLO = {"coordkit": 1, "ack": 1, "batch": 1, **REBUILD_HELLO}


@pytest.fixture
def router(tmp_path):
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address("ipc", tmp_path))
    yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close()


def engine(router, **kwargs) -> FakeEngine:
    socket, address = router
    kwargs.setdefault("cost", H100)
    kwargs.setdefault("speedup", FAST)
    fake = FakeEngine(address, heartbeat_interval=None, **kwargs)
    assert socket.recv_multipart() == [fake.identity, b""]
    identity, hello = socket.recv_multipart()
    assert identity == fake.identity and engine_hello(hello) == HELLO  # it asks for batches
    return fake


def submit(router, fake, *requests: tuple[int, int, dict]) -> None:
    """Queue ``requests`` (rid, prompt tokens, params) while paused: the next step sees them all."""
    socket, _ = router
    expected = fake.pending + len(requests)
    socket.send_multipart([fake.identity, packb([Header.PAUSE])])
    for rid, tokens, params in requests:
        socket.send_multipart([fake.identity, packb([SUBMIT, rid, params]), packb([0] * tokens)])
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while fake.pending < expected and time.monotonic() < deadline:
        fake.step()  # paused: it only takes the messages in
    socket.send_multipart([fake.identity, packb([Header.UNPAUSE])])
    while fake.state != "running" and time.monotonic() < deadline:
        fake.step()
    assert fake.pending == expected


def step(router, fake) -> list[tuple[int, int, dict]]:
    """One step; the (header, rid, body) of each entry it sent."""
    socket, _ = router
    fake.step()
    out = []
    # What the step sent crosses libzmq's I/O threads: give it a moment to arrive.
    while socket.poll(100):
        _, meta, *bodies = socket.recv_multipart()
        header, entries = unpackb(meta)
        for entry, body in zip(entries, bodies, strict=True):
            rid = entry[0] if header == Header.ENGINE_REPLY else entry
            out.append((header, rid, unpackb(body)))
    return out


def test_prefill_is_chunked_and_charged_per_uncached_token(router):
    with engine(router) as fake:
        submit(router, fake, (0, 10_000, {"output_tokens": 2}))
        assert fake.busy == 0.0
        # Step 1: the first 8 192 tokens (its chunk), no sequence decoding yet.
        assert step(router, fake) == []
        assert fake.busy == pytest.approx(0.020 + 8192 / 10_000)
        # Step 2: the other 1 808 tokens, then its first token.
        assert step(router, fake) == []
        assert fake.busy == pytest.approx(2 * 0.020 + 10_000 / 10_000)
        # Step 3: one sequence decoding; its second token ends it.
        [(header, rid, body)] = step(router, fake)
        assert (header, rid, body["status"]) == (Header.ENGINE_REPLY, 0, "finished")
        assert len(body["generated_tokens"]) == 2
        assert body["engine_busy"] == pytest.approx(3 * 0.020 + 1.0 + 0.0001)


def test_a_cached_prefix_is_not_prefilled_again(router):
    ids = list(range(20))  # 20 blocks of 512 tokens: the last one partial
    with engine(router, prefix_block_size=512, cache_blocks=64) as fake:
        submit(router, fake, (0, 10_000, {"output_tokens": 1, "block_ids": ids}))
        while not (replies := step(router, fake)):
            pass
        assert (replies[0][2]["cached_blocks"], replies[0][2]["prompt_blocks"]) == (0, 20)
        busy = fake.busy
        # 16 leading blocks shared: 10 000 - 16 * 512 = 1 808 tokens to prefill, one step.
        submit(
            router,
            fake,
            (1, 10_000, {"output_tokens": 1, "block_ids": ids[:16] + [100, 101, 102, 103]}),
        )
        [(_, _, body)] = step(router, fake)
        assert (body["cached_blocks"], body["prompt_blocks"]) == (16, 20)
        assert fake.busy - busy == pytest.approx(0.020 + 1808 / 10_000)
        # All of it cached: still one token to compute.
        submit(router, fake, (2, 10_000, {"output_tokens": 1, "block_ids": ids}))
        step(router, fake)
        assert fake.busy - busy == pytest.approx(2 * 0.020 + 1809 / 10_000)


def test_decode_steps_grow_with_the_batch(router):
    cost = CostModel(
        step_time=0.01, prefill_rate=0.0, decode_per_seq=0.001, prefill_chunk=1, max_batch=3
    )
    with engine(router, cost=cost) as fake:
        submit(router, fake, *[(rid, 4, {"output_tokens": 10}) for rid in range(5)])
        busy = fake.busy
        step(router, fake)  # three running (the batch), two waiting
        assert fake.busy - busy == pytest.approx(0.01 + 3 * 0.001)
        assert fake.pending == 5


def test_max_partials_and_output_tokens_from_the_params(router):
    with engine(router) as fake:
        submit(router, fake, (0, 16, {"output_tokens": 5, "stream": True, "max_partials": 1}))
        sent = []
        while not any(header == Header.ENGINE_REPLY for header, _, _ in sent):
            sent += step(router, fake)
        assert [header for header, _, _ in sent] == [
            Header.ENGINE_REPLY_PARTIAL,
            Header.ENGINE_REPLY,
        ]
        assert len(sent[0][2]["generated_tokens"]) == 1
        assert len(sent[1][2]["generated_tokens"]) == 5


def test_without_a_cost_model_nothing_changes(router):
    with engine(router, cost=NO_COST, speedup=1.0, output_tokens=3) as fake:
        submit(router, fake, (0, 5, {"output_tokens": 2}))  # a request may still set its length
        [(_, _, body)] = step(router, fake) + step(router, fake)
        assert body["generated_tokens"] == FakeEngine.generate([0] * 5, 2)
        assert "engine_busy" not in body
        assert fake.busy == 0.0


def test_latency_and_batch_override_the_cost_model():
    fake = FakeEngine.__new__(FakeEngine)  # the options alone, no socket
    with pytest.raises(ValueError, match="at least 1"):
        FakeEngine.__init__(fake, "ipc:///nonexistent", cost=H100, max_batch=0)
    with pytest.raises(ValueError, match=">= 0"):
        FakeEngine.__init__(fake, "ipc:///nonexistent", cost=H100._replace(prefill_rate=-1.0))
    with pytest.raises(ValueError, match="speedup"):
        FakeEngine.__init__(fake, "ipc:///nonexistent", speedup=0.0)


def test_engine_process_with_the_h100_model(router):
    socket, address = router
    options = ["--cost-model", "h100", "--speedup", "1000", "--heartbeat", "0"]
    options += ["--prefix-block-size", "512", "--batch", "8", "--latency", "0.01"]
    with engine_processes(address, [1], *options, stderr=subprocess.PIPE, text=True):
        assert socket.recv_multipart() == [b"engine-1", b""]
        identity, hello = socket.recv_multipart()
        assert identity == b"engine-1" and engine_hello(hello) == {**HELLO, "capacity": 8}
        params = {"block_ids": [7, 8], "output_tokens": 2}
        socket.send_multipart([b"engine-1", packb([SUBMIT, 3, params]), packb([0] * 600)])
        _, meta, body = socket.recv_multipart()
        reply = msgpack.unpackb(body)
        assert unpackb(meta) == [Header.ENGINE_REPLY, [[3, False]]]
        assert (reply["cached_blocks"], reply["prompt_blocks"]) == (0, 2)
        # Two steps of 10 ms (--latency overrides the model's 20 ms), 600 tokens at 10 000/s,
        # one sequence decoding in the second.
        assert reply["engine_busy"] == pytest.approx(2 * 0.010 + 0.06 + 0.0001)
