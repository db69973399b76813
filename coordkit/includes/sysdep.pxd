# cython: language_level=3
"""Declarations of sysdep.h: the host's byte order, its little-endian words, DEBUG; and
memmem, which glibc and the BSDs have and the C standard has not."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef extern from "includes/sysdep.h" nogil:
    bint BIG_ENDIAN "CK_BIG_ENDIAN"
    bint DEBUG "CK_DEBUG"  # compiled with COORDKIT_DEBUG=1 (make debug)

    uint64_t ck_load_le64(const uint8_t* p)
    void ck_store_le64(uint8_t* p, uint64_t v)
    void ck_store_le32(uint8_t* p, uint32_t v)
    int ck_ctz64(uint64_t x)


cdef extern from "<string.h>" nogil:
    # The first occurrence of needle in haystack, or NULL (Python.h asks for _GNU_SOURCE).
    const void* memmem(const void* haystack, size_t haystack_size,
                       const void* needle, size_t needle_size)
