# cython: language_level=3
"""Declarations of blake2b.h: BLAKE2b (RFC 7693), for the block hashes of a prompt."""

from libc.stdint cimport uint8_t, uint32_t


cdef extern from "includes/blake2b.h" nogil:
    ctypedef struct ck_blake2b_state:
        size_t outlen

    enum:
        CK_BLAKE2B_MAX_OUT

    void ck_blake2b_init(ck_blake2b_state* s, size_t outlen)
    void ck_blake2b_update(ck_blake2b_state* s, const uint8_t* data, size_t n)
    void ck_blake2b_update_le32(ck_blake2b_state* s, uint32_t v)
    void ck_blake2b_final(ck_blake2b_state* s, uint8_t* out)
