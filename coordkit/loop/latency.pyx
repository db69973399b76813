# The latency histograms of measure_latency (loop/latency.pxd). Included by _loop_c.pyx.


cdef void latency_init(Latency* self):
    cdef int i
    for i, bound in enumerate(LATENCY_BUCKETS):
        self.bounds[i] = bound
    for i, bound in enumerate(DECISION_BUCKETS):
        self.decision_bounds[i] = bound
    self.countdown = DECISION_EVERY


cdef inline void histogram_observe(Histogram* self, const double* bounds,
                                   double seconds) noexcept nogil:
    """One duration into the histogram: the first bucket whose bound it fits."""
    cdef int i = 0
    while i < N_LATENCY_BUCKETS and seconds > bounds[i]:
        i += 1
    self.buckets[i] += 1
    self.sum += seconds


cdef inline void latency_observe(Latency* self, double seconds, bint first,
                                 bint final) noexcept nogil:
    """A reply ``seconds`` after its SUBMIT: into first_reply when it is its
    request's first, into final when it is final."""
    if first:
        histogram_observe(&self.first_reply, self.bounds, seconds)
    if final:
        histogram_observe(&self.final, self.bounds, seconds)


cdef inline void latency_handled(Latency* self, int stage, int64_t header) noexcept nogil:
    """A message handled in ``stage`` (from a client, or from an engine): a submission
    or an engine's replies is timed from when it was taken up (one clock read)."""
    cdef double now
    if stage == STAGE_REQUEST and not (
        header == HEADER_SUBMIT_REQUEST or header == HEADER_SUBMIT_REQUEST_WITH_KV
        or header == HEADER_SUBMIT_BATCH
    ):
        return
    if stage == STAGE_REPLY and not (
        header == HEADER_ENGINE_REPLY or header == HEADER_ENGINE_REPLY_PARTIAL
    ):
        return
    now = monotonic()
    histogram_observe(&self.coordinator[stage], self.bounds, now - self.since)
    self.since = now


cdef inline void latency_decided(Latency* self, double started) noexcept nogil:
    """The router chose, from ``started`` (its own clock read): one in DECISION_SAMPLE
    is timed."""
    self.countdown -= 1
    if self.countdown:
        return
    self.countdown = DECISION_EVERY
    histogram_observe(&self.decision, self.decision_bounds, monotonic() - started)


cdef tuple histogram_metrics(Histogram* self):
    """(count per bucket, sum of the seconds), as metrics() gives a histogram."""
    return list(self.buckets), self.sum


cdef dict latency_metrics(Latency* self):
    """Each histogram as metrics() gives it."""
    return {
        "final": histogram_metrics(&self.final),
        "first_reply": histogram_metrics(&self.first_reply),
        "coordinator_request": histogram_metrics(&self.coordinator[STAGE_REQUEST]),
        "coordinator_reply": histogram_metrics(&self.coordinator[STAGE_REPLY]),
        "routing_decision": histogram_metrics(&self.decision),
    }
