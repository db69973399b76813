# Multipart and single frame (loop/dialect.pxd): everything that translates
# between coordkit's multipart messages and Megatron-Core's single frames, 0.19's
# and main's. A request is read into an Inbound once (multipart_inbound,
# single_inbound, or kept_inbound for a re-send), carriers says which formats can
# carry it, and send_request puts it in the chosen engine's format; reply_carried
# and send_reply do the same for a reply and its client. Included by _loop_c.pyx.


cdef inline bint single_frame(int format) noexcept nogil:
    """Whether a peer of ``format`` speaks Megatron-Core's single frames."""
    return format == FORMAT_SINGLE_FRAME or format == FORMAT_SINGLE_FRAME_MAIN


cdef inline bint single_layout(int64_t header, uint32_t length) noexcept nogil:
    """Whether a single-frame SUBMIT has its header's fields: [20, rid, prompt, params]
    (0.19's), with multi_modal_data last (main's), or [24, rid, prompt, params,
    kv_meta, src_block_ids] (main's KV submission)."""
    if header == HEADER_SUBMIT_REQUEST:
        return length == 4 or length == 5
    return length == 6


cdef inline bint single_walks(uint32_t length, int n_multipart, int n_single) noexcept nogil:
    """Whether a single frame must be read whole to be carried: to be split for a
    multipart engine, or (main's five fields) to be cut to four for a 0.19 engine,
    which it may be only once its multi_modal_data is found nil."""
    return n_multipart > 0 or (length == 5 and n_single > 0)


cdef inline void multipart_inbound(
    Inbound* inbound, int64_t header, zmq_msg_t* payload, int n_payload,
    const uint8_t* params, size_t params_size, zmq_msg_t* hashes,
) noexcept nogil:
    """A multipart request: ``payload`` its payload frames (the prompt first), ``params``
    what follows the rid in its metadata (or a SUBMIT_BATCH entry's params), ``hashes``
    its block-hash frame or NULL."""
    memset(inbound, 0, sizeof(Inbound))
    inbound.header = header
    inbound.payload = payload
    inbound.n_payload = n_payload
    inbound.prompt = <const uint8_t*>zmq_msg_data(payload)
    inbound.prompt_size = zmq_msg_size(payload)
    inbound.params = params
    inbound.params_size = params_size
    inbound.tokens = ck_prompt_tokens(inbound.prompt, inbound.prompt_size)
    if hashes != NULL:
        inbound.hashes = <const uint8_t*>zmq_msg_data(hashes)
        inbound.n_hashes = zmq_msg_size(hashes) // BLOCK_HASH_SIZE


cdef inline void single_inbound(
    Inbound* inbound, const uint8_t* frame, size_t size, const ck_single_submit* single
) noexcept nogil:
    """A single-frame request, ``frame[:size]``, read as far as ``single`` says: to its
    rid (ck_read_single_head: the prompt runs to the frame's end), or whole
    (ck_read_single_submit: the prompt, the params and the last field found)."""
    memset(inbound, 0, sizeof(Inbound))
    inbound.header = single.header
    inbound.single = True
    inbound.length = single.length
    inbound.prompt = frame + single.prompt
    inbound.prompt_size = size - single.prompt
    if single.params:
        inbound.prompt_size = single.params - single.prompt
        inbound.params = frame + single.params
        inbound.params_size = single.extra - single.params
        inbound.extra = frame + single.extra
        inbound.extra_size = size - single.extra
    inbound.tokens = ck_prompt_tokens(inbound.prompt, inbound.prompt_size)


cdef inline bint text_only(Inbound* inbound) noexcept nogil:
    """A single-frame SUBMIT_REQUEST without multimodal data: 0.19's four fields, or
    main's five once read whole with its multi_modal_data nil."""
    return inbound.header == HEADER_SUBMIT_REQUEST and (
        inbound.length == 4 or (inbound.extra_size == 1 and inbound.extra[0] == MSGPACK_NIL)
    )


cdef inline void carriers(Inbound* inbound, bint single_engines) noexcept nogil:
    """Which formats can carry the request, once. A single frame goes to a main engine
    as it came; to a 0.19 engine as a SUBMIT_REQUEST of four fields (main's nil
    multi_modal_data dropped); to a multipart engine once its params were found (it
    splits there), with no multimodal data. A multipart request goes to a
    single-frame engine (when there is one) as [20, rid, prompt, params], so only a
    SUBMIT_REQUEST whose prompt is one str or array and whose params are a map."""
    if inbound.single:
        inbound.carriers = 1 << FORMAT_SINGLE_FRAME_MAIN
        if text_only(inbound):
            inbound.carriers |= 1 << FORMAT_SINGLE_FRAME
        if inbound.params != NULL and (
            inbound.header == HEADER_SUBMIT_REQUEST_WITH_KV or text_only(inbound)
        ):
            inbound.carriers |= 1 << FORMAT_MULTIPART
        return
    inbound.carriers = 1 << FORMAT_MULTIPART
    if (
        single_engines
        and inbound.header == HEADER_SUBMIT_REQUEST
        and ck_check_prompt(inbound.prompt, inbound.prompt_size) == CK_OK
        and ck_check_map(inbound.params, inbound.params_size) == CK_OK
    ):
        inbound.carriers |= 1 << FORMAT_SINGLE_FRAME | 1 << FORMAT_SINGLE_FRAME_MAIN


cdef inline bint carries(Inbound* inbound, int format) noexcept nogil:
    """Whether an engine of ``format`` can take the request (carriers)."""
    return inbound.carriers >> format & 1


cdef inline void rewrite_meta(zmq_msg_t* out, Inbound* inbound, int64_t server_rid) noexcept nogil:
    """A multipart request's metadata with ``server_rid``, in a new message:
    ``[header, server_rid, <params>]``, an array of 2 + its payload frames."""
    cdef ck_submit head
    head.header = inbound.header
    head.length = 2 + inbound.n_payload
    zmq_msg_init_size(out, ck_submit_size(&head, server_rid, inbound.params_size))
    ck_write_submit(
        <uint8_t*>zmq_msg_data(out), &head, server_rid, inbound.params, inbound.params_size
    )


cdef size_t send_head(void* sock, ck_buffer_pool* buffers, int64_t header, uint32_t length,
                      int64_t rid, const uint8_t* rest, size_t rest_size, int flags) noexcept nogil:
    """``[header, rid, <rest>]`` (an array of ``length``) as one new frame, a large one in
    a buffer of ``buffers``; its size."""
    cdef ck_submit head
    cdef zmq_msg_t msg
    cdef size_t n
    head.header = header
    head.length = length
    n = ck_submit_size(&head, rid, rest_size)
    ck_buffer_msg(buffers, &msg, n)
    ck_write_submit(<uint8_t*>zmq_msg_data(&msg), &head, rid, rest, rest_size)
    if zmq_msg_send(&msg, sock, flags) < 0:
        zmq_msg_close(&msg)
    return n


cdef size_t send_copy(void* sock, ck_buffer_pool* buffers, const uint8_t* data, size_t size,
                      int flags) noexcept nogil:
    """A copy of ``data[:size]`` as one frame, a large one in a buffer of ``buffers``."""
    cdef zmq_msg_t msg
    ck_buffer_msg(buffers, &msg, size)
    memcpy(zmq_msg_data(&msg), data, size)
    if zmq_msg_send(&msg, sock, flags) < 0:
        zmq_msg_close(&msg)
    return size


cdef size_t send_single(void* sock, ck_buffer_pool* buffers, Inbound* inbound,
                        int64_t server_rid, int format) noexcept nogil:
    """A single-frame request in an engine's format; the bytes sent. To a main engine
    the rest behind the new head as it came; to a 0.19 engine its four fields; to a
    multipart engine split at the field boundaries: ``[header, server_rid, <params>]``,
    the prompt and (a KV submission) src_block_ids. Each a copy."""
    cdef size_t n
    cdef bint kv = inbound.header == HEADER_SUBMIT_REQUEST_WITH_KV
    if format == FORMAT_SINGLE_FRAME_MAIN:
        return send_head(sock, buffers, inbound.header, inbound.length, server_rid,
                         inbound.prompt,
                         inbound.prompt_size + inbound.params_size + inbound.extra_size, 0)
    if format == FORMAT_SINGLE_FRAME:
        return send_head(sock, buffers, inbound.header, 4, server_rid, inbound.prompt,
                         inbound.prompt_size + inbound.params_size, 0)
    n = send_head(sock, buffers, inbound.header, 4 if kv else 3, server_rid, inbound.params,
                  inbound.params_size, ZMQ_SNDMORE)
    n += send_copy(sock, buffers, inbound.prompt, inbound.prompt_size, ZMQ_SNDMORE if kv else 0)
    if kv:
        n += send_copy(sock, buffers, inbound.extra, inbound.extra_size, 0)
    return n


cdef inline size_t send_request(void* sock, ck_buffer_pool* buffers, Inbound* inbound,
                                int64_t server_rid, int format) noexcept nogil:
    """A request's frames after its engine's routing id, in the engine's ``format``; the
    bytes sent. Multipart to multipart: the metadata and the payload frames as
    themselves. Otherwise the prompt and the params spliced into the engine's format
    (a single frame behind a new head, or split at the field boundaries): a copy."""
    cdef size_t size
    cdef zmq_msg_t msg
    cdef int i
    if inbound.single:
        return send_single(sock, buffers, inbound, server_rid, format)
    if single_frame(format):  # [20, server_rid, <prompt>, <params>]
        size = ck_single_submit_size(
            HEADER_SUBMIT_REQUEST, server_rid, inbound.prompt_size, inbound.params_size
        )
        ck_buffer_msg(buffers, &msg, size)
        ck_write_single_submit(
            <uint8_t*>zmq_msg_data(&msg), HEADER_SUBMIT_REQUEST, server_rid, inbound.prompt,
            inbound.prompt_size, inbound.params, inbound.params_size,
        )
        if zmq_msg_send(&msg, sock, 0) < 0:
            zmq_msg_close(&msg)
        return size
    size = zmq_msg_size(inbound.meta)
    for i in range(inbound.n_payload):
        size += zmq_msg_size(&inbound.payload[i])
    send_msg(sock, inbound.meta, ZMQ_SNDMORE)
    for i in range(inbound.n_payload):
        send_msg(sock, &inbound.payload[i], ZMQ_SNDMORE if i + 1 < inbound.n_payload else 0)
    return size


cdef inline bint engine_parses(int format, int64_t header) noexcept nogil:
    """Whether an engine of ``format`` parses a message of ``header`` from the
    coordinator: a 0.19 engine has no ABORT_REQUEST and no KV transfer."""
    return format != FORMAT_SINGLE_FRAME or (
        header != HEADER_ABORT_REQUEST and header != HEADER_RELEASE_KV
    )


cdef inline int reply_carried(int format, int64_t header, const uint8_t* body,
                              size_t size) noexcept nogil:
    """Whether a client of ``format`` takes a reply (a Carried): a Megatron client takes
    maps, each ``[header, client_rid, <map>]``; a 0.19 client finals only."""
    if not single_frame(format):
        return CARRIED
    if header != HEADER_ENGINE_REPLY and format != FORMAT_SINGLE_FRAME_MAIN:
        return NOT_SENT
    return CARRIED if ck_check_map(body, size) == CK_OK else NOT_A_MAP


cdef inline size_t send_reply(void* sock, ck_buffer_pool* buffers, int format, int64_t header,
                              int64_t client_rid, const uint8_t* body, size_t size,
                              zmq_msg_t* message) noexcept nogil:
    """A reply's frames after its client's routing id, in the client's ``format``: one
    ``[header, client_rid, <map>]``, or ``[header, client_rid]`` and the body (as
    ``message`` itself when given, else a copy of ``body``); the bytes sent."""
    cdef uint8_t out[CK_HEADER_INT_MAX]
    cdef size_t n
    if single_frame(format):
        return send_head(sock, buffers, header, 3, client_rid, body, size, 0)
    n = ck_write_header_int(out, header, client_rid)
    send_bytes(sock, out, n, ZMQ_SNDMORE)
    if message != NULL:
        send_msg(sock, message, 0)
    else:
        send_bytes(sock, body, size, 0)
    return n + size
