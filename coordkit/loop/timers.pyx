# The loop's timers, every TICK (its declarations: timers.pxd).


@cython.final
cdef class Timers:
    """The loop's timers, every TICK: engines whose drain or heartbeat timed out, the grace
    and the quarantines over, requests past request_timeout, the rebuild's window, and
    what that left settled."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    cdef void tick(self, double now) noexcept nogil:
        """The timers: engines whose drain or heartbeat timed out declared gone, the
        requests in flight longer than request_timeout ended, the rebuild window
        closed, HANDLED to rebuild engines, and what that left settled. The GIL is
        taken only for what is due."""
        cdef int rank
        cdef int64_t slot
        cdef double deadline = now - self.loop.request_timeout
        for rank in range(self.loop.n_engines):
            if self.loop.engines[rank].state == ENGINE_GONE:
                continue
            if self.loop.engines[rank].state == ENGINE_DRAINING:
                if now >= self.loop.engines[rank].drain_deadline:
                    self.loop.faults.mark_gone(rank, GONE_DRAIN_TIMED_OUT)
            elif (
                self.loop.heartbeat_timeout
                and self.loop.engines[rank].heartbeats
                and now - self.loop.engines[rank].last_heartbeat > self.loop.heartbeat_timeout
            ):
                self.loop.faults.mark_gone(rank, GONE_NO_HEARTBEAT)
        self.loop.faults.tick(now)
        if self.loop.pd is not None:
            with gil:
                self.loop.pd.tick(now)
        # The oldest first: only the requests that are due are touched.
        if self.loop.request_timeout and self.oldest_submitted_before(deadline):
            with gil:
                while self.oldest_submitted_before(deadline):
                    self.loop.refusals.time_out(self.loop.deadlines.oldest)
        cdef Queue* queue = &self.loop.queue
        if queue.n_due and queue.entries[queue.due[0]].deadline <= now:
            with gil:
                while True:
                    slot = queue_expired(&self.loop.queue, now)
                    if slot < 0:
                        break
                    self.loop.counters[COUNTER_TIMED_OUT] += 1  # its own deadline, while it waited
                    self.loop.refusals.fail_request(slot, ERROR_TIMED_OUT, HEADER_SUBMIT_REQUEST)
        if self.loop.rebuild.rebuilding and now >= self.loop.rebuild.until:
            with gil:
                self.loop.rebuild.end_window()
        if self.loop.rebuild.n_deferred and (
            self.loop.router.n_members or not self.loop.rebuild.rebuilding
        ):
            with gil:
                self.loop.rebuild.resend_deferred()
        if self.loop.rebuild.n_away or self.loop.rebuild.n_holding:
            with gil:
                self.loop.rebuild.end_holds(now)
                self.loop.rebuild.mark_holding()
        self.loop.rebuild.acknowledge()
        if self.loop.n_gone:
            with gil:
                self.loop.faults.settle()
        if self.loop.dispatch_due or self.loop.queue.depth:  # an engine back from quarantine, ...
            self.loop._dispatch()
        if self.loop.traces.n_ending:
            self.loop.traces.end()

    cdef inline bint oldest_submitted_before(self, double deadline) noexcept nogil:
        return self.loop.deadlines.oldest != UINT32_MAX and (
            self.loop.submitted[self.loop.deadlines.oldest] < deadline
        )
