"""A #6675 prefill's record read for its handoff: the decode hop's frame byte for byte
what _pd's Python reading gives (the record decoded, the NIXL blobs put back, kv_meta
and the block ids packed again), on both cores. The C room reads the records msgpack
packs back as they came in place (includes/handoff.h) and leaves the others to the
Python reading: both kinds are sent here, and records that carry no usable handoff end
the request with #6675's texts."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from coordkit import _pd
from coordkit.protocol import packb, unpackb
from tests.support import megatron_pd as pd

pytestmark = pytest.mark.timeout(60)

WAIT_MS = 5000
REGISTER_ROLE, ACK, SUBMIT, SUBMIT_KV, REPLY = 27, 2, 20, 24, 21
REQUEST_ERROR, RELEASE_KV = 29, 25
AGENT = "agent-prefill"
BLOB = base64.b64encode(b"nixl-agent-metadata").decode()


def meta(role: str, agent: str) -> list[dict[str, Any]]:
    """One rank's REGISTER_ROLE metadata, NIXL's agent and its blob named."""
    return [
        {
            "tokens_per_block": 4,
            "element_size": 2,
            "head_dim": 8,
            "num_layers_global": 2,
            "num_kv_heads_global": 2,
            "request_capacity": 8,
            "agent_name": agent,
            "agent_metadata_b64": BLOB if role == "prefill" else "decode-blob",
        }
    ]


@pytest.fixture
def fleet(impl, kv_dir) -> Iterator[tuple[zmq.Socket, zmq.Socket, pd.PDClient]]:
    """A coordinator in #6675's dialect, a raw prefill and decode registered, a client."""
    from coordkit import Coordinator

    coord = Coordinator(
        f"ipc://{kv_dir}/coord",
        implementation=impl.name,
        dialect="megatron-core",
        megatron_version="pr6675",
    )
    coord.start()
    ctx = zmq.Context()
    engines = []
    try:
        for role, agent in (("prefill", AGENT), ("decode", "agent-decode")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"{role}_s0_dp0".encode())
            sock.connect(coord.address)
            sock.send(packb([REGISTER_ROLE, role, "nixl", meta(role, agent)]))
            assert sock.poll(WAIT_MS) and unpackb(sock.recv()) == [ACK]
            engines.append(sock)
        client = pd.PDClient(coord.address, ctx).connect()
        yield engines[0], engines[1], client
    finally:
        coord.stop()
        ctx.destroy(linger=0)


def record(rid: int, kv_meta: Any, blocks: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "generated_text": "",
        "disaggregated_params": {"kv_meta": kv_meta, "block_ids": blocks},
    }


def descriptor(keys: int = 4, **extra: Any) -> dict[str, Any]:
    """A kv_meta naming the prefill's agent, its blob left out, of ``keys`` keys."""
    return {**{f"k{i}": i * 1000 for i in range(keys - 1)}, "agent_name": AGENT, **extra}


def canonical(rid: int, kv_meta: Any, blocks: Any) -> bytes:
    return bytes(packb([REPLY, [record(rid, kv_meta, blocks)]]))


def repeated(rid: int, *handoff: tuple[str, Any]) -> bytes:
    """A record whose handoff map names keys more than once (a decoder keeps the last)."""
    pairs = b"".join(packb(key) + packb(value) for key, value in handoff)
    head = packb([REPLY, [None]])[:-1] + b"\x82" + packb("request_id") + packb(rid)
    return bytes(head + packb("disaggregated_params") + bytes([0x80 | len(handoff)]) + pairs)


# Each record as a prefill may pack it: as msgpack-python does (the C reading's), and in
# forms a repacking changes (the Python reading's), each to the same decode frame.
RECORDS = {
    "descriptor": lambda rid: canonical(rid, descriptor(), [1, 2, 300]),
    "fifteen keys grow to a map16": lambda rid: canonical(rid, descriptor(15), [7]),
    "blob nil": lambda rid: canonical(rid, descriptor(agent_metadata_b64=None), [1]),
    "blob the same": lambda rid: canonical(rid, descriptor(agent_metadata_b64=BLOB), [1]),
    "nested ranks": lambda rid: canonical(
        rid, {"ranks": [descriptor(), descriptor(3)], "ssm": {"conv": [1.5]}}, [1, -5]
    ),
    "empty ssm": lambda rid: canonical(rid, descriptor(ssm={}), []),
    "nested agents": lambda rid: canonical(
        rid, {**descriptor(), "inner": {"agent_name": AGENT, "agent_metadata_b64": None}}, [1]
    ),
    "kv_meta twice": lambda rid: repeated(
        rid, ("kv_meta", {"x": 1}), ("block_ids", [1]), ("kv_meta", descriptor())
    ),
    "block_ids twice": lambda rid: repeated(
        rid, ("kv_meta", descriptor()), ("block_ids", ["x"]), ("block_ids", [4])
    ),
    "no agent": lambda rid: canonical(rid, {"resume_tokens": [1], "tp": 2**40}, [2**63]),
    "float32": lambda rid: bytes(
        msgpack.packb(
            [REPLY, [record(rid, descriptor(scale=0.5), [1])]],
            use_bin_type=True,
            use_single_float=True,
        )
    ),
    "str8 key": lambda rid: canonical(rid, descriptor(), [1]).replace(b"\xa2k0", b"\xd9\x02k0"),
    "uint16 block": lambda rid: canonical(rid, descriptor(), [1]).replace(
        b"\x91\x01", b"\x91\xcd\x00\x01"
    ),
    "int key elsewhere": lambda rid: bytes(
        packb([REPLY, [{**record(rid, descriptor(), [1]), 1: "x"}]])
    ),
}


def expected(frame: bytes) -> bytes:
    """The decode hop's frame as _pd's Python reading writes it from what it carries."""
    hop = unpackb(frame)
    return _pd.decode_frames(
        True, hop[1], packb(hop[2]), packb(hop[3]), packb(hop[4]), packb(hop[5])
    )[0]


@pytest.mark.parametrize("name", list(RECORDS))
def test_the_decode_hop_is_the_python_readings(fleet, name):
    prefill, decode, client = fleet
    params = {"num_tokens_to_generate": 4, "temperature": 0.5}
    crid = client.submit(list(range(1, 11)), params)
    assert prefill.poll(WAIT_MS)
    hop1 = unpackb(prefill.recv())
    assert hop1[0] == SUBMIT
    rid = hop1[1]
    body = RECORDS[name](rid)
    prefill.send(body)
    assert decode.poll(WAIT_MS)
    frame = decode.recv()
    hop2 = unpackb(frame)
    [sent] = unpackb(body)[1]
    kv_meta = _pd.restore_nixl_blobs(
        sent["disaggregated_params"]["kv_meta"], meta("prefill", AGENT)
    )
    assert hop2 == [
        SUBMIT_KV,
        rid,
        list(range(1, 11)),
        params,
        kv_meta,
        sent["disaggregated_params"]["block_ids"],
    ]
    assert frame == expected(frame)
    assert crid == 0


@pytest.mark.parametrize(
    ("kv_meta", "blocks", "reason"),
    [
        (
            {"agent_name": "unknown"},
            [1],
            "invalid NIXL handoff metadata: NIXL agent "
            "'unknown' is absent from instance registration",
        ),
        (
            descriptor(agent_metadata_b64="other"),
            [1],
            "invalid NIXL handoff metadata: NIXL "
            f"agent {AGENT!r} handoff metadata differs "
            "from its registration",
        ),
        (
            {"agent_name": ["a", "list"]},
            [1],
            "invalid NIXL handoff metadata: NIXL agent "
            "['a', 'list'] is absent from instance registration",
        ),
        (descriptor(), [True], _pd.BAD_HANDOFF),
        ([1], [1], _pd.BAD_HANDOFF),
    ],
)
def test_a_bad_handoff_ends_the_request(fleet, kv_meta, blocks, reason):
    prefill, decode, client = fleet
    crid = client.submit(list(range(1, 11)), {"num_tokens_to_generate": 4})
    assert prefill.poll(WAIT_MS)
    rid = unpackb(prefill.recv())[1]
    prefill.send(canonical(rid, kv_meta, blocks))
    outcome = client.wait(crid)
    assert outcome.terminals == [REQUEST_ERROR] and outcome.error is not None
    assert outcome.error[0] == reason
    assert prefill.poll(WAIT_MS) and unpackb(prefill.recv()) == [RELEASE_KV, rid]
    assert not decode.poll(100)
