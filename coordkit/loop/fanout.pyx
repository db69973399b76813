# One batch fan-out for both directions (loop/fanout.pxd): the entries of the
# batch at hand bound for peers that take batches (a SUBMIT_BATCH's to batched
# engines, a reply batch's to batched clients), sent once every entry is
# handled, one batch per peer in the order the peers were first chosen: a head
# ``[header, [[rid, <tail>], ...]]`` written once, then the frames after it as
# the same messages. Included by _loop_c.pyx.


cdef inline bint fanout_reserve(Fanout* self, uint32_t count, size_t tails) noexcept nogil:
    """An empty fan-out with room for ``count`` entries whose tails come to at most
    ``tails`` bytes; False when memory is short."""
    self.n = 0
    # The head: [header, [ of count, then per entry a fixarray, an id and its tail.
    self.head_needed = CK_BATCH_HEAD_MAX + count * (1 + CK_INT_MAX) + tails
    return reserve(
        <void**>&self.entries, &self.capacity, count, sizeof(Batched)
    ) and reserve(<void**>&self.head, &self.head_capacity, self.head_needed, 1)


cdef inline bint fanout_grow(Fanout* self, size_t tail) noexcept nogil:
    """Room for one entry more, whose tail is ``tail`` bytes, than fanout_reserve made
    (the dispatch of waiting requests, as many as engines have room for); False when
    memory is short."""
    self.head_needed += 1 + CK_INT_MAX + tail
    return reserve(
        <void**>&self.entries, &self.capacity, self.n + 1, sizeof(Batched)
    ) and reserve(<void**>&self.head, &self.head_capacity, self.head_needed, 1)


cdef inline void fanout_add(Fanout* self, int32_t to, int64_t rid, const uint8_t* tail,
                            size_t tail_size, zmq_msg_t* frame, const uint8_t* data,
                            size_t size) noexcept nogil:
    """An entry for peer ``to`` (room was reserved for it): ``[rid, <tail>]`` in the
    head, then ``frame`` itself, or when it is NULL a copy of ``data[:size]``."""
    cdef Batched* entry = &self.entries[self.n]
    self.n += 1
    entry.to = to
    entry.rid = rid
    entry.tail = tail
    entry.tail_size = tail_size
    entry.frame = frame
    entry.data = data
    entry.size = size
    entry.trailed = False


cdef inline void fanout_trail(Fanout* self, const Origin* origin) noexcept nogil:
    """The last entry added goes to a rebuild engine: its trailer follows its frame."""
    self.entries[self.n - 1].trailed = True
    self.entries[self.n - 1].origin = origin[0]


cdef size_t fanout_send(Fanout* self, void* sock, int64_t header, uint32_t first) noexcept nogil:
    """The batch of the peer of ``entries[first]`` (its first entry) after its routing
    id: the head written into ``head``, then the frames; the bytes sent."""
    cdef Batched* entries = self.entries
    cdef int32_t to = entries[first].to
    cdef uint32_t j, count = 0
    cdef uint8_t* out = self.head
    cdef size_t size, frames = 0
    cdef int more, framed
    for j in range(first, self.n):
        if entries[j].to == to:
            count += 1
            frames += zmq_msg_size(entries[j].frame) if entries[j].frame else entries[j].size
    out += ck_write_batch_head(out, header, count)
    for j in range(first, self.n):
        if entries[j].to == to:
            out[0] = MSGPACK_FIXARRAY_2
            out += 1 + ck_write_int(out + 1, entries[j].rid)
            memcpy(out, entries[j].tail, entries[j].tail_size)
            out += entries[j].tail_size
    size = out - self.head
    send_bytes(sock, self.head, size, ZMQ_SNDMORE)
    for j in range(first, self.n):
        if entries[j].to == to:
            count -= 1
            more = ZMQ_SNDMORE if count else 0
            framed = ZMQ_SNDMORE if entries[j].trailed else more  # its trailer follows
            if entries[j].frame:
                send_msg(sock, entries[j].frame, framed)
            else:
                send_bytes(sock, entries[j].data, entries[j].size, framed)
            if entries[j].trailed:
                frames += send_trailer(sock, &entries[j].origin, more)
    return size + frames


cdef inline void fanout_done(Fanout* self, uint32_t first) noexcept nogil:
    """The peer of ``entries[first]`` is done with: its entries are not sent again."""
    cdef int32_t to = self.entries[first].to
    cdef uint32_t j
    for j in range(first, self.n):
        if self.entries[j].to == to:
            self.entries[j].to = -1


cdef void fanout_free(Fanout* self) noexcept nogil:
    free(self.entries)
    free(self.head)
