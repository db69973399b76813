# An engine's faults: the grace, the breaker, the migration (its methods: faults.pyx).
# Included by _loop_c.pxd.

cdef struct Streamed:  # the tokens a request's partials carried at its present engine
    uint32_t* tokens
    uint32_t count
    size_t capacity
    bint known  # its prompt is kept and its partials carry tokens: it may go on elsewhere


cdef class Faults:
    cdef:
        Loop loop  # whose tables it works on
        double grace  # seconds an engine whose connection ended keeps what it holds
        int failures  # the breaker: failures within `window` that quarantine (0: never)
        double window
        double backoff  # the first quarantine, doubled at each next one
        double backoff_max
        Streamed* streamed  # by request slot
        uint32_t slots
        # server id -> the tokens it streamed at the engines before its present one
        dict migrated

    # the grace
    cdef void lost(self, int rank, int reason) noexcept nogil
    cdef ended(self, int rank)
    cdef back(self, int rank, int fd)
    cdef not_held(self, int rank)
    cdef void admit(self, int rank) noexcept nogil
    cdef void tick(self, double now) noexcept nogil
    cdef bint _whole(self, int rank) noexcept nogil
    # the breaker
    cdef void strike(self, int rank, int reason, double now) noexcept nogil
    cdef _quarantined(self, int rank, int reason, double backoff)
    # the migration
    cdef void keep_streaming(self, uint32_t slot) noexcept nogil
    cdef void stream(self, uint32_t slot, const uint8_t* body, size_t size) noexcept nogil
    cdef void forget(self, uint32_t slot) noexcept nogil
    cdef int migrate(self, uint32_t slot) except -2
    cdef bytes continued(self, int64_t server_rid, const uint8_t* body, size_t size)
    # a gone engine's requests settled
    cdef void mark_gone(self, int rank, int reason) noexcept nogil
    cdef settle(self)
    cdef settle_engine(self, int rank)
    cdef unrun(self, uint32_t slot, dict resend)
    cdef int resend(self, uint32_t slot) noexcept nogil
    cdef RequestOrder* in_order(self, int rank, int32_t client, uint32_t* count) except NULL
