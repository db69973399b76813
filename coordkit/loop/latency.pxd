# The latency histograms of measure_latency (their functions: latency.pyx). Included by _loop_c.pxd.

cdef struct Histogram:
    uint64_t buckets[N_LATENCY_BUCKETS + 1]  # by bound of LATENCY_BUCKETS, and the rest
    double sum  # of the seconds


cdef struct Latency:  # from SUBMIT to the final reply, and to the first (partial or final)
    double bounds[N_LATENCY_BUCKETS]
    Histogram final
    Histogram first_reply
