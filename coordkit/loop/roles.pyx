# The roles of the identities retired from the tables (loop/roles.pxd). Included by
# _loop_c.pyx.


cdef int roles_init(Roles* self, uint32_t capacity) noexcept nogil:
    self.capacity = capacity
    self.count = self.next = 0
    self.role = <uint8_t*>calloc(capacity, 1)
    if self.role == NULL:
        return -1
    return ck_ids_init(&self.ids, capacity)


cdef void roles_free(Roles* self) noexcept nogil:
    ck_ids_free(&self.ids)
    free(self.role)
    self.role = NULL


cdef inline bint made_up(const uint8_t* identity, size_t n) noexcept nogil:
    """A routing id libzmq made up for a peer that named none: 5 bytes, a zero first.
    Each is one connection's and never handed out again."""
    return n == 5 and identity[0] == 0


cdef void roles_remember(Roles* self, const uint8_t* identity, size_t n,
                         int role) noexcept nogil:
    """``identity`` left the tables as a ``role``; past ``capacity``, the oldest
    remembered is forgotten. Ids libzmq made up are not kept (made_up)."""
    cdef int32_t index
    if made_up(identity, n):
        return
    index = ck_ids_find(&self.ids, identity, n)
    if index < 0:
        index = self.next
        if self.count == self.capacity:
            ck_ids_remove(&self.ids, index)
        else:
            self.count += 1
        ck_ids_insert(&self.ids, index, identity, n)
        self.next = (self.next + 1) % self.capacity
    self.role[index] = role


cdef inline int roles_of(Roles* self, const uint8_t* identity, size_t n) noexcept nogil:
    """The role ``identity`` had (ROLE_NONE: none remembered)."""
    cdef int32_t index = ck_ids_find(&self.ids, identity, n)
    return ROLE_NONE if index < 0 else self.role[index]
