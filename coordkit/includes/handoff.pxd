# cython: language_level=3
"""Declarations of handoff.h: a #6675 prefill's record read for its handoff in place, its
kv_meta's NIXL blobs put back as it is written."""

from libc.stdint cimport uint8_t


cdef extern from "includes/handoff.h" nogil:
    enum:
        CK_HANDOFF_OK
        CK_HANDOFF_SLOW

    ctypedef struct ck_agent:
        const uint8_t* name  # the agent's name, packed
        size_t name_size
        const uint8_t* blob  # its registered blob, packed
        size_t blob_size

    ctypedef struct ck_handoff:
        const uint8_t* kv_meta
        size_t kv_meta_size
        const uint8_t* blocks
        size_t blocks_size
        size_t restored_size
        int ssm
        size_t n_splices  # 0: kv_meta forwarded as it came

    int ck_pd_handoff(const uint8_t* rec, size_t n, const ck_agent* agents, size_t n_agents,
                      ck_handoff* out)
    void ck_pd_restore(const ck_handoff* h, uint8_t* out)
    int ck_pd_may_refuse(const uint8_t* params, size_t n)
