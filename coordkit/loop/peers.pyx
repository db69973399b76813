# The peers' life: engines and clients joining, living and leaving (its declarations: peers.pxd).


@cython.final
cdef class Peers:
    """The peers' life: engines registering, saying hello and their role, new and restarted;
    the socket monitor's events; clients connecting and their table, tenants; goodbyes,
    heartbeats and disconnects; a client gone."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    cdef register(self, int32_t engine):
        """An engine announced itself (one empty frame) on a connection: a new rank, or
        one coming back after it left or was declared gone. Under an identity alive, it
        is a repeat on the same connection, or, on another, a new process (Megatron's
        engines register once, at their start) -- unless a hello named its process: then
        the hello that follows says which."""
        cdef int fd = zmq_msg_get(&self.loop.message.parts[1], ZMQ_SRCFD)
        if engine < 0 or self.loop.engines[engine].state in (ENGINE_GONE, ENGINE_DRAINING):
            self.new_engine(engine, fd)
        elif fd == self.loop.engines[engine].fd or self.loop.engines[engine].session:
            self.loop.counters[COUNTER_DUPLICATE_REGISTER] += 1
        else:
            self.restarted(engine, fd)

    cdef engine_hello(self, int32_t engine):
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered; a
        hello naming another process than the one registered under its identity is a
        new process (the old one's requests are handled as its death)."""
        cdef int fd = zmq_msg_get(&self.loop.message.parts[1], ZMQ_SRCFD)
        try:
            hello = parse_engine_hello(self.loop.answers.frames())
        except ProtocolError as exc:
            self.loop.refusals.malformed(-1, None, HEADER_ENGINE_HELLO, str(exc))
            return
        if engine < 0 or self.loop.engines[engine].state in (ENGINE_GONE, ENGINE_DRAINING):
            engine = self.new_engine(engine, fd)
        elif (
            self.loop.engines[engine].session
            and hello.session != self.loop.engines[engine].session
        ):
            self.restarted(engine, fd)
        elif self.loop.engines[engine].state == ENGINE_AWAY or fd != self.loop.engines[engine].fd:
            self.loop.faults.back(engine, fd)  # the same process, a new connection
        if engine >= 0:
            self.loop.engines[engine].session = hello.session
            self.loop.engines[engine].coordkit = hello.coordkit
            self.loop.engines[engine].batch = hello.batch
            self.loop.engines[engine].format = FORMAT_MULTIPART
            # Its reply messages are numbered anew from its base: a registration each time.
            self.loop.engines[engine].rebuild = hello.rebuild
            self.loop.engines[engine].base = hello.base
            self.loop.engines[engine].handled = self.loop.engines[engine].mark = 0
            self.loop.engines[engine].acked = 0
            self.loop.router.set_capacity(engine, hello.capacity)
            self.loop.dispatch_due = True
            self.count_formats()
            if hello.role:
                self.pd_room().seat(engine, hello.role, False, hello.domain, hello.capacity)
                self.loop.pd.transfer[engine] = hello.transfer
            elif self.loop.pd is not None and self.loop.pd.seats[engine].seated:
                self.loop.pd.unseat(engine)
                self.loop.faults.admit(engine)
            if self.loop.kv_events is not None:  # its publisher, or none (its predecessor's go)
                if hello.kv_events is None:
                    self.loop.kv_events.unannounce(engine)
                else:
                    self.loop.kv_events.add(
                        engine, hello.kv_events, hello.kv_events_replay, announced=True
                    )
            if hello.ack or hello.rebuild:  # it is in the pool: say so, and what it was granted
                ack = protocol.engine_ack(hello, self.loop.epoch, roles=True)
                self.loop.answers.reply_to_sender(ack)
            if self.loop.pd is not None:
                self.loop.pd.drain()

    cdef PD pd_room(self):
        """The P/D room, made when the first engine takes a role."""
        if self.loop.pd is None:
            self.loop.pd = PD(self.loop, self.loop._options)
        return self.loop.pd

    cdef register_role(self, int32_t engine):
        """A #6675 engine's REGISTER_ROLE: judged as #6675 judges it (a registered identity
        is replaced first: its requests as at its death), then acknowledged ([2]) and
        seated, or refused ([29, reason])."""
        cdef int fd = zmq_msg_get(&self.loop.message.parts[1], ZMQ_SRCFD)
        cdef PD pd
        cdef int32_t rank
        identity = self.loop.answers.frame_bytes(0)
        try:
            message = unpackb(self.loop.answers.frame_bytes(1))
        except ProtocolError as exc:
            self.loop.refusals.malformed(-1, None, HEADER_REGISTER_ROLE, str(exc))
            return
        pd = self.pd_room() if self.loop.pr6675 else self.loop.pd
        fleet = {} if pd is None else pd.registrations
        if not isinstance(message, list):
            message = [message]
        check = check_register_role(message, identity, fleet, self.loop.pr6675)
        if check.replaces and engine >= 0 and self.loop.engines[engine].state != ENGINE_GONE:
            self.loop.faults.mark_gone(engine, GONE_RESTARTED)
            self.loop.faults.settle()
        registration = check.registration
        if registration is None or pd is None:
            if pd is not None:
                pd.counts["roles_refused"] += 1
            self.loop.answers.reply_to_sender(protocol.ROLE_REFUSED.pack(check.refusal))
            return
        rank = ck_ids_find(&self.loop.engine_ids, self.loop._data(0), self.loop._size(0))
        rank = self.new_engine(rank, fd)
        if rank < 0:
            return
        # main's frames, four SUBMIT fields
        self.loop.engines[rank].format = FORMAT_SINGLE_FRAME_MAIN
        self.count_formats()
        pd.seat(rank, ROLE_NAMES[registration.role], True, MEGATRON_DOMAIN,
                registration.request_capacity)
        pd.seats[rank].ssm_capacity = registration.ssm_capacity or 0
        pd.seats[rank].slot_cost = registration.slot_cost
        pd.seats[rank].nccl = registration.transport == "nccl"
        pd.transfer[rank] = registration.instance_meta
        pd.registrations[identity] = registration
        self.loop.answers.reply_to_sender(protocol.REGISTER_ROLE_ACK.pack())
        pd.drain()

    cdef count_formats(self):
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        cdef int rank
        self.loop.n_single_engines = self.loop.n_main_engines = self.loop.n_multipart_engines = 0
        for rank in range(self.loop.n_engines):
            if self.loop.engines[rank].state == ENGINE_GONE:
                continue
            if self.loop.engines[rank].format == FORMAT_SINGLE_FRAME:
                self.loop.n_single_engines += 1
            elif self.loop.engines[rank].format == FORMAT_SINGLE_FRAME_MAIN:
                self.loop.n_main_engines += 1
            else:
                self.loop.n_multipart_engines += 1

    cdef restarted(self, int32_t engine, int fd):
        """A new process registered under an engine's identity: the old one's requests
        are handled as its death (re-sent or failed), and the rank starts anew."""
        self.loop.counters[COUNTER_ENGINE_RESTARTS] += 1
        self.loop.faults.mark_gone(engine, GONE_RESTARTED)
        self.new_engine(engine, fd)  # first: the new one may take them
        self.loop.faults.settle()

    cdef int32_t new_engine(self, int32_t engine, int fd) except -2:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full). Its rank,
        or -1 when there is no room or the sender is, or was, a client."""
        cdef int32_t rank
        cdef size_t n = self.loop._size(0)
        cdef const uint8_t* retired
        cdef size_t retired_n
        if engine < 0:
            if ck_ids_find(&self.loop.client_ids, self.loop._data(0), n) >= 0 or (
                roles_of(&self.loop.roles, self.loop._data(0), n) == ROLE_CLIENT
            ):
                self.loop.refusals.malformed(-1, None, -1, "a client sent an engine registration")
                return -1
            rank = self.loop.n_engines
            if rank == self.loop.max_engines:
                rank = -1
                for engine in range(self.loop.n_engines):
                    if self.loop.engines[engine].state == ENGINE_GONE:
                        if self.loop.router.pending(engine) == 0:
                            rank = engine
                            break
                if rank < 0:
                    self.loop.counters[COUNTER_TABLE_FULL] += 1
                    self.loop._log.warn("engines_full", "engine table full: registration dropped")
                    return -1
                retired = ck_ids_get(&self.loop.engine_ids, rank, &retired_n)
                roles_remember(&self.loop.roles, retired, retired_n, ROLE_ENGINE)
                ck_ids_remove(&self.loop.engine_ids, rank)
            else:
                self.loop.n_engines += 1
            memset(&self.loop.engines[rank], 0, sizeof(Engine))
            tally_reset(&self.loop.tally, rank)
            self.loop.engines[rank].fd = -1
            self.loop.engines[rank].last_failure = -1
            ck_ids_insert(&self.loop.engine_ids, rank, self.loop._data(0), n)
            engine = rank
            if self.loop.kv_events is not None:  # the publisher configured for its id
                self.loop.kv_events.registered(rank, (<const char*>self.loop._data(0))[:n])
        self.loop.engines[engine].state = ENGINE_ALIVE
        self.watch(engine, fd)
        self.loop.engines[engine].session = 0
        self.loop.engines[engine].coordkit = False
        self.loop.engines[engine].batch = False
        self.loop.engines[engine].format = (
            self.loop.single_format if self.loop.megatron_core else FORMAT_MULTIPART
        )
        self.loop.engines[engine].heartbeats = False
        self.loop.engines[engine].rebuild = False
        self.loop.engines[engine].handled = 0
        self.loop.engines[engine].mark = 0
        self.loop.engines[engine].acked = 0
        self.loop.router.set_capacity(engine, 0)  # until a hello says otherwise
        self.loop.faults.admit(engine)
        self.loop.dispatch_due = True
        self.count_formats()
        return engine

    cdef watch(self, int rank, int fd):
        """An engine's connection is ``fd`` (-1: inproc, not watched): when it ends, the
        engine is lost (Faults.lost)."""
        if self.loop.engine_fds.get(self.loop.engines[rank].fd, -1) == rank:
            del self.loop.engine_fds[self.loop.engines[rank].fd]
        self.loop.engines[rank].fd = fd
        if fd < 0:
            return
        self.connection_events()  # what the monitor said first
        if fd in self.loop.connections:
            self.loop.engine_fds[fd] = rank
        else:  # it ended already
            self.end(self.engine_identity(rank), fd)

    cdef connect(self, int32_t client):
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        cdef int32_t index
        try:
            hello = parse_connect(self.loop.answers.frames())
        except ProtocolError as exc:
            self.loop.refusals.malformed(-1, None, HEADER_CONNECT, str(exc))
            return
        fd = zmq_msg_get(&self.loop.message.parts[1], ZMQ_SRCFD)
        if client >= 0 and self.loop.clients[client].present and fd != self.loop.clients[client].fd:
            # Its routing id on a new connection (libzmq hands it over: nothing reaches
            # the old one any more): it reconnected before its old connection's end was
            # seen, or another process took its name: either way the old one is gone
            # (away, with a hold: a blip).
            if self.loop.clients[client].hold > 0:
                self.loop.rebuild.go_away(client)
            else:
                self.client_gone(client, False)
            # -1: forgotten (nothing in flight kept)
            client = ck_ids_find(&self.loop.client_ids, self.loop._data(0), self.loop._size(0))
        if (
            client < 0
            and roles_of(&self.loop.roles, self.loop._data(0), self.loop._size(0)) == ROLE_ENGINE
        ):
            self.loop.refusals.malformed(-1, None, HEADER_CONNECT, "an engine sent CONNECT")
            return
        if client >= 0:
            if self.loop.clients[client].present:
                self.loop.counters[COUNTER_DUPLICATE_CONNECT] += 1
            else:  # known from an engine's report only, or away: this is its connection
                self.connection_events()  # as for a new client: what the monitor said first
                self.loop.clients[client].fd = fd
                self.loop.rebuild.returned(client)
            index = client
            self.loop._seen(client)
        else:
            # What the monitor said first: a connection that ended on this CONNECT's fd
            # before this one opened is not to be taken for this one's end.
            self.connection_events()
            index = self.vacant_client()
            if index < 0:
                self.loop.counters[COUNTER_TABLE_FULL] += 1
                self.loop.refused[ERROR_BUSY] += 1
                if hello.coordkit:
                    self.loop.counters[COUNTER_ERRORS_SENT] += 1
                    text = error_text(ERROR_BUSY, HEADER_CONNECT)
                    self.loop.answers.reply_to_sender(protocol.ERROR.pack(None, ERROR_BUSY, text))
                return
            self.loop.clients[index].used = True
            self.loop.clients[index].inflight = 0
            self.loop.clients[index].tenant = -1
            ends_init(&self.loop.clients[index].requests)
            list_push(&self.loop.idle_links, &self.loop.idle, index)
            self.loop.clients[index].fd = fd
            ck_ids_insert(&self.loop.client_ids, index, self.loop._data(0), self.loop._size(0))
            self.loop.n_clients += 1
        self.loop.clients[index].coordkit = hello.coordkit
        self.loop.clients[index].batch = hello.batch
        self.loop.clients[index].rebuild = hello.rebuild
        self.loop.clients[index].hold = hello.hold
        self.loop.clients[index].qos = hello.qos
        tenant = self.tenant(hello.tenant)  # the one it names now (None: its own)
        if self.loop.clients[index].tenant >= 0:
            queue_leave(&self.loop.queue, self.loop.clients[index].tenant)
        self.loop.clients[index].tenant = tenant
        self.loop.clients[index].present = self.loop.clients[index].fresh = True
        self.loop.clients[index].rejoined = False  # until its REJOIN, the requests adopted wait
        self.loop.clients[index].format = FORMAT_MULTIPART
        if self.loop.megatron_core and not hello.coordkit:
            self.loop.clients[index].format = (
                FORMAT_SINGLE_FRAME_MAIN if self.loop.pr6675 else FORMAT_SINGLE_FRAME
            )
        features = {BATCH_FEATURE: 1} if hello.batch else {}
        if hello.qos:
            features[QOS_FEATURE] = 1
        if hello.rebuild:
            features.update({REBUILD_FEATURE: 1, EPOCH_KEY: self.loop.epoch})
        if features:
            self.loop.answers.reply_to_sender(protocol.CONNECT_ACK_BATCH.pack(features))
        else:
            self.loop.answers.reply_to_sender(protocol.CONNECT_ACK.pack())
        fd = self.loop.clients[index].fd
        if fd >= 0:
            if fd in self.loop.connections:
                self.loop.connections[fd] = index
            else:  # the monitor said its connection ended already
                self.end(self.identity(index), fd)

    cdef int32_t tenant(self, str name):
        """The queue's tenant named ``name`` (None: a new one of its own)."""
        cdef bytes encoded
        if name is None:
            return queue_tenant(&self.loop.queue, NULL, 0)
        encoded = name.encode()
        return queue_tenant(&self.loop.queue, encoded, len(encoded))

    cdef int32_t vacant_client(self) except -2:
        """A free client index; when all are used, the client idle longest gives up
        its own; -1 when none is idle."""
        cdef int32_t index
        if (
            self.loop.vacant.newest == UINT32_MAX
            and self.loop.clients_used < <uint32_t>self.loop.max_clients
        ):
            self.loop.clients_used += 1
            return self.loop.clients_used - 1
        if self.loop.vacant.newest == UINT32_MAX:
            if self.loop.idle.oldest == UINT32_MAX:
                return -1
            self.remove_client(self.loop.idle.oldest)
        index = self.loop.vacant.newest
        list_remove(&self.loop.idle_links, &self.loop.vacant, index)
        return index

    cdef remove_client(self, int32_t client):
        """A client with nothing in flight leaves the tables (its identity stays a
        client's)."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.loop.client_ids, client, &n)
        roles_remember(&self.loop.roles, identity, n, ROLE_CLIENT)
        if self.loop.clients[client].tenant >= 0:
            queue_leave(&self.loop.queue, self.loop.clients[client].tenant)
            self.loop.clients[client].tenant = -1
        self.loop.rebuild.away.pop(self.identity(client), None)
        self.loop.rebuild.n_away = len(self.loop.rebuild.away)
        ck_ids_remove(&self.loop.client_ids, client)
        self.loop.tally.submitted[client] = 0
        self.loop.clients[client].used = False
        self.loop.n_clients -= 1
        list_remove(&self.loop.idle_links, &self.loop.idle, client)
        list_push(&self.loop.idle_links, &self.loop.vacant, client)
        fd = self.loop.clients[client].fd
        if self.loop.connections.get(fd, -1) == client:
            self.loop.connections[fd] = -1

    cdef connection_events(self):
        """The ROUTER's monitor: connections opened and ended (a client whose connection
        ended has left: nothing can reach its routing id again), handshakes refused."""
        cdef int32_t client
        cdef int rank
        for event, value in monitor_events(self.loop._monitor_socket):
            if event == zmq.EVENT_ACCEPTED:
                self.loop.connections[value] = -1
            elif event == zmq.EVENT_DISCONNECTED:
                client = self.loop.connections.pop(value, -1)
                rank = self.loop.engine_fds.pop(value, -1)
                if client >= 0:
                    self.end(self.identity(client), value)
                elif rank >= 0:
                    self.loop.faults.ended(rank)
                    self.end(self.engine_identity(rank), value)
            elif event & REFUSAL_EVENTS:
                self.loop.counters[COUNTER_AUTH_REFUSED] += 1

    cdef end(self, bytes identity, int fd):
        """A peer's connection ended: dealt with once what it sent before is handled."""
        self.loop.ended.append((identity, fd))
        self.loop.n_ended = len(self.loop.ended)

    cdef drop_ended(self):
        """Forget the clients whose connection ended (those still known by that routing
        id on that connection), and abort their requests; an engine whose connection
        ended is lost (Faults.lost: away for the grace, or gone)."""
        cdef int32_t client, rank
        cdef bytes identity
        ended, self.loop.ended = self.loop.ended, []
        self.loop.n_ended = 0
        for identity, fd in ended:
            client = ck_ids_find(&self.loop.client_ids, <const uint8_t*><const char*>identity,
                                 len(identity))
            rank = ck_ids_find(&self.loop.engine_ids, <const uint8_t*><const char*>identity,
                               len(identity))
            if client >= 0 and self.loop.clients[client].fd == fd:
                self.client_gone(client, False)
            elif rank >= 0 and self.loop.engines[rank].fd == fd and (
                self.loop.engines[rank].state != ENGINE_GONE
            ):
                self.loop.faults.lost(rank, GONE_DISCONNECTED)
        if self.loop.n_gone:
            self.loop.faults.settle()

    cdef goodbye(self, int32_t client):
        """DISCONNECT from a client: it closes; forget it and abort what it left."""
        if self.loop.answers.parse(protocol.DISCONNECT, client, HEADER_DISCONNECT) is not None:
            self.client_gone(client, False, True)

    cdef heartbeat(self, int32_t engine):
        message = self.loop.answers.parse(protocol.HEARTBEAT, -1, HEADER_HEARTBEAT)
        if message is None:
            return
        if self.loop.engines[engine].state != ENGINE_GONE:
            self.loop.engines[engine].heartbeats = True
            self.loop.engines[engine].last_heartbeat = monotonic()
            tally_heartbeat(&self.loop.tally, engine, message.pending, message.capacity)

    cdef disconnect(self, int32_t engine):
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self.loop.answers.parse(protocol.DISCONNECT, -1, HEADER_DISCONNECT) is None:
            return
        if self.loop.engines[engine].state != ENGINE_ALIVE:
            return
        if self.loop.pd is not None and self.loop.pd.seats[engine].seated:
            # a role engine leaves as #6675's do: its hops go on elsewhere now
            self.loop.faults.mark_gone(engine, GONE_DISCONNECTED)
            return
        self.loop.router.remove_rank(engine)
        self.loop.engines[engine].state = ENGINE_DRAINING
        self.loop.engines[engine].drain_deadline = monotonic() + self.loop.drain_timeout
        if self.loop.router.pending(engine) == 0:
            self.loop.engines[engine].state = ENGINE_GONE

    cdef client_gone(self, int32_t client, bint unreachable=True, bint closed=False):
        """A client that cannot be reached, or that left (DISCONNECT: ``closed``, or its
        connection ended): its requests are aborted at their engines and forgotten, and
        so is the client; but a rebuild client with a hold that did not close may come
        back (a blip): it is only away (_go_away)."""
        if not self.loop.clients[client].used:
            return
        self.loop.counters[COUNTER_CLIENTS_DEPARTED] += 1
        if unreachable:
            self.loop.counters[COUNTER_CLIENT_GONE] += 1
        if self.loop.clients[client].present and self.loop.clients[client].hold > 0 and not closed:
            self.loop.rebuild.go_away(client)
        else:
            self.drop_client(client)

    cdef drop_client(self, int32_t client):
        """Abort a client's requests at their engines, and forget them and it."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef ck_request* request
        cdef int rank
        cdef bint aborted
        order = self.loop.faults.in_order(-1, client, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                request = &self.loop.requests.pool[slot]
                if request.server_rid != order[i].server_rid:
                    continue
                rank = request.rank
                aborted = request.flags & FLAG_ABORTED
                self.loop._forget(slot)
                if aborted or rank < 0 or self.loop.engines[rank].state == ENGINE_GONE:
                    continue
                self.loop.control.abort_at_engine(rank, order[i].server_rid)
        finally:
            free(order)
        self.remove_client(client)

    cdef bytes identity(self, int32_t client):
        """A client's routing id."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.loop.client_ids, client, &n)
        return identity[:n]

    cdef bytes engine_identity(self, int rank):
        """An engine's routing id."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.loop.engine_ids, rank, &n)
        return identity[:n]
