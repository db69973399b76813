# Each engine's and each client's tally (its functions: tally.pyx). Included by _loop_c.pxd.

cdef struct EngineTally:  # one rank's, since its routing id took the rank
    # Its requests (kept with measure_latency): sent to it (re-sent ones too), their
    # finals forwarded, and those lost with it or ended with an ERROR while it held them.
    uint64_t routed
    uint64_t completed
    uint64_t failed
    # Its errors: reply entries of the wrong shape, entries for requests it does not own
    # (late, or wrong), and the times it was declared gone.
    uint64_t malformed_entries
    uint64_t unknown_request
    uint64_t gone
    bint reported  # it sent a HEARTBEAT: the last one's [91, pending, capacity]
    int64_t reported_pending
    int64_t reported_capacity


cdef struct Tally:
    EngineTally* engines  # by rank
    uint64_t* submitted  # by client index: the requests it submitted (measure_latency)
    # engine_histograms: by rank, its time to first reply and its request duration
    Histogram* first_reply
    Histogram* final
