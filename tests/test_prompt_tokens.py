"""codec.prompt_tokens: a prompt frame's size in tokens, on both implementations.

The contract, held against msgpack: a packed array counts its elements, a
packed str ceil(its UTF-8 bytes / 4), anything else ceil(the frame's bytes /
4); the two twins agree on every byte string and never raise.
"""

from __future__ import annotations

import math

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=300, deadline=None)


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Sizes around each of msgpack's length forms: fix (15 / 31), 8, 16 and 32 bits.
lengths = st.sampled_from([0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536]) | st.integers(0, 70000)
# Anything msgpack can carry that is neither an array nor a str.
others = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.binary(max_size=300)
    | st.dictionaries(st.text(max_size=4), st.integers(-(1 << 63), (1 << 63) - 1), max_size=4)
)


@SETTINGS
@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=40) | lengths.map(lambda n: [7] * n))
def test_an_array_counts_its_elements(impl, tokens):
    assert impl.codec.prompt_tokens(packb(tokens)) == len(tokens)


@SETTINGS
@given(st.text(max_size=200) | lengths.map(lambda n: "x" * n))
def test_a_str_counts_a_token_per_4_bytes(impl, text):
    assert impl.codec.prompt_tokens(packb(text)) == math.ceil(len(text.encode()) / 4)


@SETTINGS
@given(others)
def test_anything_else_counts_a_token_per_4_frame_bytes(impl, obj):
    frame = packb(obj)
    assert impl.codec.prompt_tokens(frame) == math.ceil(len(frame) / 4)


@pytest.mark.parametrize(
    ("frame", "tokens"),
    [
        (b"", 0),
        (b"\xc1", 1),  # never msgpack
        (b"\xdc\x01", 1),  # an array16 header cut short: 2 bytes
        (b"\xdd\x00\x00\x01", 1),  # an array32 header cut short
        (b"\xdc\x01\x00", 256),  # a header, no elements: read in O(1), never checked
        (b"\xdd\xff\xff\xff\xff", (1 << 32) - 1),
        (b"\xdb\xff\xff\xff\xff", 1 << 30),  # a str32 that claims 4 GiB
        (b"\xd9", 1),  # a str8 header cut short
        (b"\xa5hello", 2),
        (b"\xc4\x03abc", 2),  # bin: the frame's 5 bytes
    ],
)
def test_edge_cases(impl, frame, tokens):
    assert impl.codec.prompt_tokens(frame) == tokens


def test_any_buffer(impl):
    frame = packb(list(range(20)))
    for view in (bytearray(frame), memoryview(b"\0" + frame)[1:], zmq.Frame(frame)):
        assert impl.codec.prompt_tokens(view) == 20


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=12) | others.map(packb) | st.text(max_size=40).map(packb))
def test_the_twins_agree_on_any_bytes(c_impl, py_impl, frame):
    tokens = py_impl.codec.prompt_tokens(frame)
    assert c_impl.codec.prompt_tokens(frame) == tokens
    assert 0 <= tokens < 1 << 32
