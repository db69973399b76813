# Lists through indices (loop/lists.pxd), oldest first: every push and removal is
# O(1), whatever the number of indices, and a walk touches only its list. They
# keep the request_timeout queue (the requests in submission order, so the timer
# ends the due ones from its head), each client's requests (what a client that
# went away leaves), and the idle clients (the one idle longest gives up its
# place to a newcomer when the table is full). Included by _loop_c.pyx.


cdef bint links_init(Links* self, uint32_t capacity) noexcept nogil:
    """Room for indices below ``capacity`` (touched as they are used); False when memory
    is short."""
    self.older = <uint32_t*>malloc(capacity * sizeof(uint32_t))
    self.newer = <uint32_t*>malloc(capacity * sizeof(uint32_t))
    return self.older != NULL and self.newer != NULL


cdef void links_free(Links* self) noexcept nogil:
    free(self.older)
    free(self.newer)


cdef inline void ends_init(Ends* ends) noexcept nogil:
    ends.oldest = ends.newest = UINT32_MAX


cdef inline void list_push(Links* self, Ends* ends, uint32_t index) noexcept nogil:
    """``index`` into the list, the newest."""
    self.older[index] = ends.newest
    self.newer[index] = UINT32_MAX
    if ends.newest != UINT32_MAX:
        self.newer[ends.newest] = index
    else:
        ends.oldest = index
    ends.newest = index


cdef inline void list_remove(Links* self, Ends* ends, uint32_t index) noexcept nogil:
    """``index`` out of the list it is in."""
    cdef uint32_t older = self.older[index], newer = self.newer[index]
    if older != UINT32_MAX:
        self.newer[older] = newer
    else:
        ends.oldest = newer
    if newer != UINT32_MAX:
        self.older[newer] = older
    else:
        ends.newest = older
