# The kept-prompt store (loop/kept.pxd): with keep_prompts, what re-sends a
# request whose engine died before it produced anything. Included by _loop_c.pyx.


cdef Kept* keep(zmq_msg_t* meta, zmq_msg_t* prompt, bint single,
                uint32_t* small_shared) noexcept nogil:
    """What re-sends a request, or NULL when memory is short (it is then not kept).

    A prompt of COPY_BELOW bytes or more has a buffer of its own: shared by
    refcount. A smaller one is shared too while fewer than SHARED_SMALL_MAX of
    the loop's are (``small_shared`` counts them): a refcounted copy of a small
    frame pins the whole receive buffer libzmq decoded it from, so past that
    bound it is copied (pyzmq's copy-below-a-threshold rule), which costs a
    malloc, a memcpy and the pages they touch on every request.
    """
    cdef size_t meta_size = 0 if meta == NULL else zmq_msg_size(meta)
    cdef size_t prompt_size = zmq_msg_size(prompt)
    cdef bint small = prompt_size < COPY_BELOW
    cdef bint shared = not small or small_shared[0] < SHARED_SMALL_MAX
    cdef uint8_t* data
    cdef Kept* kept = <Kept*>malloc(
        sizeof(Kept) + meta_size + (sizeof(zmq_msg_t) if shared else prompt_size)
    )
    if kept == NULL:
        return NULL
    kept.small = small and shared
    small_shared[0] += kept.small
    kept.meta_size = meta_size
    kept.single = single
    data = <uint8_t*>(kept + 1)
    if shared:
        kept.prompt_size = UINT32_MAX
        zmq_msg_init(<zmq_msg_t*>data)
        zmq_msg_copy(<zmq_msg_t*>data, prompt)
        if meta_size:
            memcpy(data + sizeof(zmq_msg_t), zmq_msg_data(meta), meta_size)
    else:
        kept.prompt_size = prompt_size
        if meta_size:
            memcpy(data, zmq_msg_data(meta), meta_size)
        memcpy(data + meta_size, zmq_msg_data(prompt), prompt_size)
    return kept


cdef inline zmq_msg_t* kept_shared(Kept* kept) noexcept nogil:
    """The message sharing the kept prompt, or NULL when it was copied."""
    return <zmq_msg_t*>(kept + 1) if kept.prompt_size == UINT32_MAX else NULL


cdef inline const uint8_t* kept_meta(Kept* kept) noexcept nogil:
    cdef uint8_t* data = <uint8_t*>(kept + 1)
    return data + sizeof(zmq_msg_t) if kept_shared(kept) != NULL else data


cdef inline const uint8_t* kept_prompt(Kept* kept, size_t* size) noexcept nogil:
    """The kept prompt's bytes (for a single frame: the whole frame)."""
    cdef zmq_msg_t* shared = kept_shared(kept)
    if shared != NULL:
        size[0] = zmq_msg_size(shared)
        return <const uint8_t*>zmq_msg_data(shared)
    size[0] = kept.prompt_size
    return <uint8_t*>(kept + 1) + kept.meta_size


cdef void release_kept(void* kept, uint32_t* small_shared) noexcept nogil:
    if kept != NULL and kept_shared(<Kept*>kept) != NULL:
        zmq_msg_close(kept_shared(<Kept*>kept))
        small_shared[0] -= (<Kept*>kept).small
    free(kept)


cdef void kept_inbound(Kept* kept, Inbound* inbound, zmq_msg_t* messages,
                       int n_multipart, int n_single) noexcept nogil:
    """A kept request as an Inbound, to be re-sent as a new one is sent: a single frame
    read again (whole when the engines of each format, ``n_multipart`` and
    ``n_single``, say it must be: single_walks), or its metadata (the server id in it
    already) and its prompt as two new messages in ``messages`` (the prompt shared
    again, or copied). The caller closes both."""
    cdef ck_single_submit single
    cdef ck_submit submit
    cdef size_t size
    cdef const uint8_t* prompt = kept_prompt(kept, &size)
    cdef const uint8_t* meta = kept_meta(kept)
    cdef zmq_msg_t* shared = kept_shared(kept)
    if kept.single:
        zmq_msg_init(&messages[0])
        zmq_msg_init(&messages[1])
        ck_read_single_head(prompt, size, &single)
        if single_walks(single.length, n_multipart, n_single) and ck_read_single_submit(
            prompt, size, &single
        ) != CK_OK:
            single.params = 0
        single_inbound(inbound, prompt, size, &single)
        return
    zmq_msg_init_size(&messages[0], kept.meta_size)
    memcpy(zmq_msg_data(&messages[0]), meta, kept.meta_size)
    if shared != NULL:
        zmq_msg_init(&messages[1])
        zmq_msg_copy(&messages[1], shared)
    else:
        zmq_msg_init_size(&messages[1], size)
        memcpy(zmq_msg_data(&messages[1]), prompt, size)
    ck_read_submit(meta, kept.meta_size, &submit)
    multipart_inbound(inbound, HEADER_SUBMIT_REQUEST, &messages[1], 1, meta + submit.offset,
                      kept.meta_size - submit.offset, NULL)
    inbound.meta = &messages[0]
