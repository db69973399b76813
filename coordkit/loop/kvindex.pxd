# The prefix index from the engines' own KV-cache events (its methods: kvindex.pyx).
# Included by _loop_c.pxd.

from .includes.kvindex cimport ck_kvindex

cdef enum:  # the records of coordkit._kvevents (checked at import)
    KV_CLEAR = 0
    KV_STORE = 1
    KV_REMOVE = 2
    KV_STATE = 3
    KV_HASHED = 4
    KV_HEAD = 5  # <B I>: op, rank
    KV_REMOVE_HEAD = 9  # <B I I>: op, rank, n
    KV_STATE_SIZE = 6  # <B I B>: op, rank, state
    KV_HASHED_HEAD = 9  # <B I I>: op, rank, n


cdef class KVIndex:
    cdef ck_kvindex t  # what the router reads (Router.attach_kv_c)

    cdef int _rank_of(self, const uint8_t* record, size_t n) noexcept nogil
    cdef void apply_state_c(self, const uint8_t* record, Router router) noexcept nogil
    cdef void apply_blocks_c(self, const uint8_t* record, size_t n) noexcept nogil
    cdef inline void _pause(self, uint32_t i) noexcept nogil
    cdef void _set_state(self, int rank, int state, Router router) noexcept nogil
    cdef void _hashed(self, int rank, const uint8_t* record, size_t n) noexcept nogil
    cdef void _remove(self, int rank, const uint8_t* record, size_t n) noexcept nogil
