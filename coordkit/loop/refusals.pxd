# The refusals and terminal errors (its methods: refusals.pyx).
# Included by _loop_c.pxd.

cdef class Refusals:
    cdef Loop loop  # whose tables it works on

    cdef fail_request(self, uint32_t slot, int code, int64_t header)
    cdef time_out(self, uint32_t slot)
    cdef no_engines_left(self)
    cdef reject_entry(self, int32_t engine, object rid, int code, int64_t header)
    cdef bint send_error(self, int32_t client, object rid, int code, int64_t header,
                         bint ends=*, str text=*)
    cdef refuse(self, int32_t client, object rid, int code, int64_t header, int counter,
                bint ends=*)
    cdef malformed(self, int32_t client, object rid, int64_t header, str detail)
    cdef malformed_batch(self, int32_t client, uint32_t count, str detail)
    cdef shut_down(self)
