# cython: language_level=3
"""Declarations of cursor.h: msgpack's big-endian loads and stores, the bounds-checked read
cursor, and the writer of an int in its smallest form."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "includes/cursor.h" nogil:
    ctypedef struct ck_cursor:
        const uint8_t* p
        const uint8_t* end

    uint16_t ck_load_be16(const uint8_t* p)
    uint32_t ck_load_be32(const uint8_t* p)
    uint64_t ck_load_be64(const uint8_t* p)
    void ck_store_be16(uint8_t* p, uint16_t v)
    void ck_store_be32(uint8_t* p, uint32_t v)
    void ck_store_be64(uint8_t* p, uint64_t v)
    size_t ck_left(const ck_cursor* c)
    const uint8_t* ck_take(ck_cursor* c, size_t n)

    # `v` in its smallest form; `out` has room for 9 bytes (CK_INT_MAX) whatever `v` is.
    size_t ck_write_int(uint8_t* out, int64_t v)
    size_t ck_write_uint(uint8_t* out, uint64_t v)
