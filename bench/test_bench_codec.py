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
PARAMS = msgpack.packb(SAMPLING)
REPLY = msgpack.packb([21, [[1000 + i, i % 4 == 0] for i in range(16)]])


# function: (its arguments, the same work done with plain msgpack)
CASES = {
    "read_header": ((SUBMIT,), msgpack.unpackb, (SUBMIT,)),
    "read_submit": ((SUBMIT,), msgpack.unpackb, (SUBMIT,)),
    "write_submit": ((20, 3, 654321, PARAMS), msgpack.packb, ([20, 654321, SAMPLING],)),
    "read_reply": ((REPLY,), msgpack.unpackb, (REPLY,)),
    "write_header_int": ((21, 123456), msgpack.packb, ([21, 123456],)),
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
