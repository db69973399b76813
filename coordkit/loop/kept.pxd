# The kept-prompt store (its functions: kept.pyx). Included by _loop_c.pxd.

cdef struct Kept:
    # One allocation per kept request: this head, then either the metadata bytes
    # and the prompt's bytes, or (prompt_size == UINT32_MAX) a zmq_msg_t
    # sharing the prompt, then the metadata bytes. A request that came as a
    # single frame keeps that frame whole as its "prompt", with no metadata.
    uint32_t meta_size
    uint32_t prompt_size
    bint single
    bint small  # shared below COPY_BELOW: one of the loop's small_shared
