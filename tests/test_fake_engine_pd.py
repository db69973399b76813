"""FakeEngine in disaggregated prefill/decode, against a bare ROUTER playing the
coordinator's two hops: a prefill hands off and pins, a decode imports what it does
not cache and generates the tokens one engine would have, the pins go at RELEASE_KV.

Durations are the model's, never measured (a huge speedup); what is asserted is
what each engine sends and counts. Every test runs on both engine cores (``impl``).
"""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import pytest
import zmq

from coordkit.protocol import packb, unpackb
from coordkit.tools.fake_engine import H100, NO_COST, FakeEngine
from tests.support.cluster import bind_address
from tests.support.peers import (
    ABORT,
    ENGINE_ACK,
    HANDOFF,
    KV_READ_DONE,
    PARTIAL,
    RELEASE_KV,
    REPLY,
    SEND_KV,
    SUBMIT,
    SUBMIT_KV,
    engine_hello,
)
from tests.support.processes import engine_processes

TIMEOUT = 5.0
FAST = 1e6  # speedup: the model's seconds become microseconds of waiting
HOP = {"do_kv_handoff": True}
BLOCK = 16


@pytest.fixture
def router(tmp_path):
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address("ipc", tmp_path))
    yield socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close()


def engine(router, impl, role: str | None, rank: int = 0, **kwargs: Any) -> FakeEngine:
    """A FakeEngine of ``role``, registered and granted its role."""
    socket, address = router
    kwargs.setdefault("cost", H100)
    fake = FakeEngine(
        address,
        rank,
        role=role,
        speedup=FAST,
        heartbeat_interval=None,
        implementation=impl.name,
        **kwargs,
    )
    assert socket.recv_multipart() == [fake.identity, b""]
    identity, hello = socket.recv_multipart()
    assert engine_hello(hello).get("role") == role
    granted = {"role": role} if role else {}
    socket.send_multipart([fake.identity, packb([ENGINE_ACK, granted])])
    assert fake.wait_registered(TIMEOUT)
    return fake


def drive(socket, *engines: FakeEngine, count: int = 1) -> list[list[bytes]]:
    """Step the engines until ``socket`` has ``count`` messages: (identity, frames...)."""
    messages: list[list[bytes]] = []
    deadline = time.monotonic() + TIMEOUT
    while len(messages) < count:
        assert time.monotonic() < deadline, f"got {len(messages)} of {count}: {messages}"
        for fake in engines:
            fake.step()
        while socket.poll(0):
            messages.append(socket.recv_multipart())
    return messages


def prefill_hop(socket, prefill: FakeEngine, rid: int, prompt: list[int], params: dict) -> tuple:
    """SUBMIT the prefill hop; its HANDOFF's (kv_meta, blocks frame)."""
    meta = packb([SUBMIT, rid, {**params, **HOP}])
    socket.send_multipart([prefill.identity, meta, packb(prompt)])
    [[identity, head, blocks]] = drive(socket, prefill)
    assert identity == prefill.identity
    header, [[got, kv_meta]] = unpackb(head)
    assert (header, got) == (HANDOFF, rid)
    return kv_meta, blocks


def decode_hop(socket, decode, rid, prompt, params, kv_meta, blocks) -> None:
    meta = packb([SUBMIT_KV, rid, params, kv_meta])
    socket.send_multipart([decode.identity, meta, packb(prompt), blocks])


def test_a_prefill_hands_off_and_pins_until_released(router, impl):
    socket, _ = router
    prompt = list(range(100))  # 6 full blocks of 16 and a partial one: 7 pinned
    with engine(router, impl, "prefill") as prefill:
        kv_meta, blocks = prefill_hop(socket, prefill, 5, prompt, {"output_tokens": 4})
        assert kv_meta == {
            "engine": "engine-0",
            "resume_tokens": FakeEngine.generate(prompt, 1),
            "cached_blocks": 0,
            "block_size": BLOCK,
        }
        assert unpackb(blocks) == list(range(1, 8))
        assert prefill.pending == 0  # handed off: no final is owed
        first = prefill.busy
        # The same prompt again: its 6 full blocks are cached, one token is prefilled.
        kv_meta, blocks = prefill_hop(socket, prefill, 6, prompt, {"output_tokens": 4})
        assert kv_meta["cached_blocks"] == 6 and unpackb(blocks) == list(range(8, 15))
        assert prefill.busy - first < first  # a step, without the prefill of 100 tokens
        assert prefill.stats() == {
            "role": "prefill",
            "pinned": 2,
            "pinned_blocks": 14,
            "importing": 0,
            "handoffs": 2,
            "releases": 0,
            "send_kv": 0,
            "imports": 0,
            "blocks_moved": 0,
            "read_done": 0,
        }
        for message in ([RELEASE_KV, 5], [RELEASE_KV, 99], [SEND_KV, 6, [{"rank": 1}], 0]):
            socket.send_multipart([prefill.identity, packb(message)])
        deadline = time.monotonic() + TIMEOUT
        while prefill.stats()["send_kv"] == 0 and time.monotonic() < deadline:
            prefill.step()
        stats = prefill.stats()
        assert (stats["pinned"], stats["pinned_blocks"], stats["releases"]) == (1, 7, 1)


def test_a_prefill_hop_of_one_token_ends_whole(router, impl):
    socket, _ = router
    with engine(router, impl, "prefill") as prefill:
        meta = packb([SUBMIT, 3, {"output_tokens": 1, **HOP}])
        socket.send_multipart([prefill.identity, meta, packb([1, 2, 3])])
        [[_, head, body]] = drive(socket, prefill)
        assert unpackb(head) == [REPLY, [[3, False]]]
        assert unpackb(body)["generated_tokens"] == FakeEngine.generate([1, 2, 3], 1)
        assert prefill.stats()["pinned"] == 0


def test_whatever_its_role_an_engine_runs_a_whole_request(router, impl):
    socket, _ = router
    for rank, role in enumerate(("prefill", "decode", "both")):
        with engine(router, impl, role, rank) as fake:
            socket.send_multipart([fake.identity, packb([SUBMIT, 1, {}]), packb([4, 5])])
            [[_, head, body]] = drive(socket, fake)
            assert unpackb(head) == [REPLY, [[1, False]]]
            assert unpackb(body)["generated_tokens"] == FakeEngine.generate([4, 5], 8)


def test_a_decode_imports_then_generates_what_one_engine_would(router, impl):
    socket, _ = router
    prompt = list(range(40))  # 2 full blocks and a partial: 3 blocks handed off
    params = {"output_tokens": 4, "stream": True}
    with engine(router, impl, "prefill") as prefill, engine(router, impl, "decode", 1) as decode:
        kv_meta, blocks = prefill_hop(socket, prefill, 7, prompt, params)
        decode_hop(socket, decode, 7, prompt, params, kv_meta, blocks)
        messages = [frames[1:] for frames in drive(socket, decode, count=5)]
        assert messages[0] == [packb([KV_READ_DONE, 7])]
        tokens = FakeEngine.generate(prompt, 4)
        for n, (head, body) in enumerate(messages[1:4], start=1):
            assert unpackb(head) == [PARTIAL, [7]]
            assert unpackb(body)["generated_tokens"] == tokens[:n]  # the first at once
        head, body = messages[4]
        assert unpackb(head) == [REPLY, [[7, False]]]
        final = unpackb(body)
        assert final["generated_tokens"] == tokens and final["rank"] == 1
        assert final["cached_blocks"] == kv_meta["cached_blocks"]  # the prefill's hits
        stats = decode.stats()
        assert (stats["imports"], stats["blocks_moved"], stats["read_done"]) == (1, 3, 1)
        assert decode.pending == 0


def test_a_decode_moves_only_the_blocks_it_does_not_cache(router, impl):
    socket, _ = router
    prompt = list(range(50))  # 3 full blocks and a partial one
    with engine(router, impl, "prefill") as prefill, engine(router, impl, "decode", 1) as decode:
        # The decode ran the prompt's first two blocks before (a whole request).
        socket.send_multipart([decode.identity, packb([SUBMIT, 1, {}]), packb(prompt[:32])])
        drive(socket, decode)
        kv_meta, blocks = prefill_hop(socket, prefill, 2, prompt, {"output_tokens": 2})
        decode_hop(socket, decode, 2, prompt, {"output_tokens": 2}, kv_meta, blocks)
        assert unpackb(drive(socket, decode)[0][1]) == [KV_READ_DONE, 2]
        assert decode.stats()["blocks_moved"] == len(unpackb(blocks)) - 2


def test_a_decode_hop_wanting_one_more_token_than_the_prefills(router, impl):
    """The first token came from the prefill: a request of 1 token is done on import."""
    socket, _ = router
    with engine(router, impl, "decode") as decode:
        kv_meta = {"resume_tokens": [11], "cached_blocks": 0}
        decode_hop(socket, decode, 4, [1, 2], {"output_tokens": 1}, kv_meta, packb([1]))
        read_done, final = drive(socket, decode, count=2)
        assert unpackb(read_done[1]) == [KV_READ_DONE, 4]
        assert unpackb(final[1]) == [REPLY, [[4, False]]]
        assert unpackb(final[2])["generated_tokens"] == [11]


def test_an_import_aborted_ends_aborted_and_reads_nothing(router, impl):
    socket, _ = router
    slow = H100._replace(transfer_latency=1e6)  # a transfer that never ends here
    with engine(router, impl, "decode", cost=slow) as decode:
        kv_meta = {"resume_tokens": [11]}
        decode_hop(socket, decode, 4, [1, 2], {"output_tokens": 3}, kv_meta, packb([1]))
        deadline = time.monotonic() + TIMEOUT
        while not decode.stats()["importing"] and time.monotonic() < deadline:
            decode.step()
        socket.send_multipart([decode.identity, packb([ABORT, 4])])
        [[_, head, body]] = drive(socket, decode)
        assert unpackb(head) == [REPLY, [[4, False]]]
        assert unpackb(body)["status"] == "aborted"
        assert decode.stats()["importing"] == 0 and decode.stats()["read_done"] == 0


def test_the_transfer_model_charges_the_blocks_moved(router, impl):
    """Imports take turns on the link: the second's transfer ends after the first's."""
    socket, _ = router
    cost = NO_COST._replace(transfer_rate=1000.0, transfer_latency=0.5)
    with engine(router, impl, "decode", cost=cost) as decode:
        decode.speedup = 1.0  # the model's times, measured as waits: only their order counts
        for rid in (1, 2):
            kv_meta = {"resume_tokens": [9]}
            decode_hop(socket, decode, rid, [rid], {"output_tokens": 2}, kv_meta, packb([1, 2]))
        deadline = time.monotonic() + TIMEOUT
        while decode.stats()["imports"] < 2 and time.monotonic() < deadline:
            decode.step()
        done = sorted(decode._transfers)
        assert [rid for _, rid in done] == [1, 2]
        seconds = 0.5 + 2 * BLOCK / 1000.0
        assert math.isclose(done[1][0] - done[0][0], seconds, rel_tol=1e-6)


def test_both_hops_across_engine_processes(router):
    """``coordkit fake-engine --role``: a prefill process and a decode process, the
    test playing the coordinator's hops; the tokens are one engine's."""
    socket, address = router
    options = ["--heartbeat", "0", "--output-tokens", "3", "--cost-model", "h100"]
    options += ["--speedup", "1000"]
    prompt = list(range(70))
    with (
        engine_processes(address, [0], *options, "--role", "prefill") as [prefill],
        engine_processes(address, [1], *options, "--role", "decode") as [decode],
    ):
        hellos = {}
        for _ in range(4):
            identity, frame = socket.recv_multipart()
            if frame:
                hellos[identity] = engine_hello(frame)
                socket.send_multipart(
                    [identity, packb([ENGINE_ACK, {"role": hellos[identity]["role"]}])]
                )
        assert {k: v["role"] for k, v in hellos.items()} == {
            b"engine-0": "prefill",
            b"engine-1": "decode",
        }
        assert hellos[b"engine-0"]["capacity"] == 256  # h100's max_batch
        socket.send_multipart([b"engine-0", packb([SUBMIT, 9, HOP]), packb(prompt)])
        identity, head, blocks = socket.recv_multipart()
        [[rid, kv_meta]] = unpackb(head)[1]
        assert (identity, rid) == (b"engine-0", 9)
        socket.send_multipart(
            [b"engine-1", packb([SUBMIT_KV, 9, {}, kv_meta]), packb(prompt), blocks]
        )
        assert socket.recv_multipart() == [b"engine-1", packb([KV_READ_DONE, 9])]
        socket.send_multipart([b"engine-0", packb([RELEASE_KV, 9])])
        identity, head, body = socket.recv_multipart()
        assert (identity, unpackb(head)) == (b"engine-1", [REPLY, [[9, False]]])
        assert unpackb(body)["generated_tokens"] == FakeEngine.generate(prompt, 3)
        for process in (prefill, decode):
            process.send_signal(signal.SIGTERM)
            assert process.wait(TIMEOUT) == 0
