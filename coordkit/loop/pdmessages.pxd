# The P/D engines' messages, read for the P/D room (its methods: pdmessages.pyx).
# Included by _loop_c.pxd.

cdef class HandoffReader:  # how a #6675 prefill's handoffs are read (pdmessages.pyx)
    cdef:
        bint fast  # in C (handoff.h), else by _pd's Python reading
        ck_agent* agents  # its NIXL agents' names and blobs, packed (NULL: none put back)
        size_t n_agents
        list frames  # the bytes agents point into


cdef class PDMessages:
    cdef PD pd  # whose hops they end or move on
    cdef dict readers  # by rank: a #6675 prefill's HandoffReader, made at its first handoff

    cdef bint from_engine(self, int rank, int64_t header) except -1
    cdef read_one(self, int rank, int64_t rid)
    cdef handoff(self, int rank)
    cdef int64_t hop_at(self, int64_t rid, int rank)
    cdef transfer_ready(self, int rank)
    cdef read_done(self, int rank)
    cdef request_error(self, int rank)
    cdef request_aborted(self, int rank)
    cdef prefilled(self, uint32_t slot, int rank, const uint8_t* body, size_t size)
    cdef bint _handed_c(self, uint32_t slot, int rank, const uint8_t* body, size_t size) except -1
    cdef HandoffReader _reader(self, int rank)
    cdef stray_reply(self, int rank, int64_t rid)
