# The loop's timers, every TICK (its methods: timers.pyx).
# Included by _loop_c.pxd.

cdef class Timers:
    cdef Loop loop  # whose tables it works on

    cdef void tick(self, double now) noexcept nogil
    cdef bint oldest_submitted_before(self, double deadline) noexcept nogil
