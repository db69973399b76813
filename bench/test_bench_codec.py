"""Microbenchmarks of the header codec: C and Python against plain msgpack.

Each function runs on the same frame in the three variants, grouped by
function. Run with ``python -m pytest bench/ --benchmark-enable -q``.
"""

from __future__ import annotations

import msgpack
import pytest

SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 50,
    "max_tokens": 256,
    "stop": ["</s>"],
    "seed": 1234,
    "return_logprobs": False,
}
SUBMIT = msgpack.packb([20, 123456, SAMPLING])
REPLY = msgpack.packb([21, [[1000 + i, i % 4 == 0] for i in range(16)]])
HEARTBEAT = [91, 12, 256]
HEARTBEAT_FRAME = msgpack.packb(HEARTBEAT)


def msgpack_rewrite(frame: bytes, rid: int) -> bytes:
    header, _, *rest = msgpack.unpackb(frame)
    return msgpack.packb([header, rid, *rest])


# function: (its arguments, the same work done with plain msgpack)
CASES = {
    "read_header": ((SUBMIT,), msgpack.unpackb, (SUBMIT,)),
    "read_submit": ((SUBMIT,), msgpack.unpackb, (SUBMIT,)),
    "rewrite_submit": ((SUBMIT, 654321), msgpack_rewrite, (SUBMIT, 654321)),
    "read_reply": ((REPLY,), msgpack.unpackb, (REPLY,)),
    "write_header": ((21,), msgpack.packb, ([21],)),
    "write_header_int": ((21, 123456), msgpack.packb, ([21, 123456],)),
    "encode": ((HEARTBEAT,), msgpack.packb, (HEARTBEAT,)),
    "decode": ((HEARTBEAT_FRAME,), msgpack.unpackb, (HEARTBEAT_FRAME,)),
}


@pytest.mark.parametrize("name", CASES)
def test_codec(benchmark, impl, name):
    args, _, _ = CASES[name]
    benchmark.group = name
    benchmark(getattr(impl.codec, name), *args)


@pytest.mark.parametrize("name", CASES)
def test_msgpack(benchmark, name):
    _, baseline, args = CASES[name]
    benchmark.group = name
    benchmark(baseline, *args)
