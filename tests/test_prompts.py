"""How a prompt becomes a frame, on both client cores: the packing contract.

Token ids -- ints in [0, 2**32) -- are packed as ``msgpack.packb`` packs them
as plain ints, whatever holds them: a list or tuple (packed in C without a
call per token), any object exporting a 1-d integer buffer -- ``array.array``,
numpy arrays of every integer type, either byte order, strided -- packed from
the buffer in the C core, anything else with ``tolist()`` or any other
sequence by its items. A str is packed as msgpack packs it; bytes-like
objects go as they are. Anything else -- another type, a token that is not
an int, an int out of range -- raises TypeError or ValueError naming the
token's index and value, the same error with the same message in both cores.
"""

from __future__ import annotations

import array
import enum

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=300, deadline=None)
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
TOKEN_LIMIT = 1 << 32
EDGES = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
OUT_OF_RANGE = [-1, -32, -129, -(2**31), 2**32, 2**40, INT64_MAX, INT64_MIN, UINT64_MAX]
OUT_OF_RANGE += [UINT64_MAX + 1, INT64_MIN - 1]
TOKEN_RULE = "not an int in [0, 2**32)"
PROMPT_FORMS = "a str, a bytes-like object, or token ids (a sequence of ints in [0, 2**32))"

tokens = st.sampled_from(EDGES) | st.integers(0, TOKEN_LIMIT - 1)


def packb(obj):
    return msgpack.packb(obj, use_bin_type=True)


def outcome(fn, *args):
    """The result, or the type and message of the exception raised."""
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return "error", type(exc), str(exc)


@SETTINGS
@given(values=st.lists(tokens, max_size=300))
def test_lists_and_tuples(impl, values):
    assert impl.client.pack_tokens(values) == packb(values)
    assert impl.client.pack_tokens(tuple(values)) == packb(values)
    assert impl.client.encode_prompt(values) == packb(values)


@SETTINGS
@given(
    values=st.lists(tokens, max_size=50),
    bad=st.sampled_from(OUT_OF_RANGE) | st.integers(max_value=-1) | st.integers(TOKEN_LIMIT),
    data=st.data(),
)
def test_a_token_out_of_range_is_named(impl, values, bad, data):
    at = data.draw(st.integers(0, len(values)))
    prompt = [*values[:at], bad, *values[at:]]
    for tokens_ in (prompt, tuple(prompt)):
        with pytest.raises(ValueError) as caught:
            impl.client.encode_prompt(tokens_)
        assert str(caught.value) == f"coordkit: prompt: token {at} is {bad}, {TOKEN_RULE}"


@pytest.mark.parametrize("typecode", list("bBhHiIlLqQ"))
@SETTINGS
@given(data=st.data())
def test_array_array(impl, typecode, data):
    info = array.array(typecode)
    bits = 8 * info.itemsize
    low, high = (
        (0, (1 << bits) - 1) if typecode.isupper() else (-(1 << bits - 1), (1 << bits - 1) - 1)
    )
    values = data.draw(st.lists(st.integers(max(low, 0), min(high, TOKEN_LIMIT - 1)), max_size=100))
    assert impl.client.pack_tokens(array.array(typecode, values)) == packb(values)
    if high >= TOKEN_LIMIT or low < 0:
        bad = data.draw(
            st.integers(TOKEN_LIMIT, high) if high >= TOKEN_LIMIT else st.integers(low, -1)
        )
        at = data.draw(st.integers(0, len(values)))
        tokens_ = array.array(typecode, [*values[:at], bad, *values[at:]])
        with pytest.raises(ValueError, match=rf"^coordkit: prompt: token {at} is {bad}, "):
            impl.client.pack_tokens(tokens_)


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
    high = min(int(info.max), TOKEN_LIMIT - 1)
    values = data.draw(st.lists(st.integers(0, high), max_size=100))
    tokens_ = np.array(values, dtype=dtype)
    assert impl.client.pack_tokens(tokens_) == packb(values)
    step = data.draw(st.integers(1, 3))
    assert impl.client.pack_tokens(tokens_[::step]) == packb(values[::step])  # strided
    assert impl.client.pack_tokens(tokens_[::-1]) == packb(values[::-1])  # negative stride
    if int(info.min) < 0 or int(info.max) >= TOKEN_LIMIT:
        bad = data.draw(
            st.integers(int(info.min), -1)
            if int(info.max) < TOKEN_LIMIT
            else st.integers(TOKEN_LIMIT, int(info.max))
        )
        at = data.draw(st.integers(0, len(values)))
        tokens_ = np.array([*values[:at], bad, *values[at:]], dtype=dtype)
        with pytest.raises(ValueError, match=rf"^coordkit: prompt: token {at} is {bad}, "):
            impl.client.pack_tokens(tokens_)
        with pytest.raises(ValueError, match=rf"^coordkit: prompt: token {at} is {bad}, "):
            impl.client.pack_tokens(tokens_[::-1][::-1])  # strided: a view


class Token(enum.IntEnum):
    A = 7


def test_integers_that_are_not_plain_ints(impl):
    """An IntEnum, numpy's integers: converted, so that both cores send the same bytes."""
    np = pytest.importorskip("numpy")
    assert impl.client.pack_tokens([Token.A, 3]) == packb([7, 3])
    assert impl.client.pack_tokens((np.int64(5), np.uint32(2**32 - 1))) == packb([5, 2**32 - 1])


@pytest.mark.parametrize(
    ("obj", "error", "text"),
    [
        ([True, 2], TypeError, f"token 0 is True (bool), {TOKEN_RULE}"),
        ([1, 1.5], TypeError, f"token 1 is 1.5 (float), {TOKEN_RULE}"),
        ([None], TypeError, f"token 0 is None (NoneType), {TOKEN_RULE}"),
        (["a", 1], TypeError, f"token 0 is 'a' (str), {TOKEN_RULE}"),
        ([[1, 2], [3]], TypeError, f"token 0 is [1, 2] (list), {TOKEN_RULE}"),
        ([object()], TypeError, "token 0 is <object object at "),
        ([b"x" * 100], TypeError, "token 0 is b'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (bytes)"),
        ({"a": 1}, TypeError, f"dict is not {PROMPT_FORMS}"),
        ({1, 2}, TypeError, f"set is not {PROMPT_FORMS}"),
        ((t for t in [1]), TypeError, f"generator is not {PROMPT_FORMS}"),
        (object(), TypeError, f"object is not {PROMPT_FORMS}"),
        (5, TypeError, f"int is not {PROMPT_FORMS}"),
        (None, TypeError, f"NoneType is not {PROMPT_FORMS}"),
    ],
    ids=lambda obj: type(obj).__name__,
)
def test_what_is_not_a_prompt(impl, py_impl, obj, error, text):
    with pytest.raises(error) as caught:
        impl.client.encode_prompt(obj)
    assert str(caught.value).startswith(f"coordkit: prompt: {text}")
    if not hasattr(obj, "__next__"):  # a generator is used up by the first look
        assert outcome(impl.client.encode_prompt, obj) == outcome(py_impl.client.encode_prompt, obj)


def test_numpy_other_shapes_and_types(impl, py_impl):
    np = pytest.importorskip("numpy")
    for obj, text in [
        (np.arange(6).reshape(2, 3), f"token 0 is [0, 1, 2] (list), {TOKEN_RULE}"),
        (np.array([True, False]), f"token 0 is True (bool), {TOKEN_RULE}"),
        (np.array([1.5, 2.0]), f"token 0 is 1.5 (float), {TOKEN_RULE}"),
        (np.int64(5), f"numpy.int64 is not {PROMPT_FORMS}"),  # a scalar: tolist() is an int
        (np.array(5), f"numpy.ndarray is not {PROMPT_FORMS}"),  # 0-d
    ]:
        assert outcome(impl.client.pack_tokens, obj) == outcome(py_impl.client.pack_tokens, obj)
        assert outcome(impl.client.pack_tokens, obj)[2] == f"coordkit: prompt: {text}"
    assert impl.client.pack_tokens(np.array([], dtype=np.int32)) == packb([])


def test_ranges_and_other_sequences(impl):
    assert impl.client.pack_tokens(range(5)) == packb([0, 1, 2, 3, 4])
    assert impl.client.pack_tokens(memoryview(b"ab").tolist()) == packb([97, 98])


def test_the_index_of_a_prompt_in_submit_many(impl, py_impl):
    for obj in ([1, -1], {"a": 1}):
        c, py = (
            outcome(impl.client.encode_prompt, obj, 3),
            outcome(py_impl.client.encode_prompt, obj, 3),
        )
        assert c == py and c[2].startswith("coordkit: prompt 3: ")


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
