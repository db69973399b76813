# What the loop reports: stats() and metrics() (its declarations: report.pxd).


@cython.final
cdef class Report:
    """What the loop reports: stats() and metrics(), read from its tables and counters."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    def stats(self) -> dict:
        cdef int rank
        cdef uint32_t client
        cdef int64_t least = 0  # requests in flight of the last of the busiest so far
        cdef size_t n
        cdef const uint8_t* identity
        cdef Engine* engine
        cdef double now = monotonic()
        engines = []
        for rank in range(self.loop.n_engines):
            identity = ck_ids_get(&self.loop.engine_ids, rank, &n)
            engine = &self.loop.engines[rank]
            engines.append((
                rank, identity[:n], engine.state, self.loop.router.pending(rank),
                max(engine.quarantined_until - now, 0.0), engine.failures, engine.last_failure,
                *tally_engine(&self.loop.tally, rank, self.loop.measure_latency),
                now - engine.last_heartbeat if engine.heartbeats else None,
            ))
        clients = []  # the busiest so far, pruned as it grows
        for client in range(self.loop.clients_used):
            if not self.loop.clients[client].used or self.loop.clients[client].inflight < least:
                continue
            clients.append((
                self.loop.peers.identity(client), self.loop.clients[client].inflight,
                self.loop.tally.submitted[client] if self.loop.measure_latency else None,
                self.loop.clients[client].rebuild, not self.loop.clients[client].present,
            ))
            if len(clients) == 2 * STATS_CLIENTS:
                clients = busiest(clients)
                least = clients[-1][1]
        result = stats_map(
            implementation=self.loop.implementation,
            policy=self.loop.router.policy,
            epoch=self.loop.epoch,
            messages=self.loop.messages,
            inflight=self.loop.requests.live,
            clients=self.loop.n_clients - self.loop.rebuild.absent(),
            control_state=self.loop.control_state,
            counters=[self.loop.counters[i] for i in range(N_COUNTERS)],
            engines=engines,
            queue=queue_stats(&self.loop.queue),
            busiest_clients=busiest(clients),
        )
        if DEBUG:
            result["debug"] = {"polls": self.loop.debug_polls}
        if self.loop.pd is not None:
            result["pd"] = self.loop.pd.stats()
        if self.loop.kv is not None:
            result["kv_events"] = _kvevents.kv_stats(
                self.loop.kv.stats(), self.loop.kv_events.stats()
            )
        return result

    def metrics(self) -> dict:
        """Traffic by header and direction, outcomes by error code, latencies."""
        return metrics_map(
            traffic=traffic_metrics(&self.loop.traffic),
            failed=list(self.loop.failed),
            refused=list(self.loop.refused),
            latency=latency_metrics(&self.loop.latency) if self.loop.measure_latency else None,
            prefix=self.loop.router.prefix_counts,
            queue=queue_metrics(&self.loop.queue),
            engine_latency=tally_latency(&self.loop.tally, self.loop.n_engines)
            if self.loop.tally.final != NULL else None,
        )
