"""How a prompt becomes a frame, on both client cores: the packing contract.

Token ids are packed as ``msgpack.packb`` packs them as plain ints, whatever
holds them: a list or tuple (packed in C without a call per token), or any
object exporting a 1-d integer buffer -- ``array.array``, numpy arrays of
every integer type, either byte order, strided -- packed from the buffer in
the C core. A str is packed as msgpack packs it; bytes-like objects go as
they are. Anything else gets what msgpack makes of its ``tolist()`` or
``list()``, or the error it raises, the same one in both cores.
"""

from __future__ import annotations

import array

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=300, deadline=None)
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
EDGES = [0, 1, -1, 31, 32, -32, -33, 127, 128, 255, 256, -128, -129, 65535, 65536, -32768]
EDGES += [-32769, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 - 1, 2**32, INT64_MAX]
EDGES += [INT64_MAX + 1, INT64_MIN, UINT64_MAX]

tokens = st.sampled_from(EDGES) | st.integers(INT64_MIN, UINT64_MAX)


def packb(obj):
    return msgpack.packb(obj, use_bin_type=True)


def outcome(fn, *args):
    """The result, or the type of the exception raised."""
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return "error", type(exc)


@SETTINGS
@given(values=st.lists(tokens, max_size=300))
def test_lists_and_tuples(impl, values):
    assert impl.client.pack_tokens(values) == packb(values)
    assert impl.client.pack_tokens(tuple(values)) == packb(values)
    assert impl.client.encode_prompt(values) == packb(values)


@pytest.mark.parametrize("typecode", list("bBhHiIlLqQ"))
@SETTINGS
@given(data=st.data())
def test_array_array(impl, typecode, data):
    info = array.array(typecode)
    bits = 8 * info.itemsize
    low, high = (
        (0, (1 << bits) - 1) if typecode.isupper() else (-(1 << bits - 1), (1 << bits - 1) - 1)
    )
    values = data.draw(st.lists(st.integers(low, high), max_size=100))
    assert impl.client.pack_tokens(array.array(typecode, values)) == packb(values)


@pytest.mark.parametrize(
    "dtype",
    ["i1", "u1", "<i2", ">i2", "<u2", ">u2", "<i4", ">i4", "<u4", ">u4", "<i8", ">i8"]
    + ["<u8", ">u8", "intc", "uintp"],
)
@SETTINGS
@given(data=st.data())
def test_numpy_arrays(impl, dtype, data):
    np = pytest.importorskip("numpy")
    info = np.iinfo(np.dtype(dtype))
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=100))
    tokens_ = np.array(values, dtype=dtype)
    assert impl.client.pack_tokens(tokens_) == packb(values)
    step = data.draw(st.integers(1, 3))
    assert impl.client.pack_tokens(tokens_[::step]) == packb(values[::step])  # strided
    assert impl.client.pack_tokens(tokens_[::-1]) == packb(values[::-1])  # negative stride


def test_numpy_other_shapes_and_types(impl, py_impl):
    np = pytest.importorskip("numpy")
    for obj in [
        np.arange(6).reshape(2, 3),  # 2-d: nested lists, as tolist() gives
        np.array([True, False]),  # bools stay bools
        np.array([1.5, 2.0]),
        np.int64(5),  # a 0-d array: tolist() is an int
        np.array([], dtype=np.int32),
    ]:
        assert outcome(impl.client.pack_tokens, obj) == outcome(py_impl.client.pack_tokens, obj)
        assert outcome(impl.client.pack_tokens, obj)[1] == packb(obj.tolist())


@pytest.mark.parametrize(
    "obj",
    [
        [True, 2],  # a bool in a list packs as a bool
        [1.5, 2],
        [None],
        ["a", 1],
        [[1, 2], [3]],
        [UINT64_MAX + 1],
        [INT64_MIN - 1],
        [object()],
        5,
        None,
    ],
    ids=lambda obj: type(obj).__name__,
)
def test_what_msgpack_makes_of_the_rest(impl, py_impl, obj):
    assert outcome(impl.client.pack_tokens, obj) == outcome(py_impl.client.pack_tokens, obj)


def test_generators_and_ranges(impl):
    assert impl.client.pack_tokens(range(5)) == packb([0, 1, 2, 3, 4])
    assert impl.client.pack_tokens(t for t in (7, 8)) == packb([7, 8])


@SETTINGS
@given(text=st.text(max_size=300))
def test_text(impl, text):
    assert impl.client.encode_prompt(text) == packb(text)


@pytest.mark.parametrize("length", [31, 32, 255, 256, 65535, 65536])
def test_text_lengths(impl, length):
    text = "é" * (length // 2) + "x" * (length % 2)  # length bytes of UTF-8
    assert impl.client.encode_prompt(text) == packb(text)


def test_text_with_a_lone_surrogate(impl, py_impl):
    assert outcome(impl.client.encode_prompt, "\ud800") == outcome(
        py_impl.client.encode_prompt, "\ud800"
    )
    assert outcome(impl.client.encode_prompt, "\ud800")[0] == "error"


def test_bytes_like_go_as_they_are(impl):
    ints = memoryview(array.array("q", [1, 2]))  # a memoryview is bytes, whatever its format
    for obj in [b"\x93\x01", bytearray(b"ab"), memoryview(b"abc"), ints, zmq.Frame(b"f")]:
        assert impl.client.encode_prompt(obj) is obj
