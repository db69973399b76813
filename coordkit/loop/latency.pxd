# The latency histograms of measure_latency (their functions: latency.pyx). Included by _loop_c.pxd.

cdef struct Histogram:
    uint64_t buckets[N_LATENCY_BUCKETS + 1]  # by bound of LATENCY_BUCKETS, and the rest
    double sum  # of the seconds


cdef enum:  # a message's stage: its way through the coordinator (coordinator_seconds)
    STAGE_REQUEST  # a client's submission, to its last request sent on
    STAGE_REPLY  # an engine's replies, to the last one sent to its client


cdef struct Latency:
    double bounds[N_LATENCY_BUCKETS]
    double decision_bounds[N_LATENCY_BUCKETS]  # DECISION_BUCKETS: finer
    Histogram final  # from SUBMIT to the final reply
    Histogram first_reply  # and to the first (partial or final)
    Histogram coordinator[2]  # a message's time in the coordinator, by stage
    Histogram decision  # the router's choice, one in DECISION_SAMPLE
    uint32_t countdown  # to the next decision timed
    # When the message at hand was taken up, at the latest: the poll's wake, or the
    # last timed message's end (the next one was received right after it).
    double since
