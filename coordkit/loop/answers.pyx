# The rare paths' frames as Python bytes: read, parsed, sent (its declarations: answers.pxd).


@cython.final
cdef class Answers:
    """The rare paths' frames as Python bytes: the message at hand read and parsed by its spec,
    answers sent to a peer or to the sender, and counted."""

    def __cinit__(self, Loop loop):
        self.loop = loop

    cdef object parse(self, object spec, int32_t client, int64_t header):
        """The message parsed by ``spec``, or None after handling it as malformed."""
        try:
            return spec.parse(self.frames())
        except ProtocolError as exc:
            self.loop.refusals.malformed(client, exc.rid, header, str(exc))
            return None

    cdef replace(self, int part, bytes body):
        """Replace a reply body frame by ``body`` (detokenized, or continuing a stream)."""
        zmq_msg_close(&self.loop.message.parts[part])
        zmq_msg_init_size(&self.loop.message.parts[part], len(body))
        memcpy(zmq_msg_data(&self.loop.message.parts[part]), <const char*>body, len(body))

    cdef const uint8_t* held_body(self, bytes body, size_t* size):
        """A frame made on the way (a reply body detokenized or continuing a stream, a
        prefill hop's params), its size in ``size``, alive until the batches are sent
        (in held_bodies)."""
        self.loop.held_bodies.append(body)
        self.loop.holds_bodies = True
        size[0] = len(body)
        return <const uint8_t*><const char*>body

    cdef bytes detokenized(self, const uint8_t* body, size_t size):
        """A reply body with its generated_text; on failure the body as it is."""
        cdef bytes original = (<const char*>body)[:size]
        try:
            result = detokenize(self.loop._detokenizer, original)
        except Exception as exc:  # a bad body or a failing detokenizer
            self.loop.counters[COUNTER_DETOKENIZE_ERRORS] += 1
            self.loop._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return original
        self.loop.counters[COUNTER_DETOKENIZED] += 1
        return result

    cdef list frames(self):
        """The current message's frames after the routing id, as bytes."""
        return [self.frame_bytes(part) for part in range(1, self.loop.message.n_parts)]

    cdef bytes frame_bytes(self, int part):
        return (<const char*>self.loop._data(part))[:self.loop._size(part)]

    cdef bint send_frames(self, ck_ids* table, int32_t index, list frames):
        """Send ``frames`` (bytes) to a peer; False when it is gone."""
        cdef bytes frame
        cdef Py_ssize_t i, last = len(frames) - 1
        if self.loop._send_identity(table, index) != 0:
            return False
        self.count_frames_out(frames)
        for i in range(last + 1):
            frame = frames[i]
            send_bytes(
                self.loop.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i < last else 0
            )
        return True

    cdef reply_to_sender(self, list frames):
        """Send ``frames`` to the sender of the current message, in no table perhaps."""
        cdef bytes frame
        cdef Py_ssize_t i, last = len(frames) - 1
        if send_bytes(self.loop.sock, self.loop._data(0), self.loop._size(0), ZMQ_SNDMORE) != 0:
            return
        self.count_frames_out(frames)
        for i in range(last + 1):
            frame = frames[i]
            send_bytes(
                self.loop.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i < last else 0
            )

    cdef count_frames_out(self, list frames):
        cdef bytes first = frames[0]
        cdef int64_t header
        cdef uint32_t length
        cdef size_t end, size = 0
        if ck_read_header(<const uint8_t*><const char*>first, len(first), &header, &length, &end):
            header = -1
        for frame in frames:
            size += len(<bytes>frame)
        traffic_count(&self.loop.traffic, SENT, header, size)
