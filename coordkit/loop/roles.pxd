# The roles of the identities retired from the tables (their functions: roles.pyx).
# Included by _loop_c.pxd.

cdef struct Roles:  # routing ids that left the tables, the oldest overwritten first
    ck_ids ids  # routing id -> its index here
    uint8_t* role  # by index: the PeerRole it had
    uint32_t capacity
    uint32_t count  # indices filled (at most capacity)
    uint32_t next  # the index filled next: the oldest once all are
