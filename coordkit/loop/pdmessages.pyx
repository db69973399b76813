# The P/D engines' messages, read for the P/D room (its declarations: pdmessages.pxd).


@cython.final
cdef class PDMessages:
    """The P/D engines' messages: a coordkit prefill's HANDOFF, NCCL's KV_TRANSFER_READY,
    KV_READ_DONE, an engine's REQUEST_ERROR and REQUEST_ABORTED, each read and handed to its
    request's hops."""

    def __cinit__(self, PD pd):
        self.pd = pd

    cdef bint from_engine(self, int rank, int64_t header) except -1:
        """The P/D messages of an engine (False: not one)."""
        if header == HEADER_HANDOFF:
            self.handoff(rank)
        elif header == HEADER_KV_TRANSFER_READY:
            self.transfer_ready(rank)
        elif header == HEADER_KV_READ_DONE:
            self.read_done(rank)
        elif header == HEADER_REQUEST_ERROR:
            self.request_error(rank)
        elif header == HEADER_REQUEST_ABORTED:
            self.request_aborted(rank)
        else:
            return False
        return True

    cdef handoff(self, int rank):
        """A coordkit prefill's HANDOFF, read in C: each kv_meta and block-id frame goes
        to the decode as it came."""
        cdef Loop loop = self.pd.loop
        cdef uint32_t count, i
        cdef const uint8_t* meta = loop._data(1)
        cdef ck_batch_entry entry
        cdef int status = message_read_batch(&loop.message, HEADER_HANDOFF, 2, &count)
        if status != CK_OK:
            loop.refusals.malformed(-1, None, HEADER_HANDOFF,
                                    f"malformed HANDOFF: {ck_strstatus(status).decode()}")
            return
        if count != <uint32_t>(loop.message.n_parts - 2):
            loop.refusals.malformed(-1, None, HEADER_HANDOFF, "bad frame layout")
            return
        for i in range(count):
            entry = loop.message.batch_entries[i]
            kv_meta = (<const char*>meta + entry.params_offset)[:entry.params_size]
            blocks = (<const char*>loop._data(i + 2))[:loop._size(i + 2)]
            self.pd._handed(rank, entry.rid, kv_meta, blocks, 0, None)

    cdef int64_t hop_at(self, int64_t rid, int rank):
        """The request's slot when ``rank`` is its decode (before its read), else -1."""
        cdef int64_t slot = ck_requests_find(&self.pd.loop.requests, rid)
        if slot < 0:
            return -1
        if self.pd.hops[slot].stage != PD_STAGE_DECODE or self.pd.hops[slot].decode != rank:
            return -1
        return slot

    cdef transfer_ready(self, int rank):
        cdef int64_t slot
        cdef int prefill
        message = self.pd.loop.answers.parse(protocol.KV_TRANSFER_READY, -1, -1)
        if message is None:
            return
        slot = self.hop_at(message.rid, rank)
        if slot < 0:
            self.pd.counts["stray"] += 1
            return
        prefill = self.pd.hops[slot].prefill
        if self.pd.seats[prefill].seated and self.pd.seats[prefill].megatron and (
            not self.pd.seats[prefill].nccl
        ):
            self.pd._end(<uint32_t>slot, ERROR_ENGINE_FAILED, UNEXPECTED_READINESS, False)
            return
        frame = send_kv_message(message.rid, self.pd.transfer.get(rank),
                                message.cached_prefix_blocks)
        self.pd._send_to(prefill, [frame])

    cdef read_done(self, int rank):
        """KV_READ_DONE: a request's read, or the reads of a coordkit decode's step; the
        pins of those a coordkit prefill holds released in one RELEASE_KV per prefill."""
        cdef Loop loop = self.pd.loop
        cdef int64_t header, rid
        cdef uint32_t count, _i
        cdef size_t first
        cdef ck_cursor cursor
        cdef int status = ck_read_rids(loop._data(1), loop._size(1), &header, &count, &first)
        if status != CK_OK:
            loop.refusals.malformed(
                -1, None, HEADER_KV_READ_DONE,
                f"malformed metadata frame: {ck_strstatus(status).decode()}",
            )
            return
        if loop.message.n_parts != 2:
            loop.refusals.malformed(-1, None, HEADER_KV_READ_DONE, "bad frame layout")
            return
        cursor.p = loop._data(1) + first
        cursor.end = loop._data(1) + loop._size(1)
        self.pd.releasing = count > 1
        try:
            for _i in range(count):
                ck_read_int(&cursor, &rid)
                self.read_one(rank, rid)
        finally:
            self.pd.releasing = False
            self.pd._send_releases()

    cdef read_one(self, int rank, int64_t rid):
        cdef int64_t slot = self.hop_at(rid, rank)
        if slot >= 0:
            self.pd.hops[slot].stage = PD_READ
            if self.pd.hops[slot].pins:
                self.pd._release_pins(<uint32_t>slot)
            return
        orphan = self.pd.orphans.get(rid)
        if orphan is not None and orphan[1] == rank:
            self.pd._free_orphan(rid)
            return
        self.pd.counts["stray"] += 1

    cdef request_error(self, int rank):
        """An engine's REQUEST_ERROR for a request it holds: it ends with the engine's
        reason; not safe, its pins wait for the read."""
        cdef int64_t slot
        message = self.pd.loop.answers.parse(protocol.REQUEST_ERROR, -1, -1)
        if message is None:
            return
        slot = ck_requests_find(&self.pd.loop.requests, message.rid)
        if slot < 0 or self.pd.loop.requests.pool[slot].rank != rank:
            orphan = self.pd.orphans.get(message.rid)
            if message.source_safe and orphan is not None and orphan[1] == rank:
                self.pd._free_orphan(message.rid)
            else:
                self.pd.counts["stray"] += 1
            return
        if not self.pd.hops[slot].stage:  # a whole request its engine failed
            self.pd._end(<uint32_t>slot, ERROR_ENGINE_FAILED, message.reason, True)
            return
        self.pd._end(<uint32_t>slot, ERROR_ENGINE_FAILED, message.reason, message.source_safe)

    cdef request_aborted(self, int rank):
        cdef int64_t slot
        message = self.pd.loop.answers.parse(protocol.REQUEST_ABORTED, -1, -1)
        if message is None or not message.source_safe:
            return  # unsafe: a safe one follows
        slot = ck_requests_find(&self.pd.loop.requests, message.rid)
        if slot >= 0 and self.pd.loop.requests.pool[slot].rank == rank:
            self.pd._end(<uint32_t>slot, ERROR_ABORTED, ABORTED_TEXT, True, True)
            return
        orphan = self.pd.orphans.get(message.rid)
        if orphan is not None and orphan[1] == rank:
            self.pd._free_orphan(message.rid)
