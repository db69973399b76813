# The traffic counters (loop/traffic.pxd). Included by _loop_c.pyx.


cdef inline int header_slot(int64_t header) noexcept nogil:
    """Where a message of ``header`` is counted (-1: its header could not be read)."""
    return header if 0 <= header < HEADER_SLOTS - 1 else HEADER_SLOTS - 1


cdef inline void traffic_count(Traffic* self, int direction, int64_t header,
                               size_t size) noexcept nogil:
    """A message of ``size`` bytes (after the routing id), RECEIVED or SENT."""
    cdef int slot = header_slot(header)
    self.messages[direction][slot] += 1
    self.bytes[direction][slot] += size


cdef list traffic_metrics(Traffic* self):
    """(direction, header slot, messages, bytes) for every slot, as metrics() gives it."""
    cdef int direction, slot
    return [
        (direction, slot, self.messages[direction][slot], self.bytes[direction][slot])
        for direction in range(2)
        for slot in range(HEADER_SLOTS)
    ]
