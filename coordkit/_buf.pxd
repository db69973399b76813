# cython: language_level=3
"""A growable byte buffer: the endpoint cores write their outgoing frames into one."""

from libc.stdint cimport uint8_t
from libc.stdlib cimport realloc
from libc.string cimport memcpy


cdef struct Buf:
    uint8_t* data
    size_t len
    size_t cap


cdef inline int buf_reserve(Buf* b, size_t extra) except -1:
    cdef size_t cap
    cdef uint8_t* data
    if b.cap - b.len >= extra:
        return 0
    cap = max(2 * b.cap, b.len + extra, <size_t>256)
    data = <uint8_t*>realloc(b.data, cap)
    if data == NULL:
        raise MemoryError()
    b.data = data
    b.cap = cap
    return 0


cdef inline void buf_put(Buf* b, const void* data, size_t n) noexcept:
    memcpy(b.data + b.len, data, n)
    b.len += n
