# Each engine's and each client's tally (loop/tally.pxd). Included by _loop_c.pyx.


cdef bint tally_init(Tally* self, int max_engines, int max_clients,
                     bint histograms) noexcept nogil:
    """Room for every rank and client index (calloc: pages never reached cost no
    memory); the histograms by rank only with ``histograms``. False when memory is short."""
    self.engines = <EngineTally*>calloc(max_engines, sizeof(EngineTally))
    self.submitted = <uint64_t*>calloc(max_clients, sizeof(uint64_t))
    if histograms:
        self.first_reply = <Histogram*>calloc(max_engines, sizeof(Histogram))
        self.final = <Histogram*>calloc(max_engines, sizeof(Histogram))
        if self.first_reply == NULL or self.final == NULL:
            return False
    return self.engines != NULL and self.submitted != NULL


cdef void tally_free(Tally* self) noexcept nogil:
    free(self.engines)
    free(self.submitted)
    free(self.first_reply)
    free(self.final)


cdef inline void tally_reset(Tally* self, int rank) noexcept nogil:
    """Another routing id takes ``rank``: its counts start from nothing."""
    memset(&self.engines[rank], 0, sizeof(EngineTally))
    if self.final != NULL:
        memset(&self.first_reply[rank], 0, sizeof(Histogram))
        memset(&self.final[rank], 0, sizeof(Histogram))


cdef inline void tally_replied(Tally* self, const double* bounds, int rank, double seconds,
                               bint first, bint final) noexcept nogil:
    """A reply from ``rank``, ``seconds`` after its SUBMIT (measure_latency): a final
    completes a request; into its histograms when it has them."""
    self.engines[rank].completed += final
    if self.final == NULL:
        return
    if first:
        histogram_observe(&self.first_reply[rank], bounds, seconds)
    if final:
        histogram_observe(&self.final[rank], bounds, seconds)


cdef inline void tally_failed(Tally* self, int rank) noexcept nogil:
    """A request ``rank`` held ended without its final from it (-1: none held it)."""
    if rank >= 0:
        self.engines[rank].failed += 1


cdef inline void tally_heartbeat(Tally* self, int rank, int64_t pending,
                                 int64_t capacity) noexcept nogil:
    self.engines[rank].reported = True
    self.engines[rank].reported_pending = pending
    self.engines[rank].reported_capacity = capacity


cdef tuple tally_engine(Tally* self, int rank, bint measured):
    """Its (requests or None, errors, reported or None), as stats_map takes them."""
    cdef EngineTally* tally = &self.engines[rank]
    return (
        (tally.routed, tally.completed, tally.failed) if measured else None,
        (tally.malformed_entries, tally.unknown_request, tally.gone),
        (tally.reported_pending, tally.reported_capacity) if tally.reported else None,
    )


cdef list tally_latency(Tally* self, int n_engines):
    """(rank, its histograms as metrics() gives them) per rank (engine_histograms)."""
    cdef int rank
    return [
        (rank, {
            "final": histogram_metrics(&self.final[rank]),
            "first_reply": histogram_metrics(&self.first_reply[rank]),
        })
        for rank in range(n_engines)
    ]
