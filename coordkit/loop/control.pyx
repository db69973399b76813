# A peer's rare messages: aborts, KV releases, control signals, stats
# (its declarations: control.pxd).


@cython.final
cdef class Control:
    """A peer's rare messages, dispatched; a client's: aborts, KV releases, the control
    signals, shutdown and stats."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    cdef from_client(self, int32_t client, int64_t header):
        if header == HEADER_ABORT_REQUEST:
            self.abort(client)
        elif header == HEADER_RELEASE_KV:
            self.release_kv(client)
        elif HEADER_PAUSE <= header <= HEADER_STOP_CUDA_PROFILER:
            self.signal(client, header)
        elif header == HEADER_SHUTDOWN:
            self.shutdown_signal(client)
        elif header == HEADER_STATS:
            self.stats_request(client)
        elif header == HEADER_REJOIN and self.loop.clients[client].rebuild:
            self.loop.rebuild.rejoin(client)
        elif header == HEADER_DISCONNECT:
            self.loop.peers.goodbye(client)
        else:
            self.loop.refusals.refuse(
                client, None, ERROR_UNKNOWN_HEADER, header, COUNTER_UNKNOWN_HEADER
            )

    cdef from_engine(self, int32_t engine, int64_t header):
        if header == HEADER_HEARTBEAT:
            self.loop.peers.heartbeat(engine)
        elif header == HEADER_ENGINE_HELLO:
            self.loop.peers.engine_hello(engine)
        elif header == HEADER_DISCONNECT:
            self.loop.peers.disconnect(engine)
        elif header == HEADER_HELD and self.loop.engines[engine].rebuild:
            self.loop.rebuild.held(engine)
        elif header == HEADER_REPLAYED and self.loop.engines[engine].rebuild:
            self.loop.engines[engine].handled += 1
            self.loop.rebuild.replayed(engine)
        elif header == HEADER_REGISTER_ROLE:
            self.loop.peers.register_role(engine)
        elif self.loop.pd is not None and self.loop.pd.messages.from_engine(engine, header):
            pass
        else:
            self.loop.counters[COUNTER_UNKNOWN_HEADER] += 1
            self.loop._log.warn("unknown_header", unknown_from_engine(
                header, engine, self.loop.engines[engine].format
            ))

    cdef abort(self, int32_t client):
        """ABORT_REQUEST: on to the owning engine, once, with the server id."""
        cdef int64_t slot
        cdef ck_request* request
        message = self.loop.answers.parse(protocol.ABORT_REQUEST, client, HEADER_ABORT_REQUEST)
        if message is None:
            return
        slot = ck_requests_find_client(&self.loop.requests, client, message.rid)
        awaited = (self.loop.peers.identity(client), message.rid) if slot < 0 else None
        if awaited is not None and awaited in self.loop.rebuild.awaiting:
            # REJOINed, no engine claimed it yet: aborted when one does (_held), else
            # ended at the window's end, never sent again (_end_rebuild)
            self.loop.counters[COUNTER_ABORTS] += 1
            self.loop.rebuild.aborting.add(awaited)
            return
        if slot < 0:
            self.loop.refusals.refuse(
                client,
                message.rid,
                ERROR_UNKNOWN_REQUEST,
                HEADER_ABORT_REQUEST,
                COUNTER_UNKNOWN_REQUEST,
            )
            return
        self.loop.counters[COUNTER_ABORTS] += 1
        request = &self.loop.requests.pool[slot]
        if request.rank < 0 and (self.loop.pd is None or not self.loop.pd.hops[slot].stage):
            self.loop._forget(slot)  # it waits: it ends here, no engine has it
            self.loop.failed[ERROR_ABORTED] += 1
            if not self.loop.refusals.send_error(client, message.rid, ERROR_ABORTED,
                                                 HEADER_ABORT_REQUEST, True,
                                                 never_ran(message.rid)):
                self.loop.peers.client_gone(client)
            return
        if request.flags & FLAG_ABORTED:
            return
        request.flags |= FLAG_ABORTED
        if self.loop.pd is not None and self.loop.pd.hops[slot].stage:
            self.loop.pd.abort(<uint32_t>slot)  # at the hop holding it, or ended waiting for one
            return
        self.abort_at_engine(request.rank, request.server_rid)

    cdef abort_at_engine(self, int rank, int64_t server_rid):
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if not engine_parses(self.loop.engines[rank].format, HEADER_ABORT_REQUEST):
            return
        abort = protocol.ABORT_REQUEST.pack(server_rid)
        if not self.loop.answers.send_frames(&self.loop.engine_ids, rank, abort):
            self.loop.faults.lost(rank, GONE_UNREACHABLE)

    cdef release_kv(self, int32_t client):
        message = self.loop.answers.parse(protocol.RELEASE_KV, client, HEADER_RELEASE_KV)
        if message is None:
            return
        self.loop.counters[COUNTER_RELEASE_KV] += 1
        if self.loop.pd is not None:  # its own requests' pins, at their prefill only
            self.loop.pd.client_release(client, message.rid)
        else:
            self.broadcast(HEADER_RELEASE_KV)

    cdef signal(self, int32_t client, int64_t header):
        """A control signal: through the state machine, then to every engine."""
        if self.loop.answers.parse(protocol.CONTROL[header], client, header) is None:
            return
        state = CONTROL_TRANSITIONS.get((self.loop.control_state, header))
        if state is None:
            self.loop.refusals.refuse(
                client, None, ERROR_INVALID_STATE, header, COUNTER_INVALID_CONTROL
            )
            return
        self.loop.counters[COUNTER_CONTROL] += 1
        self.loop.control_state = state
        self.broadcast(header)

    cdef shutdown_signal(self, int32_t client):
        if self.loop.answers.parse(protocol.SHUTDOWN, client, HEADER_SHUTDOWN) is not None:
            self.loop.stopping = True

    cdef stats_request(self, int32_t client):
        """STATS: stats(), and with {"metrics": 1} metrics() in it too, to a coordkit client."""
        message = self.loop.answers.parse(protocol.STATS, client, HEADER_STATS)
        if message is not None and self.loop.clients[client].coordkit:
            stats = self.loop.report.stats()
            if asks_metrics(message.asked):
                stats["metrics"] = self.loop.report.metrics()
            reply = protocol.STATS_REPLY.pack(packb(stats))
            self.loop.answers.send_frames(&self.loop.client_ids, client, reply)

    cdef broadcast(self, int64_t header):
        """The metadata frame as it came (refcounted copies) to every engine not gone."""
        cdef int rank
        for rank in range(self.loop.n_engines):
            if self.loop.engines[rank].state == ENGINE_GONE:
                continue
            if not engine_parses(self.loop.engines[rank].format, header):
                continue  # 0.19 has no KV transfer
            if self.loop._send_identity(&self.loop.engine_ids, rank) != 0:
                self.loop.faults.lost(rank, GONE_UNREACHABLE)
            else:
                traffic_count(&self.loop.traffic, SENT, header, self.loop._size(1))
                send_shared(self.loop.sock, &self.loop.message.parts[1], 0)
