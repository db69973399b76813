# An engine's faults (loop/faults.pxd). Included by _loop_c.pyx.


cdef class Faults:
    """An engine's faults cost no double work and no stream (docs/failure-model.md).

    The grace: an engine whose connection ends (the monitor says so, or a send finds
    no peer) takes no new work at once, but what it holds waits for it (AWAY) for
    ``engine_grace`` seconds; back in time (any message from its identity, or a hello
    of the same session), its replies are the answers and nothing ran twice; not
    back, it is gone. The breaker: an engine that fails ``breaker_failures`` times
    within ``breaker_window`` is quarantined (no work) for a backoff that doubles
    while it keeps failing. The migration: a request that streamed tokens before its
    engine died goes on at another, its prompt extended by them (``streamed``, read
    from its partials) and its budget reduced; its replies then continue the stream.
    """

    def __cinit__(self, Loop loop not None, options):
        self.loop = loop
        self.grace = options.engine_grace
        self.failures = options.breaker_failures
        self.window = options.breaker_window
        self.backoff = options.breaker_backoff
        self.backoff_max = BACKOFF_MAX
        self.migrated = {}
        self.slots = options.max_inflight
        self.streamed = <Streamed*>calloc(self.slots, sizeof(Streamed))
        if self.streamed == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef uint32_t slot
        if self.streamed != NULL:
            for slot in range(self.slots):
                free(self.streamed[slot].tokens)
        free(self.streamed)

    # -- the grace -----------------------------------------------------------------------

    cdef void lost(self, int rank, int reason) noexcept nogil:
        """Its connection ended, or a send found no peer: AWAY for the grace, or gone
        (no grace, or it was not taking work); AWAY already, nothing more."""
        cdef double now
        cdef Engine* engine = &self.loop.engines[rank]
        if engine.state == ENGINE_AWAY:
            return
        if engine.state != ENGINE_ALIVE or self.grace == 0:
            self.mark_gone(rank, reason)
            return
        now = monotonic()
        self.strike(rank, reason, now)
        engine.state = ENGINE_AWAY
        engine.away_until = now + self.grace
        self.loop.router.remove_rank_c(rank)

    cdef ended(self, int rank):
        """The monitor says its connection ended: from now on no new work, whatever the
        grace (a Megatron engine cannot say what reached it). What it sent before is
        handled first (its late replies routed), then it is lost (Peers.drop_ended)."""
        if self.loop.engines[rank].state != ENGINE_ALIVE:
            return
        if self.grace != 0:
            self.lost(rank, GONE_DISCONNECTED)
        else:  # gone once its last messages are handled
            self.loop.router.remove_rank_c(rank)

    cdef back(self, int rank, int fd):
        """An engine AWAY (or whose connection changed unseen) heard from again on
        connection ``fd``: its requests are its own again, and it takes work (unless
        quarantined). A request may have been lost with the old connection on its way
        to it: a rebuild engine's HELD says which it holds (UNCONFIRMED until then).
        A message from a connection that ended is what it sent before: not its return."""
        cdef uint32_t i, n
        cdef RequestOrder* order
        self.loop.peers.connection_events()  # what the monitor said first
        if fd >= 0 and fd not in self.loop.connections:
            return
        if self.loop.engines[rank].state == ENGINE_AWAY:
            self.loop.engines[rank].state = ENGINE_ALIVE
            self.loop.counters[COUNTER_ENGINES_BACK] += 1
        self.admit(rank)  # out of the pool since its connection ended (ended)
        self.loop.peers.watch(rank, fd)
        if not self.loop.engines[rank].rebuild:
            return
        order = self.in_order(rank, -1, &n)
        for i in range(n):
            self.loop.requests.pool[order[i].slot].flags |= FLAG_UNCONFIRMED
        free(order)

    cdef not_held(self, int rank):
        """After an engine's HELD: its requests it did not list never reached it."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order = self.in_order(rank, -1, &n)
        resend = {}
        try:
            for i in range(n):
                slot = order[i].slot
                if self.loop.requests.pool[slot].server_rid == order[i].server_rid and (
                    self.loop.requests.pool[slot].rank == rank
                ) and self.loop.requests.pool[slot].flags & FLAG_UNCONFIRMED:
                    self.unrun(slot, resend)
        finally:
            free(order)
        self.loop.rebuild.send_resends(resend)

    cdef void admit(self, int rank) noexcept nogil:
        """An engine ALIVE takes work, unless quarantined."""
        if self.loop.engines[rank].quarantined_until <= monotonic() and self._whole(rank):
            with gil:
                self.loop.router.add_rank(rank)

    cdef void tick(self, double now) noexcept nogil:
        """The grace over (gone), and the quarantines over (work again)."""
        cdef int rank
        cdef Engine* engine
        for rank in range(self.loop.n_engines):
            engine = &self.loop.engines[rank]
            if engine.state == ENGINE_AWAY and now >= engine.away_until:
                self.mark_gone(rank, GONE_GRACE_OVER)
            if engine.quarantined_until != 0 and now >= engine.quarantined_until:
                engine.quarantined_until = 0
                if engine.state == ENGINE_ALIVE and self._whole(rank):
                    with gil:
                        self.loop.router.add_rank(rank)

    cdef bint _whole(self, int rank) noexcept nogil:
        """Whether a rank takes whole requests (a P/D role may say it does not)."""
        return self.loop.pd is None or self.loop.pd.whole(rank)

    # -- the breaker ---------------------------------------------------------------------

    cdef void strike(self, int rank, int reason, double now) noexcept nogil:
        """An engine failed: one more in its window; at ``failures`` it is quarantined,
        for a backoff doubled from the last one's unless it stayed up a window since."""
        cdef Engine* engine = &self.loop.engines[rank]
        cdef double backoff
        engine.last_failure = reason
        if self.failures == 0 or now < engine.quarantined_until:
            return  # the breaker is open: failing meanwhile is what it is open for
        if now - engine.failures_since > self.window:
            engine.failures = 0
            engine.failures_since = now
        engine.failures += 1
        if engine.failures < self.failures:
            return
        if now - engine.quarantined_until > self.window:
            engine.quarantines = 0  # it stayed up since the last one: start over
        backoff = min(self.backoff * <double>(1 << min(engine.quarantines, 30)), self.backoff_max)
        engine.quarantined_until = now + backoff
        engine.quarantines += 1
        engine.failures = 0
        self.loop.router.remove_rank_c(rank)
        with gil:
            self._quarantined(rank, reason, backoff)

    cdef _quarantined(self, int rank, int reason, double backoff):
        """Counted and said (off the hot path: its objects are this function's)."""
        self.loop.counters[COUNTER_QUARANTINES] += 1
        what = f"engine {rank} quarantined for {backoff:g} s ({GONE_REASONS[reason]})"
        self.loop._log.warn("quarantine", what)

    # -- the migration -------------------------------------------------------------------

    cdef void keep_streaming(self, uint32_t slot) noexcept nogil:
        """A request whose prompt is kept: the tokens its partials carry are kept too."""
        self.streamed[slot].count = 0
        self.streamed[slot].known = self.loop.requests.pool[slot].kept != NULL

    cdef void stream(self, uint32_t slot, const uint8_t* body, size_t size) noexcept nogil:
        """A partial of a request whose prompt is kept: the tokens it carries (a partial
        without them, or a bad one: the request cannot go on elsewhere)."""
        cdef Streamed* s = &self.streamed[slot]
        cdef int kind
        cdef uint32_t count, at
        cdef int status
        if not s.known:
            return
        at = s.count
        status = ck_streamed_tokens(body, size, &kind, s.tokens + at,
                                    <uint32_t>(s.capacity - at), &count)
        if status == CK_TOO_MANY and reserve(
            <void**>&s.tokens, &s.capacity, <size_t>at + count, sizeof(uint32_t)
        ):
            status = ck_streamed_tokens(body, size, &kind, s.tokens + at,
                                        <uint32_t>(s.capacity - at), &count)
        if status != CK_OK or kind == CK_NO_TOKENS:
            s.known = False
        elif kind == CK_NEW_TOKENS:
            s.count = at + count
        else:  # all so far: in their place
            memmove(s.tokens, s.tokens + at, count * sizeof(uint32_t))
            s.count = count

    cdef void forget(self, uint32_t slot) noexcept nogil:
        """A request ended: what it streamed, and (migrated) what it streamed before."""
        free(self.streamed[slot].tokens)
        memset(&self.streamed[slot], 0, sizeof(Streamed))
        if self.loop.requests.pool[slot].flags & FLAG_MIGRATED:
            with gil:
                del self.migrated[self.loop.requests.pool[slot].server_rid]

    cdef int migrate(self, uint32_t slot) except -2:
        """A request that streamed before its engine died, on to another: its prompt
        extended by the tokens streamed and its budget reduced (see _shared.resumed);
        -1 when it cannot go on (tokens not known, its params opt out, a str prompt),
        else how its re-send went (a RouteStatus)."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef Kept* kept = <Kept*>request.kept
        cdef Streamed* s = &self.streamed[slot]
        cdef size_t size
        cdef const uint8_t* prompt
        cdef zmq_msg_t parts[2]
        cdef bint single
        if kept == NULL or not s.known:
            return -1
        single = kept.single
        tokens = [s.tokens[i] for i in range(s.count)]
        prompt = kept_prompt(kept, &size)
        meta = None if kept.single else kept_meta(kept)[:kept.meta_size]
        new = resumed(meta, prompt[:size], tokens)
        if new is None:
            return -1
        new_meta, new_prompt = new
        for i, data in enumerate((new_meta or b"", new_prompt)):
            zmq_msg_init_size(&parts[i], len(data))
            memcpy(zmq_msg_data(&parts[i]), <const char*>data, len(data))
        release_kept(request.kept, &self.loop.small_shared)
        request.kept = keep(NULL if single else &parts[0], &parts[1], single,
                            &self.loop.small_shared)
        zmq_msg_close(&parts[0])
        zmq_msg_close(&parts[1])
        if request.kept == NULL:
            return -1
        self.migrated[request.server_rid] = self.migrated.get(request.server_rid, []) + tokens
        s.count = 0
        request.flags |= FLAG_MIGRATED
        return self.resend(slot)

    cdef bytes continued(self, int64_t server_rid, const uint8_t* body, size_t size):
        """A reply of a request that went on at another engine, continuing its stream."""
        return continued(body[:size], self.migrated[server_rid])

    # -- a gone engine's requests settled --------------------------------------------

    cdef void mark_gone(self, int rank, int reason) noexcept nogil:
        """Take ``rank`` out of the pool now; its requests are settled after the
        message at hand (see settle), so a failure never recurses into routing."""
        cdef Engine* engine = &self.loop.engines[rank]
        cdef uint64_t* counters = self.loop.counters
        cdef EngineTally* tally = &self.loop.tally.engines[rank]
        if engine.state == ENGINE_GONE:
            return
        if engine.state != ENGINE_AWAY:  # counted when it went away
            self.strike(rank, reason, monotonic())
        if engine.state == ENGINE_ALIVE:
            self.loop.router.remove_rank_c(rank)
        engine.state = ENGINE_GONE
        engine.last_failure = reason
        counters[COUNTER_ENGINE_FAILURES] += 1
        tally.gone += 1
        self.loop.gone[self.loop.n_gone] = rank
        self.loop.n_gone = self.loop.n_gone + 1

    cdef settle(self):
        """Re-send or fail the requests of the engines found gone, oldest first.

        Settling one engine may find others gone (a re-send that cannot reach
        its engine): they join the queue, so the work stays a loop, not a recursion.
        """
        cdef int i = 0
        while i < self.loop.n_gone:
            self.settle_engine(self.loop.gone[i])
            i += 1
        self.loop.n_gone = 0

    cdef settle_engine(self, int rank):
        """Each request of a gone engine, by server id, lost there (_unrun)."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        reason = GONE_REASONS[self.loop.engines[rank].last_failure]
        self.loop._log.warn("engine_failed", f"engine {rank} gone ({reason})")
        if self.loop.pd is not None:
            self.loop.pd.engine_gone(rank)  # its P/D requests go on elsewhere, or end
        if self.loop.kv_events is not None and self.loop.engines[rank].state == ENGINE_GONE:
            self.loop.kv_events.unannounce(rank)  # the publisher it announced goes too (not back)
        resend = {}
        order = self.in_order(rank, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                if self.loop.requests.pool[slot].server_rid != order[i].server_rid or (
                    self.loop.requests.pool[slot].rank != rank
                ):
                    continue  # ended meanwhile: its client went away
                self.unrun(slot, resend)
        finally:
            free(order)
        self.loop.rebuild.send_resends(resend)

    cdef unrun(self, uint32_t slot, dict resend):
        """A request its engine will never answer (it died, or does not hold it): re-sent
        from what was kept when it produced nothing (a rebuild client's: RESEND), moved on
        with the tokens it streamed when it did (Faults.migrate), otherwise ended with
        ERROR(ENGINE_FAILED)."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int32_t client = request.client
        cdef int status
        cdef int counter = COUNTER_REROUTED
        tally_failed(&self.loop.tally, request.rank)  # whatever comes of it, that engine lost it
        self.loop.router.release_c(request.rank, self.loop.work[slot])
        request.rank = -1
        request.flags &= ~FLAG_UNCONFIRMED
        if request.flags & (FLAG_ABORTED | FLAG_PINNED) or (
            request.kept == NULL and not self.loop.clients[client].rebuild
        ):
            self.loop.refusals.fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
            return
        if request.flags & FLAG_PRODUCED:
            status = self.migrate(slot)
            if status < 0:  # it cannot go on elsewhere
                self.loop.refusals.fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
                return
            counter = COUNTER_MIGRATED
        elif request.kept == NULL:  # a rebuild client sends it again itself
            resend.setdefault(client, []).append(request.client_rid)
            if self.loop.traces.on:
                self.loop.traces.drop(slot)
            self.loop._forget(slot)
            return
        else:
            status = self.resend(slot)
        if (
            status == ROUTE_ALL_BUSY and self.loop.queue.limit
            and self.loop._queued(slot, NULL, True)
        ):
            return  # it waits at the head, sent from what it kept (moved on: its tokens)
        if status == ROUTE_SENT:
            self.loop.counters[counter] += 1
        elif status == ROUTE_UNSENDABLE:  # no engine left that speaks its format
            self.loop.refusals.fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
        else:
            self.loop.refusals.fail_request(slot, refusal(status), HEADER_SUBMIT_REQUEST)

    cdef int resend(self, uint32_t slot) noexcept nogil:
        """Send a request whose engine died to another, from what it kept, as a new
        request is sent (_route); a RouteStatus."""
        cdef Inbound inbound
        cdef zmq_msg_t messages[2]
        cdef int status = ROUTE_ENGINE_GONE
        kept_inbound(<Kept*>self.loop.requests.pool[slot].kept, &inbound, messages,
                     self.loop.n_multipart_engines, self.loop.n_single_engines)
        carriers(&inbound, self.loop.n_single_engines + self.loop.n_main_engines > 0)
        while status == ROUTE_ENGINE_GONE:  # that one waits in the queue of gone engines
            status = self.loop._route(slot, &inbound)
        zmq_msg_close(&messages[0])
        zmq_msg_close(&messages[1])
        return status

    cdef RequestOrder* in_order(self, int rank, int32_t client, uint32_t* count) except NULL:
        """The requests in flight (of ``rank`` / ``client`` when >= 0) by server id;
        the caller frees the array."""
        cdef RequestOrder* order = <RequestOrder*>malloc(
            (self.loop.requests.live + 1) * sizeof(RequestOrder)
        )
        cdef ck_request* request
        cdef uint32_t slot, n = 0
        if order == NULL:
            raise MemoryError()
        if client >= 0:  # its own list
            slot = self.loop.clients[client].requests.oldest
            while slot != UINT32_MAX:
                order[n].server_rid = self.loop.requests.pool[slot].server_rid
                order[n].slot = slot
                n += 1
                slot = self.loop.client_links.newer[slot]
        else:
            for slot in range(self.loop.requests.used):
                request = &self.loop.requests.pool[slot]
                if request.server_rid < 0 or (rank >= 0 and request.rank != rank):
                    continue
                order[n].server_rid = request.server_rid
                order[n].slot = slot
                n += 1
        qsort(order, n, sizeof(RequestOrder), compare_server_rids)
        count[0] = n
        return order
