# The message at hand (loop/message.pxd): its frames, received into messages that
# never move, and what was read of its metadata. Included by _loop_c.pyx.


cdef bint message_init(Message* self) noexcept nogil:
    """Reserve room for MAX_PARTS frames once, so that ``parts`` never grows (a
    zmq_msg_t must not be byte-copied) and pointers into it stay valid while the
    message is handled. malloc maps it lazily, so the pages are touched only as
    frames arrive (calloc could touch them all, zeroing); False when memory is short."""
    self.parts = <zmq_msg_t*>malloc(MAX_PARTS * sizeof(zmq_msg_t))
    return self.parts != NULL


cdef void message_free(Message* self) noexcept nogil:
    free(self.parts)
    free(self.entries)
    free(self.single_entries)
    free(self.batch_entries)
    free(self.hashes)


cdef inline const uint8_t* message_data(Message* self, int part) noexcept nogil:
    return <const uint8_t*>zmq_msg_data(&self.parts[part])


cdef inline size_t message_size(Message* self, int part) noexcept nogil:
    return zmq_msg_size(&self.parts[part])


cdef inline size_t message_bytes(Message* self) noexcept nogil:
    """Its size after the routing id, as the traffic counters count it."""
    cdef size_t size = 0
    cdef int i
    for i in range(1, self.n_parts):
        size += message_size(self, i)
    return size


cdef inline bint message_receive(Message* self, void* sock) noexcept nogil:
    """Receive every frame of the next message; False if none waits. Frames past
    MAX_PARTS are dropped, and the message is then oversized (malformed)."""
    zmq_msg_init(&self.parts[0])
    if zmq_msg_recv(&self.parts[0], sock, ZMQ_DONTWAIT) < 0:
        zmq_msg_close(&self.parts[0])
        return False
    self.n_parts = 1
    self.oversized = False
    while zmq_msg_more(&self.parts[self.n_parts - 1]):
        if self.n_parts == MAX_PARTS:
            message_discard_rest(self, sock)
            break
        zmq_msg_init(&self.parts[self.n_parts])
        zmq_msg_recv(&self.parts[self.n_parts], sock, 0)
        self.n_parts += 1
    return True


cdef void message_discard_rest(Message* self, void* sock) noexcept nogil:
    """Drop the remaining frames of an oversized message; it is then malformed."""
    cdef zmq_msg_t extra
    cdef int more = 1
    while more:
        zmq_msg_init(&extra)
        zmq_msg_recv(&extra, sock, 0)
        more = zmq_msg_more(&extra)
        zmq_msg_close(&extra)
    self.oversized = True


cdef inline void message_close(Message* self) noexcept nogil:
    """Done with the message: its frames closed (a frame sent on is already empty)."""
    cdef int i
    for i in range(self.n_parts):
        zmq_msg_close(&self.parts[i])
    self.n_parts = 0


cdef inline uint32_t capacity32(size_t capacity) noexcept nogil:
    """A capacity as the codec's readers take it (uint32)."""
    return <uint32_t>capacity if capacity < UINT32_MAX else UINT32_MAX


cdef int message_read_replies(Message* self, int64_t* header, uint32_t* count) noexcept nogil:
    """Read an ENGINE_REPLY's entries into ``entries``, growing it for a large batch."""
    cdef int status = ck_read_reply(
        message_data(self, 1), message_size(self, 1), header, self.entries,
        capacity32(self.entries_capacity), count,
    )
    if status == CK_TOO_MANY and reserve(
        <void**>&self.entries, &self.entries_capacity, count[0], sizeof(ck_entry)
    ):
        status = ck_read_reply(
            message_data(self, 1), message_size(self, 1), header, self.entries,
            capacity32(self.entries_capacity), count,
        )
    return status


cdef int message_read_single_replies(Message* self, int64_t* header,
                                     uint32_t* count) noexcept nogil:
    """Read a single-frame ENGINE_REPLY's (or ENGINE_REPLY_PARTIAL's) entries into
    ``single_entries``, growing it."""
    cdef int status = ck_read_single_reply(
        message_data(self, 1), message_size(self, 1), header, self.single_entries,
        capacity32(self.single_entries_capacity), count,
    )
    if status == CK_TOO_MANY and reserve(
        <void**>&self.single_entries, &self.single_entries_capacity, count[0],
        sizeof(ck_single_entry),
    ):
        status = ck_read_single_reply(
            message_data(self, 1), message_size(self, 1), header, self.single_entries,
            capacity32(self.single_entries_capacity), count,
        )
    return status


cdef inline int message_read_batch(Message* self, int64_t header, int width,
                                   uint32_t* count) noexcept nogil:
    """Read a batch's entries into ``batch_entries`` (the codec grows it): a
    SUBMIT_BATCH's, ``width`` wide (3, or CK_QOS_WIDTH from a client granted QoS), or
    a HANDOFF's (2)."""
    return ck_read_batch_into(
        message_data(self, 1), message_size(self, 1), header, width,
        &self.batch_entries, &self.batch_entries_capacity, count,
    )


cdef const uint8_t* message_prompt_hashes(
    Message* self, const uint8_t* prompt, size_t size, size_t block_size, size_t* n_hashes
) noexcept nogil:
    """The block hashes of a token-id prompt (a single-frame client sends none) into
    ``hashes``, growing it; NULL for a prompt with no token ids (a str: it is routed
    by load), or when memory is short."""
    cdef int status = ck_prompt_hashes(
        prompt, size, block_size, self.hashes, self.hashes_capacity, n_hashes
    )
    if status == CK_TOO_MANY and reserve(
        <void**>&self.hashes, &self.hashes_capacity, n_hashes[0], BLOCK_HASH_SIZE
    ):
        status = ck_prompt_hashes(
            prompt, size, block_size, self.hashes, self.hashes_capacity, n_hashes
        )
    if status != CK_OK:
        n_hashes[0] = 0
        return NULL
    return self.hashes
