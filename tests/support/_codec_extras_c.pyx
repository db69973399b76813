# cython: language_level=3, embedsignature=True
"""The header codec's test-only functions, in C: the twins of codec_extras.py.

They are written on the C codec's own reads and writes, cimported as a host's
code cimports them (coordkit's public ``__init__.pxd``), so that their tests
hold the product's code against msgpack: ``encode`` on ``ck_write_int`` and
``ck_write_array``, ``decode`` on ``ck_read_int`` and ``ck_read_array``,
``write_header`` on ``ck_write_header``, ``blake2b`` on ``includes/blake2b.h``,
and ``rewrite_submit`` on the C codec's read_submit and write_submit, as its
twin is on the Python codec's.
No product code calls any of them. Compiled once per session (extension.py).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_Check, PyList_New, PyList_SET_ITEM
from cpython.long cimport (
    PyLong_AsLongLongAndOverflow,
    PyLong_AsUnsignedLongLong,
    PyLong_Check,
    PyLong_FromLongLong,
    PyLong_FromUnsignedLongLong,
)
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.tuple cimport PyTuple_Check
from libc.stdint cimport UINT32_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free

from coordkit cimport (
    CK_HEADER_MAX,
    CK_INT_MAX,
    CK_OK,
    CK_RANGE,
    CK_TOO_DEEP,
    CK_TRAILING,
    CK_TRUNCATED,
    ck_cursor,
    ck_read_array,
    ck_read_int,
    ck_strstatus,
    ck_write_array,
    ck_write_header,
    ck_write_int,
)
from coordkit.includes.blake2b cimport (
    CK_BLAKE2B_MAX_OUT,
    ck_blake2b_final,
    ck_blake2b_init,
    ck_blake2b_state,
    ck_blake2b_update,
)
from coordkit.includes.bytebuf cimport Buf, buf_reserve
from coordkit.includes.cursor cimport ck_left, ck_store_be64

from coordkit._codec_c import read_submit, write_submit
from coordkit.protocol import ProtocolError

__all__ = ["MAX_NESTING", "encode", "decode", "rewrite_submit", "write_header", "blake2b"]

cdef enum:
    _MAX_NESTING = 512

#: encode and decode refuse arrays nested deeper than this.
MAX_NESTING = _MAX_NESTING


cdef inline const uint8_t* _bytes(const unsigned char[::1] view) noexcept:
    return &view[0] if view.shape[0] else NULL


def rewrite_submit(frame, rid) -> bytes:
    """``frame``, validated as by read_submit, with its request id replaced by ``rid``."""
    header, length, _, offset = read_submit(frame)
    return write_submit(header, length, rid, memoryview(frame)[offset:])


def write_header(header) -> bytes:
    """``msgpack.packb([header])``."""
    if not isinstance(header, int) or isinstance(header, bool):
        raise TypeError(f"expected an int, got {type(header).__name__}")
    cdef uint8_t out[CK_HEADER_MAX]
    cdef size_t n = ck_write_header(out, header)  # OverflowError beyond int64
    return PyBytes_FromStringAndSize(<char*>out, n)


def blake2b(data, digest_size=8) -> bytes:
    """``hashlib.blake2b(data, digest_size=digest_size).digest()``, by ``includes/blake2b.h``
    (the block hashes' BLAKE2b, tested on its own)."""
    cdef const unsigned char[::1] view = data
    if not 1 <= digest_size <= CK_BLAKE2B_MAX_OUT:
        raise ValueError(f"digest_size must be in 1..{CK_BLAKE2B_MAX_OUT}")
    cdef ck_blake2b_state state
    cdef uint8_t digest[CK_BLAKE2B_MAX_OUT]
    ck_blake2b_init(&state, digest_size)
    ck_blake2b_update(&state, _bytes(view), view.shape[0])
    ck_blake2b_final(&state, digest)
    return PyBytes_FromStringAndSize(<char*>digest, digest_size)


cdef object _error(int status):
    return ProtocolError(f"decode: {ck_strstatus(status).decode()}")


cdef int _encode(Buf* w, object obj, int level) except -1:
    cdef int overflow
    cdef long long v
    cdef Py_ssize_t i, size
    buf_reserve(w, CK_INT_MAX)  # the room of the largest write: an int, an array32 head
    cdef uint8_t* out = w.data + w.len
    if obj is None:
        out[0] = 0xc0
        w.len += 1
    elif obj is True:
        out[0] = 0xc3
        w.len += 1
    elif obj is False:
        out[0] = 0xc2
        w.len += 1
    elif PyLong_Check(obj):
        v = PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow == 0:
            w.len += ck_write_int(out, v)
        elif overflow > 0:
            try:
                out[0] = 0xcf
                ck_store_be64(out + 1, PyLong_AsUnsignedLongLong(obj))
            except OverflowError:
                raise ProtocolError(f"encode: {obj} is out of range") from None
            w.len += 9
        else:
            raise ProtocolError(f"encode: {obj} is out of range")
    elif PyList_Check(obj) or PyTuple_Check(obj):
        if level >= _MAX_NESTING:
            raise ProtocolError("encode: nested too deep")
        size = PySequence_Fast_GET_SIZE(obj)
        if size > UINT32_MAX:
            raise ProtocolError("encode: array too long")
        w.len += ck_write_array(out, <uint32_t>size)
        # no Python code runs below (int subclasses convert without calls),
        # so the sequence cannot change size under the loop
        for i in range(size):
            _encode(w, <object>PySequence_Fast_GET_ITEM(obj, i), level + 1)
    else:
        raise ProtocolError(f"encode: unsupported type {type(obj).__name__}")
    return 0


def encode(obj) -> bytes:
    """``msgpack.packb(obj)`` for None, bool, int (-2**63 .. 2**64-1) and lists
    or tuples of them, nested at most MAX_NESTING deep; ProtocolError otherwise."""
    cdef Buf w
    w.data = NULL
    w.len = w.cap = 0
    try:
        _encode(&w, obj, 0)
        return PyBytes_FromStringAndSize(<char*>w.data, w.len)
    finally:
        free(w.data)


cdef object _decode(ck_cursor* c, int level):
    cdef int64_t v
    cdef uint32_t length, i
    cdef int status
    if ck_left(c) == 0:
        raise _error(CK_TRUNCATED)
    cdef uint8_t b = c.p[0]
    if b == 0xc0 or b == 0xc2 or b == 0xc3:
        c.p += 1
        return None if b == 0xc0 else b == 0xc3
    if (b & 0xf0) == 0x90 or b == 0xdc or b == 0xdd:
        status = ck_read_array(c, &length)
        if status == CK_OK and level >= _MAX_NESTING:
            status = CK_TOO_DEEP
        # every element takes at least one byte: no list larger than the frame
        if status == CK_OK and length > ck_left(c):
            status = CK_TRUNCATED
        if status != CK_OK:
            raise _error(status)
        result = PyList_New(length)
        for i in range(length):
            item = _decode(c, level + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(result, i, item)
        return result
    status = ck_read_int(c, &v)
    if status == CK_OK:
        return PyLong_FromLongLong(v)
    if status == CK_RANGE:
        return PyLong_FromUnsignedLongLong(<uint64_t>v)
    raise _error(status)


def decode(frame) -> object:
    """``msgpack.unpackb(frame)`` for the types encode writes; ProtocolError for
    anything else, for trailing bytes and for arrays nested deeper than MAX_NESTING."""
    cdef const unsigned char[::1] view = frame
    cdef ck_cursor c
    c.p = _bytes(view)
    c.end = c.p + view.shape[0]
    result = _decode(&c, 0)
    if c.p != c.end:
        raise _error(CK_TRAILING)
    return result
