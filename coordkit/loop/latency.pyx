# The latency histograms of measure_latency (loop/latency.pxd). Included by _loop_c.pyx.


cdef void latency_init(Latency* self):
    cdef int i
    for i, bound in enumerate(LATENCY_BUCKETS):
        self.bounds[i] = bound


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


cdef dict latency_metrics(Latency* self):
    """Each histogram as metrics() gives it: (count per bucket, sum of the seconds)."""
    return {
        "final": (list(self.final.buckets), self.final.sum),
        "first_reply": (list(self.first_reply.buckets), self.first_reply.sum),
    }
