# Multipart and single frame (its functions: dialect.pyx). Included by _loop_c.pxd.

cdef struct Inbound:
    # A request, new or kept, to be put in the format of the engine chosen for it.
    int64_t header
    bint single  # it came as one frame (Megatron-Core's: 0.19's or main's)
    uint32_t length  # single frame: its fields, 4, 5 or 6 (ck_single_submit.length)
    zmq_msg_t* meta  # multipart: its metadata with the server id, a new message
    # The messages it came in after the metadata: multipart its payload frames (the
    # prompt first), single frame the frame itself.
    zmq_msg_t* payload
    int n_payload
    # Its prompt, and what follows the rid in its metadata: the params (and a KV
    # submission's kv_meta). Single frame: the params once found (else NULL: the
    # prompt then runs to the frame's end), then its last field, extra: main's
    # multi_modal_data or src_block_ids (extra_size 0 for 0.19's four fields).
    const uint8_t* prompt
    size_t prompt_size
    const uint8_t* params
    size_t params_size
    const uint8_t* extra
    size_t extra_size
    const uint8_t* hashes  # its block hashes, n_hashes of them, or NULL
    size_t n_hashes
    zmq_msg_t* hash_msg  # the frame they came in, or NULL: forwarded to a rebuild engine
    uint64_t tokens
    bint batched  # an entry of a SUBMIT_BATCH: a batched engine takes it later
    int carriers  # a bit per PeerFormat whose engines can take it (carriers)
    int priority  # its QoS, as its client sent it (ck_read_qos): never sent on
    int64_t deadline_ms


cdef struct Origin:
    # What a rebuild engine is told of a request after its payload (its trailer):
    # the client's request id, the client's routing id (NULL: a client that cannot
    # rejoin), and its block-hash frame to forward, or NULL.
    int64_t client_rid
    const uint8_t* client_id
    size_t client_id_size
    zmq_msg_t* hashes


cdef enum Carried:  # whether a client's format carries a reply (reply_carried)
    CARRIED
    NOT_SENT  # a partial to a 0.19 client, which takes finals only
    NOT_A_MAP  # a body that is not a map, to a Megatron client: counted, dropped
