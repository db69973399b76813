# The requests traced (its methods: traces.pyx). Included by _loop_c.pxd.

cdef enum:
    TRACEPARENT_SIZE = 55  # a W3C traceparent's characters
    ROUTING_ID_MAX = 255  # a ZeroMQ routing id's bytes, at most
    TRACE_RECORDS = 4096  # traced requests in flight at once (and ending), at most
    TRACE_RING = 8192  # records ended and not yet taken by the sink (a power of two)


cdef struct Traced:  # what is recorded of a traced request: a TraceRecord's fields
    int64_t server_rid
    int64_t client_rid
    double accepted
    double routed  # 0: not yet (first_reply, final, ended likewise)
    double first_reply
    double final
    double ended
    int32_t error  # 0 (a final), an ErrorCode, or tracing.CLIENT_GONE
    bint has_parent  # traceparent holds the one its params carry
    char traceparent[TRACEPARENT_SIZE]
    # Routing ids copied when known (its client's index, its engine's rank may be
    # another's by the time it is handed over); engine_size 0: never routed.
    uint8_t client_size
    uint8_t engine_size
    uint8_t client[ROUTING_ID_MAX]
    uint8_t engine[ROUTING_ID_MAX]


cdef class Traces:
    cdef:
        Loop loop  # whose requests it records
        object sink  # the coordinator's TraceSink (None: tracing off)
        bint on  # tracing on: the Loop's hooks call in
        bint follow  # every request whose params carry a traceparent is traced
        uint32_t every  # and one in `every` of the others (0: none)
        uint32_t countdown  # to the next of those
        uint32_t* index  # by request slot: its record in `records` + 1 (0: not traced)
        Traced* records  # of the requests traced in flight, and of those ending
        uint32_t* vacant  # the records not in use, a stack
        uint32_t n_vacant
        uint32_t* ending  # the records of the requests ended by the message at hand
        uint32_t n_ending
        Traced* ring  # the records ended, for the sink's thread (take)
        ck_ring cursors
        uint64_t reported  # of ck_ring_dropped, added to the sink's count already

    cdef void accept(self, uint32_t slot, Inbound* inbound) noexcept nogil
    cdef void routed(self, uint32_t slot, int rank) noexcept nogil
    cdef void replied(self, uint32_t slot, bint final, double now) noexcept nogil
    cdef void fail(self, uint32_t slot, int code) noexcept nogil
    cdef void drop(self, uint32_t slot) noexcept nogil
    cdef void forget(self, uint32_t slot) noexcept nogil
    cdef void end(self) noexcept nogil
    cdef const char* _parent(self, Inbound* inbound) noexcept nogil
    cdef bint _counted(self) noexcept nogil
