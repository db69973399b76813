# A peer's rare messages: aborts, KV releases, control signals, stats (its methods: control.pyx).
# Included by _loop_c.pxd.

cdef class Control:
    cdef Loop loop  # whose tables it works on

    cdef from_client(self, int32_t client, int64_t header)
    cdef from_engine(self, int32_t engine, int64_t header)
    cdef abort(self, int32_t client)
    cdef abort_at_engine(self, int rank, int64_t server_rid)
    cdef release_kv(self, int32_t client)
    cdef signal(self, int32_t client, int64_t header)
    cdef shutdown_signal(self, int32_t client)
    cdef stats_request(self, int32_t client)
    cdef broadcast(self, int64_t header)
