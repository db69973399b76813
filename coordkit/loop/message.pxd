# The message at hand (its functions: message.pyx). Included by _loop_c.pxd.

cdef struct Message:
    # Its frames, frame 0 the sender's routing id: room for MAX_PARTS messages,
    # reserved once and touched only as used (a zmq_msg_t is never moved by copying).
    zmq_msg_t* parts
    int n_parts
    bint oversized  # it had more than MAX_PARTS frames: malformed
    # What was read of its metadata: the entries of a reply batch (multipart or
    # single frame), of a SUBMIT_BATCH; the block hashes computed from its prompt.
    ck_entry* entries
    size_t entries_capacity
    ck_single_entry* single_entries
    size_t single_entries_capacity
    ck_batch_entry* batch_entries
    uint32_t batch_entries_capacity  # grown by the codec (ck_read_batch_into)
    uint8_t* hashes
    size_t hashes_capacity  # in hashes of BLOCK_HASH_SIZE bytes
