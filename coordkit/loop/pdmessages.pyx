# The P/D engines' messages, read for the P/D room (its declarations: pdmessages.pxd).


@cython.final
cdef class HandoffReader:
    """How a #6675 prefill's handoffs are read, from its registration: in C (handoff.h),
    its NIXL agents' blobs packed once to be put back, or by _pd's Python reading where
    the C one could not say the same (conflicting agents, a name not a str)."""

    def __cinit__(self, registration):
        cdef Py_ssize_t i
        self.fast = True
        self.frames = []
        if registration is None or registration.transport != "nixl":
            return  # no blob put back
        if registration.agents is None or any(
            not isinstance(name, str) for name in registration.agents
        ):
            self.fast = False
            return
        for name, blob in registration.agents.items():
            self.frames += [packb(name), packb(blob)]
        self.n_agents = len(registration.agents)
        self.agents = <ck_agent*>calloc(max(self.n_agents, 1), sizeof(ck_agent))
        if self.agents == NULL:
            raise MemoryError()
        for i in range(<Py_ssize_t>self.n_agents):
            name, blob = self.frames[2 * i], self.frames[2 * i + 1]
            self.agents[i].name = <const uint8_t*><const char*>name
            self.agents[i].name_size = len(name)
            self.agents[i].blob = <const uint8_t*><const char*>blob
            self.agents[i].blob_size = len(blob)

    def __dealloc__(self):
        free(self.agents)


@cython.final
cdef class PDMessages:
    """The P/D engines' messages: a coordkit prefill's HANDOFF, a #6675 prefill's reply,
    NCCL's KV_TRANSFER_READY, KV_READ_DONE, an engine's REQUEST_ERROR and REQUEST_ABORTED,
    each read and handed to its request's hops."""

    def __cinit__(self, PD pd):
        self.pd = pd
        self.readers = {}

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

    # -- a #6675 prefill's replies ------------------------------------------------------

    cdef prefilled(self, uint32_t slot, int rank, const uint8_t* body, size_t size):
        """A #6675 prefill's finished request, read for its handoff (NIXL blobs put back):
        in C where it can (_handed_c), else by _pd's Python reading."""
        cdef PD pd = self.pd
        cdef int64_t rid = pd.loop.requests.pool[slot].server_rid
        if self._handed_c(slot, rank, body, size):
            return
        try:
            record = unpackb((<const char*>body)[:size])
        except ProtocolError:
            record = None
        handoff = handoff_of(record)
        if pd.loop.requests.pool[slot].flags & FLAG_ABORTED:
            pd._send_rid(rank, HEADER_RELEASE_KV, rid)
            pd._end(slot, ERROR_ABORTED, ABORTED_TEXT, True, True)
            return
        if isinstance(handoff, str):
            pd._send_rid(rank, HEADER_RELEASE_KV, rid)
            pd._end(slot, ERROR_ENGINE_FAILED, handoff, True)
            return
        kv_meta, blocks = handoff
        registration = pd.registrations.get(pd.loop.peers.engine_identity(rank))
        if registration is not None and registration.transport == "nixl":
            try:
                kv_meta = restore_nixl_blobs(kv_meta, registration.instance_meta,
                                             registration.agents)
            except ValueError as error:
                pd._send_rid(rank, HEADER_RELEASE_KV, rid)
                pd._end(slot, ERROR_ENGINE_FAILED, f"invalid NIXL handoff metadata: {error}",
                        True)
                return
        tokens = prompt_tokens_of(record) if str_prompt(pd._prompt(slot)) else None
        pd._handed(rank, rid, packb(kv_meta), packb(blocks), decode_slots(kv_meta), tokens)

    cdef bint _handed_c(self, uint32_t slot, int rank, const uint8_t* body, size_t size) except -1:
        """The handoff read in C (handoff.h) and on to hop 2, kv_meta and the block ids
        forwarded as they came, the NIXL blobs put back as kv_meta is written: True; False
        when the Python reading must say (an aborted request, a str prompt's tokens, a
        record the C reading cannot vouch for)."""
        cdef PD pd = self.pd
        cdef HandoffReader reader
        cdef ck_handoff handoff
        cdef bytes kv_meta
        if pd.loop.requests.pool[slot].flags & FLAG_ABORTED or pd._str_prompt(slot):
            return False
        reader = self._reader(rank)
        if not reader.fast or ck_pd_handoff(
            body, size, reader.agents, reader.n_agents, &handoff
        ) != CK_HANDOFF_OK:
            return False
        if not handoff.n_splices:  # nothing to put back
            kv_meta = (<const char*>handoff.kv_meta)[:handoff.kv_meta_size]
        else:
            kv_meta = PyBytes_FromStringAndSize(NULL, handoff.restored_size)
            ck_pd_restore(&handoff, <uint8_t*>PyBytes_AS_STRING(kv_meta))
        pd._handed(rank, pd.loop.requests.pool[slot].server_rid, kv_meta,
                   (<const char*>handoff.blocks)[:handoff.blocks_size], handoff.ssm, None)
        return True

    cdef HandoffReader _reader(self, int rank):
        reader = self.readers.get(rank)
        if reader is None:
            reader = HandoffReader(
                self.pd.registrations.get(self.pd.loop.peers.engine_identity(rank))
            )
            self.readers[rank] = reader
        return reader

    cdef stray_reply(self, int rank, int64_t rid):
        """A #6675 prefill's reply of no request of its (ended meanwhile): what it may
        have pinned for it goes."""
        if self.pd.seats[rank].seated and self.pd.seats[rank].megatron and (
            self.pd.seats[rank].role & PD_PREFILL
        ):
            self.pd._send_rid(rank, HEADER_RELEASE_KV, rid)
