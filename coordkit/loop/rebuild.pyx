# The rebuild after a coordinator's loss, and a client's blip (loop/rebuild.pxd).
# Included by _loop_c.pyx.


cdef class Rebuild:
    """The rebuild after a coordinator's loss, and the ride-through of a client's blip
    (docs/design.md, "The rebuild after a coordinator's loss"): what engines report
    (HELD), what clients wait for (REJOIN), the replays (REPLAY, REPLAYED), what is sent
    back (RESEND), the acknowledgements (HANDLED) and the clients away. Until the window
    ends, engines report what they hold and clients what they wait for; meanwhile no
    HANDLED goes out (a replay may need it all). It works on its loop's tables."""

    def __cinit__(self, Loop loop not None, options):
        self.loop = loop
        self.window = options.rebuild_window
        self.cluster = options.cluster
        self.until = monotonic() + self.window
        self.rebuilding = True
        self.awaiting = {}
        self.aborting = set()
        self.claimed_ids = set()
        self.claimed_rids = set()
        self.deferred = {}
        self.away = {}

    cdef reopen(self):
        """A cluster's member, a HELD or a REJOIN at hand: the window (again, or longer)
        for what a member lost leaves (its clients' REJOINs, the engines' claims of
        their requests, in either order, within a window of each other)."""
        if self.cluster:
            self.rebuilding = True
            self.until = max(self.until, monotonic() + self.window)

    cdef held(self, int32_t engine):
        """HELD: what a rebuild engine holds, after its registration. A request this
        coordinator has at that engine (a blip) is replayed whole; one it does not know
        is adopted under its server id while the window lasts, for a client that may
        still REJOIN it; any other is aborted at the engine, which must not run it on."""
        cdef int64_t slot
        cdef int32_t client
        cdef ck_request* request
        cdef const uint8_t* identity
        cdef size_t n
        parsed = self.loop.answers.parse(protocol.HELD, -1, HEADER_HELD)
        if parsed is None:
            return
        self.reopen()
        entries, hashes = parsed
        self.loop.router.learn(engine, hashes, monotonic())
        replays = {}
        aborts = []
        for server_rid, client_rid, client_id, partials, final in entries:
            if client_id is None and self.loop.pd is not None and (
                self.loop.pd.reported(engine, server_rid, final)
            ):
                continue
            slot = ck_requests_find(&self.loop.requests, server_rid)
            if slot >= 0:
                request = &self.loop.requests.pool[slot]
                identity = ck_ids_get(&self.loop.client_ids, request.client, &n)
                # Its client named, or nil for one that did not ask for the rebuild.
                named = client_id == (
                    identity[:n] if self.loop.clients[request.client].rebuild else None
                )
                if not (request.rank == engine and request.client_rid == client_rid and named):
                    aborts.append(server_rid)  # another's: the first claim stands
                    continue
                request.flags &= ~FLAG_UNCONFIRMED
                if client_id is not None and not request.flags & FLAG_ORPHAN:
                    self._replay(slot, -1, replays)  # an orphan's waits for its client
                continue
            if client_id is None:  # nobody to adopt it for
                aborts.append(server_rid)
                continue
            client = -1
            if self.loop.engines[engine].state != ENGINE_GONE:
                client = self._adoptive_client(client_id, client_rid)
            if client < 0 or not self._claimable(server_rid, client_id, client_rid):
                aborts.append(server_rid)
                continue
            slot = ck_requests_adopt(&self.loop.requests, client, client_rid, server_rid)
            self.loop._admit(slot, client)
            self.loop.router.hold(engine)
            request = &self.loop.requests.pool[slot]
            request.rank = engine
            self.loop.work[slot] = <uint32_t>self.loop.router.charged
            request.flags = FLAG_ORPHAN | FLAG_REPLAYING | (FLAG_PRODUCED if partials else 0)
            self.loop.counters[COUNTER_ADOPTED] += 1
            start = self.awaiting.pop((client_id, client_rid), None)
            if start is not None:
                request.flags &= ~FLAG_ORPHAN
                self._replay(slot, start, replays)
                if (client_id, client_rid) in self.aborting:  # its client aborted it meanwhile
                    self.aborting.discard((client_id, client_rid))
                    request.flags |= FLAG_ABORTED
                    aborts.append(server_rid)
        self._refuse_claims(engine, "HELD", len(aborts))
        for server_rid in aborts:
            if self.loop.engines[engine].state != ENGINE_GONE:
                self.loop.control.abort_at_engine(engine, server_rid)
        self._send_replays(replays)
        self.loop.faults.not_held(engine)

    cdef bint _claimable(self, int64_t server_rid, bytes client_id, int64_t client_rid):
        """Whether an engine's report may be adopted under ``server_rid``: not an id this
        life drew (those are all known, in flight or ended), nor one past MAX_ADOPTED,
        and claimed by nobody before in the window (by server id, or by its client's
        id), even if it has ended since. A cluster's member skips the first test: a
        member lost drew its ids from its own start, among or past this one's, and an
        adoption moves the next id past the one adopted; a claim of its own ended
        request is adopted only for a client that is absent or has not REJOINed yet,
        and its REJOIN, which does not list it, has it aborted."""
        if not 0 <= server_rid < MAX_ADOPTED or (
            not self.cluster
            and self.loop.first_server_id <= server_rid < <int64_t>self.loop.requests.next_rid
        ):
            return False
        if server_rid in self.claimed_ids or (client_id, client_rid) in self.claimed_rids:
            return False
        self.claimed_ids.add(server_rid)
        self.claimed_rids.add((client_id, client_rid))
        return True

    cdef _refuse_claims(self, int32_t engine, str kind, Py_ssize_t count):
        """Claims of an engine's report that could not be true: counted and logged; they
        change nothing of another peer's."""
        if count:
            self.loop.counters[COUNTER_REFUSED_CLAIMS] += count
            what = f"refused {count} {kind} claims from engine {engine}"
            self.loop._log.warn(f"claims:{engine}", what)

    cdef int32_t _adoptive_client(self, bytes identity, int64_t client_rid) except -2:
        """The client an adopted request would be for (made, absent, until it
        connects); -1 when it must not be adopted: the window is over, the client
        rejoined without it or sent it again, or the tables are full."""
        cdef size_t n = len(identity)
        cdef int32_t client = ck_ids_find(&self.loop.client_ids, identity, n)
        # A client connected that rejoined (or said it rejoins nothing) waits only for
        # what it listed; one that never asked for the rebuild waits for nothing.
        cdef bint unwanted = client >= 0 and self.loop.clients[client].present and not (
            self.loop.clients[client].rebuild and self.loop.clients[client].fresh
        )
        if (
            not self.rebuilding
            or self.loop.requests.live >= self.loop.max_inflight
            or (
                client >= 0
                and ck_requests_find_client(&self.loop.requests, client, client_rid) >= 0
            )
            or (unwanted and (identity, client_rid) not in self.awaiting)
        ):
            return -1
        if client >= 0:
            return client
        if ck_ids_find(&self.loop.engine_ids, identity, n) >= 0 or (
            roles_of(&self.loop.roles, identity, n) == ROLE_ENGINE
        ):
            return -1
        client = self.loop.peers.vacant_client()
        if client < 0:
            return -1
        memset(&self.loop.clients[client], 0, sizeof(Client))
        self.loop.clients[client].used = True
        ends_init(&self.loop.clients[client].requests)
        list_push(&self.loop.idle_links, &self.loop.idle, client)  # idle until its first adoption
        # only a rebuild client's id travels
        self.loop.clients[client].coordkit = self.loop.clients[client].rebuild = True
        self.loop.clients[client].format = FORMAT_MULTIPART
        self.loop.clients[client].fd = -1  # no connection yet: its CONNECT says which
        self.loop.clients[client].tenant = -1  # its CONNECT names it
        ck_ids_insert(&self.loop.client_ids, client, identity, n)
        self.loop.n_clients += 1
        return client

    cdef rejoin(self, int32_t client):
        """REJOIN: the requests a rebuild client still waits for, once acknowledged
        again. Each one held is replayed from the partials it got; one not held waits
        for an engine to claim it while the window lasts, and is sent back after it
        (RESEND, or ERROR(ENGINE_FAILED) when it got partials: it cannot start over).
        Its adopted requests it did not list are not awaited: aborted."""
        cdef int64_t slot
        if not self.loop.clients[client].fresh:  # its first message settled what it waits for
            self.loop.refusals.malformed(client, None, HEADER_REJOIN, "not the connection's first")
            return
        parsed = self.loop.answers.parse(protocol.REJOIN, client, HEADER_REJOIN)
        if parsed is None:
            return
        entries, _ = parsed
        if any(partials < 0 for _, partials in entries):
            what = "a negative count of partials"
            self.loop.refusals.malformed(client, None, HEADER_REJOIN, what)
            return
        if len(entries) > self.loop.max_inflight:
            what = "more entries than max_inflight"
            self.loop.refusals.malformed(client, None, HEADER_REJOIN, what)
            return
        self.loop.clients[client].fresh = False
        self.loop.clients[client].rejoined = True
        self.reopen()
        identity = self.loop.answers.frame_bytes(0)
        self.away.pop(identity, None)  # back from a blip: its requests carry on
        self.n_away = len(self.away)
        replays = {}
        resend = {}
        for rid, partials in entries:
            slot = ck_requests_find_client(&self.loop.requests, client, rid)
            if slot >= 0:
                self.loop.requests.pool[slot].flags &= ~FLAG_ORPHAN
                self._replay(slot, partials, replays)
            elif self.rebuilding:
                self.awaiting[(identity, rid)] = partials
            else:
                self._unclaimed(client, rid, partials, resend)
        self._drop_orphans(client)
        self._send_replays(replays)
        self.send_resends(resend)

    cdef replayed(self, int32_t engine):
        """REPLAYED: what an engine sends again, each reply with its place, on to its
        client as CLIENT_REPLAYED (which drops what it has); its normal replies flow
        again. A request the engine does not hold is sent back to its client when
        nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        cdef int64_t slot
        cdef int32_t client
        cdef int part
        cdef double now = 0.0
        cdef size_t size
        parsed = self.loop.answers.parse(protocol.REPLAYED, -1, HEADER_REPLAYED)
        if parsed is None:
            return
        entries, _ = parsed
        if self.loop.measure_latency:
            now = monotonic()
        out = {}  # client -> (its entries, the parts of their bodies)
        resend = {}
        refused = 0
        at = 2
        for server_rid, first, count, final in entries:
            parts, at = range(at, at + count), at + count
            slot = ck_requests_find(&self.loop.requests, server_rid)
            if slot < 0 or self.loop.requests.pool[slot].rank != engine or not (
                self.loop.requests.pool[slot].flags & FLAG_ASKED
            ):
                refused += 1  # not asked of it (or asked and answered already)
                continue
            if not self.loop.clients[self.loop.requests.pool[slot].client].present:
                continue  # its client is away again: its REJOIN asks anew
            self.loop.requests.pool[slot].flags &= ~(FLAG_REPLAYING | FLAG_ASKED)
            if first < 0:
                self._unheld(<uint32_t>slot, resend)
                continue
            client = self.loop.requests.pool[slot].client
            client_rid = self.loop.requests.pool[slot].client_rid
            for j, part in enumerate(parts):
                last = final and j == count - 1
                self.loop._finish(<uint32_t>slot, last, now)
                replies = out.setdefault(client, ([], []))
                replies[0].append([client_rid, first + j, last])
                replies[1].append(part)
        self._refuse_claims(engine, "REPLAYED", refused)
        for client, (replied, parts) in out.items():
            if self.loop._send_identity(&self.loop.client_ids, client) != 0:
                self.loop.peers.client_gone(client)
                continue
            meta = packb([HEADER_REPLAYED, replied])
            send_bytes(self.loop.sock, <const char*>meta, len(meta), ZMQ_SNDMORE)
            size = len(meta)
            for j, part in enumerate(parts):
                size += self.loop._size(part)
                send_msg(self.loop.sock, &self.loop.message.parts[part],
                         ZMQ_SNDMORE if j + 1 < len(parts) else 0)
            traffic_count(&self.loop.traffic, SENT, HEADER_REPLAYED, size)
        self.send_resends(resend)

    cdef _replay(self, uint32_t slot, int64_t start, dict replays):
        """Ask the request's engine (a rebuild engine) to send again what it sent for
        it from partial ``start`` on (-1: all it keeps); its replies wait till then."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int rank = request.rank
        if rank < 0:
            return
        if self.loop.engines[rank].rebuild and self.loop.engines[rank].state != ENGINE_GONE:
            request.flags |= FLAG_REPLAYING | FLAG_ASKED
            replays.setdefault(rank, []).append([request.server_rid, start])

    cdef _send_replays(self, dict replays):
        for rank, entries in replays.items():
            self.loop.counters[COUNTER_REPLAYED] += len(entries)
            replay = protocol.REPLAY.pack(entries)
            if not self.loop.answers.send_frames(&self.loop.engine_ids, rank, replay):
                self.loop.faults.lost(rank, GONE_UNREACHABLE)

    cdef send_resends(self, dict resend):
        """RESEND to each client (one that is connected) of the requests it must send again."""
        cdef int32_t client
        for client, rids in resend.items():
            if not (self.loop.clients[client].used and self.loop.clients[client].present):
                continue
            self.loop.counters[COUNTER_RESENT] += len(rids)
            message = protocol.RESEND.pack(rids)
            if not self.loop.answers.send_frames(&self.loop.client_ids, client, message):
                self.loop.peers.client_gone(client)

    cdef rejoins_nothing(self, int32_t client):
        """A connected client's first message is not a REJOIN: it waits for nothing an
        engine may still report, and what was adopted for it is aborted (before the
        message is handled: one of its new requests may have the id of one)."""
        self.loop.clients[client].fresh = False
        self._drop_orphans(client)

    cdef _unclaimed(self, int32_t client, int64_t rid, int64_t partials, dict resend):
        """A request a client waits for that no engine holds: sent back when it got
        nothing, else ended (partials went out: it cannot start over)."""
        if partials == 0:
            resend.setdefault(client, []).append(rid)
            return
        self.loop.failed[ERROR_ENGINE_FAILED] += 1
        self.loop.counters[COUNTER_ENGINE_FAILED] += 1
        if not self.loop.refusals.send_error(
            client, rid, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST
        ):
            self.loop.peers.client_gone(client)

    cdef _unheld(self, uint32_t slot, dict resend):
        """A request its engine says it does not hold (any more): sent back to its
        client when nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int32_t client = request.client
        cdef int64_t client_rid = request.client_rid
        if request.flags & (FLAG_PRODUCED | FLAG_ABORTED | FLAG_PINNED) or (
            not self.loop.clients[client].rebuild
        ):
            self.loop.refusals.fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
            return
        if self.loop.traces.on:
            self.loop.traces.drop(slot)
        self.loop._forget(slot)
        resend.setdefault(client, []).append(client_rid)

    cdef _drop_orphan(self, uint32_t slot):
        """An adopted request no client waits for: aborted at its engine and forgotten,
        and its client with it when that never came back and has nothing left."""
        cdef int rank = self.loop.requests.pool[slot].rank
        cdef int32_t client = self.loop.requests.pool[slot].client
        cdef int64_t server_rid = self.loop.requests.pool[slot].server_rid
        self.loop._forget(slot)
        if rank >= 0 and self.loop.engines[rank].state != ENGINE_GONE:
            self.loop.control.abort_at_engine(rank, server_rid)
        if not self.loop.clients[client].present and self.loop.clients[client].inflight == 0:
            self.loop.peers.remove_client(client)

    cdef defer(self, int32_t client, int64_t rid):
        """Keep a request for RESEND once an engine registered (see _submit)."""
        self.deferred.setdefault(self.loop.peers.identity(client), []).append(rid)
        self.n_deferred = len(self.deferred)

    cdef resend_deferred(self):
        """RESEND of the deferred requests (see _submit), to the clients still here."""
        cdef int32_t client
        deferred, self.deferred = self.deferred, {}
        self.n_deferred = 0
        resend = {}
        for identity, rids in deferred.items():
            client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
            if client >= 0:
                resend[client] = rids
        self.send_resends(resend)

    cdef end_window(self):
        """The window's end: the requests clients wait for that no engine claimed are
        sent back (see _unclaimed), the adopted ones no client came back for are
        aborted, and HANDLED goes out again."""
        cdef int32_t client
        self.rebuilding = False
        self.claimed_ids.clear()  # no report is adopted any more
        self.claimed_rids.clear()
        awaiting, self.awaiting = self.awaiting, {}
        aborting, self.aborting = self.aborting, set()
        resend = {}
        for (identity, rid), partials in awaiting.items():
            client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
            if client < 0:
                continue
            if (identity, rid) in aborting:  # aborted before anyone ran it: not sent again
                self.loop.refusals.refuse(
                    client, rid, ERROR_UNKNOWN_REQUEST, HEADER_ABORT_REQUEST,
                    COUNTER_UNKNOWN_REQUEST,
                )
            else:
                self._unclaimed(client, rid, partials, resend)
        self.send_resends(resend)
        self._drop_orphans(-1)  # but those of a client away from a blip: they wait for it

    cdef end_holds(self, double now):
        """The clients away past their hold: one that did not come back is dropped with
        its requests (aborted at their engines); one that came back and did not REJOIN
        them has its orphans aborted."""
        cdef int32_t client
        for identity, until in list(self.away.items()):
            if now < until:
                continue
            del self.away[identity]
            self.n_away = len(self.away)
            client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
            if not self.loop.clients[client].present:
                self.loop.peers.drop_client(client)
            else:
                self._drop_orphans(client)

    cdef _drop_orphans(self, int32_t client):
        """The adopted requests no client waits for (``client``'s, or with -1 all but
        those of clients away), by server id: aborted at their engines and forgotten
        (_drop_orphan)."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order = self.loop.faults.in_order(-1, client, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                if self.loop.requests.pool[slot].server_rid == order[i].server_rid and (
                    self.loop.requests.pool[slot].flags & FLAG_ORPHAN
                ) and (client >= 0 or self.loop.peers.identity(self.loop.requests.pool[slot].client)
                       not in self.away):
                    self._drop_orphan(slot)
        finally:
            free(order)

    cdef void acknowledge(self) noexcept nogil:
        """HANDLED to each rebuild engine (after the window): the number of its last
        reply message handled by the previous tick, so at least a tick ago, by when
        the replies in it have left this process in all but a stall. An engine that
        holds requests of a client away is not (``holding``): a REJOIN may want all it
        kept."""
        cdef uint8_t handled[CK_HEADER_INT_MAX]
        cdef size_t n
        cdef int rank
        cdef Engine* engine
        for rank in range(self.loop.n_engines):
            engine = &self.loop.engines[rank]
            if (
                engine.rebuild and engine.state != ENGINE_GONE and not self.rebuilding
                and not engine.holding and engine.mark > engine.acked
            ):
                engine.acked = engine.mark
                n = ck_write_header_int(
                    handled, HEADER_HANDLED, engine.base + <int64_t>engine.acked - 1
                )
                if self.loop._send_identity(&self.loop.engine_ids, rank) != 0:
                    self.loop.faults.lost(rank, GONE_UNREACHABLE)
                else:
                    send_bytes(self.loop.sock, handled, n, 0)
                    traffic_count(&self.loop.traffic, SENT, HEADER_HANDLED, n)
            engine.mark = engine.handled

    cdef mark_holding(self):
        """Which engines hold requests of clients away (Engine.holding, n_holding)."""
        cdef int rank
        cdef int32_t client
        cdef uint32_t slot
        for rank in range(self.loop.n_engines):
            self.loop.engines[rank].holding = False
        for identity in self.away:
            client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
            slot = self.loop.clients[client].requests.oldest
            while slot != UINT32_MAX:
                if self.loop.requests.pool[slot].rank >= 0:
                    self.loop.engines[self.loop.requests.pool[slot].rank].holding = True
                slot = self.loop.client_links.newer[slot]
        self.n_holding = 0
        for rank in range(self.loop.n_engines):
            self.n_holding += self.loop.engines[rank].holding

    cdef go_away(self, int32_t client):
        """A rebuild client's connection ended: for its hold (its failover_timeout, from
        its CONNECT) its requests at rebuild engines wait for its REJOIN, as adopted ones
        do (ORPHAN), their replies dropped meanwhile (REPLAYING: the engine keeps them,
        and is sent no HANDLED meanwhile); the REJOIN replays what it lacks. Those at
        other engines cannot be replayed: aborted now (the REJOIN then has them sent
        again, or failed, as after a coordinator's loss). A client left with nothing in
        flight is not kept: it is forgotten as any other."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef ck_request* request
        cdef int rank
        cdef bint aborted
        self.loop.clients[client].present = self.loop.clients[client].rejoined = False
        fd = self.loop.clients[client].fd
        if self.loop.connections.get(fd, -1) == client:
            self.loop.connections[fd] = -1
        self.loop.clients[client].fd = -1
        self.away[self.loop.peers.identity(client)] = monotonic() + self.loop.clients[client].hold
        self.n_away = len(self.away)
        order = self.loop.faults.in_order(-1, client, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                request = &self.loop.requests.pool[slot]
                rank = request.rank
                if rank >= 0 and self.loop.engines[rank].rebuild and (
                    self.loop.engines[rank].state != ENGINE_GONE
                ):
                    request.flags |= FLAG_ORPHAN | FLAG_REPLAYING
                    continue
                aborted = request.flags & FLAG_ABORTED
                self.loop._forget(slot)
                if not aborted and rank >= 0 and self.loop.engines[rank].state != ENGINE_GONE:
                    self.loop.control.abort_at_engine(rank, order[i].server_rid)
        finally:
            free(order)
        if self.loop.clients[client].inflight == 0:
            self.loop.peers.remove_client(client)

    cdef int absent(self):
        """The clients away and not back yet (stats: they are not connected)."""
        cdef int n = 0
        cdef int32_t client
        for identity in self.away:
            client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
            n += not self.loop.clients[client].present
        return n

    cdef returned(self, int32_t client):
        """A client not connected (away, or known from an engine's report) sent CONNECT:
        one that was away and has nothing in flight awaits no REJOIN."""
        identity = self.loop.peers.identity(client)
        if identity in self.away:
            self.loop.counters[COUNTER_CLIENTS_RETURNED] += 1
            if self.loop.clients[client].inflight == 0:
                del self.away[identity]
                self.n_away = len(self.away)

    cdef void sent_finals(self, int32_t engine, uint32_t count, double now) noexcept nogil:
        """The finals to clients with a hold, sent: forgotten now, but those whose client
        went away meanwhile (REPLAYING since: its REJOIN replays them)."""
        cdef uint32_t i
        cdef int64_t slot
        cdef ck_request* request
        for i in range(count):
            if not self.loop.message.entries[i].valid:
                continue
            slot = ck_requests_find(&self.loop.requests, self.loop.message.entries[i].rid)
            if slot < 0:
                continue
            request = &self.loop.requests.pool[slot]
            if (
                request.rank == engine
                and self.loop.clients[request.client].hold > 0
                and not request.flags & FLAG_REPLAYING
            ):
                self.loop._finish(<uint32_t>slot, True, now)
