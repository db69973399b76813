"""The frames the coordinator and the endpoints write (included by _codec_c.pyx).

Every int is written by ``ck_write_int`` (``includes/cursor.h``), the one
writer of an int in its smallest form, which needs 9 bytes of room whatever
the int: a writer into a buffer of exactly the frame's size writes its short
head apart when what follows is too short to take the overrun.
"""

from cpython.bool cimport PyBool_Check
from cpython.buffer cimport PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_Check
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

from .includes.cursor cimport ck_store_be16, ck_store_be32, ck_write_int

cdef inline size_t _write_array(uint8_t* out, uint32_t length) noexcept nogil:
    if length < 16:
        out[0] = 0x90 | length
        return 1
    if length <= 0xffff:
        out[0] = 0xdc
        ck_store_be16(out + 1, <uint16_t>length)
        return 3
    out[0] = 0xdd
    ck_store_be32(out + 1, length)
    return 5


cdef inline size_t _write_prefix(uint8_t* out, const ck_submit* prefix, int64_t rid) noexcept nogil:
    cdef size_t n = _write_array(out, prefix.length)
    n += ck_write_int(out + n, prefix.header)
    return n + ck_write_int(out + n, rid)


cdef size_t ck_submit_size(const ck_submit* prefix, int64_t rid, size_t rest_len) noexcept nogil:
    # written, not computed, so it cannot drift from what ck_write_submit writes
    cdef uint8_t scratch[CK_SUBMIT_PREFIX_MAX]
    return _write_prefix(scratch, prefix, rid) + rest_len


cdef size_t ck_write_submit(uint8_t* out, const ck_submit* prefix, int64_t rid,
                            const uint8_t* rest, size_t rest_len) noexcept nogil:
    cdef uint8_t head[CK_SUBMIT_PREFIX_MAX]
    cdef size_t n
    if rest_len >= CK_INT_MAX:  # the rid's overrun lands where the rest goes next
        n = _write_prefix(out, prefix, rid)
    else:
        n = _write_prefix(head, prefix, rid)
        memcpy(out, head, n)
    memcpy(out + n, rest, rest_len)
    return n + rest_len


cdef size_t ck_write_header_int(uint8_t* out, int64_t header, int64_t value) noexcept nogil:
    out[0] = 0x92
    cdef size_t n = 1 + ck_write_int(out + 1, header)
    return n + ck_write_int(out + n, value)


cdef size_t ck_write_header(uint8_t* out, int64_t header) noexcept nogil:
    out[0] = 0x91
    return 1 + ck_write_int(out + 1, header)


cdef size_t ck_write_batch_head(uint8_t* out, int64_t header, uint32_t count) noexcept nogil:
    out[0] = 0x92
    cdef size_t n = 1 + ck_write_int(out + 1, header)
    return n + ck_write_array(out + n, count)


cdef inline size_t _write_single_prefix(uint8_t* out, int64_t header, int64_t rid) noexcept nogil:
    out[0] = 0x94
    cdef size_t n = 1 + ck_write_int(out + 1, header)
    return n + ck_write_int(out + n, rid)


cdef size_t ck_single_submit_size(int64_t header, int64_t rid, size_t prompt_len,
                                  size_t params_len) noexcept nogil:
    cdef uint8_t scratch[CK_SINGLE_PREFIX_MAX]
    return _write_single_prefix(scratch, header, rid) + prompt_len + params_len


cdef size_t ck_write_single_submit(uint8_t* out, int64_t header, int64_t rid,
                                   const uint8_t* prompt, size_t prompt_len,
                                   const uint8_t* params, size_t params_len) noexcept nogil:
    cdef uint8_t head[CK_SINGLE_PREFIX_MAX]
    cdef size_t n
    if prompt_len + params_len >= CK_INT_MAX:  # as in ck_write_submit
        n = _write_single_prefix(out, header, rid)
    else:
        n = _write_single_prefix(head, header, rid)
        memcpy(out, head, n)
    memcpy(out + n, prompt, prompt_len)
    memcpy(out + n + prompt_len, params, params_len)
    return n + prompt_len + params_len


cdef size_t ck_write_array(uint8_t* out, uint32_t length) noexcept nogil:
    return _write_array(out, length)


# -- the Python API ---------------------------------------------------------------

def write_submit(header, length, rid, rest) -> bytes:
    """``[header, rid, <rest>]``, an array of ``length`` elements: ``rest`` (the
    other ``length - 2``, already packed) spliced in as it is."""
    cdef ck_submit prefix
    cdef int64_t r = _int64_arg(rid)
    cdef Py_buffer view
    prefix.header = _int64_arg(header)
    if not PyLong_Check(length) or PyBool_Check(length):
        raise TypeError(f"expected an int, got {type(length).__name__}")
    if not 2 <= length <= 0xFFFFFFFF:
        raise ValueError(f"length must be in 2..2**32-1, not {length}")
    prefix.length = length
    _acquire(rest, &view)
    try:
        out = PyBytes_FromStringAndSize(NULL, ck_submit_size(&prefix, r, view.len))
        ck_write_submit(
            <uint8_t*>PyBytes_AS_STRING(out), &prefix, r, <const uint8_t*>view.buf, view.len
        )
    finally:
        PyBuffer_Release(&view)
    return out


def write_header_int(header, value) -> bytes:
    """``msgpack.packb([header, value])``."""
    cdef uint8_t out[CK_HEADER_INT_MAX]
    cdef size_t n = ck_write_header_int(out, _int64_arg(header), _int64_arg(value))
    return PyBytes_FromStringAndSize(<char*>out, n)


def write_single_submit(header, rid, prompt, params) -> bytes:
    """``[header, rid, <prompt>, <params>]``: the two byte strings spliced in as
    they are (so ``msgpack.packb([header, rid, p, s])`` when they are ``packb(p)``
    and ``packb(s)``)."""
    cdef int64_t h = _int64_arg(header)
    cdef int64_t r = _int64_arg(rid)
    cdef Py_buffer pv, sv
    _acquire(prompt, &pv)
    try:
        _acquire(params, &sv)
    except BaseException:
        PyBuffer_Release(&pv)
        raise
    try:
        out = PyBytes_FromStringAndSize(NULL, ck_single_submit_size(h, r, pv.len, sv.len))
        ck_write_single_submit(
            <uint8_t*>PyBytes_AS_STRING(out),
            h,
            r,
            <const uint8_t*>pv.buf,
            pv.len,
            <const uint8_t*>sv.buf,
            sv.len,
        )
    finally:
        PyBuffer_Release(&pv)
        PyBuffer_Release(&sv)
    return out
