# cython: language_level=3
"""Growable C buffers: ``reserve``, the one rule by which every malloc'd array grows, and
``Buf``, a growable byte buffer on it (the endpoints write their outgoing frames into one)."""

from libc.stdint cimport SIZE_MAX, uint8_t
from libc.stdlib cimport realloc
from libc.string cimport memcpy


cdef inline bint reserve(void** buffer, size_t* capacity, size_t needed,
                         size_t item) noexcept nogil:
    """Grow ``buffer[0]``, an array of ``capacity[0]`` items of ``item`` bytes, to hold at
    least ``needed``, at least doubling it; the contents are kept. False when memory is
    short (the buffer is then as it was)."""
    cdef size_t grown_capacity
    cdef void* grown
    if needed <= capacity[0]:
        return True
    grown_capacity = 2 * capacity[0] if capacity[0] <= SIZE_MAX // 2 else SIZE_MAX
    if grown_capacity < needed:
        grown_capacity = needed
    if grown_capacity > SIZE_MAX // item:
        return False
    grown = realloc(buffer[0], grown_capacity * item)
    if grown == NULL:
        return False
    buffer[0] = grown
    capacity[0] = grown_capacity
    return True


cdef struct Buf:
    uint8_t* data
    size_t len
    size_t cap


cdef inline int buf_reserve(Buf* b, size_t extra) except -1:
    """Room for ``extra`` more bytes after ``b.len``."""
    if b.len + extra < b.len or not reserve(<void**>&b.data, &b.cap, b.len + extra, 1):
        raise MemoryError()
    return 0


cdef inline void buf_put(Buf* b, const void* data, size_t n) noexcept:
    """``n`` bytes after ``b.len``, which ``buf_reserve`` made room for."""
    memcpy(b.data + b.len, data, n)
    b.len += n
