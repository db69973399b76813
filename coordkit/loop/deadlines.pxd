# The request_timeout queue (its functions: deadlines.pyx). Included by _loop_c.pxd.

cdef struct Deadlines:
    # The requests in submission order, so in deadline order (every request has the
    # same timeout): a doubly linked list through their slots, UINT32_MAX its end.
    uint32_t* older
    uint32_t* newer
    uint32_t oldest
    uint32_t newest
