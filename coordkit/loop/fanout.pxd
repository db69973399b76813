# One batch fan-out for both directions (its functions: fanout.pyx). Included by _loop_c.pxd.

cdef struct Batched:  # an entry of the batch at hand bound for a peer that takes batches
    int32_t to  # the peer: an engine's rank or a client's index; -1 once sent or left out
    int64_t rid  # the id it goes under: its server id to an engine, its client's to a client
    const uint8_t* tail  # what follows the id in its entry: its params, or the final flag
    size_t tail_size
    zmq_msg_t* frame  # its frame (prompt or body), sent as the message itself
    const uint8_t* data  # or, when frame is NULL, a copy of data[:size] (a 0.19 reply)
    size_t size
    bint trailed  # to a rebuild engine: its trailer follows the frame
    Origin origin


cdef struct Fanout:
    Batched* entries  # in the order they were routed
    size_t capacity
    uint32_t n
    uint8_t* head  # an outgoing batch's metadata, written before it is sent
    size_t head_capacity
    size_t head_needed  # what the entries reserved may need of it
