# The request_timeout queue (loop/deadlines.pxd): the requests in submission
# order, so the timer ends the due ones from the head and touches nothing
# else. Included by _loop_c.pyx.


cdef bint deadlines_init(Deadlines* self, uint32_t capacity) noexcept nogil:
    """An empty queue for ``capacity`` slots; False when memory is short."""
    self.older = <uint32_t*>malloc(capacity * sizeof(uint32_t))
    self.newer = <uint32_t*>malloc(capacity * sizeof(uint32_t))
    self.oldest = self.newest = UINT32_MAX
    return self.older != NULL and self.newer != NULL


cdef void deadlines_free(Deadlines* self) noexcept nogil:
    free(self.older)
    free(self.newer)


cdef inline void deadlines_push(Deadlines* self, uint32_t slot) noexcept nogil:
    """A new request, the newest."""
    self.older[slot] = self.newest
    self.newer[slot] = UINT32_MAX
    if self.newest != UINT32_MAX:
        self.newer[self.newest] = slot
    else:
        self.oldest = slot
    self.newest = slot


cdef inline void deadlines_remove(Deadlines* self, uint32_t slot) noexcept nogil:
    cdef uint32_t older = self.older[slot], newer = self.newer[slot]
    if older != UINT32_MAX:
        self.newer[older] = newer
    else:
        self.oldest = newer
    if newer != UINT32_MAX:
        self.older[newer] = older
    else:
        self.newest = older
