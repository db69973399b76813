# The traffic counters (their functions: traffic.pyx). Included by _loop_c.pxd.

cdef enum Direction:
    RECEIVED
    SENT


cdef struct Traffic:  # messages and bytes by direction and header slot (the last: unreadable)
    uint64_t messages[2][HEADER_SLOTS]
    uint64_t bytes[2][HEADER_SLOTS]
