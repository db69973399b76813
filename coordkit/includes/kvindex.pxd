# cython: language_level=3
"""Declarations of kvindex.h: the prefix index built from the engines' own KV-cache events."""

from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef extern from "includes/kvindex.h" nogil:
    enum:
        CK_KV_NONE
        CK_KV_UNKNOWN
        CK_KV_KNOWN
        CK_KV_LOCK_BLOCKS

    ctypedef struct ck_kvcell:
        uint64_t key
        uint64_t value
        uint64_t count  # 0: an empty cell

    ctypedef struct ck_kvmap:
        uint64_t used

    ctypedef struct ck_kvindex:
        int max_ranks
        ck_kvmap* blocks  # per rank: block hash -> the keys naming it
        ck_kvmap* keys  # per rank: an engine's key -> its block hash, times stored
        uint8_t* state  # per rank: CK_KV_*
        int* known  # the ranks whose state is CK_KV_KNOWN, ascending
        int n_known
        uint64_t applied

    ck_kvcell* ck_kvmap_find(const ck_kvmap* m, uint64_t key)
    ck_kvcell* ck_kvmap_vacant(ck_kvmap* m, uint64_t key)
    void ck_kvmap_delete(ck_kvmap* m, ck_kvcell* c)
    void ck_kvmap_clear(ck_kvmap* m)
    int ck_kvindex_init(ck_kvindex* t, int max_ranks)
    void ck_kvindex_free(ck_kvindex* t)
    void ck_kvindex_lock(ck_kvindex* t)
    void ck_kvindex_unlock(ck_kvindex* t)
    int64_t ck_kvindex_depth(const ck_kvindex* t, int rank, const uint8_t* hashes, size_t n)
