# The refusals and terminal errors (its declarations: refusals.pxd).


@cython.final
cdef class Refusals:
    """The refusals and terminal errors: a request failed, timed out or refused; ERROR to a
    client; malformed input answered and counted."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    cdef fail_request(self, uint32_t slot, int code, int64_t header):
        """End the request at ``slot`` with ERROR(code): its one terminal reply."""
        cdef int32_t client = self.loop.requests.pool[slot].client
        rid = self.loop.requests.pool[slot].client_rid
        tally_failed(&self.loop.tally, self.loop.requests.pool[slot].rank)
        if self.loop.traces.on:
            self.loop.traces.fail(slot, code)
        self.loop._forget(slot)
        self.loop.failed[code] += 1
        if code == ERROR_ENGINE_FAILED:
            self.loop.counters[COUNTER_ENGINE_FAILED] += 1
        if not self.send_error(client, rid, code, header, True):
            self.loop.peers.client_gone(client)

    cdef time_out(self, uint32_t slot):
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped); one
        that waits leaves the queue; a P/D request's hops are its room's."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int rank = request.rank
        self.loop.counters[COUNTER_TIMED_OUT] += 1
        if self.loop.pd is not None and self.loop.pd.hops[slot].stage:
            self.loop.pd.time_out(slot)
            return
        if rank < 0:
            self.loop._unqueue(slot, OUTCOME_TIMED_OUT)
        elif not request.flags & FLAG_ABORTED and self.loop.engines[rank].state != ENGINE_GONE:
            self.loop.control.abort_at_engine(rank, request.server_rid)
        self.fail_request(slot, ERROR_TIMED_OUT, HEADER_SUBMIT_REQUEST)

    cdef no_engines_left(self):
        """The waiting requests, with no engine left to wait for: ERROR(NO_ENGINES)."""
        cdef uint32_t i, n
        cdef uint32_t slot
        cdef RequestOrder* order = self.loop.faults.in_order(-1, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                if (
                    self.loop.requests.pool[slot].server_rid == order[i].server_rid
                    and self.loop.requests.pool[slot].rank < 0
                    and queue_holds(&self.loop.queue, slot)
                ):
                    self.loop._unqueue(slot, OUTCOME_REFUSED)
                    self.fail_request(slot, ERROR_NO_ENGINES, HEADER_SUBMIT_REQUEST)
        finally:
            free(order)

    cdef reject_entry(self, int32_t engine, object rid, int code, int64_t header):
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ERROR_MALFORMED:
            self.loop.counters[COUNTER_MALFORMED_ENTRIES] += 1
            self.loop.tally.engines[engine].malformed_entries += 1
            what = f"malformed entry in {header_name(header)} from engine {engine}"
            self.loop._log.warn("malformed", what)
        if self.loop.engines[engine].coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self.loop.answers.send_frames(&self.loop.engine_ids, engine, error):
                self.loop.faults.lost(engine, GONE_UNREACHABLE)

    cdef bint send_error(self, int32_t client, object rid, int code, int64_t header,
                         bint ends=False, str text=None):
        """ERROR to a coordkit client (its text ``text``, else error_text's); to a
        Megatron main client, when the error ends a request of its (``ends``), the
        FAILED final it takes (0.19's clients get nothing). False when the client is
        gone."""
        cdef bint coordkit = self.loop.clients[client].coordkit
        if not self.loop.clients[client].present or (
            not coordkit
            and not (ends and self.loop.clients[client].format == FORMAT_SINGLE_FRAME_MAIN)
        ):
            return True  # away, its REJOIN then finds it ended; or it takes no ERROR
        self.loop.counters[COUNTER_ERRORS_SENT] += 1
        text = error_text(code, header) if text is None else text
        if self.loop.pr6675 and not coordkit:  # #6675's client: its REQUEST_ERROR
            error = protocol.REQUEST_ERROR.pack(rid, text, True)
            return self.loop.answers.send_frames(&self.loop.client_ids, client, error)
        if not coordkit:
            what = f"a Megatron main client's request {rid} failed: {text}"
            self.loop._log.warn("failed_final", what)
            reply = [megatron_failed_reply(rid)]
            return self.loop.answers.send_frames(&self.loop.client_ids, client, reply)
        error = protocol.ERROR.pack(rid, code, text)
        return self.loop.answers.send_frames(&self.loop.client_ids, client, error)

    cdef refuse(self, int32_t client, object rid, int code, int64_t header, int counter,
                bint ends=False):
        """Count a refused message and answer its client with ERROR(code); ``ends``:
        it was a request that parsed (see _send_error)."""
        self.loop.counters[counter] += 1
        self.loop.refused[code] += 1
        if not self.send_error(client, rid, code, header, ends):
            self.loop.peers.client_gone(client)

    cdef malformed(self, int32_t client, object rid, int64_t header, str detail):
        """A message that does not parse: counted, logged (rate-limited), and
        answered when its sender is a client (``client`` >= 0)."""
        self.loop._log.warn(
            "malformed",
            f"malformed {header_name(header)} from {self.loop.answers.frame_bytes(0)!r}: {detail}"
        )
        if client < 0:
            self.loop.counters[COUNTER_MALFORMED] += 1
        else:
            self.refuse(client, rid, ERROR_MALFORMED, header, COUNTER_MALFORMED)

    cdef malformed_batch(self, int32_t client, uint32_t count, str detail):
        """A SUBMIT_BATCH whose entries cannot all go on: no prompt can be told from
        another, so each of the ``count`` requests named ends here; when none is,
        one ERROR without an id says so."""
        cdef uint32_t i
        if count == 0:
            self.malformed(client, None, HEADER_SUBMIT_BATCH, detail)
        for i in range(count):
            if not self.loop.clients[client].used:
                return  # found gone meanwhile
            self.malformed(
                client, self.loop.message.batch_entries[i].rid, HEADER_SUBMIT_BATCH, detail
            )

    cdef shut_down(self):
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        cdef uint32_t i, n
        cdef RequestOrder* order = self.loop.faults.in_order(-1, -1, &n)
        try:
            for i in range(n):
                if self.loop.requests.pool[order[i].slot].server_rid == order[i].server_rid:
                    self.loop._unqueue(order[i].slot, OUTCOME_REFUSED)
                    self.fail_request(order[i].slot, ERROR_SHUTTING_DOWN, HEADER_SHUTDOWN)
        finally:
            free(order)
        self.loop.faults.settle()
        if self.loop.traces.n_ending:
            self.loop.traces.end()
