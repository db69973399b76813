# The requests traced (loop/traces.pxd). Included by _loop_c.pyx.


@cython.final
cdef class Traces:
    """The requests the coordinator traces, recorded for its TraceSink (coordkit.tracing).

    Off (no sink), it allocates nothing and the Loop's hooks are one test of ``on``
    each. On, a request is traced when its params carry a client's traceparent
    (``follow``) or it is one in ``every`` of the others: ``accept`` gives it a record,
    and ``index``, a column by request slot, finds it again. The hooks stamp its
    routing, its first reply, its final, and its ERROR; ``forget`` (every end of a
    request goes through the Loop's) sets it aside, and ``end``, once the message at
    hand is handled (its replies and ERRORs sent), stamps them ended and puts them in a
    ring, without the GIL. The sink's thread takes them from there (``take``, with
    the GIL), so the loop's thread makes no Python object for a trace.
    """

    def __cinit__(self, Loop loop not None, options):
        cdef int i
        self.loop = loop
        self.sink = options.tracing
        if self.sink is None:
            return
        self.on = True
        self.follow = self.sink.follow
        self.every = self.countdown = self.sink.every
        self.index = <uint32_t*>calloc(options.max_inflight, sizeof(uint32_t))
        self.records = <Traced*>malloc(TRACE_RECORDS * sizeof(Traced))
        self.vacant = <uint32_t*>malloc(TRACE_RECORDS * sizeof(uint32_t))
        self.ending = <uint32_t*>malloc(TRACE_RECORDS * sizeof(uint32_t))
        self.ring = <Traced*>malloc(TRACE_RING * sizeof(Traced))
        if (
            self.index == NULL or self.records == NULL or self.vacant == NULL
            or self.ending == NULL or self.ring == NULL
        ):
            raise MemoryError()
        for i in range(TRACE_RECORDS):
            self.vacant[i] = TRACE_RECORDS - 1 - i  # the first record on top
        self.n_vacant = TRACE_RECORDS
        self.sink.attach(self.take)

    def __dealloc__(self):
        free(self.index)
        free(self.records)
        free(self.vacant)
        free(self.ending)
        free(self.ring)

    # -- what the Loop calls -------------------------------------------------------------

    cdef void accept(self, uint32_t slot, Inbound* inbound) noexcept nogil:
        """A request accepted at ``slot``: traced when the sampling says so, while a
        record is free (none: not traced, counted as dropped)."""
        cdef const char* parent
        cdef Traced* record
        cdef ck_request* request
        cdef const uint8_t* client
        cdef size_t n
        if self.follow:
            parent = self._parent(inbound)
            if parent == NULL and not self._counted():
                return
        elif self._counted():
            parent = self._parent(inbound)  # its spans still join the client's trace
        else:
            return
        if self.n_vacant == 0:
            ck_ring_drop(&self.cursors)
            return
        self.n_vacant -= 1
        self.index[slot] = self.vacant[self.n_vacant] + 1
        record = &self.records[self.vacant[self.n_vacant]]
        request = &self.loop.requests.pool[slot]
        record.server_rid = request.server_rid
        record.client_rid = request.client_rid
        # _admit read the clock already when the loop times its requests
        record.accepted = self.loop.submitted[slot] if self.loop.submitted != NULL else (
            monotonic()
        )
        record.routed = record.first_reply = record.final = record.ended = 0.0
        record.error = 0
        record.has_parent = parent != NULL
        if parent != NULL:
            memcpy(record.traceparent, parent, TRACEPARENT_SIZE)
        client = ck_ids_get(&self.loop.client_ids, request.client, &n)
        record.client_size = <uint8_t>n
        memcpy(record.client, client, n)
        record.engine_size = 0

    cdef void routed(self, uint32_t slot, int rank) noexcept nogil:
        """Its frames went to engine ``rank`` (a re-send: the last routing counts)."""
        cdef const uint8_t* engine
        cdef size_t n
        cdef Traced* record
        if self.index[slot] == 0:
            return
        record = &self.records[self.index[slot] - 1]
        record.routed = monotonic()
        engine = ck_ids_get(&self.loop.engine_ids, rank, &n)
        record.engine_size = <uint8_t>n
        memcpy(record.engine, engine, n)

    cdef void replied(self, uint32_t slot, bint final, double now) noexcept nogil:
        """A reply entry for it (``now``: the clock read for its message, or 0)."""
        cdef Traced* record
        if self.index[slot] == 0:
            return
        record = &self.records[self.index[slot] - 1]
        if now == 0.0:
            now = monotonic()
        if record.first_reply == 0.0:
            record.first_reply = now
        if final:
            record.final = now

    cdef void fail(self, uint32_t slot, int code) noexcept nogil:
        """It ends with ERROR(code) (or tracing.CLIENT_GONE), before its forget."""
        if self.index[slot] != 0:
            self.records[self.index[slot] - 1].error = code

    cdef void drop(self, uint32_t slot) noexcept nogil:
        """It leaves without an end of its own (its client sends it again: RESEND): no
        spans, its record free again."""
        if self.index[slot] == 0:
            return
        self.vacant[self.n_vacant] = self.index[slot] - 1
        self.n_vacant += 1
        self.index[slot] = 0

    cdef void forget(self, uint32_t slot) noexcept nogil:
        """It leaves the tables (the Loop's _forget): its record waits for the message's
        end (end). Without a final or an ERROR, its client left."""
        cdef Traced* record
        if self.index[slot] == 0:
            return
        record = &self.records[self.index[slot] - 1]
        if record.final == 0.0 and record.error == 0:
            record.error = TRACED_CLIENT_GONE
        self.ending[self.n_ending] = self.index[slot] - 1
        self.n_ending += 1
        self.index[slot] = 0

    cdef void end(self) noexcept nogil:
        """The message at hand is handled, what it sent sent: the records set aside are
        stamped ended and handed over to the ring (full: dropped, counted)."""
        cdef double now = monotonic()
        cdef uint32_t i, r
        for i in range(self.n_ending):
            r = self.ending[i]
            self.records[r].ended = now
            if ck_ring_room(&self.cursors, TRACE_RING):
                memcpy(&self.ring[self.cursors.head & (TRACE_RING - 1)], &self.records[r],
                       sizeof(Traced))
                ck_ring_push(&self.cursors)
            else:
                ck_ring_drop(&self.cursors)
            self.vacant[self.n_vacant] = r
            self.n_vacant += 1
        self.n_ending = 0

    # -- the sink's thread -------------------------------------------------------------

    def take(self):
        """The records ended since the last call, as TraceRecords (the sink's thread,
        with the GIL: TraceSink.attach); those dropped meanwhile are added to its count."""
        cdef uint64_t tail = self.cursors.tail
        cdef uint64_t head = ck_ring_filled(&self.cursors)
        cdef uint64_t dropped = ck_ring_dropped(&self.cursors)
        cdef Traced* record
        taken = []
        while tail != head:
            record = &self.ring[tail & (TRACE_RING - 1)]
            taken.append(TraceRecord(
                record.server_rid,
                record.client_rid,
                (<const char*>record.client)[:record.client_size],
                (<const char*>record.engine)[:record.engine_size] if record.engine_size else None,
                record.accepted,
                record.routed or None,
                record.first_reply or None,
                record.final or None,
                record.ended,
                record.error,
                (<const char*>record.traceparent)[:TRACEPARENT_SIZE].decode("latin-1")
                if record.has_parent else None,
            ))
            tail += 1
        ck_ring_taken(&self.cursors, tail)
        self.sink.dropped += dropped - self.reported
        self.reported = dropped
        return taken

    # -- its own steps -----------------------------------------------------------------

    cdef const char* _parent(self, Inbound* inbound) noexcept nogil:
        """The traceparent in a multipart request's params (tracing.TRACEPARENT_MARK and
        the 55 bytes after it), or NULL. A Megatron client's single frame carries none."""
        cdef const char* found
        if inbound.single or inbound.params == NULL:
            return NULL
        found = <const char*>memmem(inbound.params, inbound.params_size, TRACE_MARK,
                                    TRACE_MARK_SIZE)
        if found == NULL or (
            found + TRACE_MARK_SIZE + TRACEPARENT_SIZE
            > <const char*>inbound.params + inbound.params_size
        ):
            return NULL
        return found + TRACE_MARK_SIZE

    cdef bint _counted(self) noexcept nogil:
        """Whether this one is the one in ``every`` (of the requests without a parent
        followed)."""
        if self.every == 0:
            return False
        self.countdown -= 1
        if self.countdown:
            return False
        self.countdown = self.every
        return True
