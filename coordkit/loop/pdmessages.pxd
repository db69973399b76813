# The P/D engines' messages, read for the P/D room (its methods: pdmessages.pyx).
# Included by _loop_c.pxd.

cdef class PDMessages:
    cdef PD pd  # whose hops they end or move on

    cdef bint from_engine(self, int rank, int64_t header) except -1
    cdef read_one(self, int rank, int64_t rid)
    cdef handoff(self, int rank)
    cdef int64_t hop_at(self, int64_t rid, int rank)
    cdef transfer_ready(self, int rank)
    cdef read_done(self, int rank)
    cdef request_error(self, int rank)
    cdef request_aborted(self, int rank)
